"""Order debiasing under the options-first layout: the reversed order is its own
cached options block, the state is evaluated after each, and the combined answer is the average of the
two orders' log-probabilities. Real SmolLM2 inference throughout."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from semif.serving.engine.context import softmax
from semif.serving.engine.passes.orders import combine_orders
from semif.serving.engine.prompt import Outcome, Question
from serving import start_cold

# The given and reversed orders are compared with the same questions evaluated alone: the label memo,
# which would answer those from the first evaluation, is off here.
pytestmark = pytest.mark.usefixtures("memo_off")

ROUTING = Question(
    "Which team should take this ticket?",
    (Outcome("network", "Wi-Fi, VPN and internet connectivity problems."),
     Outcome("hardware", "Broken or missing laptops, monitors, keyboards."),
     Outcome("billing", "Invoices, refunds and payments."),
     Outcome("access", "Accounts, passwords and permissions.")),
)
REVERSED = Question(ROUTING.text, tuple(reversed(ROUTING.outcomes)))
TICKET = "I was charged twice for the March invoice; please refund one of the two payments."


def _split(plan):
    return replace(plan, fuse_state_and_question=False)


def test_options_first_debias_gives_the_reversed_block_its_own_prefix_and_runs_the_state_after_it(engine):
    plan = engine.plan(TICKET, [ROUTING], layout="options_first", debias="reverse")
    question = plan.questions[0]
    # The first read shows the direction whose first key sorts before its last: here the listing reversed
    # ("access" before "network"), in the request's own prefix; the given listing is the other order.
    assert question.order == (3, 2, 1, 0)
    assert plan.prefix_text.index("A. Accounts, passwords") < plan.prefix_text.index(TICKET)
    back = question.reversed
    assert back is not None and back.own_prefix_segments is not None and back.order == (0, 1, 2, 3)
    shown = "".join(piece.text for piece in back.own_prefix_pieces)
    # The other order's options come before the state, in its order; the state follows them.
    assert shown.index("A. Wi-Fi, VPN") < shown.index("D. Accounts, passwords") < shown.index(TICKET)
    assert plan.template_version.endswith("+options-first")


def test_options_first_debias_reversed_order_equals_the_reversed_question_scored_alone(engine):
    start_cold(engine)
    debiased = engine.score(TICKET, [ROUTING], layout="options_first", debias="reverse", reads=2).distributions[0]
    # Without debias a routing plan fuses the state with the question (one segment); debias keeps them
    # apart (the state prefix is shared by nothing else, but the reversed pass mirrors the given one).
    start_cold(engine)
    given = engine.execute(_split(engine.plan(TICKET, [ROUTING], layout="options_first"))).distributions[0]
    start_cold(engine)
    alone = engine.execute(_split(engine.plan(TICKET, [REVERSED], layout="options_first"))).distributions[0]
    assert given.evaluated_tokens > 0 and alone.evaluated_tokens > 0
    orders = debiased.orders
    np.testing.assert_allclose(orders["given"]["probabilities"], given.probabilities, atol=1e-6)
    # The reversed pass, put back in the given order, is the reversed question's own answer.
    np.testing.assert_allclose(orders["reversed"]["probabilities"], alone.probabilities[::-1], atol=1e-6)
    combined = softmax(combine_orders(given.option_logits, alone.option_logits[::-1]))
    np.testing.assert_allclose(debiased.probabilities, combined, atol=1e-6)
    assert sum(debiased.probabilities) == pytest.approx(1.0)
