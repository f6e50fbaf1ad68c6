"""Order debiasing: a question read in several option orders, the reads combined into one answer.

Each read scores the question as one ``QuestionPlan`` shows it (``order``: the shown outcomes as indices into
the given ones) and is put back in the given order; the answer's logits are the mean of the reads'
log-probabilities (``combine_orders``), so their softmax is the renormalised geometric mean. Debias
"reverse" reads two orders: the given one and its reverse. The one ``plan.first_direction`` picks is read
first (the same one for a listing and its reverse), and the other only while the combined answer could still
change (``settled``, the stop rule debias "rotations" shares; label scoring, where it was measured: cloze
scoring reads both). A request that sends ``reads`` gets that many (at most two), without the stop rule.

The stop rule: after k of the n orders, stop when k · margin > (n − k) · STOP_MARGIN_PER_READ, margin being the
combined answer's lead of its first option over its second in mean log-probability. It holds when no unread
order, moving the margin against the leader by at most STOP_MARGIN_PER_READ, could change the choice. It
depends on the request alone (never on other traffic), so the answer is the same alone or among others.

Entry points: ``other_orders`` (the orders a question is read in besides the first one), ``read`` (one
question in one order from the held prefix, or the order's own prefix), ``combine`` (reads into one
Distribution). ``read_on_held_prefix`` and ``read_with_own_prefix`` are the pass as ``Engine._execute``
runs it: reads that share the first order's prefix right after it, while the context holds that prefix;
reads with a prefix of their own (options first: the options come before the state) after everything
else that reuses the first order's prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from ..plan import PromptPlan, QuestionPlan, TokenBudgetExceeded
from ..readout import log_softmax
from ..results import Distribution, softmax
from . import Answers, Core

__all__ = ["STOP_MARGIN_PER_READ", "Read", "cached_of_combined", "combine", "combine_orders", "combined_answer", "listing_name",
           "other_orders", "plan_orders", "read", "read_on_held_prefix", "read_with_own_prefix", "replace_with_reads",
           "settled"]

# The most one unread order is assumed to move the margin against the leader (mean log-probability, nats).
# Chosen on the dev split (120 stratified decisions, tools/order_study.py; docs/benchmarks.md), one value for both
# passes, on a grid every 0.05: the smallest whose early stop changes the final choice, against reading every
# order, in at most 2% of decisions counting one standard error of that share (120 decisions measure a share
# of 2% to about ±1.3%). Reverse (two orders): 0.3 changed 1.7% (2 of 120), within 2% only without its
# standard error; 0.5 changed 0.8% (1 of 120), with 35% of decisions answered from one read. Rotations: 0.45
# changed 0.8%. On the holdout split 0.3 changed 4.3% of choices, 0.5 0.9% (1.4% with the shared lead); the standard error was counted after
# that run, so the holdout informed the choice (docs/benchmarks.md). tests/test_eval_tools.py ties this value to the
# study's recorded `shared_delta`.
STOP_MARGIN_PER_READ = 0.5


def settled(log_probs: list[np.ndarray], total: int, per_read: float = STOP_MARGIN_PER_READ) -> bool:
    """Whether reading the other ``total - len(log_probs)`` orders could no longer change the choice."""
    k = len(log_probs)
    if k >= total:
        return True
    mean = np.mean(log_probs, axis=0)
    top = np.sort(mean)[::-1]
    margin = float(top[0] - top[1]) if len(top) > 1 else float("inf")
    return k * margin > (total - k) * per_read


@dataclass
class Read:
    """One reading of a question in one option order: the distribution as scored (outcomes in shown order)."""

    name: str  # its key in the answer's ``orders`` record ("reversed")
    qplan: QuestionPlan  # the question as this read shows it (``order``, its own prefix if any)
    dist: Distribution
    memo_tokens: int  # suffix tokens answered from the label memo

    def in_given_order(self, values: Sequence[float]) -> list[float]:
        """Values indexed by shown position, put back in the given order."""
        out = [0.0] * len(self.qplan.order)
        for shown, original in enumerate(self.qplan.order):
            out[original] = values[shown]
        return out


def combine_orders(given: Sequence[float], *others: Sequence[float]) -> list[float]:
    """The mean of the reads' log-probabilities (each indexed by the given order), as logits; their softmax
    is the renormalised combined distribution. Two reads: (log p_given + log p_other) / 2."""
    logs = [np.log(np.clip(np.asarray(softmax(logits)), 1e-300, None)) for logits in (given, *others)]
    total = logs[0]
    for more in logs[1:]:
        total = total + more
    return (total / len(logs)).tolist()


def cached_of_combined(tokens: int, evaluated: int) -> int:
    """An answer read in several orders: its cached tokens are its tokens less what its reads evaluated. The
    reads share the state prefix, counted once in ``tokens``; a read may evaluate that prefix again (the
    first read answered from the label memo, the next one not), and then nothing of it was cached."""
    return max(0, tokens - evaluated)


def other_orders(qplan: QuestionPlan) -> list[tuple[str, QuestionPlan]]:
    """The orders ``qplan`` is read in besides its first one, by record name."""
    return [(listing_name(qplan.reversed), qplan.reversed)] if qplan.reversed is not None else []


def listing_name(qplan: QuestionPlan) -> str:
    """A read's key in the answer's ``orders`` record: "given" (the caller's listing) or "reversed" (its reverse)."""
    order = list(qplan.order or ())
    return "given" if order == sorted(order) else "reversed"


def plan_orders(build: Callable[..., PromptPlan], *, max_request_tokens: Optional[int], budget_field: str,
                by_default: bool, debias: str = "reverse") -> PromptPlan:
    """The request's plan (``build()``) with every question in each of its orders. Over the budget only because
    of the other orders (the questions alone fit), it is refused naming what pushed it over: never answered in
    one order only."""
    try:
        return build()
    except TokenBudgetExceeded as over:
        if over.field != budget_field:
            raise  # the injection checks pushed it over: named as such
        alone = build(max_request_tokens=None, return_prompt=False, injection_check=False, debias="none", reads=None)
        if alone.worst_case_tokens <= max_request_tokens:
            blamed = TokenBudgetExceeded(over.tokens, over.budget, field=budget_field if by_default else "debias")
            counted = ("each question in both option orders" if debias == "reverse" else
                       "each question in every order it may be read in")
            counted += " (each later order after the lead it shares with the first)"
            blamed.args = (f"{over}; with debias {debias!r}{' (the server default)' if by_default else ''} that "
                           f"counts {counted}: send reads 1 (SemIf) or debias 'none' to read each question once",)
            raise blamed from None
        raise


def _has_own_prefix(qplan: QuestionPlan) -> bool:
    return any(other.own_prefix_segments is not None for _, other in other_orders(qplan))


def read(core: Core, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]], name: str,
         first: Optional[QuestionPlan] = None) -> Read:
    """The question in the order ``qplan`` shows, from the held ``prefix`` (the state is not evaluated again),
    or from ``qplan``'s own prefix where it has one. ``first``: the question's
    first read; ``qplan.lead`` (the question text, the options header) is kept from it, not evaluated again."""
    dist, memo_tokens = core._score_question(plan, qplan, prefix, after=first)
    return Read(name, qplan, dist, memo_tokens)


