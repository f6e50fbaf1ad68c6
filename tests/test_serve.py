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


def test_with_a_log_hash_key_the_state_is_logged_as_an_hmac_and_never_as_a_plain_hash(start_serve):
    import hmac

    server = start_serve(SEMIF_LOG_HASH_KEY="log-secret")
    response = httpx.post(server.base_url + "/invocations", json=_body(1), timeout=60)
    assert response.status_code == 200, response.text
    state = f"{STATE} (ticket 1)".encode()
    line = [line for line in server.log_lines() if line.get("message") == "request"][-1]
    assert line["state_hmac_sha256"] == hmac.new(b"log-secret", state, hashlib.sha256).hexdigest()
    assert "state_sha256" not in line
    assert hashlib.sha256(state).hexdigest() not in server.log_text()


def test_settings_default_to_a_deadline_under_sagemakers_60_s_a_token_budget_and_the_models_context(model_path):
    from semif.serving.config import Settings, SettingsError

    settings = Settings.from_env({"SEMIF_MODEL_PATH": str(model_path)})
    assert settings.n_ctx is None  # the engine picks the model's training context, capped at 8192
    assert 0 < settings.request_deadline_s < 60
    assert settings.max_request_tokens == 65536
    assert settings.label_memo is True and settings.log_hash_key is None
    tuned = Settings.from_env({"SEMIF_MODEL_PATH": str(model_path), "SEMIF_REQUEST_DEADLINE_S": "20",
                               "SEMIF_MAX_REQUEST_TOKENS": "9000", "SEMIF_LABEL_MEMO": "0", "SEMIF_N_CTX": "2048"})
    assert (tuned.request_deadline_s, tuned.max_request_tokens, tuned.label_memo, tuned.n_ctx) == (20.0, 9000, False, 2048)
    with pytest.raises(SettingsError, match="SEMIF_REQUEST_DEADLINE_S"):
        Settings.from_env({"SEMIF_MODEL_PATH": str(model_path), "SEMIF_REQUEST_DEADLINE_S": "soon"})
    assert 0 < settings.chat_deadline_s < 60
    assert Settings.from_env({"SEMIF_MODEL_PATH": str(model_path), "SEMIF_CHAT_DEADLINE_S": "300"}).chat_deadline_s == 300.0
    with pytest.raises(SettingsError, match="SEMIF_CHAT_DEADLINE_S"):
        Settings.from_env({"SEMIF_MODEL_PATH": str(model_path), "SEMIF_CHAT_DEADLINE_S": "0"})


def test_the_example_printed_by_make_run_warns_that_the_embedded_model_is_near_chance(model_path):
    from semif.serving.config import Settings
    from semif.serving.serve import example_curl

    text = example_curl(Settings.from_env({"SEMIF_MODEL_PATH": str(model_path)}))
    assert "near chance" in text and "SEMIF_MODEL_PATH=/path/to/model.gguf make run" in text
