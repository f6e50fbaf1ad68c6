"""What the model file and the machine are, read once at load: the default context size, the KV cache
type's name, the CPU or GPU a record names. No state; llama_cpp is imported where it is needed."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

__all__ = ["DEFAULT_N_CTX_CAP", "FALLBACK_N_CTX", "cpu_name", "default_n_ctx", "ggml_type_name", "gpu_name"]

DEFAULT_N_CTX_CAP = 8192  # what SEMIF_N_CTX defaults to at most: System One's 255 described options need ~4.7k
FALLBACK_N_CTX = 4096  # a model that does not say its training context


def default_n_ctx(model_path: str | os.PathLike) -> int:
    """The context size when SEMIF_N_CTX is unset: the model's training context, capped at 8192
    (enough for the largest standard requests; a bigger context only costs memory). Read from the
    GGUF header of a vocabulary-only load: no weights are read."""
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with suppress_stdout_stderr(disable=False):  # llama.cpp prints its loader log otherwise
        model = llama_cpp.llama_model_load_from_file(str(model_path).encode("utf-8"), params)
    if not model:
        return FALLBACK_N_CTX
    try:
        buf = ctypes.create_string_buffer(256)
        trained = 0
        if llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf)) > 0:
            key = buf.value + b".context_length"
            if llama_cpp.llama_model_meta_val_str(model, key, buf, len(buf)) > 0 and buf.value.isdigit():
                trained = int(buf.value)
    finally:
        llama_cpp.llama_model_free(model)
    return min(trained, DEFAULT_N_CTX_CAP) if trained > 0 else FALLBACK_N_CTX


def ggml_type_name(value: int) -> str:
    """The KV cache element type's name ("f16"), from llama_cpp's GGML_TYPE_* constants."""
    import llama_cpp

    for name in dir(llama_cpp):
        if name.startswith("GGML_TYPE_") and getattr(llama_cpp, name) == value:
            return name[len("GGML_TYPE_"):].lower()
    return str(value)




def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=5
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        return ", ".join(names) or None
    except (OSError, subprocess.SubprocessError):
        return None

