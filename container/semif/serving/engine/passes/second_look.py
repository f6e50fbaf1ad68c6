"""The second look (plan.SecondLook) at ambiguous answers: when the first pass misses a threshold, the model
reasons greedily from the same prefix within a token budget and a deadline, then the labels are read again
after SECOND_LOOK_CUE; the first pass's answer stays in the record, the second decides. While it reasons,
it peeks at the labels every ``settle_every`` tokens (the cue decoded on a side branch, then dropped) and
stops early once the peeks agree (SecondLook.settled).

``plan_look`` adds the look to a plan (its worst case counts in the budget), ``suffix_tokens`` is a
question's second-look prompt after the plan's prefix, ``look`` is one answer's look, ``run`` the pass as
``Engine._execute`` runs it, after every other pass.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from ..plan import (EngineError, PromptPlan, QuestionPlan, SecondLook, SecondLookUnsupported, TokenBudgetExceeded,
                    _question_tokens)
from ..prompt import SECOND_LOOK_CUE, SECOND_LOOK_VERSION
from ..readout import label_logits
from ..results import Cancelled, Distribution, softmax
from . import Answers, Core

__all__ = ["look", "plan_look", "run", "suffix_tokens"]


# ---- planning (any thread) ---------------------------------------------------------------------------


def suffix_tokens(core: Core, plan: PromptPlan, qplan: QuestionPlan) -> list[int]:
    """The second look's suffix tokens after the plan's prefix (PromptTemplate.second_look_suffix_parts)."""
    template = core.template
    block, tail = template.second_look_suffix_parts(qplan.question, list(qplan.labels), list(qplan.order), plan.layout)
    if template.between and not qplan.pieces[0].text.startswith(template.between) and block.startswith(template.between):
        block = block[len(template.between):]  # the prefix took the blank line after the state (plan._join_across)
    block_tokens, tail_tokens = _question_tokens(core._tokenize, plan.prefix_text, block, tail)
    return list(block_tokens) + list(tail_tokens)


def _prefix_after_checks(core: Core, plan: PromptPlan) -> int:
    """Prefix tokens the second look evaluates again because state-first injection checks ran before it:
    each check's own prefix (its question, then the state) replaced the request's in the context, so the
    first second look evaluates the request's prefix again, less the leading segments the check's prefix
    shares with it (the template head) where the context keeps them (Engine._rewind); the looks after it
    reuse it."""
    own = [c for c in plan.injection_checks if c.own_prefix_segments is not None]
    if plan.layout != "state_first" or not own:
        return 0
    kept = 0
    if core.partial_rewind:
        for mine, theirs in zip(plan.prefix_segments, own[-1].own_prefix_segments):
            if mine != theirs:
                break
            kept += len(mine)
    return plan.state_tokens - kept


def plan_look(core: Core, planned: PromptPlan, config: SecondLook, *, native: bool,
              max_request_tokens: Optional[int], field: str) -> PromptPlan:
    """``planned`` (everything but the look, planned and refused as without it) with the look added. Its worst
    case counts in the budget: every question looks again with the whole budget: its second-look suffix, the
    reasoning, the answer cue and, options first (the state is the last prefix segment, merged with the first
    pass's suffix), the whole prefix once more, and its peeks (the answer cue each time)."""
    if planned.scoring != "label" or native:
        raise SecondLookUnsupported("the second look reads labels: it needs label scoring on a chat model", field=field)
    if config.settle_every > 0 and not core.partial_rewind:
        # A peek is dropped by removing its cue from the end of the KV memory; recurrent and hybrid models
        # cannot remove a sequence's tail (Engine._rewind), so their reasoning could not go on unchanged. Such
        # a model reasons without peeks, to its budget; the answer's `budget.settle_every` says 0.
        config = replace(config, settle_every=0)
    cue = len(core._tokenize(SECOND_LOOK_CUE, special=False))
    again = sum(len(s) for s in planned.prefix_segments) if planned.layout == "options_first" else 0
    suffixes = tuple(suffix_tokens(core, planned, q) for q in planned.questions)
    peeks = config.max_peeks() * cue
    extra = sum(len(s) + config.max_tokens + cue + peeks + again for s in suffixes)
    extra += _prefix_after_checks(core, planned)
    planned = replace(planned, second_look=config, second_look_tokens=extra, second_look_suffixes=suffixes)
    if max_request_tokens is not None and planned.worst_case_tokens > max_request_tokens:
        over = TokenBudgetExceeded(planned.worst_case_tokens, max_request_tokens, field=field)
        peeking = (f", its peeks ({config.max_peeks()} × {cue} cue tokens, settle_every {config.settle_every})"
                   if peeks else "")
        over.args = (f"{over}; the second look counts, per question, its reasoning budget "
                     f"({config.max_tokens} tokens){peeking} and its own prompt: ask for fewer reasoning tokens"
                     f"{' or fewer peeks' if peeks else ''}, or leave the second look out",)
        raise over
    return planned


# ---- looking (the model thread) ----------------------------------------------------------------------


def run(core: Core, plan: PromptPlan, prefix: list[list[int]], answers: Answers,
        cancel: Optional[Callable[[], bool]]) -> None:
    """Every answer of a plan that asks for a second look, looked at once more where it is ambiguous."""
    if plan.second_look is None:
        return
    for index in range(len(plan.questions)):
        answers.distributions[index] = look(core, plan, index, prefix, answers.distributions[index], cancel)
        answers.evaluated += answers.distributions[index].second_look.get("evaluated_tokens", 0)


def look(core: Core, plan: PromptPlan, index: int, prefix: list[list[int]], first: Distribution,
         cancel: Optional[Callable[[], bool]]) -> Distribution:
    """The second look at one answer: nothing when the first pass is clear; else greedy reasoning from the
    same prefix within the token budget and deadline, then the labels read after SECOND_LOOK_CUE; or, once
    the peeks every ``settle_every`` tokens have settled, the last peek's read. When no reasoning token fits
    (deadline, context) the first pass decides. The client going away or the request deadline raises
    Cancelled, as everywhere in the engine. The context keeps the prefix; the label memo is not used."""
    config = plan.second_look
    reason = config.reason(first.probabilities, first.label_mass)
    if reason is None:
        first.second_look = {"ran": False, "decided_by": "first_pass"}
        return first
    started = time.perf_counter()
    deadline = started + config.deadline_s
    suffix = list(plan.second_look_suffixes[index])
    cue = core._tokenize(SECOND_LOOK_CUE, special=False)
    base = sum(len(s) for s in prefix) + len(suffix)
    budget = min(config.max_tokens, core.n_ctx - base - len(cue))
    first_pass = {"probabilities": first.probabilities, "option_logits": first.option_logits,
                  "label_mass": first.label_mass}
    if first.recompute is not None:
        first_pass["recompute"] = first.recompute  # semif-recompute reproduces the first pass, not the second
    # The bounds as asked, so that a caller sees which one stopped the reasoning.
    asked = {"max_tokens": config.max_tokens, "deadline_ms": round(config.deadline_s * 1000),
             "settle_every": config.settle_every}

    def kept(stopped: str, evaluated: int = 0) -> Distribution:
        """No reasoning happened: the first pass decides."""
        first.second_look = {"ran": False, "decided_by": "first_pass", "reason": reason, "stopped": stopped,
                             "version": SECOND_LOOK_VERSION, "reasoning_tokens": 0, "evaluated_tokens": evaluated,
                             "budget": asked, "peeks": 0, "peek_choices": [],
                             "ms": round((time.perf_counter() - started) * 1000, 3)}
        first.evaluated_tokens += evaluated
        return first

    if budget < 1:
        return kept("context")
    if time.perf_counter() >= deadline:
        return kept("deadline")
    variants = [list(v) for v in first.label_variant_ids or [(t,) for t in first.label_token_ids]]
    past_deadline = False

    def stop() -> bool:
        """Asked between the batches of the prefix (evaluated again when a check or the other option order
        took the context) and the suffix: the request's hook, then this look's own deadline."""
        nonlocal past_deadline
        if cancel is not None and cancel():
            return True
        past_deadline = time.perf_counter() >= deadline
        return past_deadline

    outer_cancel, core._cancel = core._cancel, stop
    decoded_before = core._decoded_tokens
    try:
        try:
            core._ensure_prefix(prefix)
            rows, reused, evaluated = core._forward(prefix + [suffix], [base - 1])
        except Cancelled:
            if not past_deadline:
                raise Cancelled(index, len(plan.questions)) from None
            return kept("deadline", core._decoded_tokens - decoded_before)
        core._cancel = None  # the loop below asks the hook itself, per token
        row, position = rows[base - 1], base - 1
        generated: list[int] = []
        pieces = bytearray()  # bytes, decoded once: a character may span tokens
        peeks: list[tuple[int, float, bool]] = []  # (choice, margin, clear of the look's thresholds) per peek
        peeked: Optional[tuple[list[float], float]] = None  # the last peek's (label logits, label mass)
        stopped = "budget"
        while True:
            if cancel is not None and cancel():
                raise Cancelled(index, len(plan.questions))
            if len(generated) >= budget:
                # the context's room, where it ends before the token budget: stopped says which bound applied
                stopped = "budget" if budget == config.max_tokens else "context"
                break
            if time.perf_counter() >= deadline:
                stopped = "deadline"
                break
            if config.settle_every > 0 and generated and len(generated) % config.settle_every == 0:
                peeked = _peek(core, cue, position, variants)
                evaluated += len(cue)
                peek_probabilities = softmax(peeked[0])
                ranked = np.sort(peek_probabilities)[::-1]
                peeks.append((int(np.argmax(peeked[0])), float(ranked[0] - (ranked[1] if len(ranked) > 1 else 0.0)),
                              config.reason(peek_probabilities, peeked[1]) is None))
                if config.settled(peeks):
                    stopped = "settled"
                    break
            token = int(np.argmax(row))
            if core._ends_generation(token):
                stopped = "end_of_turn"
                break
            generated.append(token)
            position += 1
            row = core._decode([token], {position})[position]
            evaluated += 1
            pieces += core.llm.detokenize([token], special=True)
            # "Answer:" on a line of its own or after a sentence, not an echo of the instruction's quote.
            tail = bytes(pieces[-16:]).rstrip()
            if tail.endswith(b"Answer:") and not tail.endswith(b'"Answer:'):
                stopped = "answer"
                break
        if not generated:
            return kept(stopped, evaluated)
        if stopped == "settled":
            logits, label_mass = peeked  # the read after the cue at this point: no other read
        else:
            if stopped != "answer":
                position += len(cue)
                row = core._decode(cue, {position})[position]
                evaluated += len(cue)
            logits, label_mass = label_logits(row, variants)
    finally:
        core._cancel = outer_cancel
        core._rewind(len(prefix))
    probabilities = softmax(logits)
    return Distribution(
        option_logits=logits, probabilities=probabilities, tokens=first.tokens, cached_tokens=first.cached_tokens,
        evaluated_tokens=first.evaluated_tokens + evaluated, scoring="label", label_token_ids=first.label_token_ids,
        labels=first.labels, prompt_text=first.prompt_text, label_mass=label_mass, label_variant_ids=variants,
        debias=first.debias, orders=first.orders, reads=first.reads, reads_stopped=first.reads_stopped,
        unread_tokens=first.unread_tokens, content_free=first.content_free, compute_ms=first.compute_ms,
        second_look={
            "ran": True, "decided_by": "second_look", "reason": reason, "version": SECOND_LOOK_VERSION,
            "first_pass": first_pass, "reasoning": pieces.decode("utf-8", errors="replace"),
            "reasoning_tokens": len(generated), "stopped": stopped, "budget": asked, "peeks": len(peeks),
            "peek_choices": [choice for choice, _, _ in peeks],
            "evaluated_tokens": evaluated, "ms": round((time.perf_counter() - started) * 1000, 3),
        },
    )


def _peek(core: Core, cue: list[int], position: int, variants: list[list[int]]) -> tuple[list[float], float]:
    """The label logits and label mass after the answer cue, read on a side branch after ``position`` (the
    last reasoning token), exactly as the final read reads them; then the cue's cells are removed from the
    KV memory, so the reasoning goes on from ``position`` as if nothing had been read."""
    held = len(core._segments)
    row = core._decode(cue, {position + len(cue)})[position + len(cue)]
    core._rewind(held)
    if len(core._segments) != held:  # plan_look refuses peeks where the memory cannot drop a tail
        raise EngineError("the second look could not drop its peek from the context")
    return label_logits(row, variants)
