"""debias "content_free": contextual calibration at run time, on the real embedded model at its shipped
defaults (flash attention, the label memo, prefix snapshots).

Each answer is the raw label distribution divided by the model's distribution for the content-free state
"N/A" with the same question and options, renormalised. That prior depends on the question only, so the
engine keeps it; every kept or evicted prior is compared here with a cold computation of the same answer
(the context, the snapshots, the memo and the priors emptied first).

The servers here calibrate content-free by default (SEMIF_DEBIAS=content_free, the `client` and
`tight_client` fixtures of this module): what an operator who sets it gets, requests without `debias`
included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from semif.serving.engine.context import Cancelled, Engine, TokenBudgetExceeded, softmax
from semif.serving.engine.plan import CONTENT_FREE_STATE, PlanError
from semif.serving.engine.prompt import Outcome, Question
from semif.tools.recompute import recompute_logits

from serving import make_settings, start_cold

ROUTE = Question("Which queue should handle this request?",
                 (Outcome("account_access", "Logins, passwords, locked accounts."),
                  Outcome("billing", "Charges, refunds, invoices."),
                  Outcome("shipping", "Parcels, delivery, returns.")))
URGENT = Question("Does this need an answer today?", (Outcome("true"), Outcome("false")), kind="binary")
TONE = Question("What is the tone?", (Outcome("calm"), Outcome("annoyed"), Outcome("angry"), Outcome("pleased")))
STATES = ["I cannot log in: the reset email never arrives and my account is locked.",
          "I was charged twice for order 5521; please refund the duplicate.",
          "The parcel says delivered but nothing came."]


@pytest.fixture(scope="module")
def client(engine, model_path):
    """The server at its defaults but for SEMIF_DEBIAS=content_free."""
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    with TestClient(create_app(make_settings(model_path, debias="content_free"), engine),
                    raise_server_exceptions=False) as calibrating:
        yield calibrating


def _log_softmax(logits):
    values = np.asarray(logits, dtype=np.float64)
    peak = values.max()
    return values - (peak + np.log(np.exp(values - peak).sum()))


@pytest.fixture
def fresh(engine):
    """Nothing held before or after: the priors, the context, the snapshots and the memo emptied."""
    start_cold(engine)
    entries = engine.content_free_entries
    try:
        yield engine
    finally:
        engine.content_free_entries = entries
        start_cold(engine)


def _cold(engine, state, questions, **kwargs):
    """The same request with nothing to answer from: what every held or evicted prior is compared with."""
    start_cold(engine)
    return engine.score(state, questions, debias="content_free", **kwargs)


def _same(got, want):
    """Exact: the engine's exactness rule makes a held prior or a cached prefix run the same kernels."""
    for a, b in zip(got.distributions, want.distributions, strict=True):
        np.testing.assert_allclose(a.option_logits, b.option_logits, rtol=0, atol=1e-6)
        np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=0, atol=1e-9)
        np.testing.assert_allclose(a.content_free["prior"], b.content_free["prior"], rtol=0, atol=1e-9)


def test_the_answer_is_the_raw_distribution_divided_by_the_content_free_one(fresh):
    engine = fresh
    answer = engine.score(STATES[0], [ROUTE, URGENT], debias="content_free").distributions
    start_cold(engine)
    raw = engine.score(STATES[0], [ROUTE, URGENT], debias="none").distributions
    start_cold(engine)
    prior = engine.score(CONTENT_FREE_STATE, [ROUTE, URGENT], debias="none").distributions
    for got, r, p in zip(answer, raw, prior, strict=True):
        assert got.debias == "content_free" and got.content_free["state"] == CONTENT_FREE_STATE
        expected = np.asarray(r.option_logits) - _log_softmax(p.option_logits)
        np.testing.assert_allclose(got.option_logits, expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.probabilities, softmax(expected), rtol=0, atol=1e-9)
        # The raw answer and the prior stay in the record.
        np.testing.assert_allclose(got.content_free["option_logits"], r.option_logits, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.content_free["probabilities"], r.probabilities, rtol=0, atol=1e-9)
        np.testing.assert_allclose(got.content_free["prior"], p.probabilities, rtol=0, atol=1e-9)
        assert got.content_free["held"] is False
        assert got.label_mass == pytest.approx(r.label_mass, abs=1e-9)  # read from the raw distribution
        # Dividing out a prior that is not uniform changes the answer: the check above cannot pass vacuously.
        assert np.max(np.abs(np.subtract(got.probabilities, r.probabilities))) > 1e-3


