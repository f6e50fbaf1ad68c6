"""Content-free calibration (debias "content_free"; Zhao et al., 2021): each question's answer with the
model's answer for a state that says nothing (CONTENT_FREE_STATE) divided out.

The prior depends on the question and its options, not the state, so the engine keeps it across requests
(``PriorMemo``, keyed by the content-free prompt's exact tokens and label variants: ``prior_key``) and a
recurring decision pays for it once. ``plan_priors`` plans the content-free prompt and counts it in the
budget; ``evaluate`` reads the priors not held (the content-free plan through the core, before the
request's own reads); ``apply`` divides them out (``content_free_shift``) and fills each answer's
``content_free`` record. ``evaluate_alone`` and ``apply_to_result`` are the same for the batched path.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from ..plan import CONTENT_FREE_STATE, PlanError, PromptPlan, PromptTooLong, QuestionPlan, TokenBudgetExceeded
from ..readout import RULED_OUT_LOGIT, log_softmax, tokens_key
from ..results import Cancelled, Distribution, ScoreResult, softmax
from . import Answers, Core

__all__ = ["CONTENT_FREE_ENTRIES", "CONTENT_FREE_FLOOR", "PriorMemo", "Priors", "apply", "apply_prior", "apply_to_result",
           "content_free_shift", "evaluate", "evaluate_alone", "plan_priors", "prior_key", "with_priors"]

# Content-free priors kept: one per distinct question and option set, a few floats each. A decision
# service asks a few dozen recurring decisions; an evicted prior is evaluated again.
CONTENT_FREE_ENTRIES = 1024
CONTENT_FREE_FLOOR = math.log(1e-4)  # the smallest content-free probability divided out (apply_prior)


class PriorMemo(OrderedDict):
    """Priors kept across requests (log-probabilities over a question's labels, in shown order), least
    recently used dropped first once a content-free pass has added its own beyond ``entries``."""

    def __init__(self, entries: int = CONTENT_FREE_ENTRIES):
        super().__init__()
        self.entries = max(1, int(entries))
        self.passes = 0  # content-free plans evaluated (the others were answered from held priors)

    def trim(self) -> None:
        while len(self) > self.entries:
            self.popitem(last=False)


class Priors(NamedTuple):
    """Per question, its prior and whether it was held; tokens evaluated for them."""

    priors: list[list[float]]
    held: list[bool]
    evaluated_tokens: int
    per_question: list[int]  # of those, each question's (its content-free suffix, the prefix with the first)
    # Per question, the index of the option its caller marked as the abstain option (kept: apply_prior).
    abstain: tuple[Optional[int], ...]
    # Leading prefix tokens the answer shares with the content-free prompt (the template head) that this
    # request's pass decoded, not an earlier request: the answer reused them, but they were not "cached".
    fresh_shared: int = 0


def prior_key(content_free: PromptPlan, qplan: QuestionPlan) -> bytes:
    variants = [t for variant in (qplan.label_variants or ()) for t in (*variant, -1)]
    # Fused or not, the same tokens decode in other batch shapes (other kernels): part of the key.
    variants.append(-2 if content_free.fuse_state_and_question else -3)
    return tokens_key(content_free.prefix_segments, qplan.suffix_tokens, variants)


def _abstain_indices(plan: PromptPlan) -> tuple[Optional[int], ...]:
    """Each question's abstain option (an index in the given order), as its caller marked it, or None."""
    return tuple(q.question.abstain for q in plan.questions)


# ---- planning (any thread) ---------------------------------------------------------------------------


def plan_priors(core: Core, build: Callable[..., PromptPlan], *, scoring: str, max_request_tokens: Optional[int],
                budget_field: str, by_default: bool) -> PromptPlan:
    """The request's plan (``build()``) with its content-free plan and the priors held now. The budget counts
    one content-free prompt per distinct question, held or not: what a request may do depends on the request
    alone, never on what ran before."""
    if scoring != "label":
        raise PlanError("debias 'content_free' reads each option's label probability: it needs label scoring",
                        field="debias")
    planned = build()
    try:
        content_free = build(state_text=CONTENT_FREE_STATE, state_field="debias", max_request_tokens=None,
                             return_prompt=False, injection_check=False, debias="none")
    except PromptTooLong as too_long:
        # Refused, by default too: an answer is never given at another calibration than asked.
        raise PromptTooLong(too_long.tokens, too_long.n_ctx, field="debias",
                            what="the content-free prompt (debias 'content_free'; send debias 'none' to leave it out)"
                            ) from None
    # The prior is read the way the answer is: one segment for state and question where the answer is.
    content_free = replace(content_free, fuse_state_and_question=planned.fuse_state_and_question)
    # A held prior still saves the compute: the plan keeps it, so it is used even if evicted before
    # execution. Copies of one question share one prior.
    held, distinct = [], {}
    for qplan in content_free.questions:
        key = prior_key(content_free, qplan)
        prior = core.prior_memo.get(key)
        held.append(tuple(prior) if prior is not None else None)
        distinct.setdefault(key, qplan.worst_case_tokens)
    planned = replace(planned, content_free=content_free, content_free_held=tuple(held),
                      content_free_tokens=content_free.state_tokens + sum(distinct.values()) if distinct else 0)
    if max_request_tokens is not None and planned.worst_case_tokens > max_request_tokens:
        # Refused, never answered at another calibration: the answer would depend on its neighbours.
        over = TokenBudgetExceeded(planned.worst_case_tokens, max_request_tokens,
                                   field=budget_field if by_default else "debias")
        over.args = (f"{over}; with debias 'content_free'{' (the server default)' if by_default else ''} that "
                     f"counts the content-free prompt of each distinct question ({len(distinct)} here): send "
                     "debias 'none' to leave it out",)
        raise over
    return planned


# ---- evaluating (the model thread) -------------------------------------------------------------------


def evaluate(core: Core, plan: PromptPlan, cancel: Optional[Callable[[], bool]], started: float) -> Optional[Priors]:
    """Each question's content-free prior (None without debias "content_free"): the ones held, else the
    content-free plan evaluated now (all its questions, so that they share its prefix) and kept. Stored only
    once the whole pass has succeeded: a pass cancelled or failed part-way keeps nothing."""
    content_free = plan.content_free
    if content_free is None:
        return None
    memo = core.prior_memo
    keys = [prior_key(content_free, q) for q in content_free.questions]
    planned = plan.content_free_held or (None,) * len(keys)
    priors = [memo.get(key) for key in keys]
    for i, (key, prior) in enumerate(zip(keys, priors)):
        if prior is None and planned[i] is not None:  # held when planned, evicted since: kept again
            prior = priors[i] = memo[key] = list(planned[i])
        if prior is not None:
            memo.move_to_end(key)
    missing = [i for i, prior in enumerate(priors) if prior is None]
    if not missing:
        return Priors(priors, [True] * len(keys), 0, [0] * len(keys), _abstain_indices(plan))
    # Only the questions whose prior is not held, each distinct one once, from the content-free prefix
    # (evaluated once for them): what the plan's budget counted.
    first_of: dict[bytes, int] = {}
    distinct = [i for i in missing if first_of.setdefault(keys[i], i) == i]
    subset = replace(content_free, questions=tuple(content_free.questions[i] for i in distinct))
    core._note_prefix(subset.prefix_segments)
    try:
        result = core._execute(subset, cancel, started)
    except Cancelled:
        raise Cancelled(0, len(plan.questions)) from None  # none of the request's own questions was answered
    memo.passes += 1
    evaluated = [0] * len(keys)
    for i, dist in zip(distinct, result.distributions):
        priors[i], evaluated[i] = log_softmax(dist.option_logits), dist.evaluated_tokens
        memo[keys[i]] = priors[i]
        memo.move_to_end(keys[i])
    for i in missing:
        priors[i] = priors[first_of[keys[i]]]
    memo.trim()
    shared = 0
    for mine, theirs in zip(plan.prefix_segments, content_free.prefix_segments):
        if mine != theirs:
            break
        shared += len(mine)
    fresh = max(0, shared - result.state_cached_tokens)
    return Priors(priors, [i not in missing for i in range(len(keys))], result.evaluated_tokens, evaluated,
                  _abstain_indices(plan), fresh)


def evaluate_alone(core: Core, plan: PromptPlan, cancel: Optional[Callable[[], bool]] = None) -> Priors:
    """``evaluate`` for a caller that holds the engine's lock and scores the plan itself (batching.py).
    Cancelled passes through; any other failure empties the context, as ``Engine.execute`` does."""
    with core._running(plan, cancel):
        return evaluate(core, plan, cancel, time.perf_counter())


# ---- dividing out ------------------------------------------------------------------------------------


def content_free_shift(prior: Sequence[float], abstain: Optional[int] = None) -> np.ndarray:
    """What content-free calibration subtracts from each raw logit.

    Without an abstain option: the content-free log-prior, so that each probability is divided by the option's
    content-free probability (renormalised) and the content-free state itself answers uniformly. A prior below
    CONTENT_FREE_FLOOR counts as the floor: an option the model all but rules out when the state says nothing
    is not made a near-certainty by dividing by almost zero.

    With the caller's abstain option (``abstain``, an index): a content-free state is itself a reason to
    abstain, so that option keeps its content-free share, and only the bias among the other options is divided
    out: on the content-free state the answer is the abstain option's content-free probability, the rest shared
    equally among the others. The abstain option's logit is not shifted; the others are shifted by their log-prior
    less log((1 - p_abstain) / (n - 1)). Measured on labeled decisions: docs/benchmarks.md, "Calibration and
    abstention"."""
    log_prior = np.asarray(prior, dtype=np.float64)
    shift = np.maximum(log_prior, CONTENT_FREE_FLOOR)
    n = len(shift)
    if abstain is None or n < 2:
        return shift
    rest = max(1.0 - softmax(prior)[abstain], math.exp(CONTENT_FREE_FLOOR))
    shift = shift - math.log(rest / (n - 1))
    shift[abstain] = 0.0
    return shift


def apply_prior(dist: Distribution, prior: Sequence[float], held: bool, evaluated: int = 0,
                abstain: Optional[int] = None) -> Distribution:
    """Contextual calibration: the raw logits less content_free_shift (each probability divided by the
    option's content-free probability, renormalised; the caller's abstain option keeps its content-free share).
    The raw answer stays in ``content_free``."""
    raw = list(dist.option_logits)
    # An option the answer itself rules out stays ruled out (probability exactly 0), whatever its prior.
    applied = content_free_shift(prior, abstain)
    shifted = np.asarray(raw, dtype=np.float64) - applied
    dist.option_logits = [RULED_OUT_LOGIT if r <= RULED_OUT_LOGIT else float(v) for r, v in zip(raw, shifted)]
    dist.content_free = {"state": CONTENT_FREE_STATE, "prior": softmax(prior), "held": held,
                         "evaluated_tokens": evaluated, "option_logits": raw, "probabilities": dist.probabilities}
    if abstain is not None:
        dist.content_free["abstain_kept"] = abstain
    dist.probabilities = softmax(dist.option_logits)
    dist.debias = "content_free"
    if dist.recompute is not None:
        # The raw logits are recomputed from the segments; the prior, as applied, is subtracted from them.
        dist.recompute = dict(dist.recompute, content_free_log_prior=applied.tolist())
    return dist


def with_priors(distributions: list[Distribution], priors: Priors) -> list[Distribution]:
    """Each answer with its prior divided out. The first answer reused the template head that this request's
    content-free pass decoded: its record counts those tokens as evaluated, as a cold answer's does."""
    out = [apply_prior(d, p, h, e, a)
           for d, p, h, e, a in zip(distributions, priors.priors, priors.held, priors.per_question, priors.abstain)]
    first_pass = next((i for i, held in enumerate(priors.held) if not held), None)
    if out and priors.fresh_shared and first_pass is not None and out[0].evaluated_tokens > 0:  # not a memo answer
        # Moved, not added: from the first answer's reused tokens to its evaluated ones, and out of the
        # content-free record of the question whose pass decoded them, so the records still add up.
        moved = min(priors.fresh_shared, out[0].cached_tokens, out[first_pass].content_free["evaluated_tokens"])
        out[0].cached_tokens -= moved
        out[0].evaluated_tokens += moved
        out[first_pass].content_free["evaluated_tokens"] -= moved
    return out


def apply(answers: Answers, priors: Optional[Priors]) -> None:
    """The pass in ``Engine._execute``: the priors divided out of every answer, their cost counted."""
    if priors is None:
        return
    answers.distributions = with_priors(answers.distributions, priors)
    answers.evaluated += priors.evaluated_tokens
    answers.prefix_decoded_by_passes = priors.fresh_shared


def apply_to_result(result: ScoreResult, priors: Priors) -> ScoreResult:
    """A result scored without its priors (batching.py), with them divided out, as ``Engine.execute`` does."""
    result.distributions = with_priors(result.distributions, priors)
    result.evaluated_tokens += priors.evaluated_tokens
    moved = min(priors.fresh_shared, result.state_cached_tokens)  # decoded by this request's own pass
    result.state_cached_tokens -= moved
    result.cached_tokens -= moved
    return result
