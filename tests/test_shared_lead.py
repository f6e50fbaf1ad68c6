"""Reads in other orders share the first read's lead: the question text and the options header are the same
tokens in every order, so a later read keeps those cells (as the first read's evaluation left them) and
evaluates only what follows. The shared cells were computed in one batch with the rest of the first read's
question block, so a later read is exact only if it always starts from that evaluation: these tests drive the
paths where the first read came from the label memo, where a later read follows another later read, and where
several questions share the state, and compare each with a cold engine."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from semif.serving.engine.plan import EngineError, question_lead, shared_lead
from semif.serving.engine.prompt import Outcome, Question
from serving import start_cold

ROUTE = Question(
    "Which queue should handle this request? Read the whole message before you answer.",
    (Outcome("account_access", "Account access support."), Outcome("billing", "Billing support."),
     Outcome("shipping", "Delivery problems."), Outcome("other", "Anything else.")),
)
URGENT = Question("How urgent is it?", (Outcome("low"), Outcome("medium"), Outcome("high")), kind="scale")
STATE = "Order 1142 arrived broken, the customer was charged twice and wants a refund before Friday."


def _reads(result, index: int = 0) -> dict:
    """Each read's option logits (in the given order), by listing name."""
    dist = result.distributions[index]
    if dist.orders:
        return {name: read["option_logits"] for name, read in dist.orders.items()}
    return {f"read{k}": read["option_logits"] for k, read in enumerate(dist.reads)}


def _cold(engine, **kwargs):
    start_cold(engine)
    return engine.score(STATE, kwargs.pop("questions", [ROUTE]), **kwargs)


def _assert_same(a, b, index: int = 0):
    ra, rb = _reads(a, index), _reads(b, index)
    assert ra.keys() == rb.keys()
    for name in ra:
        np.testing.assert_array_equal(ra[name], rb[name], err_msg=name)
    np.testing.assert_array_equal(a.distributions[index].option_logits, b.distributions[index].option_logits)


def test_the_other_order_read_after_a_memo_hit_equals_the_cold_read(engine, memo_on):
    """The first read answered from the memo left nothing in the context: the first read's question block is
    evaluated again (the same batches) before the lead is kept, and counted as evaluated."""
    cold = _cold(engine, debias="reverse", reads=2)
    plan = engine.plan(STATE, [ROUTE], debias="reverse", reads=2)
    first, other = plan.questions[0].suffix_tokens, plan.questions[0].reversed.suffix_tokens
    lead = shared_lead(first, other)
    assert lead >= len(engine._tokenize(f"Question: {ROUTE.text}", special=False)) - 1
    assert cold.evaluated_tokens == cold.input_tokens == plan.state_tokens + len(first) + len(other) - lead
    assert cold.cached_tokens == 0

    start_cold(engine)
    engine.score(STATE, [ROUTE], debias="reverse", reads=1)  # the memo now holds the first read only
    engine.invalidate()  # and the context holds nothing
    warm = engine.score(STATE, [ROUTE], debias="reverse", reads=2)
    _assert_same(cold, warm)
    # The first read came from the memo; the second evaluated the state, the first block again, then its own rest:
    # nothing of this request was answered from a cache after all.
    assert warm.evaluated_tokens == warm.input_tokens == plan.state_tokens + len(first) + len(other) - lead
    assert warm.cached_tokens == 0 and warm.distributions[0].cached_tokens == 0


def test_a_request_right_after_the_same_one_answers_from_the_memo_and_equals_it(engine, memo_on):
    cold = _cold(engine, debias="reverse", reads=2)
    again = engine.score(STATE, [ROUTE], debias="reverse", reads=2)
    assert again.evaluated_tokens == 0 and again.cached_tokens == again.input_tokens == cold.input_tokens
    _assert_same(cold, again)