def combined_answer(plan: PromptPlan, every: Sequence[Read], *, debias: str, stopped: Optional[str],
                    **records) -> Distribution:
    """Reads of one question (the first read first) as one answer: the mean of their log-probabilities, computed
    in the first read's order so that listings that read the same prompts get the same answer to the last bit,
    put back in the given order; each option keeps the label it had in the first read (the second look reads
    them so). ``records``: the pass's own per-read record (``orders`` or ``reads``)."""
    first = every[0]
    shown = list(first.qplan.order)
    combined_shown = combine_orders(*[[logits[index] for index in shown]
                                      for logits in (r.in_given_order(r.dist.option_logits) for r in every)])
    back = first.in_given_order
    masses = [r.dist.label_mass for r in every if r.dist.label_mass is not None]
    recompute = None
    if plan.return_prompt:
        # option_logits = the mean of every read's log-probabilities, each put back in the given order by its
        # ``order`` (this record is the first read's; tools/recompute.py).
        recompute = dict(first.dist.recompute or {}, order=shown,
                         reads=[dict(r.dist.recompute or {}, order=list(r.qplan.order)) for r in every[1:]])
    tokens = first.dist.tokens + sum(r.qplan.input_tokens for r in every[1:])  # input_tokens leaves the lead out
    evaluated = sum(r.dist.evaluated_tokens for r in every)
    dist = first.dist
    return Distribution(
        recompute=recompute,
        option_logits=back(combined_shown),
        probabilities=back(softmax(combined_shown)),
        tokens=tokens,
        cached_tokens=cached_of_combined(tokens, evaluated),
        evaluated_tokens=evaluated,
        scoring=dist.scoring,
        label_token_ids=back(dist.label_token_ids) if dist.label_token_ids else None,
        labels=back(dist.labels) if dist.labels else None,
        prompt_text=dist.prompt_text,
        label_mass=sum(masses) / len(masses) if masses else None,
        label_variant_ids=back(dist.label_variant_ids) if dist.label_variant_ids else None,
        debias=debias,
        reads_stopped=stopped,
        **records,
    )


