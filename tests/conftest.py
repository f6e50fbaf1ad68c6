"""Shared fixtures: one real llama.cpp model per test session (loading costs seconds), an in-process app,
and a helper that starts the real `serve` process on a free port. Plain helpers live in serving.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving import ServeProcess, embedded_model, free_port, make_settings


@pytest.fixture(scope="session")
def model_path() -> Path:
    return embedded_model()


@pytest.fixture(scope="session")
def engine(model_path):
    """The session-scoped engine, label memo off: every answer a test compares is computed, never recalled.
    Tests of the memo itself switch it on for their duration (`memo_on`) and say "memo" in their name.
    Prefix snapshots are off too, so that what a test finds cached depends on that test alone; tests of
    the snapshots switch them on (`snapshots_on`).
    Flash attention is off here although the server turns it on by default: many tests compare the engine
    with an independent one-batch evaluation to 2e-3, which holds without it; with it, the CPU kernel
    accumulates in half precision and other batch shapes differ by ~0.2 logit. The server's default is
    tested through `serve` (tests/test_serve.py) and tests/test_engine_overhead.py."""
    from semif.serving.engine import Engine

    eng = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=os.cpu_count() or 2, label_memo=False,
                 prefix_cache_mb=0, flash_attn=False)
    yield eng
    eng.close()


@pytest.fixture
def memo_on(engine):
    """The label memo switched on for one test, emptied before and after."""
    engine._label_memo.clear()
    engine.label_memo = True
    try:
        yield engine
    finally:
        engine.label_memo = False
        engine._label_memo.clear()


@pytest.fixture
def snapshots_on(engine):
    """Prefix snapshots switched on (64 MiB) for one test, emptied before and after."""
    engine.clear_prefix_snapshots()
    engine.prefix_cache_bytes = 64 << 20
    try:
        yield engine
    finally:
        engine.prefix_cache_bytes = 0
        engine.clear_prefix_snapshots()


@pytest.fixture(scope="session")
def app(engine, model_path):
    from semif.serving.app import create_app

    return create_app(make_settings(model_path), engine)


@pytest.fixture(scope="session")
def client(app):
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


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
            # Default context size (what a user's `make run` gets); memo off so that compared answers are computed.
            SEMIF_LABEL_MEMO="0",
        )
        env.update({k: str(v) for k, v in env_overrides.items()})
        proc = ServeProcess(env, port, tmp_path / f"serve-{port}.log")
        started.append(proc)
        return proc.wait_ready() if wait else proc

    yield _start
    for proc in started:
        proc.stop()