def test_a_held_prior_costs_no_tokens_and_gives_the_cold_answer(fresh):
    engine = fresh
    first = engine.score(STATES[0], [ROUTE], debias="content_free")
    passes = engine.content_free_passes
    again = engine.score(STATES[1], [ROUTE], debias="content_free")
    assert engine.content_free_passes == passes, "a held prior was evaluated again"
    assert again.distributions[0].content_free["held"] is True
    cold = _cold(engine, STATES[1], [ROUTE])
    _same(again, cold)
    # The held one evaluated its own prompt only (what the context did not hold); the cold one its prompt
    # and the content-free one beyond the template head they share.
    assert again.evaluated_tokens == again.input_tokens - again.cached_tokens
    assert again.distributions[0].content_free["evaluated_tokens"] == 0
    d0 = first.distributions[0]
    assert d0.content_free["held"] is False and d0.content_free["evaluated_tokens"] > 0
    # From a cold engine nothing was reused from an earlier request, though the content-free pass
    # evaluated the template head before the question's own prompt reused it: counted as the answer's.
    assert first.cached_tokens == 0 and first.state_cached_tokens == 0
    assert d0.cached_tokens == 0 and d0.evaluated_tokens == d0.tokens
    assert first.evaluated_tokens == first.input_tokens + d0.content_free["evaluated_tokens"]


def test_alternating_questions_through_a_small_store_evict_least_recently_used_and_stay_exact(fresh):
    engine = fresh
    sequence = [ROUTE, URGENT, ROUTE, TONE, URGENT, ROUTE, ROUTE]
    states = [STATES[i % len(STATES)] for i in range(len(sequence))]
    cold = [_cold(engine, state, [question]) for state, question in zip(states, sequence)]
    start_cold(engine)
    engine.content_free_entries = 2
    held = []
    for state, question, want in zip(states, sequence, cold):
        passes = engine.content_free_passes
        got = engine.score(state, [question], debias="content_free")
        held.append(got.distributions[0].content_free["held"])
        assert engine.content_free_passes == passes + (0 if held[-1] else 1)
        assert len(engine.prior_memo) <= 2
        _same(got, want)
    # Two entries: ROUTE is used again before TONE arrives, so URGENT goes first, then ROUTE, then TONE.
    assert held == [False, False, True, False, False, False, True]


def test_least_recently_used_prior_is_evicted_first(fresh):
    engine = fresh
    engine.content_free_entries = 2
    for question in (ROUTE, URGENT, ROUTE, TONE):  # ROUTE used again before TONE arrives: URGENT goes
        engine.score(STATES[0], [question], debias="content_free")
    held = {q.text: engine.score(STATES[1], [q], debias="content_free").distributions[0].content_free["held"]
            for q in (ROUTE, TONE)}
    assert held == {ROUTE.text: True, TONE.text: True}
    assert engine.score(STATES[1], [URGENT], debias="content_free").distributions[0].content_free["held"] is False


def test_more_questions_than_the_store_holds_are_answered_from_the_pass_itself(fresh):
    engine = fresh
    engine.content_free_entries = 1
    got = engine.score(STATES[2], [ROUTE, URGENT, TONE], debias="content_free")
    assert len(engine.prior_memo) == 1
    engine.content_free_entries = 1
    _same(got, _cold(engine, STATES[2], [ROUTE, URGENT, TONE]))


def test_a_pass_cancelled_part_way_keeps_no_prior_and_the_next_request_is_exact(fresh):
    engine = fresh
    asked = []

    def cancel():  # lets the content-free pass start, then stops it before its second question
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(Cancelled) as stopped:
        engine.score(STATES[0], [ROUTE, URGENT], debias="content_free", cancel=cancel)
    assert stopped.value.done == 0  # none of the request's own questions was answered
    assert len(engine.prior_memo) == 0
    got = engine.score(STATES[0], [ROUTE, URGENT], debias="content_free")
    assert [d.content_free["held"] for d in got.distributions] == [False, False]
    _same(got, _cold(engine, STATES[0], [ROUTE, URGENT]))


def test_the_token_budget_counts_the_content_free_pass(fresh):
    engine = fresh
    plain = engine.plan(STATES[0], [ROUTE], debias="none")
    planned = engine.plan(STATES[0], [ROUTE], debias="content_free")
    assert planned.worst_case_tokens == plain.worst_case_tokens + planned.content_free.worst_case_tokens
    engine.plan(STATES[0], [ROUTE], debias="none", max_request_tokens=plain.worst_case_tokens)
    with pytest.raises(TokenBudgetExceeded):
        engine.plan(STATES[0], [ROUTE], debias="content_free", max_request_tokens=plain.worst_case_tokens)


