"""Answers are bounded: with `return_prompt` a batch shows its state once (its decisions' prompts share it), an
answer over SEMIF_MAX_RESPONSE_BYTES is refused with 413 naming `return_prompt` (a JSON Lines record with a 413
line of its own), and answers are serialised off the event loop."""

from __future__ import annotations

import asyncio

import pytest

from serving import make_settings

STATE = " ".join(f"Note {k}: the parcel for order {4000 + k} left the depot on day {k} and has not arrived."
                 for k in range(50))  # about 1,400 tokens: the state dominates every prompt
OPTIONS = [{"id": "billing"}, {"id": "shipping"}, {"id": "returns"}]


def _decisions(n: int) -> list[dict]:
    return [{"id": f"d{i}", "question": f"Question {i}: which queue should handle this?", "options": OPTIONS}
            for i in range(n)]


def _batch(n: int, state: str = STATE, **extra) -> dict:
    return {"state": state, "decisions": _decisions(n), "return_prompt": True, "debias": "none", **extra}


def _post(client, body):
    response = client.post("/v1/semif", json=body)
    assert response.status_code == 200, response.text
    return response


def test_return_prompt_shows_the_state_once_and_grows_with_each_decisions_own_prompt(client):
    sizes = {}
    for state in (STATE, "Short."):
        for n in (1, 4, 10):
            response = _post(client, _batch(n, state))
            assert response.text.count(state) == 1, n  # the state's text, once per answer
            body = response.json()
            shared = body["prompt"]["segments"]
            assert sum(len(s["tokens"]) for s in shared) == body["usage"]["state_tokens"]  # the state's tokens, once
            for result in body["results"]:
                record = result["prompt"]["recompute"]
                assert record["request_prompt_segments"] == len(shared)
                assert state not in result["prompt"]["text"]
            sizes[len(state), n] = len(response.content)
    per_decision = {chars: ((sizes[chars, 4] - sizes[chars, 1]) / 3, (sizes[chars, 10] - sizes[chars, 4]) / 6)
                    for chars in (len(STATE), len("Short."))}
    print(f"answer bytes: {sizes}; per added decision: {per_decision}")
    for first, then in per_decision.values():
        assert then == pytest.approx(first, rel=0.05)  # linear in the decisions
    # What a decision adds is its own prompt, whatever the state's length.
    assert per_decision[len(STATE)][1] == pytest.approx(per_decision[len("Short.")][1], rel=0.05)


def test_each_decisions_prompt_is_the_shared_text_and_its_own_as_one_decision_would_show_it(client):
    from semif.tools.recompute import answers_of

    state = STATE[:400]
    body = _post(client, _batch(2, state, debias="reverse", reads=2)).json()
    for decision, result, whole in zip(_decisions(2), body["results"], answers_of(body)):
        single = _post(client, {"decision": {**decision, "state": state}, "return_prompt": True, "debias": "reverse",
                                "reads": 2}).json()
        assert body["prompt"]["text"] + result["prompt"]["text"] == single["prompt"]["text"]
        assert set(result["prompt"]["orders"]) == {"given", "reversed"}
        # The first read's text is the answer's own (prompt.text); the other read carries its own.
        texts = {name: read["prompt_text"] for name, read in result["prompt"]["orders"].items() if "prompt_text" in read}
        assert len(texts) == 1
        for name, text in texts.items():
            assert state not in text
            assert body["prompt"]["text"] + text == single["prompt"]["orders"][name]["prompt_text"]
        # Each further read's record holds its own segments, not the state again: the first read's question block
        # (the source of the lead they share) and its own block from the lead on.
        reads = result["prompt"]["recompute"]["reads"]
        assert [len(r["segments"]) for r in reads] == [2]
        assert reads[0]["segments"][0]["tokens"] == result["prompt"]["recompute"]["segments"][-1]["tokens"]
        assert whole["prompt"]["recompute"] == single["prompt"]["recompute"]  # made whole again: the same record


def test_a_batchs_prompt_records_hold_its_state_once_while_they_are_built(engine, memo_off, snapshots_off):
    """What a result with return_prompt keeps per added question is its own prompt, not another copy of the
    state's token records: the engine builds the state's records once and every question's record shares them.
    (Memo and prefix snapshots off: what they keep is not the result's.)"""
    import tracemalloc

    from semif.serving.engine.context import recompute_segments
    from semif.serving.engine.prompt import Outcome, Question

    outcomes = tuple(Outcome(o["id"]) for o in OPTIONS)
    questions = [Question(f"Question {i}: which queue should handle this?", outcomes) for i in range(11)]

    def kept(plan) -> int:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            result = engine.execute(plan)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert all(d.recompute is not None for d in result.distributions)
        return held

    one = engine.plan(STATE, questions[:1], return_prompt=True, debias="none")
    kept(one)  # warms what every request keeps the same (the prefix in the context, its memo digest)
    per_question = (kept(engine.plan(STATE, questions, return_prompt=True, debias="none")) - kept(one)) / 10
    tracemalloc.start()
    try:
        state_records = recompute_segments(one.prefix_segments)
        copy = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    print(f"kept per added question: {per_question:.0f} bytes; one copy of the state's records: {copy} bytes")
    assert state_records and per_question < copy


@pytest.fixture(scope="module")
def capped(engine):
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    with TestClient(create_app(make_settings(engine.model_path, max_response_bytes=20_000), engine),
                    raise_server_exceptions=False) as http:
        yield http


def test_an_answer_over_the_cap_is_a_413_naming_return_prompt_and_the_server_keeps_serving(capped):
    refused = capped.post("/v1/semif", json=_batch(10))
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "response_too_large" and error["field"] == "return_prompt"
    assert "SEMIF_MAX_RESPONSE_BYTES" in error["message"]
    assert capped.get("/ping").status_code == 200
    assert capped.post("/v1/semif", json={**_batch(10), "return_prompt": False}).status_code == 200
    assert capped.post("/v1/semif", json=_batch(1)).status_code == 200


def test_a_json_lines_record_over_the_cap_gets_its_own_413_line_and_the_others_are_answered(capped):
    import json

    small = {"decision": {**_decisions(1)[0], "id": "small", "state": "Where is my parcel?"}, "debias": "none"}
    lines = [small, _batch(10), {**small, "return_prompt": True}]
    response = capped.post("/invocations", content="".join(json.dumps(line) + "\n" for line in lines).encode(),
                           headers={"content-type": "application/jsonlines"})
    assert response.status_code == 200, response.text
    first, over, last = [json.loads(line) for line in response.text.splitlines()]
    assert first["choice"] in {o["id"] for o in OPTIONS} and last["prompt"]["text"]
    assert over["error"]["code"] == "response_too_large" and over["error"]["field"] == "return_prompt", over
    assert "SEMIF_MAX_RESPONSE_BYTES" in over["error"]["message"]
    # Without the prompt the same record fits: the field named is the one to change.
    again = capped.post("/invocations", content=(json.dumps({**_batch(10), "return_prompt": False}) + "\n").encode(),
                        headers={"content-type": "application/jsonlines"})
    assert "results" in json.loads(again.text.splitlines()[0]), again.text


def test_answers_are_serialised_off_the_event_loop(client, monkeypatch):
    from semif.serving.http import responses

    threads = []
    serialise = responses.json_bytes

    def recording(payload):
        try:
            asyncio.get_running_loop()
            threads.append("event loop")
        except RuntimeError:
            threads.append("worker")
        return serialise(payload)

    monkeypatch.setattr(responses, "json_bytes", recording)
    _post(client, _batch(2))
    assert threads == ["worker"]
