"""The SemIf contract over HTTP, on the real model, in-process."""

from __future__ import annotations

import math

import numpy as np

from serving import start_cold

SINGLE = {
    "decision": {
        "id": "support-route",
        "state": "The customer cannot receive a password reset email.",
        "question": "Which queue should handle this request?",
        "options": [
            {"id": "account_access", "description": "Account access support."},
            {"id": "billing", "description": "Billing support."},
        ],
    }
}

BATCH = {
    "state": "Order 1142 arrived broken and the customer wants a refund before Friday.",
    "decisions": [
        {"id": "queue", "question": "Which queue?", "options": [{"id": "billing"}, {"id": "shipping"}, {"id": "returns"}]},
        {"id": "urgent", "question": "Is it urgent?", "options": [{"id": "yes"}, {"id": "no"}]},
        {"id": "tone", "question": "Customer tone?", "options": [{"id": "calm"}, {"id": "angry"}, {"id": "neutral"}]},
    ],
}


def test_ping_is_ok_when_the_model_is_loaded(client):
    response = client.get("/ping")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_single_decision_returns_a_full_result(client, engine):
    response = client.post("/invocations", json=SINGLE)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "support-route"
    assert body["option_ids"] == ["account_access", "billing"]
    assert math.isclose(sum(body["probabilities"]), 1.0, abs_tol=1e-9)
    exp = np.exp(np.array(body["option_logits"]) - max(body["option_logits"]))
    np.testing.assert_allclose(body["probabilities"], exp / exp.sum(), atol=1e-9)
    top = int(np.argmax(body["probabilities"]))
    assert body["choice"] == body["option_ids"][top]
    assert body["margin"] == abs(body["probabilities"][0] - body["probabilities"][1])
    assert body["prompt"]["template_version"] == engine.info["template_version"]
    assert len(body["prompt"]["options_sha256"]) == 64
    assert body["prompt"]["tokens"] > 0
    assert set(body["timing"]) == {"queue_ms", "compute_ms", "total_ms"}
    assert body["model"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert body["model"]["sha256"] == engine.sha256
    assert body["model"]["scoring"] == "label"
    assert body["model"]["llama_cpp_python"]
    assert body["model"]["flash_attn"] is engine.info["flash_attn"] is True  # the shipped default (conftest)
    assert "text" not in body["prompt"]


def test_v1_semif_is_an_alias_of_invocations(client, memo_off):
    a = client.post("/invocations", json=SINGLE).json()
    b = client.post("/v1/semif", json=SINGLE).json()
    assert a["prompt"]["evaluated_tokens"] > 0 and b["prompt"]["evaluated_tokens"] > 0
    np.testing.assert_allclose(a["probabilities"], b["probabilities"], atol=1e-6)


def test_return_prompt_exposes_text_and_label_token_ids(client):
    body = client.post("/invocations", json={**SINGLE, "return_prompt": True}).json()
    assert "The customer cannot receive a password reset email." in body["prompt"]["text"]
    assert len(body["prompt"]["label_token_ids"]) == 2


def test_options_hash_changes_with_descriptions(client):
    changed = {"decision": {**SINGLE["decision"], "options": [{"id": "account_access"}, {"id": "billing"}]}}
    a = client.post("/invocations", json=SINGLE).json()["prompt"]["options_sha256"]
    b = client.post("/invocations", json=changed).json()["prompt"]["options_sha256"]
    assert a != b


def test_shared_state_batch_equals_separate_requests(client, engine, memo_off):
    start_cold(engine)
    batch = client.post("/invocations", json=BATCH)
    assert batch.status_code == 200, batch.text
    results = batch.json()["results"]
    assert [r["id"] for r in results] == ["queue", "urgent", "tone"]
    assert all(r["prompt"]["evaluated_tokens"] > 0 for r in results)
    for decision, result in zip(BATCH["decisions"], results):
        start_cold(engine)  # each single request from a cold context
        alone = client.post("/invocations", json={"decision": {**decision, "state": BATCH["state"]}}).json()
        assert alone["prompt"]["evaluated_tokens"] == alone["prompt"]["tokens"]
        np.testing.assert_allclose(result["probabilities"], alone["probabilities"], atol=1e-6)
    usage = batch.json()["usage"]
    # the state prefix once, then each decision's own suffix; nothing was cached (cold context)
    suffixes = [r["prompt"]["tokens"] - usage["state_tokens"] for r in results]
    assert all(s > 0 for s in suffixes)
    assert usage["input_tokens"] == usage["state_tokens"] + sum(suffixes)
    # Evaluated: every input token, each decision in the orders it was read in (the server's default debiasing)
    # over the one state prefix.
    assert all(r["prompt"]["debias"] == "reverse" for r in results)
    assert usage["cached_tokens"] == 0 and usage["evaluated_tokens"] == usage["input_tokens"]


def test_repeat_request_reuses_the_cached_prefix(client, engine, memo_off):
    start_cold(engine)
    client.post("/invocations", json=SINGLE)
    prompt = client.post("/invocations", json=SINGLE).json()["prompt"]
    # memo off: the repeat reuses the state prefix from the context and evaluates its question again (in
    # every order it reads, under the default debiasing)
    _, segments = engine.prefix_segments(SINGLE["decision"]["state"])
    state_prefix = sum(len(segment) for segment in segments)
    assert prompt["cached_tokens"] == state_prefix and prompt["evaluated_tokens"] > 0
    assert prompt["cached_tokens"] + prompt["evaluated_tokens"] == prompt["tokens"]
    other_question = {"decision": {**SINGLE["decision"], "question": "Which team owns this?"}}
    prompt = client.post("/invocations", json=other_question).json()["prompt"]
    # a new question about the same state reuses the state and evaluates only the question
    assert prompt["cached_tokens"] + prompt["evaluated_tokens"] == prompt["tokens"]
    assert prompt["cached_tokens"] == state_prefix and prompt["evaluated_tokens"] > 0


def test_memo_answers_an_identical_request_without_evaluation_as_a_cold_evaluation_would(client, engine, memo_on):
    other_question = {"decision": {**SINGLE["decision"], "question": "Which team owns this?"}}
    other_state = {"decision": {**SINGLE["decision"], "state": "A parcel never arrived; the customer asks where it is."}}
    start_cold(engine)
    assert client.post("/invocations", json=other_question).status_code == 200
    first = client.post("/invocations", json=SINGLE).json()  # memoised from a warm context: its state was cached
    _, segments = engine.prefix_segments(SINGLE["decision"]["state"])
    assert first["prompt"]["cached_tokens"] == sum(len(segment) for segment in segments)
    assert first["prompt"]["evaluated_tokens"] == first["prompt"]["tokens"] - first["prompt"]["cached_tokens"] > 0
    # Other keys in between: another state, the first state's other question (the context moves on).
    assert client.post("/invocations", json=other_state).status_code == 200
    other_again = client.post("/invocations", json=other_question).json()
    again = client.post("/invocations", json=SINGLE).json()
    assert again["prompt"]["evaluated_tokens"] == 0 and again["prompt"]["cached_tokens"] == again["prompt"]["tokens"]
    start_cold(engine)  # the reference: the same request evaluated from an empty context, nothing remembered
    reference = client.post("/invocations", json=SINGLE).json()
    assert reference["prompt"]["evaluated_tokens"] == reference["prompt"]["tokens"]
    np.testing.assert_allclose(again["option_logits"], reference["option_logits"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(again["probabilities"], reference["probabilities"], rtol=0, atol=1e-9)
    # The other question, also answered by the memo, got its own logits, not the first question's.
    assert other_again["prompt"]["evaluated_tokens"] == 0
    assert other_again["option_logits"] != again["option_logits"]


def test_sequence_scoring_per_request(client):
    body = client.post("/invocations", json={**SINGLE, "scoring": "sequence"}).json()
    assert body["model"]["scoring"] == "sequence"
    assert math.isclose(sum(body["probabilities"]), 1.0, abs_tol=1e-9)


def test_unknown_route_is_a_json_404(client):
    response = client.post("/nope", json={})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_custom_attributes_can_force_the_contract(client):
    response = client.post("/invocations", json=SINGLE, headers={"X-Amzn-SageMaker-Custom-Attributes": "contract=semif"})
    assert response.status_code == 200
    bad = client.post("/invocations", json=SINGLE, headers={"X-Amzn-SageMaker-Custom-Attributes": "contract=nope"})
    assert bad.status_code == 400
    assert bad.json()["error"]["field"] == "x-amzn-sagemaker-custom-attributes"


def test_a_client_request_id_is_echoed_only_when_short_and_of_safe_characters(client, caplog):
    """`X-Request-Id` is echoed in a header and written to every log line: an id of up to 128 characters of
    A-Z a-z 0-9 . _ : / + = - comes back as sent; any other gets a generated id instead, on every route."""
    import logging
    import re

    fine = "trace-" + "a1:/+=_." * 15
    fine = fine[:128]
    hostile = ["x" * 129, "x" * 100_000, "id with spaces", "id\u2028line", "<script>", "é"]
    routes = [("/invocations", {"json": SINGLE}),
              ("/v1/chat/completions", {"json": {"messages": "not a list"}}),
              ("/invocations", {"content": b'{"decision": 1}\n', "headers": {"content-type": "application/jsonlines"}})]
    with caplog.at_level(logging.INFO):
        for path, request in routes:
            headers = request.get("headers", {})
            kept = client.post(path, **{**request, "headers": {**headers, "x-request-id": fine}})
            assert kept.headers["x-request-id"] == fine, path
            for value in hostile:
                response = client.post(path, **{**request, "headers": {**headers, "x-request-id": value.encode()}})
                assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), (path, value[:20])
    assert client.get("/ping").status_code == 200
    logged = [getattr(r, "request_id", None) for r in caplog.records]
    assert fine in logged and not any(value in logged for value in hostile)