def test_a_new_question_beside_held_ones_evaluates_only_its_own_prior(fresh):
    engine = fresh
    engine.score(STATES[0], [ROUTE], debias="content_free")
    passes = engine.content_free_passes
    got = engine.score(STATES[1], [ROUTE, TONE], debias="content_free")
    assert engine.content_free_passes == passes + 1
    assert [d.content_free["held"] for d in got.distributions] == [True, False]
    assert got.distributions[0].content_free["evaluated_tokens"] == 0 < got.distributions[1].content_free["evaluated_tokens"]
    _same(got, _cold(engine, STATES[1], [ROUTE, TONE]))


# States long enough for a prefix snapshot (it must spare PREFIX_SNAPSHOT_MIN_TOKENS of evaluation).
LONG_STATES = [
    "Hello, I have been trying to sign in to my account since yesterday evening. The password reset email "
    "never arrives, I checked the spam folder twice, and after three attempts the app now says my account is "
    "locked for security reasons. I need to get in today to download my invoices for the accountant.",
    "Good morning. My card was charged twice for the same order last Tuesday, once at 10:02 and again at "
    "10:04, each time for the full amount of 84.90. I only placed one order and only received one parcel. "
    "Please refund the duplicate charge and confirm by email when it has been done.",
]


def _reversed(question: Question) -> Question:
    return Question(question.text, tuple(reversed(question.outcomes)), question.kind)


@pytest.mark.parametrize("second", [TONE, _reversed(ROUTE)], ids=["a new question", "the options reversed"])
def test_a_held_state_outlives_the_content_free_pass_of_a_new_option_set_and_the_answer_is_cold(fresh, second):
    """The next request on the same state with an option set whose prior is not held: its content-free pass
    rewinds past the state, which is snapshotted first and restored for the request's own pass, so the
    state is not evaluated again; the answer equals a cold one."""
    engine = fresh
    engine.score(LONG_STATES[0], [ROUTE], debias="content_free")
    restores, passes = engine.prefix_restores, engine.content_free_passes
    got = engine.score(LONG_STATES[0], [second], debias="content_free")
    d = got.distributions[0]
    assert engine.content_free_passes == passes + 1 and d.content_free["held"] is False
    assert engine.prefix_restores == restores + 1
    assert got.state_cached_tokens == got.state_tokens, "the state was evaluated again after the content-free pass"
    assert got.evaluated_tokens == got.input_tokens - got.state_tokens + d.content_free["evaluated_tokens"]
    _same(got, _cold(engine, LONG_STATES[0], [second]))


def test_without_room_for_a_snapshot_the_state_is_evaluated_again_and_the_answer_is_the_same(fresh):
    engine = fresh
    limit = engine.prefix_cache_bytes
    want = _cold(engine, LONG_STATES[0], [TONE])
    start_cold(engine)
    engine.prefix_cache_bytes = 1  # no state fits: the pass rewinds past it and nothing can bring it back
    try:
        engine.score(LONG_STATES[0], [ROUTE], debias="content_free")
        restores = engine.prefix_restores
        got = engine.score(LONG_STATES[0], [TONE], debias="content_free")
    finally:
        engine.prefix_cache_bytes = limit
    assert engine.prefix_restores == restores
    assert got.state_cached_tokens < got.state_tokens
    assert got.evaluated_tokens == got.input_tokens - got.cached_tokens + got.distributions[0].content_free["evaluated_tokens"]
    _same(got, want)


def test_states_and_option_sets_alternating_through_the_snapshots_stay_exact(fresh):
    """Two states and three option sets interleaved, new priors arriving on held and on evicted states, with
    the snapshots as shipped: every answer is the cold one and the reuse it reports adds up."""
    engine = fresh
    sequence = [(0, ROUTE), (0, TONE), (1, ROUTE), (0, _reversed(ROUTE)), (1, TONE), (1, URGENT), (0, URGENT),
                (1, _reversed(ROUTE))]
    cold = [_cold(engine, LONG_STATES[i], [q]) for i, q in sequence]
    start_cold(engine)
    restores = engine.prefix_restores
    for (i, question), want in zip(sequence, cold):
        got = engine.score(LONG_STATES[i], [question], debias="content_free")
        d = got.distributions[0]
        assert got.evaluated_tokens == got.input_tokens - got.cached_tokens + d.content_free["evaluated_tokens"]
        _same(got, want)
    assert engine.prefix_restores > restores


def test_under_the_default_a_request_over_budget_with_its_prior_is_refused_naming_the_field(fresh):
    engine = fresh
    plain = engine.plan(STATES[0], [ROUTE], debias="none")
    budget = plain.worst_case_tokens
    with pytest.raises(TokenBudgetExceeded) as over:
        engine.plan(STATES[0], [ROUTE], default_debias="content_free", max_request_tokens=budget,
                    budget_field="decisions")
    assert over.value.field == "decisions" and "debias 'none'" in str(over.value)
    assert engine.plan(STATES[0], [ROUTE], default_debias="content_free").debias == "content_free"
    with pytest.raises(TokenBudgetExceeded) as over:
        engine.plan(STATES[0], [ROUTE], debias="content_free", max_request_tokens=budget)
    assert over.value.field == "debias" and "debias 'none'" in str(over.value)


