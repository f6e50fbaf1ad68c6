"""SemIf: bounded decisions scored from llama.cpp logits."""

__version__ = "0.1.0"
