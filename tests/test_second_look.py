"""The second look (opt-in): for an ambiguous first pass the model reasons within a token budget and a
deadline, then the label is read again. Runs only when asked, respects its budget, deadline and the
client going away, reports both passes, leaves the context as a plain request finds it, and refuses a
bad spec with a 422 naming the field. All on the embedded model through real llama.cpp."""

from __future__ import annotations

import math
import time

import pytest

from semif.serving.engine.passes import second_look as second_look_pass
from serving import start_cold

# Each answer is compared with a cold evaluation of the same question: a memo hit would compare it with itself.
pytestmark = pytest.mark.usefixtures("memo_off")

TICKET = ("I was charged twice for my March invoice and the refund I was promised last week still hasn't "
          "arrived. Please fix this today.")
DECISION = {"id": "route", "state": TICKET, "question": "Which team should handle this ticket?",
            "options": [{"id": "billing", "description": "Payments, invoices, refunds"},
                        {"id": "technical", "description": "Bugs and outages"},
                        {"id": "sales", "description": "New purchases and upgrades"}]}
ALWAYS = {"below_margin": 1.0}  # no first pass is this clear: every answer looks again


def semif(client, **extra):
    response = client.post("/v1/semif", json={"decision": DECISION, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_nothing_runs_unless_asked(client):
    plain = semif(client)
    assert "second_look" not in plain
    # Asked, but the first pass is clear enough: it decides, and the answer is the plain one.
    clear = semif(client, second_look={"below_margin": 0.0})
    assert clear["second_look"] == {"ran": False, "decided_by": "first_pass"}
    assert clear["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-5)
    # Nothing generated: the same prompt, and no more evaluated than its question (the state is cached now).
    assert clear["prompt"]["tokens"] == plain["prompt"]["tokens"]
    assert clear["prompt"]["evaluated_tokens"] <= plain["prompt"]["tokens"] - clear["prompt"]["cached_tokens"]


def test_second_look_reports_both_passes(client, engine):
    plain = semif(client)
    body = semif(client, second_look={**ALWAYS, "max_tokens": 24})
    look = body["second_look"]
    assert look["ran"] is True and look["decided_by"] == "second_look"
    assert look["reason"].startswith("margin ")
    assert look["version"] == "semif-second-look-v1"
    # The first pass is the plain request's answer, kept as it was.
    assert look["first_pass"]["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-5)
    assert look["first_pass"]["option_logits"] == pytest.approx(plain["option_logits"], abs=1e-4)
    # The served answer is the second pass's: a distribution over the same options, read after reasoning.
    assert math.isclose(sum(body["probabilities"]), 1.0, abs_tol=1e-6)
    assert body["choice"] == DECISION["options"][max(range(3), key=lambda i: body["probabilities"][i])]["id"]
    assert body["option_logits"] != pytest.approx(plain["option_logits"], abs=1e-3)
    assert 1 <= look["reasoning_tokens"] <= 24 and look["reasoning"].strip()
    assert look["stopped"] in ("budget", "answer", "end_of_turn")
    # The answer counts the second look's tokens (its first pass may be the label memo's: the plain request's).
    assert body["prompt"]["evaluated_tokens"] >= look["evaluated_tokens"] >= look["reasoning_tokens"]
    # Greedy and from the same prefix: the same request gives the same second look.
    again = semif(client, second_look={**ALWAYS, "max_tokens": 24})
    assert again["second_look"]["reasoning"] == look["reasoning"]
    assert again["probabilities"] == pytest.approx(body["probabilities"], abs=1e-4)
    # The context is left as a plain request finds it: the next plain answer equals a cold one.
    after = semif(client)
    assert after["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-5)
    start_cold(engine)
    cold = semif(client)
    assert cold["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-4)


def test_token_budget_is_respected(client):
    for budget in (1, 3):
        look = semif(client, second_look={**ALWAYS, "max_tokens": budget})["second_look"]
        assert look["ran"] and look["reasoning_tokens"] <= budget
        if look["stopped"] == "budget":
            assert look["reasoning_tokens"] == budget


def test_deadline_is_respected(client):
    plain = semif(client)
    body = semif(client, second_look={**ALWAYS, "max_tokens": 1024, "deadline_ms": 1})
    look = body["second_look"]
    # Nothing could be reasoned within 1 ms: the first pass decides, and says why.
    assert look["stopped"] == "deadline" and look["reasoning_tokens"] == 0
    assert look["ran"] is False and look["decided_by"] == "first_pass"
    assert body["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-5)
    assert look["ms"] < 5_000  # not the 1024-token budget
    # A deadline that allows some reasoning stops it part-way, far below the budget.
    body = semif(client, second_look={**ALWAYS, "max_tokens": 1024, "deadline_ms": 300})
    look = body["second_look"]
    assert look["stopped"] in ("deadline", "answer", "end_of_turn") and look["reasoning_tokens"] < 1024
    assert look["ms"] < 300 + 5_000


def _question():
    from semif.serving.engine.prompt import Outcome, Question

    return Question(DECISION["question"], tuple(Outcome(o["id"], o["description"]) for o in DECISION["options"]))


def test_client_going_away_ends_the_request(engine):
    from semif.serving.engine.plan import SecondLook
    from semif.serving.engine.results import Cancelled

    question = _question()
    calls = [0]

    def counting():
        calls[0] += 1
        return False

    engine.score(TICKET, [question], cancel=counting)
    first_pass_calls = calls[0]
    calls[0] = 0
    limit = first_pass_calls + 2  # the first pass runs whole; the reasoning sees two tokens, then the client is gone

    def going_away():
        calls[0] += 1
        return calls[0] > limit

    with pytest.raises(Cancelled):
        engine.score(TICKET, [question, question], cancel=going_away,
                     second_look=SecondLook(below_margin=1.0, max_tokens=64))
    assert calls[0] == limit + 1  # asked once more, then nothing else ran
    # Still a consistent context: a plain answer afterwards equals a cold one.
    plain = engine.score(TICKET, [question]).distributions[0].probabilities
    start_cold(engine)
    cold = engine.score(TICKET, [question]).distributions[0].probabilities
    assert plain == pytest.approx(cold, abs=1e-4)


def test_request_deadline_ends_a_long_second_look(tmp_path, model_path, engine):
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app
    from serving import make_settings

    app = create_app(make_settings(model_path, request_deadline_s=2.0), engine)
    # Eight decisions that all look again: their reasoning takes several seconds on any machine, past 2 s.
    decisions = [{**{k: v for k, v in DECISION.items() if k != "state"}, "id": f"d{i}"} for i in range(8)]
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/semif", json={"state": TICKET, "decisions": decisions,
                                                  "second_look": {**ALWAYS, "max_tokens": 1024, "deadline_ms": 120_000}})
        assert response.status_code == 504, response.text
        assert client.get("/ping").status_code == 200


# About 3,000 tokens: many batches of the engine below, so "about one batch past the deadline" and "the whole
# state again" are far apart on any CPU.
LONG_STATE = " ".join(f"Line {i}: the customer wrote again about invoice {1000 + i} and a damaged parcel."
                      for i in range(170))
# State-first, the injection check reads the state from a prefix of its own (question first), so the second
# look finds the request's prefix gone and evaluates the state again (no prefix snapshot to restore it from).
LOOKS_AGAIN_FROM_THE_STATE = {"decision": {**DECISION, "state": LONG_STATE}, "injection_check": True, "debias": "none"}
SMALL_BATCH = 128


@pytest.fixture(scope="module")
def small_batches(model_path):
    """An app over an engine of its own that evaluates SMALL_BATCH tokens per batch (SEMIF_N_BATCH), without
    prefix snapshots or label memo, and a request deadline long enough for a loaded machine."""
    import os

    from starlette.testclient import TestClient

    from semif.serving.engine.context import Engine
    from semif.serving.http.app import create_app
    from serving import make_settings

    engine = Engine(model_path, n_ctx=4096, n_batch=SMALL_BATCH, n_threads=os.cpu_count() or 2, prefix_cache_mb=0,
                    label_memo=False)
    app = create_app(make_settings(model_path, n_batch=SMALL_BATCH, request_deadline_s=600.0), engine)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine
    engine.close()


def _timed_batches(engine, monkeypatch) -> list[float]:
    """Seconds of each whole batch the engine decodes from now on: what a batch costs during the test."""
    seconds: list[float] = []
    real = engine._decode

    def decode(tokens, want):
        started = time.perf_counter()
        rows = real(tokens, want)
        if len(tokens) == engine.n_batch:
            seconds.append(time.perf_counter() - started)
        return rows

    monkeypatch.setattr(engine, "_decode", decode)
    return seconds


def test_the_second_looks_deadline_bounds_the_state_it_evaluates_again(small_batches, monkeypatch):
    client, engine = small_batches
    state_tokens = engine.plan(LONG_STATE, [_question()]).state_tokens
    assert state_tokens > 16 * engine.n_batch
    batches = _timed_batches(engine, monkeypatch)
    looks: list[float] = []
    real = second_look_pass.look

    def timed(*args):
        started = time.perf_counter()
        try:
            return real(*args)
        finally:
            looks.append(time.perf_counter() - started)

    monkeypatch.setattr(second_look_pass, "look", timed)
    deadline_s = 0.2
    response = client.post("/v1/semif", json={**LOOKS_AGAIN_FROM_THE_STATE,
                                              "second_look": {**ALWAYS, "max_tokens": 64, "deadline_ms": 200}})
    assert response.status_code == 200, response.text
    body = response.json()
    look = body["second_look"]
    # Stopped in the state, between two batches: the first pass decides, and it says why.
    assert look["stopped"] == "deadline" and look["decided_by"] == "first_pass" and look["reasoning_tokens"] == 0
    assert 0 < look["evaluated_tokens"] < state_tokens
    # The deadline plus the batch running when it passed (and a few more, for a loaded machine's jitter);
    # not the state again, which is more than 16 batches.
    one_batch_s = sorted(batches)[len(batches) // 2]
    assert len(looks) == 1 and looks[0] < deadline_s + 4 * one_batch_s + 0.3, (looks, one_batch_s)
    # The state stopped part-way left the context consistent: the same question again gets the same answer.
    again = client.post("/v1/semif", json={**LOOKS_AGAIN_FROM_THE_STATE, "injection_check": False})
    assert again.json()["probabilities"] == pytest.approx(body["probabilities"], abs=1e-4)
    print(f"second look {looks[0] * 1000:.0f} ms with deadline_ms 200: {look['evaluated_tokens']} of the "
          f"{state_tokens} state tokens evaluated again, {one_batch_s * 1000:.0f} ms per batch of {engine.n_batch}")


def test_the_request_deadline_stops_the_state_the_second_look_evaluates_again(small_batches, monkeypatch):
    client, engine = small_batches
    batches = _timed_batches(engine, monkeypatch)
    passed: list[float] = []
    real = second_look_pass.look

    def deadline_passes_as_it_starts(core, plan, index, prefix, first, cancel):
        if not passed:
            cancel.deadline = cancel.clock() - 1e-3  # the request's own deadline (SEMIF_REQUEST_DEADLINE_S)
            passed.append(time.perf_counter())
        return real(core, plan, index, prefix, first, cancel)

    monkeypatch.setattr(second_look_pass, "look", deadline_passes_as_it_starts)
    response = client.post("/v1/semif", json={**LOOKS_AGAIN_FROM_THE_STATE,
                                              "second_look": {**ALWAYS, "max_tokens": 64, "deadline_ms": 120_000}})
    stopped_s = time.perf_counter() - passed[0]
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    # A 504 within about a batch of the deadline, not after the state is evaluated again.
    one_batch_s = sorted(batches)[len(batches) // 2]
    assert stopped_s < 4 * one_batch_s + 0.3, (stopped_s, one_batch_s)
    print(f"504 {stopped_s * 1000:.0f} ms after the deadline passed ({one_batch_s * 1000:.0f} ms per batch of "
          f"{engine.n_batch})")


def test_policy_asks_for_a_second_look_below_its_own_thresholds(client):
    body = semif(client, policy={"min_margin": 1.0, "fallback": "human", "second_look": {"max_tokens": 4}})
    look = body["second_look"]
    assert look["ran"] and look["reason"].startswith("margin ") and look["reasoning_tokens"] <= 4
    assert body["action"] in ("accept", "fallback", "abstain", "review")
    # A policy whose thresholds every answer meets never looks again.
    clear = semif(client, policy={"min_margin": 0.0, "second_look": {"max_tokens": 4}})
    assert clear["second_look"]["ran"] is False
    # Nor does a policy with no thresholds at all: it accepts every answer.
    accepting = semif(client, policy={"fallback": "human", "second_look": {"max_tokens": 4}})
    assert accepting["second_look"] == {"ran": False, "decided_by": "first_pass"}


def test_batch_request_looks_at_each_decision(client):
    decisions = [{k: v for k, v in DECISION.items() if k != "state"},
                 {"id": "refund", "question": "Does the customer ask for money back?",
                  "options": [{"id": "yes"}, {"id": "no"}]}]
    response = client.post("/v1/semif", json={"state": TICKET, "decisions": decisions,
                                              "second_look": {**ALWAYS, "max_tokens": 6}})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["second_look"]["ran"] for r in results] == [True, True]
    assert all(r["second_look"]["reasoning_tokens"] <= 6 for r in results)


def test_system_one_reports_the_second_look(client):
    question = {"type": "choice", "instructions": DECISION["question"],
                "criteria": {o["id"]: o["description"] for o in DECISION["options"]}}
    response = client.post("/v1/systemone", json={"state": TICKET, "questions": {"team": question},
                                                  "second_look": {**ALWAYS, "max_tokens": 4}})
    assert response.status_code == 200, response.text
    answer = response.json()["answers"]["team"]
    look = answer["x_second_look"]
    assert response.json()["usage"]["output_tokens"] == look["reasoning_tokens"]
    assert look["ran"] and look["decided_by"] == "second_look" and look["reasoning_tokens"] <= 4
    assert len(look["first_pass"]["probabilities"]) == 3
    assert math.isclose(sum(answer["probabilities"].values()), 1.0, abs_tol=1e-6)
    assert answer["choice"] in question["criteria"]


@pytest.mark.parametrize("body, field", [
    ({"decision": DECISION, "second_look": {"max_tokens": 0}}, "second_look.max_tokens"),
    ({"decision": DECISION, "second_look": {"max_tokens": 10**6}}, "second_look.max_tokens"),
    ({"decision": DECISION, "second_look": {"deadline_ms": 0}}, "second_look.deadline_ms"),
    ({"decision": DECISION, "second_look": {"below_margin": 2}}, "second_look.below_margin"),
    ({"decision": DECISION, "second_look": {"think": True}}, "second_look.think"),
    ({"decision": DECISION, "second_look": "yes"}, "second_look"),
    ({"decision": DECISION, "policy": {"min_margin": 0.5, "second_look": {"below_margin": 0.5}}},
     "policy.second_look.below_margin"),
    ({"decision": DECISION, "scoring": "sequence", "second_look": {}}, "second_look"),
    ({"decision": DECISION, "second_look": {"settle_every": -1}}, "second_look.settle_every"),
    ({"decision": DECISION, "second_look": {"settle_every": "16"}}, "second_look.settle_every"),
    ({"decision": DECISION, "second_look": {"max_tokens": 8, "settle_every": 9}}, "second_look.settle_every"),
    ({"decision": DECISION, "policy": {"min_margin": 0.5, "second_look": {"max_tokens": 8, "settle_every": 16}}},
     "policy.second_look.settle_every"),
])
def test_bad_spec_is_a_422_naming_the_field(client, body, field):
    response = client.post("/v1/semif", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field
    if field == "second_look" and body.get("scoring"):
        assert response.json()["error"]["code"] == "unsupported_second_look"
    assert client.get("/ping").status_code == 200


def test_system_one_bad_spec_names_the_field(client):
    response = client.post("/v1/systemone", json={"state": TICKET, "questions": {"q": {
        "type": "noul", "instructions": "Refund?"}}, "second_look": {"max_tokens": -1}})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "second_look", "max_tokens"]


@pytest.mark.parametrize("layout", ["state_first", "options_first"])
def test_worst_case_counts_in_the_token_budget(engine, layout):
    from semif.serving.engine.plan import SecondLook, TokenBudgetExceeded

    question = _question()
    state = TICKET * 20  # a long state: options-first evaluates its last segment again
    look = SecondLook(below_margin=1.0, max_tokens=16)
    plain = engine.plan(state, [question], layout=layout)
    planned = engine.plan(state, [question], layout=layout, second_look=look)
    assert planned.worst_case_tokens > plain.worst_case_tokens + look.max_tokens
    # Admission counts at least what the second look really evaluates, from a cold context.
    start_cold(engine)
    result = engine.execute(planned)
    assert result.distributions[0].second_look["ran"]
    assert result.evaluated_tokens <= planned.worst_case_tokens
    engine.plan(state, [question], layout=layout, max_request_tokens=planned.worst_case_tokens, second_look=look)
    with pytest.raises(TokenBudgetExceeded):
        engine.plan(state, [question], layout=layout, max_request_tokens=planned.worst_case_tokens - 1, second_look=look)


def test_after_state_first_injection_checks_the_state_the_second_look_evaluates_again_counts(engine, model_path):
    from starlette.testclient import TestClient

    from semif.serving.engine.plan import SecondLook, TokenBudgetExceeded
    from semif.serving.http.app import create_app
    from serving import make_settings

    state = TICKET * 20  # long: the state the second look evaluates again dominates what it adds
    look = SecondLook(below_margin=1.0, max_tokens=8)
    checked = engine.plan(state, [_question()], injection_check=True, debias="none")
    planned = engine.plan(state, [_question()], injection_check=True, debias="none", second_look=look)
    # Each check's own prefix (its question, then the state) replaces the request's: the first second look
    # evaluates the request's state again, less the template head they share.
    head = len(planned.prefix_segments[0])
    assert planned.worst_case_tokens - checked.worst_case_tokens > planned.state_tokens - head
    start_cold(engine)
    result = engine.execute(planned)
    assert result.distributions[0].second_look["ran"]
    assert result.evaluated_tokens <= planned.worst_case_tokens
    assert result.distributions[0].second_look["evaluated_tokens"] > planned.state_tokens - head
    with pytest.raises(TokenBudgetExceeded) as over:
        engine.plan(state, [_question()], injection_check=True, debias="none", second_look=look,
                    max_request_tokens=planned.worst_case_tokens - 1, budget_field="decision")
    assert over.value.field == "second_look"
    # On the wire: a 413 naming the field that asked for the look (the request's, or its policy's).
    budget = planned.worst_case_tokens - 1
    with TestClient(create_app(make_settings(model_path, max_request_tokens=budget), engine),
                    raise_server_exceptions=False) as http:
        body = {"decision": dict(DECISION, state=state), "injection_check": True, "debias": "none"}
        assert http.post("/v1/semif", json=body).status_code == 200
        for extra, field in (({"second_look": {"below_margin": 1.0, "max_tokens": 8}}, "second_look"),
                             ({"policy": {"min_margin": 1.0, "second_look": {"max_tokens": 8}}}, "policy.second_look")):
            refused = http.post("/v1/semif", json={**body, **extra})
            assert refused.status_code == 413, refused.text
            assert refused.json()["error"]["field"] == field


def test_reasoning_keeps_characters_that_span_tokens(engine, monkeypatch):
    """The reasoning is decoded once, from bytes: a character split across tokens is not garbled."""
    from semif.serving.engine.plan import SecondLook

    question = _question()
    text = "日本語 🙂 déjà"
    tokens = engine.llm.tokenize(text.encode(), add_bos=False, special=False)
    assert any("\ufffd" in engine.llm.detokenize([t]).decode("utf-8", errors="replace") for t in tokens)
    written = [0]
    real_decode = engine._decode

    def decode(batch, want):  # the model "writes" the text token by token, then stops
        rows = real_decode(batch, want)
        if written[0] < len(tokens) and list(batch) == [tokens[written[0]]]:
            written[0] += 1  # the token just generated: force the one after it
        nxt = tokens[written[0]] if written[0] < len(tokens) else engine.llm.token_eos()
        for position, row in rows.items():
            row = row.copy()
            row[nxt] = row.max() + 100.0
            rows[position] = row
        return rows

    monkeypatch.setattr(engine, "_decode", decode)
    start_cold(engine)
    look = engine.score(TICKET, [question], second_look=SecondLook(below_margin=1.0, max_tokens=64)).distributions[0]
    monkeypatch.undo()
    start_cold(engine)
    assert text in look.second_look["reasoning"]


def test_binary_second_look_does_not_ask_for_a_bare_reply(engine):
    from semif.serving.engine.prompt import Outcome, Question

    question = Question("Does the customer ask for money back?", (Outcome("true"), Outcome("false")), "binary")
    planned = engine.plan(TICKET, [question])
    text = engine.llm.detokenize(second_look_pass.suffix_tokens(engine, planned, planned.questions[0])).decode()
    labels = list(planned.questions[0].labels[:2])
    assert "Reply " not in text and "Think it through" in text and ", ".join(labels) in text


def test_a_second_look_request_is_never_collected_with_others():
    """The batching collector runs a plan with a second look alone, so that no other answer waits for it."""
    import collections
    from types import SimpleNamespace

    from semif.serving.http.batch_collector import BatchCollector

    collector = BatchCollector.__new__(BatchCollector)
    collector.n_seq = 8
    # The collector asks engine/batching.py's own batchable(): an engine with several sequences and partial
    # rewinds, and label plans that differ only in their second look.
    collector.engine = SimpleNamespace(n_seq=8, partial_rewind=True)
    question = SimpleNamespace(suffix_tokens=[1], reversed=None, temperature=None, own_prefix_segments=None)

    def waiting(look):
        return SimpleNamespace(plan=SimpleNamespace(questions=[question], second_look=look, scoring="label",
                                                    injection_check=None))

    plain, looking = waiting(None), waiting(object())
    collector._pending = collections.deque([plain, plain, looking, plain])
    assert collector._take() == [plain, plain]
    assert collector._take() == [looking]
    assert collector._take() == [plain]


# ---- peeks: the early exit once the reasoning has settled ------------------------------------------------


SLOW_MACHINE_S = 600.0  # a look's deadline that a loaded machine never reaches: these tests compare reasoning


def _look(engine, below_margin=1.0, **config):
    from semif.serving.engine.plan import SecondLook

    look = SecondLook(below_margin=below_margin, deadline_s=SLOW_MACHINE_S, **config)
    return engine.score(TICKET, [_question()], second_look=look).distributions[0]


def _reasoning_tokens(engine, monkeypatch, **config) -> tuple[list[int], object]:
    """The tokens the look reasons, as the model decoded them (one at a time, as generation does; a peek's
    cue is several), and its answer."""
    decoded: list[int] = []
    real = engine._decode

    def decode(tokens, want):
        if len(tokens) == 1:
            decoded.append(int(tokens[0]))
        return real(tokens, want)

    monkeypatch.setattr(engine, "_decode", decode)
    try:
        answer = _look(engine, **config)
    finally:
        monkeypatch.undo()
    return decoded[len(decoded) - answer.second_look["reasoning_tokens"]:], answer


def test_a_settled_look_stops_and_decides_with_the_read_at_that_point(engine):
    # The first pass's margin (about 0.1) is below 0.3: it looks again. Settle margin 0: two peeks in a row
    # that choose alike and clear the look's own margin of 0.3 settle it (on this model the first two do).
    settled = _look(engine, below_margin=0.3, max_tokens=64, settle_every=4, settle_margin=0.0)
    look = settled.second_look
    assert look["stopped"] == "settled" and look["decided_by"] == "second_look"
    assert look["peeks"] == len(look["peek_choices"]) >= 2
    assert look["peek_choices"][-1] == look["peek_choices"][-2]
    assert look["reasoning_tokens"] == 4 * look["peeks"] < 64
    # The last peek is the read after the cue at that point: a look whose budget ends there, without peeks,
    # reasons the same and reads the same distribution.
    cut = _look(engine, below_margin=0.3, max_tokens=look["reasoning_tokens"], settle_every=0)
    assert cut.second_look["stopped"] == "budget" and cut.second_look["reasoning"] == look["reasoning"]
    assert settled.probabilities == pytest.approx(cut.probabilities, abs=1e-6)
    assert settled.option_logits == pytest.approx(cut.option_logits, abs=1e-5)
    assert look["peek_choices"][-1] == max(range(3), key=lambda i: cut.probabilities[i])  # an index, as probabilities
    # No read after the last peek: the cut look evaluates one cue for its final read, the settled one one per peek.
    cue = len(engine._tokenize(second_look_pass.SECOND_LOOK_CUE, special=False))
    assert look["evaluated_tokens"] - cut.second_look["evaluated_tokens"] == (look["peeks"] - 1) * cue
    # Peeks every 8 tokens change their mind each time on this model: however clear the last one, no exit.
    wavering = _look(engine, below_margin=0.3, max_tokens=64, settle_every=8, settle_margin=0.0).second_look
    choices = wavering["peek_choices"]
    assert len(choices) >= 2 and all(a != b for a, b in zip(choices, choices[1:]))
    assert wavering["stopped"] != "settled"
    # Peeks that agree but never clear the threshold that started the look (margin 1.0) never settle it.
    unclear = _look(engine, below_margin=1.0, max_tokens=64, settle_every=4, settle_margin=0.0).second_look
    assert unclear["peeks"] >= 2 and unclear["peek_choices"][0] == unclear["peek_choices"][1]
    assert unclear["stopped"] != "settled"


def test_the_settle_rule_needs_agreement_the_margin_and_the_looks_own_thresholds_cleared():
    from semif.serving.engine.plan import SecondLook

    rule = SecondLook(below_margin=0.3, settle_every=4, settle_agree=2, settle_margin=0.5)
    assert rule.settled([(1, 0.2, False), (1, 0.6, True)])
    assert not rule.settled([(1, 0.6, True)])  # one peek is not agreement
    assert not rule.settled([(0, 0.6, True), (1, 0.6, True)])  # disagreement
    assert not rule.settled([(1, 0.6, True), (1, 0.4, True)])  # below settle_margin
    assert not rule.settled([(1, 0.6, True), (1, 0.6, False)])  # the look's own threshold missed


def test_peeks_leave_the_reasoning_exactly_as_without_them(engine, monkeypatch):
    # A peek every 2 tokens that can never settle (a margin above 1), against no peeks at all.
    peeked_tokens, peeked = _reasoning_tokens(engine, monkeypatch, max_tokens=48, settle_every=2, settle_margin=1.5)
    plain_tokens, plain = _reasoning_tokens(engine, monkeypatch, max_tokens=48, settle_every=0)
    look, off = peeked.second_look, plain.second_look
    assert look["reasoning_tokens"] >= 8 and look["peeks"] >= (look["reasoning_tokens"] - 1) // 2
    assert peeked_tokens == plain_tokens and len(plain_tokens) == off["reasoning_tokens"]
    assert look["reasoning"] == off["reasoning"] and look["stopped"] == off["stopped"]
    assert peeked.probabilities == pytest.approx(plain.probabilities, abs=1e-6)
    # Peeks off: none made, none counted.
    assert off["peeks"] == 0 and off["peek_choices"] == []
    cue = len(engine._tokenize(second_look_pass.SECOND_LOOK_CUE, special=False))
    assert look["evaluated_tokens"] - off["evaluated_tokens"] == look["peeks"] * cue


def test_the_record_reports_the_budget_and_the_peeks(client):
    ids = [o["id"] for o in DECISION["options"]]
    look = semif(client, second_look={**ALWAYS, "max_tokens": 24, "deadline_ms": 120_000,
                                      "settle_every": 4})["second_look"]
    assert look["budget"] == {"max_tokens": 24, "deadline_ms": 120_000, "settle_every": 4}
    assert look["peeks"] == len(look["peek_choices"]) >= 1 and set(look["peek_choices"]) <= set(range(len(ids)))
    # A policy's budget reaches the look too; the defaults when it gives none.
    look = semif(client, policy={"min_margin": 1.0, "second_look": {"max_tokens": 24, "settle_every": 0}})["second_look"]
    assert look["budget"] == {"max_tokens": 24, "deadline_ms": 20_000, "settle_every": 0} and look["peeks"] == 0
    look = semif(client, second_look=ALWAYS)["second_look"]
    assert look["budget"] == {"max_tokens": 128, "deadline_ms": 20_000, "settle_every": 0}  # peeks are opt-in
    assert look["peeks"] == 0


def test_peeks_count_in_the_token_budget(engine, model_path):
    from starlette.testclient import TestClient

    from semif.serving.engine.plan import SecondLook, TokenBudgetExceeded
    from semif.serving.http.app import create_app
    from serving import make_settings

    cue = len(engine._tokenize(second_look_pass.SECOND_LOOK_CUE, special=False))
    off = engine.plan(TICKET, [_question()], debias="none",
                      second_look=SecondLook(below_margin=1.0, max_tokens=16, settle_every=0))
    # One peek after each 4 tokens, before the budget: 3 peeks.
    every4 = SecondLook(below_margin=1.0, max_tokens=16, settle_every=4)
    on = engine.plan(TICKET, [_question()], debias="none", second_look=every4)
    assert on.worst_case_tokens == off.worst_case_tokens + 3 * cue
    # What a look peeking at every token really evaluates, from a cold context, fits its worst case.
    every1 = SecondLook(below_margin=1.0, max_tokens=16, settle_every=1, settle_margin=1.5, deadline_s=SLOW_MACHINE_S)
    planned = engine.plan(TICKET, [_question()], debias="none", second_look=every1)
    start_cold(engine)
    result = engine.execute(planned)
    assert result.distributions[0].second_look["peeks"] == result.distributions[0].second_look["reasoning_tokens"] - 1
    assert result.evaluated_tokens <= planned.worst_case_tokens
    # Fits without peeks, not with them: refused naming the field.
    with pytest.raises(TokenBudgetExceeded) as over:
        engine.plan(TICKET, [_question()], debias="none", second_look=every4, max_request_tokens=off.worst_case_tokens)
    assert over.value.field == "second_look" and "settle_every 4" in str(over.value)
    with TestClient(create_app(make_settings(model_path, max_request_tokens=off.worst_case_tokens), engine),
                    raise_server_exceptions=False) as http:
        body = {"decision": DECISION, "debias": "none"}
        look = {"below_margin": 1.0, "max_tokens": 16}
        assert http.post("/v1/semif", json={**body, "second_look": {**look, "settle_every": 0}}).status_code == 200
        refused = http.post("/v1/semif", json={**body, "second_look": {**look, "settle_every": 4}})
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["field"] == "second_look"


def test_a_model_that_cannot_drop_a_peek_reasons_without_peeks(engine, monkeypatch):
    from semif.serving.engine.plan import SecondLook

    monkeypatch.setattr(engine, "partial_rewind", False)  # as a recurrent or hybrid model reports
    without = engine.plan(TICKET, [_question()], second_look=SecondLook(below_margin=1.0, settle_every=0))
    asked = engine.plan(TICKET, [_question()], second_look=SecondLook(below_margin=1.0, settle_every=16))
    assert asked.second_look.settle_every == 0  # what the answer's budget.settle_every reports
    assert asked.worst_case_tokens == without.worst_case_tokens  # no peek counted


def test_a_look_the_context_cannot_hold_stops_at_the_context_and_says_so(engine, model_path):
    """Where the context ends before the token budget, the look reasons up to the context's end and says
    "context"; where not one reasoning token fits, the first pass decides, and says "context" too."""
    from semif.serving.engine.context import Engine
    from semif.serving.engine.plan import SecondLook
    from semif.serving.engine.prompt import SECOND_LOOK_CUE

    question = _question()
    look = SecondLook(below_margin=1.0, max_tokens=64, deadline_s=600)  # the context binds, not the deadline
    small = Engine(model_path, n_ctx=512, n_batch=512, n_threads=2)
    try:
        cue = len(small._tokenize(SECOND_LOOK_CUE, special=False))

        def left(words: int) -> int:
            """The context's tokens left after the look's prompt and cue, for the state with ``words`` words added."""
            planned = small.plan(TICKET + " word" * words, [question], debias="none", second_look=look)
            return small.n_ctx - sum(len(s) for s in planned.prefix_segments) - len(planned.second_look_suffixes[0]) - cue

        def state_leaving(room: int) -> str:
            """A state after which the look's prompt and cue leave exactly ``room`` tokens (" word" is about one token)."""
            words = left(0) - room
            for near in sorted(range(max(words - 8, 0), words + 9), key=lambda w: abs(w - words)):
                if left(near) == room:
                    return TICKET + " word" * near
            raise AssertionError(f"no state leaves {room} tokens")

        for room in (3, 0):
            result = small.score(state_leaving(room), [question], debias="none", second_look=look)
            second = result.distributions[0].second_look
            assert second["stopped"] == "context", (room, second)
            assert second["reasoning_tokens"] == room
            assert second["decided_by"] == ("second_look" if room else "first_pass")
            assert second["budget"]["max_tokens"] == 64
    finally:
        small.close()
