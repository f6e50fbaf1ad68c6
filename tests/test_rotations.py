"""debias "rotations": the options read in a canonical order and its cyclic rotations, the reads combined.

The plan's orders (canonical_order, rotation_schedule, read_orders) are checked as properties over generated
option sets; the engine's answers with the embedded model (conftest's engine at production defaults)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semif.serving.engine.plan import question_lead
from semif.serving.engine.passes.orders import combine_orders
from semif.serving.engine.passes.rotations import STOP_MARGIN_PER_READ, settled
from semif.serving.engine.plan import PlanError, canonical_order, read_orders, rotation_schedule
from semif.serving.engine.prompt import Outcome, Question
from semif.serving.engine.readout import log_softmax
from semif.serving.engine.results import softmax

KEYS = st.lists(st.text(alphabet="abcdefghij_XYZ0123", min_size=1, max_size=6), min_size=1, max_size=12, unique=True)


def question(keys, kind="choice") -> Question:
    return Question("Which one?", tuple(Outcome(k) for k in keys), kind=kind)


@given(st.integers(min_value=1, max_value=40))
def test_the_schedule_reads_every_rotation_once_starting_with_the_canonical_order(n):
    schedule = rotation_schedule(n)
    assert schedule[0] == 0
    assert sorted(schedule) == list(range(n))


def test_the_schedule_reads_the_farthest_rotation_next():
    assert rotation_schedule(4) == [0, 2, 1, 3]
    assert rotation_schedule(8)[:4] == [0, 4, 2, 6]
    assert rotation_schedule(2) == [0, 1]


@settings(max_examples=200)
@given(KEYS, st.randoms(use_true_random=False))
def test_the_orders_read_depend_on_the_option_set_not_on_the_listing(keys, rng):
    shuffled = list(keys)
    rng.shuffle(shuffled)
    a, b = question(keys), question(shuffled)
    # The same option ids shown in the same sequence, read after read, whatever the listing.
    shown_a = [[a.outcomes[i].key for i in order] for order in read_orders(a)]
    shown_b = [[b.outcomes[i].key for i in order] for order in read_orders(b)]
    assert shown_a == shown_b
    assert [a.outcomes[i].key for i in canonical_order(a)] == sorted(keys)


@given(KEYS)
def test_each_read_is_a_distinct_rotation_of_the_canonical_order(keys):
    q = question(keys)
    orders = read_orders(q)
    assert len(orders) == len(keys) == len(set(orders))
    first = canonical_order(q)
    rotations = {tuple(first[(i + r) % len(first)] for i in range(len(first))) for r in range(len(first))}
    assert set(orders) == rotations


@pytest.mark.parametrize("kind,keys", [("scale", ["low", "medium", "high", "critical"]), ("binary", ["yes", "no"])])
def test_ordered_kinds_keep_their_order_and_its_reverse(kind, keys):
    q = question(keys, kind)
    assert canonical_order(q) == tuple(range(len(keys)))
    assert read_orders(q) == [tuple(range(len(keys))), tuple(range(len(keys)))[::-1]]


# ---- the engine (embedded model, production defaults) -------------------------------------------

STATE = "The customer cannot receive a password reset email and is locked out of the account."
ROUTE = Question("Which queue should handle this request?",
                 (Outcome("shipping", "Delivery problems."), Outcome("account_access", "Account access support."),
                  Outcome("billing", "Billing support."), Outcome("refunds", "Money back for an order.")))


def listed(question: Question, order) -> Question:
    return Question(question.text, tuple(question.outcomes[i] for i in order), question.kind)


def by_id(question: Question, values) -> dict:
    return {o.key: v for o, v in zip(question.outcomes, values)}


def test_every_read_combined_is_the_mean_log_probability_of_its_reads_each_one_in_its_order(engine, memo_off):
    answer = engine.score(STATE, [ROUTE], debias="rotations", reads=4, return_prompt=True).distributions[0]
    assert answer.debias == "rotations" and answer.reads_stopped == "all" and len(answer.reads) == 4
    expected_orders = read_orders(ROUTE)
    assert [tuple(r["order"]) for r in answer.reads] == expected_orders
    reads = [r["option_logits"] for r in answer.reads]
    np.testing.assert_allclose(answer.option_logits, combine_orders(*reads), atol=1e-9)
    np.testing.assert_allclose(answer.probabilities, softmax(np.mean([log_softmax(x) for x in reads], axis=0)), atol=1e-9)
    independent = []
    for order in expected_orders:  # each read as a client listing the options in that order would get it
        raw = engine.score(STATE, [listed(ROUTE, order)], debias="none").distributions[0].option_logits
        back = [0.0] * len(order)
        for position, original in enumerate(order):
            back[original] = raw[position]
        independent.append(back)
    # The first read is exactly that; a later read takes the question's lead (its text, the options header) from
    # the first read's evaluation, so it is the same prompt to the kernels' precision (batch shapes, flash
    # attention), exactly reproducible from its record (test_recompute_reproduces_the_combined_logits).
    np.testing.assert_allclose(reads[0], independent[0], atol=1e-9)
    for read, own in zip(reads[1:], independent[1:]):
        np.testing.assert_allclose(read, own, atol=0.25)


@pytest.mark.parametrize("reads", [None, 1, 2, 4])
def test_the_answer_does_not_depend_on_the_order_the_client_lists_the_options_in(engine, reads):
    answers = []
    for order in [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]:
        q = listed(ROUTE, order)
        dist = engine.score(STATE, [q], debias="rotations", reads=reads).distributions[0]
        answers.append(by_id(q, dist.probabilities))
    for other in answers[1:]:
        assert other.keys() == answers[0].keys()
        np.testing.assert_allclose([other[k] for k in answers[0]], list(answers[0].values()), atol=1e-12)
    plain = [by_id(listed(ROUTE, o), engine.score(STATE, [listed(ROUTE, o)], debias="none").distributions[0].probabilities)
             for o in [(0, 1, 2, 3), (3, 2, 1, 0)]]
    assert not np.allclose([plain[1][k] for k in plain[0]], list(plain[0].values()), atol=1e-3), "the model is order-sensitive"


def test_options_first_reads_each_order_with_its_own_prefix_and_does_not_depend_on_the_listing(engine, memo_off):
    answers = []
    for order in [(0, 1, 2, 3), (3, 2, 1, 0)]:
        q = listed(ROUTE, order)
        dist = engine.score(STATE, [q], debias="rotations", reads=3, layout="options_first").distributions[0]
        assert len(dist.reads) == 3 and dist.reads_stopped == "requested"
        answers.append(by_id(q, dist.probabilities))
    assert answers[0] == answers[1]
    # Each read is what a client listing the options in that order gets with debias none, options first.
    answer = engine.score(STATE, [ROUTE], debias="rotations", reads=3, layout="options_first").distributions[0]
    for read in answer.reads:
        own = engine.score(STATE, [listed(ROUTE, read["order"])], debias="none", layout="options_first").distributions[0]
        back = [0.0] * 4
        for position, original in enumerate(read["order"]):
            back[original] = own.option_logits[position]
        np.testing.assert_allclose(read["option_logits"], back, atol=1e-9)


def test_the_stop_rule_reads_until_the_combined_answer_is_settled_and_no_further(engine):
    seen_stops = set()
    for state in [STATE, "Where is my parcel? It was due on Monday.", "Please refund order 1182, it arrived broken.",
                  "hello"]:
        answer = engine.score(state, [ROUTE], debias="rotations").distributions[0]
        logs = [np.asarray(log_softmax(r["option_logits"])) for r in answer.reads]
        k, n = len(logs), len(read_orders(ROUTE))
        # Every earlier point was not settled; the last is settled, or every order was read.
        assert all(not settled(logs[:j], n) for j in range(1, k))
        assert answer.reads_stopped == ("settled" if k < n else "all")
        if k < n:
            assert settled(logs, n)
        seen_stops.add(answer.reads_stopped)
        np.testing.assert_allclose(answer.option_logits, combine_orders(*[r["option_logits"] for r in answer.reads]),
                                   atol=1e-12)
    assert STOP_MARGIN_PER_READ > 0


def test_the_stop_rule_is_the_margin_test_it_names():
    lead = np.log(np.array([0.7, 0.2, 0.1]))
    margin = lead[0] - lead[1]  # ≈ 1.25 nats
    assert settled([lead], 3, per_read=margin / 2 - 1e-6)  # 1 · m > 2 · δ
    assert not settled([lead], 3, per_read=margin / 2 + 1e-6)
    assert settled([lead, lead], 3, per_read=2 * margin - 1e-6)  # 2 · m > 1 · δ
    assert settled([lead, lead, lead], 3, per_read=1e9)  # every order read


def test_asking_for_reads_reads_exactly_that_many(engine):
    for reads, stopped in [(1, "requested"), (3, "requested"), (4, "all"), (9, "all")]:
        answer = engine.score(STATE, [ROUTE], debias="rotations", reads=reads).distributions[0]
        assert len(answer.reads) == min(reads, 4)
        assert answer.reads_stopped == stopped


def test_reads_apply_to_rotations_only_and_rotations_to_label_scoring_only(engine):
    with pytest.raises(PlanError) as caught:
        engine.plan(STATE, [ROUTE], debias="none", reads=2)
    assert caught.value.field == "reads"
    with pytest.raises(PlanError) as caught:
        engine.plan(STATE, [ROUTE], debias="rotations", scoring="sequence")
    assert caught.value.field == "debias"
    # Under a server default of rotations, a cloze request reads the raw distribution.
    assert engine.plan(STATE, [ROUTE], scoring="sequence", default_debias="rotations").debias == "none"


def test_a_scale_is_read_in_its_order_and_reversed():
    scale = Question("How urgent?", (Outcome("low"), Outcome("medium"), Outcome("high")), kind="scale")
    assert read_orders(scale) == [(0, 1, 2), (2, 1, 0)]


def test_the_state_is_evaluated_once_and_each_read_is_one_more_question_segment(engine, memo_off):
    engine.invalidate()
    one = engine.score(STATE, [ROUTE], debias="rotations", reads=1)
    engine.invalidate()
    four = engine.score(STATE, [ROUTE], debias="rotations", reads=4)
    plan = engine.plan(STATE, [ROUTE], debias="rotations", reads=4)
    # Each later read evaluates its block after the lead all orders share with the first read's (kept once).
    lead = question_lead(plan.questions[0])
    later = sum(len(r.suffix_tokens) - lead for r in plan.questions[0].reads)
    assert later < sum(len(r.suffix_tokens) for r in plan.questions[0].reads)
    assert four.evaluated_tokens == one.evaluated_tokens + later


def test_the_answer_alone_equals_the_answer_after_other_requests(engine):
    engine.invalidate()
    cold = engine.score(STATE, [ROUTE], debias="rotations").distributions[0]
    for other in ["hello", STATE, "Where is my parcel?"]:
        engine.score(other, [listed(ROUTE, (3, 1, 0, 2))], debias="rotations", reads=2)
        engine.score(other, [ROUTE], debias="reverse")
    warm = engine.score(STATE, [listed(ROUTE, (1, 3, 2, 0))], debias="rotations").distributions[0]
    assert by_id(listed(ROUTE, (1, 3, 2, 0)), warm.probabilities) == pytest.approx(by_id(ROUTE, cold.probabilities),
                                                                                   abs=1e-12)
    assert len(warm.reads) == len(cold.reads)


def test_recompute_reproduces_the_combined_logits(engine, model_path, memo_off):
    from semif.tools.recompute import recompute_logits

    answer = engine.score(STATE, [ROUTE], debias="rotations", reads=3, return_prompt=True).distributions[0]
    np.testing.assert_allclose(recompute_logits(answer.recompute, model_path), answer.option_logits, atol=1e-9)


# ---- the wire ------------------------------------------------------------------------------------

SEMIF = {"decision": {"id": "route", "state": STATE, "question": ROUTE.text,
                      "options": [{"id": o.key, "description": o.description} for o in ROUTE.outcomes]},
         "debias": "rotations"}


def test_semif_reports_each_read_and_refuses_reads_without_rotations(client):
    body = client.post("/v1/semif", json={**SEMIF, "reads": 2}).json()
    assert body["prompt"]["debias"] == "rotations" and body["prompt"]["reads_stopped"] == "requested"
    shown = [[o.key for o in (ROUTE.outcomes[i] for i in order)] for order in read_orders(ROUTE)[:2]]
    assert [r["order"] for r in body["prompt"]["reads"]] == shown
    bad = client.post("/v1/semif", json={**SEMIF, "debias": "none", "reads": 2})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "reads", bad.text
    for value in [0, 65, "two", 1.5]:
        bad = client.post("/v1/semif", json={**SEMIF, "reads": value})
        assert bad.status_code == 422 and "reads" in bad.text, (value, bad.text)
    assert client.post("/v1/semif", json=SEMIF).status_code == 200


def test_system_one_and_openai_decisions_accept_rotations_and_answer_alike(client, engine):
    expected = by_id(ROUTE, engine.score(STATE, [ROUTE], debias="rotations").distributions[0].probabilities)
    s1 = client.post("/v1/systemone", json={"state": STATE, "debias": "rotations", "questions": {"route": {
        "type": "choice", "instructions": ROUTE.text,
        "criteria": {o.key: o.description for o in ROUTE.outcomes[::-1]}}}})
    assert s1.status_code == 200, s1.text
    assert s1.json()["answers"]["route"]["probabilities"] == pytest.approx(expected, abs=1e-9)
    oa = client.post("/v1/decisions", json={"model": "gpt-6-luna", "input": STATE, "debias": "rotations", "questions": [{
        "type": "choice", "name": "route", "instructions": ROUTE.text,
        "choices": [{"value": o.key, "description": o.description} for o in ROUTE.outcomes]}]})
    assert oa.status_code == 200, oa.text
    assert {p["value"]: p["probability"] for p in oa.json()["answers"][0]["probabilities"]} == pytest.approx(expected, abs=1e-9)


def test_the_injection_check_reads_the_options_in_the_canonical_order_too(engine):
    values = set()
    for order in [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]:
        result = engine.score(STATE, [listed(ROUTE, order)], debias="rotations", reads=1, injection_check=True)
        values.add(result.distributions[0].injection_suspected)
    assert len(values) == 1
    plain = {engine.score(STATE, [listed(ROUTE, o)], debias="none", injection_check=True).distributions[0].injection_suspected
             for o in [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]}
    assert len(plain) > 1, "the check is order-sensitive when the options are shown as listed"


@pytest.mark.parametrize("reads", [None, 4])
def test_the_combined_answer_is_the_same_to_the_last_bit_whatever_the_listing(engine, reads):
    """The reads are combined in the canonical order, then put in the caller's: the same float operations
    in the same order whatever the listing (combined in the given order, the last bit differed here)."""
    question = Question("Which one?", tuple(Outcome(k, f"Option {k}.") for k in
                                            ["shipping", "account_access", "billing", "refunds"]))
    backward_q = listed(question, (3, 2, 1, 0))
    forward = engine.score(STATE, [question], debias="rotations", reads=reads).distributions[0]
    backward = engine.score(STATE, [backward_q], debias="rotations", reads=reads).distributions[0]
    assert by_id(question, forward.probabilities) == by_id(backward_q, backward.probabilities)
    assert by_id(question, forward.option_logits) == by_id(backward_q, backward.option_logits)


@pytest.mark.parametrize("debias,reads", [("rotations", 4), ("reverse", None)])
def test_an_answers_cached_and_evaluated_tokens_add_up_to_its_tokens_cold_and_from_the_memo(engine, memo_on,
                                                                                           debias, reads):
    """Reads in several orders share the state prefix: it is counted once in the answer's tokens, so it is
    counted once in what was cached or evaluated, cold and when the label memo answers every read."""
    engine.invalidate()
    cold = engine.score(STATE, [ROUTE], debias=debias, reads=reads).distributions[0]
    again = engine.score(STATE, [ROUTE], debias=debias, reads=reads).distributions[0]
    assert cold.cached_tokens + cold.evaluated_tokens == cold.tokens
    assert again.evaluated_tokens == 0 and again.cached_tokens == again.tokens


def test_a_first_read_from_the_memo_and_a_second_evaluated_still_add_up_to_the_answers_tokens(engine, memo_on):
    """The read as listed answered from the label memo (an earlier single read), the read backwards evaluated
    from a context that holds another state: the state is evaluated again, and nothing of it counts as cached."""
    engine.invalidate()
    engine.score(STATE, [ROUTE], debias="none")
    engine.score("Another customer asks about an invoice.", [ROUTE], debias="none")
    mixed = engine.score(STATE, [ROUTE], debias="reverse", reads=2).distributions[0]  # both orders, whatever the stop rule
    assert mixed.evaluated_tokens > 0
    assert mixed.cached_tokens + mixed.evaluated_tokens == mixed.tokens
