"""debias "rotations": a question read in its canonical order and, while the combined answer could still
change, in further cyclic rotations of that order; the reads combined into one answer.

The first read is the one the core makes (``QuestionPlan.order`` is the canonical order: the options sorted
by id, so the prompt is the same whatever order the caller lists them in); ``QuestionPlan.reads`` holds the
other orders in the sequence they are read (plan.read_orders). Each read is put back in the given order and
the answer's logits are the mean of the reads' log-probabilities (orders.combine_orders).

The stop rule (a request that does not ask for a number of ``reads``) is orders.settled: after k of the n
orders, stop when k · margin > (n − k) · STOP_MARGIN_PER_READ.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..plan import PromptPlan, QuestionPlan, read_orders
from ..readout import log_softmax
from ..results import Distribution
from . import Answers, Core
from .orders import STOP_MARGIN_PER_READ, Read, combined_answer, read, replace_with_reads, settled

__all__ = ["STOP_MARGIN_PER_READ", "read_on_held_prefix", "read_with_own_prefix", "settled"]


def _canonical(reads: list[Read], values_of) -> list[list[float]]:
    """Each read's values (indexed by its shown position) in the canonical order, the first read's: the
    arithmetic that combines reads then runs in the same order whatever the caller's listing, so the answer
    is the same to the last bit."""
    canonical = reads[0].qplan.order
    out = []
    for r in reads:
        given = r.in_given_order(values_of(r))
        out.append([given[index] for index in canonical])
    return out


def _read_all(core: Core, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]], first: Distribution,
              first_memo: int) -> tuple[Distribution, int]:
    reads = [Read("first", qplan, first, first_memo)]
    total = len(read_orders(qplan.question))
    stopped: Optional[str] = None
    for more in qplan.reads:
        if plan.reads is None and settled([np.asarray(log_softmax(x))
                                           for x in _canonical(reads, lambda r: r.dist.option_logits)], total):
            stopped = "settled"
            break
        reads.append(read(core, plan, more, prefix, "rotation", first=qplan))
    if stopped is None:
        stopped = "all" if len(reads) == total else "requested"
    dist = _combine(plan, reads, stopped)
    dist.unread_tokens = sum(r.input_tokens for r in qplan.reads[len(reads) - 1:])
    return dist, sum(r.memo_tokens for r in reads)


def _combine(plan: PromptPlan, reads: list[Read], stopped: str) -> Distribution:
    records = []
    for r in reads:
        record = {"order": list(r.qplan.order), "probabilities": r.in_given_order(r.dist.probabilities),
                  "option_logits": r.in_given_order(r.dist.option_logits), "label_mass": r.dist.label_mass}
        if plan.return_prompt:
            record.update(labels=r.dist.labels, prompt_text=r.dist.prompt_text)
        records.append(record)
    return combined_answer(plan, reads, debias="rotations", stopped=stopped, reads=records)


def _own_prefix(qplan: QuestionPlan) -> bool:
    return any(r.own_prefix_segments is not None for r in qplan.reads)


def read_on_held_prefix(core: Core, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]],
                        first: Distribution, first_memo: int) -> tuple[Distribution, int]:
    """Right after the first read: the other orders, where they share its prefix (state first), combined."""
    if plan.debias != "rotations" or _own_prefix(qplan):
        return first, first_memo
    return _read_all(core, plan, qplan, prefix, first, first_memo)


def read_with_own_prefix(core: Core, plan: PromptPlan, prefix: list[list[int]], answers: Answers) -> None:
    """Options first: each order has a prefix of its own (its options, then the state); read last, after
    everything that reuses the first read's prefix, each answer replaced by the combination."""
    if plan.debias == "rotations":
        replace_with_reads(core, plan, prefix, answers, _own_prefix, _read_all)