def combine(plan: PromptPlan, qplan: QuestionPlan, first: Distribution, first_memo: int,
            reads: Sequence[Read], debias: str = "reverse", stopped: Optional[str] = None) -> tuple[Distribution, int]:
    """The first read's answer and the other reads as one answer (combined_answer); each read's own answer stays
    in ``orders``, keyed by its listing. ``stopped``: why no further order was read ("settled": the stop rule;
    "requested": the request's ``reads``; "all"). Returns (distribution, suffix tokens answered from the memo by
    all reads)."""
    every = [Read(listing_name(qplan), qplan, first, first_memo), *reads]
    orders = {}
    for r in every:
        orders[r.name] = {"order": list(r.qplan.order), "probabilities": r.in_given_order(r.dist.probabilities),
                          "option_logits": r.in_given_order(r.dist.option_logits), "label_mass": r.dist.label_mass,
                          "labels": r.dist.labels, "label_token_ids": r.dist.label_token_ids}
        if plan.return_prompt and r is not every[0]:  # the first read's text is the answer's prompt_text
            orders[r.name]["prompt_text"] = r.dist.prompt_text
    dist = combined_answer(plan, every, debias=debias, stopped=stopped, orders=orders)
    return dist, sum(r.memo_tokens for r in every)


def _read_all(core: Core, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]], first: Distribution,
              first_memo: int) -> tuple[Distribution, int]:
    others = other_orders(qplan)
    total = 1 + len(others)
    if plan.reads is not None:
        others, stopped = others[: plan.reads - 1], ("all" if plan.reads >= total else "requested")
    elif plan.scoring == "label" and settled([np.asarray(log_softmax(first.option_logits))], total):
        others, stopped = [], "settled"
    else:
        stopped = "all"
    reads = [read(core, plan, other, prefix, name, first=qplan) for name, other in others]
    dist, memo = combine(plan, qplan, first, first_memo, reads, stopped=stopped)
    dist.unread_tokens = sum(other.input_tokens for _, other in other_orders(qplan)[len(reads):])
    return dist, memo


def read_on_held_prefix(core: Core, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]],
                        first: Distribution, first_memo: int) -> tuple[Distribution, int]:
    """Right after the first order's read: the other orders that share its prefix, combined with it (the
    first answer unchanged where there are none, or where they wait for ``read_with_own_prefix``). Debias
    "reverse" with ``reads`` 1 plans no other order: the first read alone, recorded as the request asked."""
    if plan.debias == "reverse" and qplan.reversed is None:
        return combine(plan, qplan, first, first_memo, [], stopped="requested")
    if not other_orders(qplan) or _has_own_prefix(qplan):
        return first, first_memo
    return _read_all(core, plan, qplan, prefix, first, first_memo)


def read_with_own_prefix(core: Core, plan: PromptPlan, prefix: list[list[int]], answers: Answers) -> None:
    """The questions whose other orders have a prefix of their own: read last, after everything that reuses
    the first order's prefix, each answer replaced by the combination."""
    replace_with_reads(core, plan, prefix, answers, lambda q: bool(other_orders(q)) and _has_own_prefix(q), _read_all)


def replace_with_reads(core: Core, plan: PromptPlan, prefix: list[list[int]], answers: Answers,
                       wanted: Callable[[QuestionPlan], bool], read_all: Callable[..., tuple[Distribution, int]]) -> None:
    """Each ``wanted`` question's first answer replaced by ``read_all(core, plan, qplan, prefix, first, 0)``
    (its reads in other orders combined), its time and tokens accounted: the own-prefix reads of a pass."""
    total = len(plan.questions)
    for index, qplan in enumerate(plan.questions):
        if not wanted(qplan):
            continue
        core._progress(index, total, restart_batch_count=False)
        started = time.perf_counter()
        given = answers.distributions[index]
        answers.evaluated -= given.evaluated_tokens
        dist, memo_tokens = read_all(core, plan, qplan, prefix, given, 0)
        dist.compute_ms = given.compute_ms + (time.perf_counter() - started) * 1000
        answers.evaluated += dist.evaluated_tokens
        answers.memo_suffix_tokens += memo_tokens
        answers.distributions[index] = dist
