"""The real `serve` process: SageMaker's contract, admission control under load, logs, startup errors."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import shutil
import subprocess
import time

import httpx
import numpy as np
import pytest

from serving import SERVE

STATE = "A customer writes: my card was charged twice for order 5521 and I want the duplicate refunded."
QUESTION = {
    "id": "route",
    "question": "Which queue should handle this?",
    "options": [{"id": "billing"}, {"id": "shipping"}, {"id": "technical"}],
}


def _body(i: int) -> dict:
    return {"decision": {**QUESTION, "id": f"route-{i}", "state": f"{STATE} (ticket {i % 5})"}}


def test_serve_answers_ping_and_invocations_and_logs_state_hash_only(start_serve):
    server = start_serve()
    assert httpx.get(server.base_url + "/ping").status_code == 200
    response = httpx.post(server.base_url + "/invocations", json=_body(0), timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"]
    text = server.log_text()
    assert STATE not in text
    request_lines = [line for line in server.log_lines() if line.get("message") == "request"]
    assert request_lines[-1]["status"] == 200
    assert request_lines[-1]["state_sha256"] == hashlib.sha256(f"{STATE} (ticket 0)".encode()).hexdigest()
    assert request_lines[-1]["model_sha256"] == response.json()["model"]["sha256"]
    loaded = [line for line in server.log_lines() if line.get("message") == "model loaded"]
    assert loaded and loaded[0]["model"]["sha256"] == response.json()["model"]["sha256"]


def test_full_queue_answers_503_with_retry_after_while_every_200_is_correct(start_serve):
    server = start_serve(SEMIF_MAX_QUEUE=1, SEMIF_RETRY_AFTER_S=2)
    serial = {}
    with httpx.Client(timeout=60) as http:
        for i in range(5):
            serial[i % 5] = http.post(server.base_url + "/invocations", json=_body(i)).json()["probabilities"]

    def call(i):
        with httpx.Client(timeout=60) as http:
            return i, http.post(server.base_url + "/invocations", json=_body(i))

    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(call, range(48)))
    statuses = [r.status_code for _, r in outcomes]
    assert set(statuses) <= {200, 503}
    assert statuses.count(503) > 0, "a queue of 1 under 12 concurrent clients must refuse some requests"
    assert statuses.count(200) > 0
    for i, response in outcomes:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "2"
            assert response.json()["error"]["code"] == "overloaded"
        else:
            body = response.json()
            assert body["id"] == f"route-{i}"  # never another request's result
            np.testing.assert_allclose(body["probabilities"], serial[i % 5], atol=1e-4)
    logged_503 = [line for line in server.log_lines() if line.get("status") == 503]
    assert len(logged_503) == statuses.count(503)


def test_ping_answers_while_a_decision_is_computing(start_serve):
    server = start_serve()
    long_state = "The customer explains the problem at length. " * 120
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(
            httpx.post, server.base_url + "/invocations",
            json={"decision": {**QUESTION, "state": long_state}, "scoring": "sequence"}, timeout=600,
        )
        time.sleep(0.3)
        ping_ms = []
        while not future.done():
            started = time.perf_counter()
            assert httpx.get(server.base_url + "/ping", timeout=5).status_code == 200
            ping_ms.append((time.perf_counter() - started) * 1000)
            time.sleep(0.05)
        assert future.result().status_code == 200
    assert ping_ms, "the decision finished before /ping could be tried"
    assert max(ping_ms) < 500


def test_invalid_setting_stops_startup_with_a_one_line_error(model_path):
    result = subprocess.run(
        [str(SERVE)], env={"SEMIF_MODEL_PATH": str(model_path), "SEMIF_MAX_QUEUE": "many", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "SEMIF_MAX_QUEUE" in result.stderr


def test_manifest_mismatch_stops_startup(tmp_path, model_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(model_path, model_dir / model_path.name)
    (model_dir / "model-manifest.json").write_text(
        json.dumps({"file": model_path.name, "sha256": "0" * 64, "size_bytes": model_path.stat().st_size})
    )
    result = subprocess.run(
        [str(SERVE), "serve"], env={"SEMIF_MODEL_DIR": str(model_dir), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 3
    assert "sha256" in result.stderr
