"""Debias "reverse" (the server default) reads the direction plan.first_direction picks, and the other direction
only while the combined answer could still change (orders.settled, the stop rule). Real SmolLM2 inference."""

from __future__ import annotations

import numpy as np
import pytest

from semif.serving.engine.passes.orders import STOP_MARGIN_PER_READ, settled
from semif.serving.engine.plan import PlanError, first_direction
from semif.serving.engine.prompt import Outcome, Question
from semif.serving.engine.readout import log_softmax
from semif.serving.engine.plan import question_lead
from serving import start_cold

STATES = (
    "I was charged twice for my order and I want my money back now!",
    "Bonjour, je ne peux pas me connecter à mon compte.",
    "Thanks, the parcel arrived on time, all good.",
)
QUESTIONS = {
    "route": Question("Which queue should handle this request?",
                      (Outcome("billing", "Charges, refunds, invoices."), Outcome("account_access", "Login and password problems."),
                       Outcome("shipping", "Delivery problems."))),
    "refund": Question("Is the customer asking for a refund?",
                       (Outcome("refund", "The customer wants money back."),
                        Outcome("no_refund", "The customer does not want money back."))),
    "mood": Question("What is the customer's mood?", (Outcome("angry"), Outcome("happy"), Outcome("neutral"))),
    "language": Question("Which language is the message written in?",
                         (Outcome("english"), Outcome("french"), Outcome("german"), Outcome("spanish"))),
}
CASES = [(state, name) for state in STATES for name in QUESTIONS]


def _backwards(question: Question) -> Question:
    return Question(question.text, tuple(reversed(question.outcomes)), kind=question.kind)


def _answer(engine, state, question, **kwargs):
    return engine.score(state, [question], debias="reverse", **kwargs).distributions[0]


def test_the_first_direction_is_the_same_for_a_listing_and_its_reverse_and_ordered_kinds_keep_theirs():
    listed = Question("q", (Outcome("b"), Outcome("a"), Outcome("c")))
    backwards = _backwards(listed)
    shown = [[q.outcomes[i].key for i in first_direction(q)] for q in (listed, backwards)]
    assert shown == [["b", "a", "c"], ["b", "a", "c"]]
    assert first_direction(backwards) == (2, 1, 0)
    scale = Question("q", (Outcome("low"), Outcome("medium"), Outcome("high")), kind="scale")
    yes_no = Question("q", (Outcome("true"), Outcome("false")), kind="binary")
    assert first_direction(scale) == (0, 1, 2) and first_direction(yes_no) == (0, 1)


def test_the_answer_is_the_first_read_where_the_stop_rule_settles_and_both_reads_where_it_does_not(engine, memo_off):
    outcomes = []
    for state, name in CASES:
        question = QUESTIONS[name]
        one, both = _answer(engine, state, question, reads=1), _answer(engine, state, question, reads=2)
        answer = _answer(engine, state, question)
        settles = settled([np.asarray(log_softmax(one.option_logits))], 2)
        expected = one if settles else both
        assert answer.probabilities == expected.probabilities and answer.option_logits == expected.option_logits, name
        assert answer.tokens == expected.tokens
        assert answer.reads_stopped == ("settled" if settles else "all")
        assert (one.reads_stopped, both.reads_stopped) == ("requested", "all")
        assert len(answer.orders) == (1 if settles else 2) and set(both.orders) == {"given", "reversed"}
        lead = np.sort(log_softmax(one.option_logits))[::-1]
        assert settles == (lead[0] - lead[1] > STOP_MARGIN_PER_READ)
        # The one read is the question listed in its first direction, read once, put back in the given order.
        first = first_direction(question)
        shown = Question(question.text, tuple(question.outcomes[i] for i in first))
        alone = engine.score(state, [shown], debias="none").distributions[0].probabilities
        back = [0.0] * len(first)
        for position, index in enumerate(first):
            back[index] = alone[position]
        np.testing.assert_allclose(one.probabilities, back, rtol=0, atol=1e-9)
        outcomes.append(settles)
    # The cases drive both branches of the rule.
    assert 2 <= sum(outcomes) <= len(outcomes) - 2, outcomes


