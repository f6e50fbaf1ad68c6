"""The engine: one llama.cpp context, prompt plans, labels, prefix snapshots and batching.

Knows llama.cpp, tokens and prompts; knows nothing of HTTP, wire contracts or policy. This package
imports nothing on import (the operator tools use its prompt module without llama-cpp-python)."""
