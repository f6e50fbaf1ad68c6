"""JSON Lines on /invocations (SageMaker Batch Transform's mini-batches) and /execution-parameters, on the
real model, in-process: one answer line per record in order, errors in each contract's own shape, prefix
reuse between consecutive records, the mini-batch deadline and token budget, and the record ids."""

from __future__ import annotations

import json
import uuid

import pytest
from starlette.testclient import TestClient

from serving import make_settings

# The label memo is off here: the token counts checked are those of real evaluations and prefix reuse
# (a memo hit would repeat the first answer).
pytestmark = pytest.mark.usefixtures("memo_off")

JSONL = {"content-type": "application/jsonlines"}
TICKET = "Order 1142 arrived broken and the customer wants a refund before Friday."


def semif_line(state=TICKET, decision_id="queue", question="Which queue?", options=("billing", "shipping", "returns")):
    return {"decision": {"id": decision_id, "state": state, "question": question,
                         "options": [{"id": o} for o in options]}}


def systemone_line(record_id=None, state=TICKET):
    body = {"state": state, "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}}
    return {"id": record_id, **body} if record_id else body


def openai_line(record_id=None, state=TICKET):
    body = {"model": "gpt-6-luna", "input": state,
            "questions": [{"type": "choice", "name": "team", "instructions": "Which team?",
                           "choices": [{"value": "billing"}, {"value": "logistics"}]}]}
    return {"id": record_id, **body} if record_id else body


def post_lines(client, lines, headers=JSONL):
    payload = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return client.post("/invocations", content=payload.encode(), headers=headers)


def answer_lines(response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/jsonlines")
    return [json.loads(line) for line in response.text.splitlines()]


@pytest.fixture
def app_with(engine, model_path):
    """A separate app over the session-scoped engine, with settings of the test's choosing."""
    from semif.serving.http.app import create_app

    clients = []

    def _make(**overrides) -> TestClient:
        client = TestClient(create_app(make_settings(model_path, **overrides), engine), raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield _make
    for client in clients:
        client.__exit__(None, None, None)


def test_execution_parameters_are_derived_from_the_adapters_limits(client, app_with):
    assert client.get("/execution-parameters").json() == {
        "MaxConcurrentTransforms": 1, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 1}
    bigger = app_with(max_body_bytes=(6 << 20) + 12345)
    assert bigger.get("/execution-parameters").json()["MaxPayloadInMB"] == 6


def test_a_mini_batch_answers_every_line_in_order_with_bad_lines_as_errors_in_their_contracts_shape(client):
    lines = [
        semif_line(),
        "{not json",
        systemone_line("ticket-7"),
        {"hello": "world"},
        openai_line("ticket-8"),
        {"state": TICKET, "questions": {"bad": {"type": "choice", "criteria": {"only": None}}}, "id": "ticket-9"},
        {"model": "gpt-6-luna", "input": TICKET, "questions": [{"type": "predicate"}]},
        {"decision": {"id": "broken", "state": TICKET, "question": "Which?", "options": [{"id": "a"}]}},
        semif_line(decision_id="last"),
    ]
    out = answer_lines(post_lines(client, lines))
    assert len(out) == len(lines)
    assert out[0]["id"] == "queue" and out[0]["option_ids"] == ["billing", "shipping", "returns"]
    assert out[1]["error"]["code"] == "invalid_json" and "line 2" in out[1]["error"]["message"]
    assert out[2]["id"] == "ticket-7" and 0.0 <= out[2]["answers"]["urgent"]["noul"] <= 1.0
    assert out[3]["error"]["code"] == "unknown_body_shape"
    assert out[4]["id"] == "ticket-8" and out[4]["answers"][0]["choice"] in ("billing", "logistics")
    # System One's validation error: FastAPI's detail list, and the record's id to join on.
    assert out[5]["detail"][0]["loc"] == ["body", "questions", "bad", "criteria"] and out[5]["id"] == "ticket-9"
    # OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
    assert out[6]["error"]["param"] == "questions[0].instructions" and out[6]["error"]["type"] == "invalid_request_error"
    assert out[7]["error"]["field"].startswith("decision.options") and out[7]["id"] == "broken"
    assert out[8]["id"] == "last"
    # An answer line is the same answer the JSON path gives.
    single = client.post("/invocations", json=lines[0]).json()
    assert single["probabilities"] == out[0]["probabilities"] and single["choice"] == out[0]["choice"]


def test_x_ndjson_is_json_lines_too_and_a_final_newline_adds_no_record(client):
    response = client.post("/invocations", content=(json.dumps(semif_line()) + "\n").encode(),
                           headers={"content-type": "application/x-ndjson; charset=utf-8"})
    assert [line["id"] for line in answer_lines(response)] == ["queue"]


def test_consecutive_lines_that_share_a_state_reuse_its_prefix(client, engine):
    state = f"{TICKET} Reference {uuid.uuid4().hex}."  # a state no earlier test put in the context
    other = f"A different customer asks about invoice {uuid.uuid4().hex}."
    # Each line read once (debias "none"): what a line evaluates is its state (unless the line before held it)
    # and its own question, nothing a debiasing adds.
    lines = [{**line, "debias": "none"} for line in (
        semif_line(state, "queue"), semif_line(state, "urgent", "Is it urgent?", ("yes", "no")),
        semif_line(state, "tone", "Customer tone?", ("calm", "angry")), semif_line(other, "queue"))]
    out = answer_lines(post_lines(client, lines))
    assert all(line["prompt"]["debias"] == "none" for line in out)
    _, segments = engine.prefix_segments(state)
    state_prefix = sum(len(s) for s in segments)
    head = engine.plan(state, []).shared_tokens
    first, second, third, distinct = (line["prompt"] for line in out)
    assert first["cached_tokens"] <= head < state_prefix  # at most the constant template head was held
    for reused in (second, third):
        assert reused["cached_tokens"] == state_prefix
        assert reused["evaluated_tokens"] == reused["tokens"] - state_prefix
    assert distinct["cached_tokens"] < state_prefix


class _DeadlineClock:
    """The mini-batch's deadline clock (jsonlines' ``time.monotonic``): the batch starts, reaches line 1 and
    is admitted for it at t = 0, and every later reading (the engine's cancel hook, the checks before lines
    2…) is far past the deadline. With the wall clock the test depended on reading and planning line 1
    within 1 ms, which a loaded CI machine does not always do."""

    def __init__(self):
        self.readings = 0

    def monotonic(self) -> float:
        self.readings += 1
        return 0.0 if self.readings <= 3 else 100.0

    def perf_counter(self) -> float:  # log timings only
        return 0.0


def test_lines_not_reached_before_the_mini_batch_deadline_are_answered_with_errors(app_with, monkeypatch):
    from semif.serving.http import jsonlines

    client = app_with(batch_transform=True, batch_deadline_s=0.001)
    clock = _DeadlineClock()
    monkeypatch.setattr(jsonlines, "time", clock)
    # Real work on a state never seen: line 1 starts in time and the deadline passes before its question.
    lines = [semif_line(f"{TICKET} {uuid.uuid4().hex}"), systemone_line("late-1"), openai_line("late-2"), semif_line()]
    out = answer_lines(post_lines(client, lines))
    assert len(out) == 4
    # The first record started in time but is stopped by the engine's cancel hook before its question ran.
    assert out[0]["error"]["code"] == "deadline_exceeded" and "stopped after 0 of 1 questions" in out[0]["error"]["message"]
    assert out[1]["detail"]["code"] == "deadline_exceeded" and out[1]["id"] == "late-1"
    assert out[2]["error"]["code"] == "deadline_exceeded" and out[2]["id"] == "late-2"
    assert out[3]["error"]["code"] == "deadline_exceeded" and "SEMIF_BATCH_DEADLINE_S" in out[3]["error"]["message"]
    assert clock.readings >= 6  # the clock really was the batch's: start, line 1, its admission, the cancel hook, lines 2-4


def test_a_record_over_the_batch_token_budget_is_refused_and_the_others_answered(app_with, engine):
    from semif.serving.contracts import semif as semif_contract
    from semif.serving.contracts.base import Limits
    short = semif_line("Short ticket.")
    job = semif_contract.parse(short, Limits(255, 400))
    # The record's own prompt, without the default's content-free pass (which the budget counts too).
    budget = engine.plan(job.state_text, job.questions, debias="none").worst_case_tokens
    client = app_with(batch_transform=True, batch_max_request_tokens=budget)
    long_state = "The parcel was damaged in transit and " * 20
    out = answer_lines(post_lines(client, [{**semif_line(long_state), "debias": "none"}, {**short, "debias": "none"}]))
    assert out[0]["error"]["code"] == "token_budget_exceeded" and "SEMIF_BATCH_MAX_REQUEST_TOKENS" in out[0]["error"]["message"]
    assert out[1]["prompt"]["tokens"] == budget


def test_on_the_real_time_route_a_record_gets_the_request_token_budget_as_the_same_json_body_does(app_with, engine):
    """/invocations outside a Batch Transform job is the real-time route: a body refused as JSON with 413 over
    SEMIF_MAX_REQUEST_TOKENS is refused as a JSON Lines record too (its error line names the same field), the
    batch budget (SEMIF_BATCH_MAX_REQUEST_TOKENS, 0: none) applies only in a transform job's container."""
    from semif.serving.contracts import semif as semif_contract
    from semif.serving.contracts.base import Limits

    short = semif_line("Short ticket.")
    job = semif_contract.parse(short, Limits(255, 400))
    budget = engine.plan(job.state_text, job.questions, debias="none").worst_case_tokens
    decisions = [{"id": f"q{i}", "question": f"Which queue, point {i}?", "options": [{"id": "billing"}, {"id": "returns"}]}
                 for i in range(8)]
    body = {"state": TICKET, "decisions": decisions, "debias": "none"}
    real_time = app_with(max_request_tokens=budget)
    as_json = real_time.post("/invocations", json=body)
    assert as_json.status_code == 413, as_json.text
    refused = as_json.json()["error"]
    out = answer_lines(post_lines(real_time, [body, {**short, "debias": "none"}]))
    assert (out[0]["error"]["code"], out[0]["error"]["field"]) == ("token_budget_exceeded", refused["field"])
    assert "SEMIF_MAX_REQUEST_TOKENS" in out[0]["error"]["message"]
    assert out[1]["prompt"]["tokens"] == budget  # a record within the budget is answered
    # In a Batch Transform job's container the same record has the batch budget: none by default.
    batch = app_with(max_request_tokens=budget, batch_transform=True)
    (answered,) = answer_lines(post_lines(batch, [body]))
    assert [r["id"] for r in answered["results"]] == [d["id"] for d in decisions]


def test_batch_transform_is_told_by_sagemakers_variable_or_the_models_own(model_path):
    from semif.serving.config import Settings
    from semif.serving.http.jsonlines import route_limits

    env = {"SEMIF_MODEL_PATH": str(model_path)}
    endpoint = Settings.from_env(env)
    assert endpoint.batch_transform is False
    limits = route_limits(endpoint)
    assert (limits.deadline_s, limits.deadline_setting, limits.max_request_tokens) == (50.0, "SEMIF_REQUEST_DEADLINE_S", 65536)
    for variables in ({"SAGEMAKER_BATCH": "true"}, {"SEMIF_BATCH_TRANSFORM": "1"}):
        job = Settings.from_env({**env, **variables})
        assert job.batch_transform is True, variables
        limits = route_limits(job)
        assert (limits.deadline_s, limits.deadline_setting, limits.max_request_tokens) == (3300.0, "SEMIF_BATCH_DEADLINE_S", None)
    assert Settings.from_env({**env, "SAGEMAKER_BATCH": "false"}).batch_transform is False


def test_a_mini_batch_that_cannot_be_admitted_is_refused_whole_with_503_so_sagemaker_retries(app_with):
    client = app_with()
    client.app.state.service.admission.draining = True
    response = post_lines(client, [semif_line(), semif_line()])
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "overloaded"


def test_a_mini_batch_over_the_payload_limit_is_413(app_with):
    client = app_with(max_body_bytes=1024)  # MaxPayloadInMB is then 1: the floor
    response = client.post("/invocations", content=b"x" * ((1 << 20) + 1), headers=JSONL)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_a_mini_batch_over_the_record_cap_is_413_naming_the_body_and_one_at_the_cap_is_answered(app_with):
    client = app_with(max_jsonl_records=3)
    lines = [semif_line(decision_id=f"q{i}") for i in range(4)]
    refused = post_lines(client, lines)
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["field"]) == ("too_many_records", "<body>")
    assert "4 records" in error["message"] and "SEMIF_MAX_JSONL_RECORDS" in error["message"]
    # Empty lines are records too (each would get an error line), and a final newline adds none.
    empty = client.post("/invocations", content=b"\n" * 4, headers=JSONL)
    assert empty.status_code == 413 and empty.json()["error"]["code"] == "too_many_records"
    answered = answer_lines(post_lines(client, lines[:3]))
    assert [line["id"] for line in answered] == ["q0", "q1", "q2"]
    assert all("choice" in line for line in answered)


def test_lines_that_never_wait_for_the_model_still_give_the_event_loop_turns(app_with):
    # Refused lines are answered from the parsed chunk without suspending; another task on the loop
    # must still run while a thousand of them are answered (not once per parsed chunk only).
    import asyncio
    from collections import Counter

    from semif.serving.http.admission import Cancellation
    from semif.serving.http.jsonlines import YIELD_EVERY, _answer_lines

    service = app_with().app.state.service
    lines = [b""] * 1000

    async def run() -> tuple[int, list]:
        turns, out, done = 0, [], False

        async def ticker():
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        started = turns
        await _answer_lines(service, lines, None, Cancellation(None), request_id="r", out=out,
                            errors=Counter(), totals=Counter())
        done = True
        await task
        return turns - started, out

    turns, out = asyncio.run(run())
    assert len(out) == 1000 and {line["error"]["code"] for line in out} == {"invalid_json"}
    assert turns >= 1000 // YIELD_EVERY, f"the loop ran other tasks only {turns} times"


def test_the_answer_of_a_mini_batch_is_serialised_off_the_event_loop(client, monkeypatch):
    import asyncio

    from semif.serving.http import jsonlines

    loops = []
    serialise = jsonlines.serialise

    def watched(out):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:  # a worker thread runs no loop
            loops.append(None)
        return serialise(out)

    monkeypatch.setattr(jsonlines, "serialise", watched)
    answered = answer_lines(post_lines(client, [semif_line(decision_id="q0"), semif_line(decision_id="q1")]))
    assert [line["id"] for line in answered] == ["q0", "q1"]
    assert loops == [None]


def test_json_requests_echo_an_optional_record_id_for_system_one_and_openai(client):
    assert client.post("/invocations", json=systemone_line("s1-42")).json()["id"] == "s1-42"
    assert client.post("/v1/decisions", json=openai_line("oa-42")).json()["id"] == "oa-42"
    assert "id" not in client.post("/v1/decisions", json=openai_line()).json()
    bad_s1 = client.post("/v1/systemone", json={**systemone_line(), "id": 7})
    assert bad_s1.status_code == 422 and bad_s1.json()["detail"][0]["loc"] == ["body", "id"]
    bad_oa = client.post("/v1/decisions", json={**openai_line(), "id": ""})
    assert bad_oa.status_code == 400 and bad_oa.json()["error"]["param"] == "id"


def test_batch_settings_come_from_their_own_variables(model_path):
    from semif.serving.config import Settings, SettingsError

    env = {"SEMIF_MODEL_PATH": str(model_path)}
    assert (Settings.from_env(env).batch_deadline_s, Settings.from_env(env).batch_max_request_tokens) == (3300.0, 0)
    tuned = Settings.from_env({**env, "SEMIF_BATCH_DEADLINE_S": "120", "SEMIF_BATCH_MAX_REQUEST_TOKENS": "8192"})
    assert (tuned.batch_deadline_s, tuned.batch_max_request_tokens) == (120.0, 8192)
    assert Settings.from_env(env).max_jsonl_records == 10000
    assert Settings.from_env({**env, "SEMIF_MAX_JSONL_RECORDS": "500"}).max_jsonl_records == 500
    with pytest.raises(SettingsError, match="SEMIF_MAX_JSONL_RECORDS"):
        Settings.from_env({**env, "SEMIF_MAX_JSONL_RECORDS": "0"})
    with pytest.raises(SettingsError, match="SEMIF_BATCH_DEADLINE_S"):
        Settings.from_env({**env, "SEMIF_BATCH_DEADLINE_S": "soon"})