def test_with_a_second_look_the_field_named_is_what_pushed_the_request_over_the_budget(fresh):
    from semif.serving.engine.plan import SecondLook

    engine = fresh
    look = SecondLook(below_margin=1.0, max_tokens=16)
    plain = engine.plan(STATES[0], [ROUTE], debias="none").worst_case_tokens
    looked = engine.plan(STATES[0], [ROUTE], debias="none", second_look=look).worst_case_tokens
    calibrated = engine.plan(STATES[0], [ROUTE], debias="content_free").worst_case_tokens
    both = engine.plan(STATES[0], [ROUTE], debias="content_free", second_look=look).worst_case_tokens
    assert plain < looked < both and plain < calibrated < both
    refusals = [
        (dict(debias="content_free"), calibrated - 1, "debias"),  # the calibration does not fit: debias, look or not
        (dict(default_debias="content_free"), calibrated - 1, "decisions"),  # the server's default: the questions
        (dict(debias="content_free"), both - 1, "second_look"),  # the calibration fits, the look does not
        (dict(debias="none"), plain - 1, "decisions"),  # the decision itself does not fit
    ]
    for asked, budget, field in refusals:
        with pytest.raises(TokenBudgetExceeded) as over:
            engine.plan(STATES[0], [ROUTE], second_look=look, max_request_tokens=budget, budget_field="decisions",
                        **asked)
        assert over.value.field == field, (asked, budget)
    engine.plan(STATES[0], [ROUTE], debias="content_free", second_look=look, max_request_tokens=both)


def test_admission_never_depends_on_held_priors_but_a_held_prior_is_not_evaluated_again(fresh):
    """The budget is a function of the request alone: the same request is admitted or refused whatever the cache
    holds; a prior the cache holds still costs no model call."""
    engine = fresh
    plain = engine.plan(STATES[0], [ROUTE, URGENT], debias="none")
    cold = engine.plan(STATES[0], [ROUTE, URGENT], debias="content_free")
    assert cold.worst_case_tokens > plain.worst_case_tokens
    engine.score(STATES[1], [ROUTE], debias="content_free")  # ROUTE's prior held from here on
    engine.score(STATES[1], [URGENT], debias="content_free")
    held = engine.plan(STATES[0], [ROUTE, URGENT], debias="content_free")
    assert held.worst_case_tokens == cold.worst_case_tokens
    with pytest.raises(TokenBudgetExceeded):
        engine.plan(STATES[0], [ROUTE, URGENT], debias="content_free", max_request_tokens=plain.worst_case_tokens)
    passes = engine.content_free_passes
    engine.clear_content_free()  # evicted after planning: the plan kept the priors it found held
    result = engine.execute(held)
    assert engine.content_free_passes == passes and result.evaluated_tokens <= held.worst_case_tokens
    assert [d.debias for d in result.distributions] == ["content_free", "content_free"]


def test_copies_of_one_question_evaluate_and_count_one_content_free_prompt(fresh):
    engine = fresh
    one = engine.plan(STATES[0], [ROUTE], debias="content_free")
    many = engine.plan(STATES[0], [ROUTE] * 5, debias="content_free")
    plain = engine.plan(STATES[0], [ROUTE] * 5, debias="none")
    assert many.worst_case_tokens - plain.worst_case_tokens == one.content_free.worst_case_tokens
    passes = engine.content_free_passes
    got = engine.execute(many)
    assert engine.content_free_passes == passes + 1
    assert [d.content_free["held"] for d in got.distributions] == [False] * 5
    assert sum(d.content_free["evaluated_tokens"] for d in got.distributions) == got.evaluated_tokens - sum(
        d.evaluated_tokens for d in got.distributions)
    assert got.evaluated_tokens <= many.worst_case_tokens
    _same(got, _cold(engine, STATES[0], [ROUTE] * 5))


def test_under_the_default_cloze_scoring_keeps_none_and_asked_for_it_is_refused(fresh):
    assert fresh.plan(STATES[0], [ROUTE], scoring="sequence", default_debias="content_free").debias == "none"


def test_sequence_scoring_refuses_content_free_naming_the_field(fresh):
    with pytest.raises(PlanError) as refused:
        fresh.plan(STATES[0], [ROUTE], scoring="sequence", debias="content_free")
    assert refused.value.field == "debias" and "label scoring" in str(refused.value)


