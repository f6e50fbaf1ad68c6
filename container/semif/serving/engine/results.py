"""What the engine answers: one distribution per question, the request's result, and the stop signal.

Shared by the serial path (context.py) and the batched one (batching.py), and read by the contracts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .plan import EngineError
from .prompt import TEMPLATE_VERSION


class Cancelled(EngineError):
    """The caller's ``cancel`` hook said stop (deadline passed, client gone). Raised between
    questions, or between two batches of a long segment (that segment is then dropped): the context
    and its bookkeeping stay consistent and keep the complete segments evaluated."""

    code = "cancelled"

    def __init__(self, done: int, total: int):
        super().__init__(f"stopped after {done} of {total} questions")
        self.done = done
        self.total = total


@dataclass
class Distribution:
    """One question's answer: a distribution over its outcomes, in the order they were given."""

    option_logits: list[float]
    probabilities: list[float]
    tokens: int  # prompt tokens of this question (state prefix + question)
    cached_tokens: int  # of those, reused from the context without evaluation
    evaluated_tokens: int  # tokens actually run through the model for this question
    scoring: str
    label_token_ids: Optional[list[int]] = None
    labels: Optional[list[str]] = None
    prompt_text: Optional[str] = None
    compute_ms: float = 0.0
    # p(yes) of this question's injection check (the state read after this question's options alone), or None.
    injection_suspected: Optional[float] = None
    # Label scoring: the share of the whole next-token distribution that falls on the option labels
    # (all their variants). Low mass: the model wanted to write something else (an abstention signal).
    label_mass: Optional[float] = None
    # Every token scored per label (label_token_ids holds the first of each).
    label_variant_ids: Optional[list[list[int]]] = None
    debias: str = "none"
    # With debias "reverse": each order read, keyed "given" or "reversed", its answer with outcomes in the
    # given order ({"order", "probabilities", "option_logits", "label_mass", ...}); reads_stopped says why the
    # other was not read, if it was not.
    orders: Optional[dict] = None
    # Sequence scoring: each option's token log-probabilities (its last token is the end-of-turn token).
    answer_token_logprobs: Optional[list[list[float]]] = None
    temperature: Optional[float] = None  # a native decision model's: probabilities = softmax(logits / T)
    # With return_prompt: what a fresh llama.cpp context must decode to reproduce option_logits exactly
    # (the segments as decoded, the logits positions, the numerics settings): docs/adapter.md, "Recomputing
    # an answer". None on the batched path, whose answers depend on the other questions in the batch.
    recompute: Optional[dict] = None
    # With a second look asked for: {"ran", "decided_by", and when it ran "reason", "first_pass",
    # "reasoning", "reasoning_tokens", "stopped", "evaluated_tokens", "ms"} (passes/second_look.py).
    second_look: Optional[dict] = None
    # With debias "content_free": {"state", "prior" (the options' probabilities for the content-free state),
    # "held" (the prior was kept from an earlier request), "option_logits" and "probabilities" (the raw
    # answer, before the prior was divided out)}; option_logits and probabilities are then the calibrated ones.
    content_free: Optional[dict] = None
    # With debias "rotations": each order read, first to last ({"order": the outcomes as shown, as indices in
    # the given order; "probabilities", "option_logits", "label_mass": that read's answer, outcomes in the
    # given order}), and why no further order was read: "settled" (the stop rule: the combined answer could no
    # longer change), "all" (every order read) or "requested" (the request's `reads`). option_logits and
    # probabilities are then the reads combined (the mean of their log-probabilities).
    reads: Optional[list[dict]] = None
    reads_stopped: Optional[str] = None
    # Prompt tokens of the orders planned but not read (the stop rule or the request's `reads`): the request's
    # input_tokens leave them out (Engine._execute).
    unread_tokens: int = 0
    # A read in another order that evaluated the first read's block again (the context no longer held it): its
    # length, which the request counts as evaluated, not as answered from the memo.
    redone_tokens: int = 0


@dataclass
class ScoreResult:
    distributions: list[Distribution]
    state_tokens: int
    input_tokens: int  # distinct prompt tokens of the request: state prefix once + every question suffix
    # Of input_tokens, those this request never evaluated: state-prefix tokens the context held from
    # earlier requests, plus whole prompts answered from remembered label logits.
    cached_tokens: int
    evaluated_tokens: int  # tokens run through the model (a re-evaluated token counts each time)
    compute_ms: float
    state_cached_tokens: int = 0  # of the state prefix, tokens reused from earlier requests
    template_version: str = TEMPLATE_VERSION  # what the plan ran: names the layout (e.g. "+options-first")
    layout: str = "state_first"
    injection_suspected: Optional[float] = None  # the highest of the answers' injection_suspected, when checked
    batch_requests: int = 1  # requests that shared a decode with this one, itself included (batching.py)
    # With return_prompt: the plan's shared prefix (the system block and, state first, the state), which every
    # question's prompt_text starts with; a contract can show it once per request.
    prefix_text: Optional[str] = None


def softmax(logits: Sequence[float]) -> list[float]:
    values = np.asarray(logits, dtype=np.float64)
    values = np.exp(values - values.max())
    return (values / values.sum()).tolist()