@pytest.mark.parametrize("state,name", CASES)
def test_a_listing_and_its_reverse_get_the_same_answer_to_the_last_bit(engine, memo_off, state, name):
    """Each listing evaluated (the memo off): both read the same prompts, and the reads are combined in the
    first read's order, so the answers are equal, not only close."""
    question = QUESTIONS[name]
    listed, backwards = _answer(engine, state, question), _answer(engine, state, _backwards(question))
    assert listed.probabilities == backwards.probabilities[::-1]
    assert listed.option_logits == backwards.option_logits[::-1]
    assert listed.reads_stopped == backwards.reads_stopped
    assert listed.labels == backwards.labels[::-1]  # each option keeps the label of the first read


def test_cloze_scoring_reads_both_orders_where_label_scoring_stops(engine):
    state, question = STATES[1], QUESTIONS["mood"]
    assert _answer(engine, state, question).reads_stopped == "settled"
    cloze = _answer(engine, state, question, scoring="sequence")
    assert cloze.reads_stopped == "all" and set(cloze.orders) == {"given", "reversed"}


@pytest.mark.parametrize("debias", ["none", "content_free"])
def test_reads_is_refused_where_no_orders_are_read(engine, debias):
    with pytest.raises(PlanError) as refused:
        engine.plan(STATES[0], [QUESTIONS["route"]], debias=debias, reads=1)
    assert refused.value.field == "reads"


def test_a_semif_request_reports_why_no_further_order_was_read_and_may_ask_for_both(client):
    body = {"decision": {"id": "mood", "state": STATES[1], "question": QUESTIONS["mood"].text,
                         "options": [{"id": o.key} for o in QUESTIONS["mood"].outcomes]}}
    settled_answer = client.post("/v1/semif", json={**body, "return_prompt": True}).json()
    assert settled_answer["prompt"]["debias"] == "reverse" and settled_answer["prompt"]["reads_stopped"] == "settled"
    assert len(settled_answer["prompt"]["orders"]) == 1
    both = client.post("/v1/semif", json={**body, "reads": 2, "return_prompt": True}).json()
    assert both["prompt"]["reads_stopped"] == "all" and set(both["prompt"]["orders"]) == {"given", "reversed"}
    assert both["prompt"]["tokens"] > settled_answer["prompt"]["tokens"]
    refused = client.post("/v1/semif", json={**body, "debias": "none", "reads": 1})
    assert refused.status_code == 422 and "reads" in refused.text


def test_a_semif_answer_whose_first_read_is_the_listing_reversed_is_put_back_in_the_listings_order(client):
    question = QUESTIONS["refund"]  # "no_refund" sorts before "refund": the reversed listing is read first
    decision = {"id": "refund", "state": STATES[0], "question": question.text,
                "options": [{"id": o.key, "description": o.description} for o in question.outcomes]}
    one = client.post("/v1/semif", json={"decision": decision, "reads": 1, "return_prompt": True}).json()
    assert one["prompt"]["reads_stopped"] == "requested" and list(one["prompt"]["orders"]) == ["reversed"]
    assert one["prompt"]["orders"]["reversed"]["order"] == ["no_refund", "refund"]
    backwards = {**decision, "options": decision["options"][::-1]}
    alone = client.post("/v1/semif", json={"decision": backwards, "debias": "none"}).json()
    assert one["option_ids"] == ["refund", "no_refund"]
    np.testing.assert_allclose(one["probabilities"], alone["probabilities"][::-1], rtol=0, atol=1e-9)


