"""Exactness on a sliding-window-attention model: Gemma 3 270M (SentencePiece vocabulary, SWA layers).

Partial rewinds of an SWA cache are exact only while the cache keeps every position (llama.cpp's
full-size SWA cache, `swa_full`), which the engine asks for explicitly. These tests prove it on the real
model: with the prefix cache on, answers after long states (several windows long, so the window has
slid) equal answers with the cache off.

Run by `make test` (which installs the model); alone with

    .venv/bin/python -m pytest -m gemma tests/test_gemma_swa.py -v -s

Result and command in docs/explanation/scoring.md ("Sliding-window attention").
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from semif.serving.engine.prompt import Outcome, Question
from serving import gemma_model

pytestmark = pytest.mark.gemma

ROUTE = Question(
    "Which queue should handle this request?",
    (Outcome("account_access", "Account access support."), Outcome("billing", "Billing support."), Outcome("shipping", "Delivery problems.")),
)
PRIORITY = Question("How urgent is this?", (Outcome("low"), Outcome("medium"), Outcome("high")), kind="scale")
IS_ACCOUNT = Question("Is this about logging in?", (Outcome("true"), Outcome("false")), kind="binary")
TONE = Question("What is the customer's tone?", (Outcome("calm"), Outcome("annoyed"), Outcome("furious")))
# Gemma's vocabulary has no single-token digit labels after its answer cue, so scales are sequence-scored only.
QUESTIONS = {"label": [ROUTE, IS_ACCOUNT, TONE], "sequence": [ROUTE, PRIORITY, IS_ACCOUNT]}


def _long_state(topic: str, lines: int) -> str:
    return "\n".join(f"Message {k}: the customer writes again about {topic}, order {1000 + k}, and asks for an update."
                     for k in range(lines))


@pytest.fixture(scope="module")
def gemma():
    from semif.serving.engine.context import Engine

    engine = Engine(gemma_model(), n_ctx=8192, n_batch=512, n_threads=os.cpu_count() or 2, label_memo=False)
    yield engine
    engine.close()


def _computed(result):
    assert all(d.evaluated_tokens > 0 for d in result.distributions)
    return result


def test_gemma_has_sliding_window_attention_and_the_engine_keeps_the_full_window_cache(gemma):
    assert gemma.n_swa > 0
    assert gemma.llm.context_params.swa_full is True
    assert gemma.partial_rewind  # an attention model: questions rewind to the state boundary
    # Prefix snapshots stay off on a sliding-window model: a restored SWA state is not exact there (the
    # sequence case below, run after the label case has left a snapshot, fails with them on).
    assert gemma.prefix_snapshot_stats["limit_bytes"] == 0


@pytest.mark.parametrize("scoring", ["label", "sequence"])
def test_on_gemma_cache_on_equals_cache_off_after_states_longer_than_the_window(gemma, scoring):
    questions = QUESTIONS[scoring]
    first, second = _long_state("a missing refund", 60), _long_state("a parcel that never arrived", 60)
    grown = first + "\nMessage 60: the customer now threatens to cancel the account."

    gemma.prefix_cache = False
    try:
        cold = {state: _computed(gemma.score(state, questions, scoring=scoring)) for state in (first, second, grown)}
    finally:
        gemma.prefix_cache = True
    assert all(r.state_tokens > 3 * gemma.n_swa for r in cold.values())  # the window slid several times

    gemma.invalidate()
    warm = [
        (first, _computed(gemma.score(first, questions, scoring=scoring))),  # rewinds to the state boundary
        (second, _computed(gemma.score(second, questions, scoring=scoring))),  # reuses the system head only
        (first, _computed(gemma.score(first, questions, scoring=scoring))),  # after another state
        (first, _computed(gemma.score(first, questions, scoring=scoring))),  # the whole state prefix reused
        (grown, _computed(gemma.score(grown, questions, scoring=scoring))),  # unchanged n_batch blocks reused
    ]
    assert warm[3][1].state_cached_tokens == warm[3][1].state_tokens
    assert 0 < warm[4][1].state_cached_tokens < warm[4][1].state_tokens
    worst = 0.0
    for state, result in warm:
        for a, b in zip(result.distributions, cold[state].distributions):
            worst = max(worst, float(np.max(np.abs(np.subtract(a.probabilities, b.probabilities)))))
            np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=0, atol=1e-6)
    print(f"gemma {scoring}: state tokens {[r.state_tokens for r in cold.values()]}, n_swa {gemma.n_swa}, "
          f"largest |cached - uncached| probability difference {worst:.2e}")