def test_rotations_read_each_order_from_the_same_kept_lead(engine, memo_off):
    """Four orders: each later read keeps the lead the first read left, whichever later read came before."""
    plan = engine.plan(STATE, [ROUTE], debias="rotations", reads=4)
    first = plan.questions[0].suffix_tokens
    others = [r.suffix_tokens for r in plan.questions[0].reads]
    assert len(others) == 3
    leads = [shared_lead(first, o) for o in others]
    assert min(leads) > 0
    cold = _cold(engine, debias="rotations", reads=4)
    assert cold.evaluated_tokens == plan.state_tokens + len(first) + sum(len(o) - n for o, n in zip(others, leads))
    # The same reads with the context already holding the state from another question: the same logits.
    start_cold(engine)
    engine.score(STATE, [URGENT])
    warm = engine.score(STATE, [ROUTE], debias="rotations", reads=4)
    _assert_same(cold, warm)


def test_orders_that_share_more_with_the_first_read_than_others_keep_the_one_lead_all_share(engine, memo_off):
    """Option ids that start alike: the rotation that shows `billing_refund` first shares `A. billing` with the
    first read, the others only `A.`. Every later read keeps the shortest lead, so no read evaluates the first
    read's block again, and nothing is counted twice or below zero."""
    question = Question("Which queue?", tuple(Outcome(key) for key in ("billing_dispute", "billing_refund", "other",
                                                                       "shipping")))
    plan = engine.plan(STATE, [question], debias="rotations", reads=4)
    first = plan.questions[0]
    leads = [shared_lead(first.suffix_tokens, r.suffix_tokens) for r in first.reads]
    assert len(set(leads)) > 1  # the case this test is about
    lead = question_lead(first)
    assert lead == min(leads) > 0
    start_cold(engine)
    result = engine.execute(plan)
    assert result.evaluated_tokens == plan.state_tokens + len(first.suffix_tokens) + sum(
        len(r.suffix_tokens) - lead for r in first.reads)
    assert result.cached_tokens == 0 and result.evaluated_tokens == result.input_tokens


def test_questions_sharing_a_state_each_read_their_orders_as_alone(engine, memo_off):
    """Two questions after one state: the second question's reads start from its own first read's lead, never
    from the first question's."""
    both = _cold(engine, questions=[ROUTE, URGENT], debias="reverse", reads=2)
    for index, question in enumerate((ROUTE, URGENT)):
        start_cold(engine)
        alone = engine.score(STATE, [question], debias="reverse", reads=2)
        ra, rb = _reads(both, index), _reads(alone, 0)
        for name in ra:
            np.testing.assert_array_equal(ra[name], rb[name], err_msg=f"{question.text} {name}")


def test_the_lead_read_is_not_the_other_order_evaluated_whole(engine, memo_off):
    """What the test above compares could not fail if sharing changed nothing: the later read's logits differ
    (in the kernels' last bits) from the same tokens evaluated as one block after the state."""
    cold = _cold(engine, debias="reverse", reads=2)
    plan = engine.plan(STATE, [ROUTE], debias="reverse", reads=2)
    other = plan.questions[0].reversed
    start_cold(engine)
    prefix = [list(s) for s in plan.prefix_segments]
    whole = engine._score_labels(other, prefix, other.suffix_tokens)
    assert whole.evaluated_tokens == plan.state_tokens + len(other.suffix_tokens)
    shared = [r for r in cold.distributions[0].orders.values()][1]["option_logits"]
    back = [0.0] * len(other.order)
    for shown, original in enumerate(other.order):
        back[original] = whole.option_logits[shown]
    np.testing.assert_allclose(shared, back, atol=0.25)  # the same read, to the kernels' precision (up to 0.23 seen) ...
    assert not np.array_equal(shared, back)  # ... but not the same computation


def test_sequence_scoring_reads_every_order_whole(engine, memo_off):
    """Cloze scoring reads answers after each order's block: no lead is shared there, every token is evaluated."""
    plan = engine.plan(STATE, [ROUTE], scoring="sequence", debias="reverse", reads=2)
    result = _cold(engine, scoring="sequence", debias="reverse", reads=2)
    assert result.cached_tokens == 0
    # Each order: its whole block, then each answer but its last token (the end of turn, read from the row before).
    orders = (plan.questions[0], plan.questions[0].reversed)
    assert result.evaluated_tokens == plan.state_tokens + sum(
        len(q.suffix_tokens) + sum(len(a) - 1 for a in q.answer_tokens) for q in orders)


