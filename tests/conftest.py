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
    """The session's engine at the server's shipped defaults (semif/serving/config.py): flash attention on,
    the label memo on, 256 MiB of prefix snapshots, n_batch 512. Its own default debiasing is the engine's
    ("none"); requests through `app`/`client` get the server's (SEMIF_DEBIAS, reverse), and a test that
    compares the two passes `debias` to the engine. Only the context is smaller than the
    shipped default (the model's training context): 4096 tokens, which changes memory, not a logit.
    An exact comparison with an independent evaluation recomputes the answer's `prompt.recompute` record
    (semif.tools.recompute): decoded in the engine's own segments, flash attention reproduces to 1e-4.
    A test that compares two computations of one prompt asks for `memo_off` (a memo hit would compare an
    answer with itself); the memo and snapshot tests empty them first (`memo_on`, `snapshots_on`)."""
    from semif.serving.engine.context import Engine

    eng = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=os.cpu_count() or 2)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _no_priors_from_other_tests(request):
    """Content-free priors (debias content_free) are kept on the session's engine: each test that
    uses it starts without any, so what a request evaluates never depends on the order tests ran in."""
    if {"engine", "app", "client"} & set(request.fixturenames):
        request.getfixturevalue("engine").clear_content_free()
    yield


@pytest.fixture
def memo_on(engine):
    """The label memo (on by default) emptied before and after one test, so what it recalls is this test's."""
    engine._label_memo.clear()
    try:
        yield engine
    finally:
        engine.label_memo = True
        engine._label_memo.clear()


@pytest.fixture
def memo_off(engine):
    """The label memo switched off for one test: for tests that compare two evaluations of one prompt
    (cached prefix against evaluated, restored snapshot against evaluated), where the memo would answer
    the second from the first and the comparison could not fail."""
    engine._label_memo.clear()
    engine.label_memo = False
    try:
        yield engine
    finally:
        engine.label_memo = True
        engine._label_memo.clear()


@pytest.fixture
def snapshots_on(engine):
    """Prefix snapshots (on by default, 256 MiB) emptied before and after one test, held to 64 MiB."""
    engine.clear_prefix_snapshots()
    engine.prefix_cache_bytes = 64 << 20
    try:
        yield engine
    finally:
        engine.prefix_cache_bytes = 256 << 20
        engine.clear_prefix_snapshots()


@pytest.fixture
def snapshots_off(engine):
    """Prefix snapshots switched off for one test: for tests that count what the context itself still holds
    after another state displaced it (a snapshot of an earlier test's prefix would be restored instead)."""
    engine.clear_prefix_snapshots()
    engine.prefix_cache_bytes = 0
    try:
        yield engine
    finally:
        engine.prefix_cache_bytes = 256 << 20
        engine.clear_prefix_snapshots()


@pytest.fixture(scope="session")
def app(engine, model_path):
    from semif.serving.http.app import create_app

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