def test_options_first_content_free_gives_the_cold_answer(fresh):
    engine = fresh
    engine.score(STATES[0], [ROUTE], debias="content_free", layout="options_first")
    got = engine.score(STATES[1], [ROUTE], debias="content_free", layout="options_first")
    assert got.distributions[0].content_free["held"] is True
    _same(got, _cold(engine, STATES[1], [ROUTE], layout="options_first"))


def test_the_recompute_record_reproduces_the_calibrated_logits(fresh, model_path):
    got = fresh.score(STATES[1], [ROUTE], debias="content_free", return_prompt=True).distributions[0]
    record = dict(got.recompute)
    np.testing.assert_allclose(record["content_free_log_prior"], np.log(got.content_free["prior"]), rtol=0, atol=1e-9)
    np.testing.assert_allclose(recompute_logits(record, model_path, n_threads=2), got.option_logits, rtol=0, atol=1e-4)


# ---- through HTTP --------------------------------------------------------------------------------------

BODY = {"decision": {"id": "route", "state": STATES[0], "question": ROUTE.text,
                     "options": [{"id": o.key, "description": o.description} for o in ROUTE.outcomes]}}


def test_semif_and_system_one_report_the_prior_and_the_raw_answer(client, fresh):
    response = client.post("/v1/semif", json={**BODY, "debias": "content_free"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prompt"]["debias"] == "content_free"
    record = body["prompt"]["content_free"]
    assert record["state"] == CONTENT_FREE_STATE and sum(record["prior"]) == pytest.approx(1.0)
    np.testing.assert_allclose(body["probabilities"], softmax(body["option_logits"]), rtol=0, atol=1e-9)
    expected = np.log(record["probabilities"]) - np.log(record["prior"])
    np.testing.assert_allclose(body["probabilities"], softmax(expected), rtol=0, atol=1e-6)
    systemone = {"state": STATES[0], "debias": "content_free",
                 "questions": {"route": {"type": "choice", "instructions": ROUTE.text,
                                         "criteria": {o.key: o.description for o in ROUTE.outcomes}}}}
    replies = [client.post("/v1/systemone", json={**systemone, "state": state}) for state in STATES[:2]]
    assert [r.status_code for r in replies] == [200, 200], replies[-1].text
    x = replies[1].json()["x_semif"]
    assert x["debias"] == "content_free" and x["content_free"]["route"]["held"] is True  # kept from the first
    assert x["content_free"]["route"]["prior"] == replies[0].json()["x_semif"]["content_free"]["route"]["prior"]


def test_asking_for_content_free_with_cloze_scoring_is_a_422_naming_debias_on_every_path(client):
    body = {**BODY, "scoring": "sequence", "debias": "content_free"}
    response = client.post("/v1/semif", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "debias"
    line = client.post("/invocations", content=(json.dumps(body) + "\n").encode(),
                       headers={"content-type": "application/jsonlines"})
    assert line.status_code == 200, line.text
    [record] = [json.loads(text) for text in line.text.splitlines() if text.strip()]
    assert record["error"]["field"] == "debias" and record["id"] == "route"
    assert client.get("/ping").status_code == 200
    # The default is not asked for: the same request without `debias` is scored with cloze, uncalibrated.
    plain = client.post("/v1/semif", json={**BODY, "scoring": "sequence"})
    assert plain.status_code == 200 and plain.json()["prompt"]["debias"] == "none"


def test_openai_decisions_answers_say_they_were_debiased(client, fresh):
    body = {"model": "gpt-6-luna", "input": STATES[0], "questions": [
        {"type": "choice", "name": "route", "instructions": ROUTE.text,
         "choices": [{"value": o.key, "description": o.description} for o in ROUTE.outcomes]}]}
    plain = client.post("/v1/decisions", json=body)
    assert plain.status_code == 200, plain.text
    assert "x_semif" not in plain.json()  # a plain OpenAI request gets OpenAI's shape
    debiased = client.post("/v1/decisions", json={**body, "debias": "content_free"})
    assert debiased.status_code == 200, debiased.text
    assert debiased.json()["answers"] == plain.json()["answers"]  # the default it ran
    x = debiased.json()["x_semif"]
    assert x["debias"] == "content_free" and x["content_free"][0]["state"] == CONTENT_FREE_STATE
    raw = client.post("/v1/decisions", json={**body, "debias": "none"}).json()
    assert raw["x_semif"]["debias"] == "none" and "content_free" not in raw["x_semif"]


# A decision whose question suffix (~94 tokens) makes 399 copies of it fit the default budget
# (SEMIF_MAX_REQUEST_TOKENS, 65536) with one content-free prompt counted, and not with one per copy.
PARCEL = Question("Which support queue should handle this customer message?",
                  (Outcome("account_access", "Sign-in problems: forgotten passwords, locked or disabled accounts, two-factor codes."),
                   Outcome("billing", "Money: charges, double charges, refunds, invoices, payment methods."),
                   Outcome("shipping", "Parcels: delivery status, lost or late parcels, returns and exchanges.")))
PARCEL_STATE = ("The tracking page says my parcel was delivered yesterday, but nothing came and the neighbours "
                "have not seen it.")


def _semif_body(questions, state=PARCEL_STATE):
    return {"state": state, "decisions": [
        {"id": f"d{i}", "question": q.text, "options": [{"id": o.key, "description": o.description} for o in q.outcomes]}
        for i, q in enumerate(questions)]}


def _openai_body(questions, state=PARCEL_STATE):
    return {"model": "gpt-6-luna", "input": state, "questions": [
        {"type": "choice", "name": f"q{i}", "instructions": q.text,
         "choices": [{"value": o.key, "description": o.description} for o in q.outcomes]}
        for i, q in enumerate(questions)]}


def _probabilities(path, body):
    if path == "/v1/semif":
        return [r["probabilities"] for r in body["results"]]
    return [[c["probability"] for c in a["probabilities"]] for a in body["answers"]]


@pytest.mark.parametrize("path, make", [("/v1/semif", _semif_body), ("/v1/decisions", _openai_body)])
def test_a_decision_among_399_copies_answers_as_it_does_alone_at_the_default_budget(client, engine, path, make):
    start_cold(engine)
    alone = client.post(path, json=make([PARCEL]))
    assert alone.status_code == 200, alone.text
    start_cold(engine)
    many = client.post(path, json=make([PARCEL] * 399))
    assert many.status_code == 200, many.text
    [want] = _probabilities(path, alone.json())
    got = _probabilities(path, many.json())
    assert len(got) == 399
    np.testing.assert_allclose(got, [want] * 399, rtol=0, atol=1e-6)
    if path == "/v1/semif":
        assert {r["prompt"]["debias"] for r in many.json()["results"]} == {"content_free"}


@pytest.fixture
def tight_client(engine, model_path):
    """The server at its defaults but for SEMIF_DEBIAS=content_free and SEMIF_MAX_REQUEST_TOKENS=1500."""
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    with TestClient(create_app(make_settings(model_path, max_request_tokens=1500, debias="content_free"), engine),
                    raise_server_exceptions=False) as tight:
        yield tight


FILLERS = [Question(f"Filler question number {i}?", (Outcome("a"), Outcome("b"))) for i in range(15)]


@pytest.mark.parametrize("path, make, field", [("/v1/semif", _semif_body, "decisions"),
                                               ("/v1/decisions", _openai_body, "questions")])
def test_over_the_budget_the_default_calibration_is_refused_naming_the_field_never_dropped(tight_client, engine,
                                                                                           path, make, field):
    start_cold(engine)
    alone = tight_client.post(path, json=make([PARCEL]))
    assert alone.status_code == 200, alone.text
    start_cold(engine)
    refused = tight_client.post(path, json=make([PARCEL] + FILLERS))
    assert refused.status_code == 413, refused.text
    assert field in refused.text and "SEMIF_MAX_REQUEST_TOKENS" in refused.text
    # With every prior held (each question asked before, in requests that fit), the same request is refused all
    # the same: admission depends on the request, never on what ran before.
    for start in range(0, len(FILLERS), 8):
        assert tight_client.post(path, json=make([PARCEL] + FILLERS[start:start + 8])).status_code == 200
    again = tight_client.post(path, json=make([PARCEL] + FILLERS))
    assert again.status_code == 413, again.text
    # And the decision alone still answers at its calibration, the same as before.
    np.testing.assert_allclose(_probabilities(path, tight_client.post(path, json=make([PARCEL])).json())[0],
                               _probabilities(path, alone.json())[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("path, body", [
    ("/v1/semif", {**BODY, "debias": "contentfree"}),
    ("/v1/systemone", {"state": "x", "debias": "prior", "questions": {"q": {"type": "choice", "instructions": "?",
                                                                              "criteria": {"a": "A", "b": "B"}}}}),
])
def test_an_unknown_debias_mode_is_a_422_naming_the_field(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert "debias" in response.text
    assert client.get("/ping").status_code == 200


def test_under_batching_the_prior_is_evaluated_serially_and_the_questions_share_a_decode(model_path, fresh):
    from semif.serving.engine.batching import batchable, execute_batch

    batched = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=1, n_seq=2)
    try:
        plans = [batched.plan(STATES[i], [ROUTE], debias=mode) for i, mode in ((0, "content_free"), (1, "none"))]
        assert batchable(batched, plans[0]) and batchable(batched, plans[1])
        shared = batched.batch_stats.shared_waves
        first, plain = execute_batch(batched, plans)
        assert batched.batch_stats.shared_waves == shared + 1 and batched.batch_stats.serial_fallbacks == 0
        cold = _cold(fresh, STATES[0], [ROUTE]).distributions[0]
        got = first.distributions[0]
        # The prior comes from the serial path: exactly the cold one. The question shared a decode: its raw
        # logits are within the batching drift (tests/test_batching.py), and the prior divided out of them.
        assert got.debias == "content_free" and got.content_free["held"] is False
        np.testing.assert_allclose(got.content_free["prior"], cold.content_free["prior"], rtol=0, atol=1e-9)
        np.testing.assert_allclose(got.content_free["option_logits"], cold.content_free["option_logits"], rtol=0, atol=0.3)
        np.testing.assert_allclose(np.subtract(got.content_free["option_logits"], got.option_logits),
                                   np.log(got.content_free["prior"]), rtol=0, atol=1e-9)
        assert plain.distributions[0].debias == "none" and plain.distributions[0].content_free is None
        # A cold engine: nothing was reused from an earlier request (the head came from its own pass).
        assert first.cached_tokens == 0 and first.state_cached_tokens == 0
        # The next batch finds the prior held and evaluates no content-free pass.
        passes = batched.content_free_passes
        [again] = execute_batch(batched, [batched.plan(STATES[2], [ROUTE], debias="content_free")])
        assert batched.content_free_passes == passes and again.distributions[0].content_free["held"] is True
    finally:
        batched.close()


def test_a_batched_request_cancelled_in_its_content_free_pass_keeps_nothing_and_the_others_answer(model_path, fresh):
    from semif.serving.engine.batching import execute_batch

    batched = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=1, n_seq=2)
    try:
        plans = [batched.plan(STATES[0], [ROUTE, URGENT], debias="content_free"), batched.plan(STATES[1], [ROUTE])]
        asked = []

        def stop_in_the_pass():  # the pass asks before each of its questions: stop before the second
            asked.append(1)
            return len(asked) > 1

        stopped, other = execute_batch(batched, plans, [stop_in_the_pass, None])
        assert isinstance(stopped, Cancelled) and len(batched.prior_memo) == 0
        assert other.distributions[0].debias == "none"
    finally:
        batched.close()


# ---- the caller's abstain option ------------------------------------------------------------------------

ESCAPE = Outcome("needs_more_info", "The message does not say enough to route it.")
ROUTE_OR_ASK = Question(ROUTE.text, ROUTE.outcomes + (ESCAPE,), abstain=3)
ASK_FIRST = Question(ROUTE.text, (ESCAPE,) + ROUTE.outcomes, abstain=0)


@pytest.mark.parametrize("question", [ROUTE_OR_ASK, ASK_FIRST], ids=["last", "first"])
def test_the_abstain_option_keeps_its_content_free_share_and_the_others_lose_their_bias(fresh, question):
    """A content-free state is itself a reason to abstain: the marked option is not divided by its prior; the
    others are, and share what the content-free answer left them."""
    engine = fresh
    a = question.abstain
    got = engine.score(STATES[2], [question], debias="content_free").distributions[0]
    start_cold(engine)
    raw = engine.score(STATES[2], [question], debias="none").distributions[0]
    start_cold(engine)
    prior = engine.score(CONTENT_FREE_STATE, [question], debias="none").distributions[0]
    p = np.asarray(prior.probabilities)
    n = len(p)
    shift = np.log(p) - np.log((1 - p[a]) / (n - 1))
    shift[a] = 0.0
    expected = np.asarray(raw.option_logits) - shift
    np.testing.assert_allclose(got.option_logits, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.probabilities, softmax(expected), rtol=0, atol=1e-6)
    assert got.content_free["abstain_kept"] == a
    # On the content-free state itself the answer is the abstain option's content-free share, the rest even.
    on_nothing = softmax(np.asarray(prior.option_logits) - shift)
    assert on_nothing[a] == pytest.approx(p[a], abs=1e-6)
    np.testing.assert_allclose(np.delete(on_nothing, a), (1 - p[a]) / (n - 1), rtol=0, atol=1e-6)
    # Unmarked, the same question divides the abstain option out too: another answer (not vacuous).
    start_cold(engine)
    plain = engine.score(STATES[2], [Question(question.text, question.outcomes)], debias="content_free").distributions[0]
    assert "abstain_kept" not in plain.content_free
    assert abs(plain.probabilities[a] - got.probabilities[a]) > 1e-3


def test_a_prior_held_for_the_unmarked_question_gives_the_marked_one_its_cold_answer(fresh, model_path):
    engine = fresh
    engine.score(STATES[0], [Question(ROUTE_OR_ASK.text, ROUTE_OR_ASK.outcomes)], debias="content_free")
    held = engine.score(STATES[1], [ROUTE_OR_ASK], debias="content_free", return_prompt=True).distributions[0]
    assert held.content_free["held"] is True
    cold = _cold(engine, STATES[1], [ROUTE_OR_ASK]).distributions[0]
    assert held.option_logits == cold.option_logits and held.probabilities == cold.probabilities
    # semif-recompute rebuilds the kept share from the record alone.
    np.testing.assert_allclose(recompute_logits(dict(held.recompute), model_path, n_threads=2), held.option_logits,
                               rtol=0, atol=1e-4)


def test_semif_marks_the_abstain_option_by_id_or_by_the_policy_fallback(client, fresh):
    options = BODY["decision"]["options"] + [{"id": ESCAPE.key, "description": ESCAPE.description}]
    decision = {**BODY["decision"], "options": options}
    marked = client.post("/v1/semif", json={"decision": {**decision, "abstain_option": ESCAPE.key}, "debias": "content_free"})
    assert marked.status_code == 200, marked.text
    assert marked.json()["prompt"]["content_free"]["abstain_kept"] == ESCAPE.key
    by_fallback = client.post("/v1/semif", json={"decision": decision, "debias": "content_free",
                                                 "policy": {"min_probability": 0.5, "fallback": ESCAPE.key}})
    assert by_fallback.status_code == 200, by_fallback.text
    assert by_fallback.json()["prompt"]["content_free"]["abstain_kept"] == ESCAPE.key
    assert by_fallback.json()["probabilities"] == marked.json()["probabilities"]
    # A fallback that is not an option ("escalate") marks nothing.
    other = client.post("/v1/semif", json={"decision": decision, "debias": "content_free",
                                           "policy": {"min_probability": 0.5, "fallback": "escalate"}})
    assert "abstain_kept" not in other.json()["prompt"]["content_free"]
    assert other.json()["probabilities"] != marked.json()["probabilities"]


@pytest.mark.parametrize("body, field", [
    ({"decision": {**BODY["decision"], "abstain_option": "unknown"}}, "decision.abstain_option"),
    ({"state": STATES[0], "decisions": [{k: v for k, v in BODY["decision"].items() if k != "state"} | {"abstain_option": "nope"}]},
     "decisions[0].abstain_option"),
])
def test_an_abstain_option_that_is_not_an_option_is_a_422_naming_the_field(client, body, field):
    response = client.post("/v1/semif", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_semif_eval_scores_a_labeled_rows_abstain_option_as_marked(fresh):
    """A labeled row's `abstain_option` (data/README.md) reaches the engine as the caller's abstain option."""
    from semif.tools.evaluate import InProcessTarget

    row = {"id": "r", "state": STATES[2], "question": ROUTE.text, "answer": ESCAPE.key,
           "options": [{"id": o.key, "description": o.description} for o in ROUTE_OR_ASK.outcomes]}
    target = InProcessTarget(fresh)
    plain = target.decide(row, "label", debias="content_free")
    start_cold(fresh)
    marked = target.decide({**row, "abstain_option": ESCAPE.key}, "label", debias="content_free")
    start_cold(fresh)
    direct = fresh.score(STATES[2], [ROUTE_OR_ASK], debias="content_free").distributions[0]
    assert marked.probabilities == direct.probabilities
    assert marked.probabilities != plain.probabilities


def test_over_the_budget_with_the_reversed_order_the_field_named_is_debias(fresh):
    """debias "reverse" counts each question in both orders; a request that fits in one order only is refused
    naming what pushed it over, never answered in one order."""
    engine = fresh
    plain = engine.plan(STATES[0], [ROUTE], debias="none").worst_case_tokens
    both = engine.plan(STATES[0], [ROUTE], debias="reverse").worst_case_tokens
    assert plain < both
    for asked, budget, field in [(dict(debias="reverse"), both - 1, "debias"),
                                 (dict(default_debias="reverse"), both - 1, "decisions"),
                                 (dict(debias="reverse"), plain - 1, "decisions")]:
        with pytest.raises(TokenBudgetExceeded) as over:
            engine.plan(STATES[0], [ROUTE], max_request_tokens=budget, budget_field="decisions", **asked)
        assert over.value.field == field, (asked, budget)
    engine.plan(STATES[0], [ROUTE], debias="reverse", max_request_tokens=both, budget_field="decisions")
