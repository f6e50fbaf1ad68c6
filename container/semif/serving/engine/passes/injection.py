"""The injection check: per question, p(yes) that the state tries to steer the decision (plan.build_plan
builds the check questions; ``injection_check`` in the request asks for them).

Options first, a check is read from the same prefix as its question (the state is already in the context).
State first, from the check's own prefix, its question and options, then the state (INJECTION_CHECK_LAYOUT),
so the state is evaluated again. Copies of one question share one check, read once.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..plan import PromptPlan, QuestionPlan
from ..results import Cancelled, Distribution
from . import Answers, Core

__all__ = ["attach", "check", "run"]


def check(core: Core, check_plan: QuestionPlan, prefix: list[list[int]]) -> tuple[float, int, int]:
    """p(yes) of one injection check; (probability, evaluated tokens, suffix tokens answered by the memo)."""
    if check_plan.own_prefix_segments is not None:
        prefix = [list(s) for s in check_plan.own_prefix_segments]
    dist = core._score_labels(check_plan, prefix, check_plan.suffix_tokens)
    memo_tokens = len(check_plan.suffix_tokens) if dist.evaluated_tokens == 0 else 0
    return dist.probabilities[0], dist.evaluated_tokens, memo_tokens


def run(core: Core, plan: PromptPlan, prefix: list[list[int]], answers: Answers,
        cancel: Optional[Callable[[], bool]]) -> None:
    """Every distinct check of the plan, after its questions: ``answers.suspected`` by check."""
    total = len(plan.questions)
    for check_plan in plan.injection_checks:
        if id(check_plan) in answers.suspected:
            continue
        if cancel is not None and cancel():
            raise Cancelled(total, total)
        core._progress(total, total)
        answers.suspected[id(check_plan)], evaluated, memo_tokens = check(core, check_plan, prefix)
        answers.evaluated += evaluated
        answers.memo_suffix_tokens += memo_tokens


def attach(plan: PromptPlan, distributions: Sequence[Distribution], answers: Answers) -> Optional[float]:
    """Each answer's own check on it; the request's value, where a contract reports one: the most suspicious
    of its questions' checks (None when nothing was checked)."""
    for dist, check_plan in zip(distributions, plan.injection_checks):
        dist.injection_suspected = answers.suspected[id(check_plan)]
    return max(answers.suspected.values()) if answers.suspected else None