def test_the_budget_counts_each_lead_once_and_bounds_what_a_request_evaluates(engine, memo_on):
    """The plan gives each later read its lead (QuestionPlan.lead), so the token budget admits a request whose
    whole blocks would not fit, and what the request evaluates, cold or after a memo hit on its first read,
    never passes the budget it was admitted under."""
    plan = engine.plan(STATE, [ROUTE], debias="rotations", reads=4)
    first = plan.questions[0]
    lead = question_lead(first)
    assert lead > 0 and [r.lead for r in first.reads] == [lead] * 3 and first.lead == 0
    whole = plan.state_tokens + len(first.suffix_tokens) + sum(len(r.suffix_tokens) for r in first.reads)
    assert plan.worst_case_tokens == plan.input_tokens == whole - 3 * lead
    # Admitted under a budget the whole blocks would pass.
    engine.plan(STATE, [ROUTE], debias="rotations", reads=4, max_request_tokens=whole - 1)
    cold = _cold(engine, debias="rotations", reads=4)
    assert cold.evaluated_tokens == cold.input_tokens == plan.worst_case_tokens
    start_cold(engine)
    engine.score(STATE, [ROUTE], debias="rotations", reads=1)  # the memo holds the first read only
    engine.invalidate()
    warm = engine.score(STATE, [ROUTE], debias="rotations", reads=4)
    # The first read from the memo, its block evaluated again for the lead: exactly the budget, never more.
    assert warm.evaluated_tokens == plan.worst_case_tokens and warm.input_tokens == cold.input_tokens


def test_orders_read_whole_plan_no_lead(engine, memo_off, monkeypatch):
    """Cloze scoring, options-first and models that cannot drop a sequence's tail read every order whole, and
    their plans count every order whole."""
    for plan in (engine.plan(STATE, [ROUTE], scoring="sequence", debias="reverse", reads=2),
                 engine.plan(STATE, [ROUTE], layout="options_first", debias="reverse", reads=2)):
        assert plan.questions[0].reversed.lead == 0
    labels = engine.plan(STATE, [ROUTE], debias="reverse", reads=2)
    assert labels.questions[0].reversed.lead == question_lead(labels.questions[0]) > 0
    shared = _cold(engine, debias="reverse", reads=2)
    monkeypatch.setattr(engine, "partial_rewind", False)
    whole = engine.plan(STATE, [ROUTE], debias="reverse", reads=2)
    first = whole.questions[0]
    assert first.reversed.lead == 0
    assert whole.worst_case_tokens == whole.state_tokens + len(first.suffix_tokens) + len(first.reversed.suffix_tokens)
    start_cold(engine)
    result = engine.execute(whole)
    assert result.input_tokens == whole.worst_case_tokens
    # The same reads from other cells: equal to the kernels' precision.
    np.testing.assert_allclose(result.distributions[0].option_logits, shared.distributions[0].option_logits, atol=0.25)
    start_cold(engine)  # no snapshot of this mode left for the tests after it


def test_a_plan_whose_lead_is_not_shared_is_refused(engine, memo_off):
    """The engine keeps a lead only where the later read's block starts with the first read's tokens."""
    plan = engine.plan(STATE, [ROUTE], debias="reverse", reads=2)
    first = plan.questions[0]
    wrong = replace(first, reversed=replace(first.reversed, lead=len(first.reversed.suffix_tokens)))
    start_cold(engine)
    with pytest.raises(EngineError, match="does not share it"):
        engine.execute(replace(plan, questions=(wrong,)))
    assert engine.score(STATE, [ROUTE], debias="reverse", reads=2).input_tokens == plan.input_tokens