@pytest.mark.parametrize("debias", ["reverse", "rotations"])
def test_input_tokens_count_the_orders_read_not_the_orders_planned(engine, memo_off, debias):
    state, question = STATES[1], QUESTIONS["mood"]
    plan = engine.plan(state, [question], debias=debias)
    start_cold(engine)
    result = engine.execute(plan)
    answer = result.distributions[0]
    assert answer.reads_stopped == "settled"
    # The state once and each read's question segment; the orders left unread are neither counted nor evaluated.
    # A later read's lead is the first read's: counted once, like the state.
    assert result.evaluated_tokens == result.input_tokens == answer.tokens < plan.input_tokens
    if debias == "reverse":
        assert answer.tokens == plan.state_tokens + len(plan.questions[0].suffix_tokens)
    every = engine.score(state, [question], debias=debias, reads=len(question.outcomes))
    # The plan counts each later read's lead once, as the answer does: every order read, the two agree exactly.
    lead = question_lead(plan.questions[0])
    assert lead > 0 and all(o.lead == lead for o in (plan.questions[0].reversed, *plan.questions[0].reads) if o)
    assert every.input_tokens == every.distributions[0].tokens == plan.input_tokens


@pytest.mark.parametrize("name", ["route", "mood"])
def test_a_second_look_reads_the_first_direction_so_a_listing_and_its_reverse_get_one_answer(engine, name):
    """The look reads the options in the first read's order with its labels: the same prompt for both
    listings (a look that read the caller's listing could answer each listing differently)."""
    from semif.serving.engine.plan import SecondLook

    look = SecondLook(below_margin=1.0, max_tokens=16, settle_every=0)
    question = QUESTIONS[name]
    listed = engine.score(STATES[0], [question], debias="reverse", second_look=look).distributions[0]
    backwards = engine.score(STATES[0], [_backwards(question)], debias="reverse", second_look=look).distributions[0]
    assert listed.second_look["ran"] and backwards.second_look["ran"]
    assert listed.reads_stopped == backwards.reads_stopped is not None  # the first pass's record survives the look
    assert listed.second_look["reasoning"] == backwards.second_look["reasoning"]
    assert listed.probabilities == backwards.probabilities[::-1]


def test_a_request_that_fits_one_read_only_is_refused_naming_reads_and_fits_with_one_read(engine):
    from semif.serving.engine.plan import TokenBudgetExceeded

    state, question = STATES[0], QUESTIONS["route"]
    budget = engine.plan(state, [question], debias="none").worst_case_tokens
    with pytest.raises(TokenBudgetExceeded) as over:
        engine.plan(state, [question], debias="reverse", max_request_tokens=budget)
    assert over.value.field == "debias" and "send reads 1" in str(over.value)
    one = engine.plan(state, [question], debias="reverse", reads=1, max_request_tokens=budget)
    assert one.worst_case_tokens == budget and one.questions[0].reversed is None
    answer = engine.execute(one).distributions[0]
    assert answer.reads_stopped == "requested" and answer.debias == "reverse" and len(answer.orders) == 1


@pytest.mark.parametrize("debias,kept", [("none", True), ("reverse", False)])
def test_a_calibration_fit_for_reads_in_several_orders_carries_no_listing_keyed_prior(engine, debias, kept):
    """A contextual prior applies where a request's options hash (in its listing's order) to the one it was
    measured on: under reverse it would calibrate a listing and its reverse differently, so none is written."""
    import json
    from pathlib import Path

    from semif.serving.postprocess.calibration import FitKind
    from semif.tools.calibrate import fit_kind
    from semif.tools.evaluate import InProcessTarget

    sample = Path(__file__).resolve().parents[1] / "data" / "decisions-sample.jsonl"
    rows = [json.loads(line) for line in sample.read_text(encoding="utf-8").splitlines() if line.strip()][:12]
    entry, _ = fit_kind(InProcessTarget(engine), rows, FitKind("label", "state_first", debias), folds=3, seed=0,
                        min_per_decision=2, contextual="on")
    assert ("contextual" in entry) is kept
