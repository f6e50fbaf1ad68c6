"""The decision-level passes over the scoring core: one module per pass, each talking to the core through
the small interface below and nothing else.

The core (``context.Engine``) owns the llama.cpp context: tokens, the plan, KV segments, rewinds, prefix
snapshots, the label memo, and the reading of one question after a prefix. ``Engine._execute`` runs one
plan as a fixed sequence, each pass adding to one ``Answers``:

1. the core reads every question in the order its plan shows (``Engine._score_question``), and
   ``orders.read_on_held_prefix`` reads its other orders that share the held prefix right after it
   (debias "reverse"), as ``rotations.read_on_held_prefix`` does under debias "rotations";
2. ``injection.run``: each distinct injection check, p(yes);
3. ``orders.read_with_own_prefix``: the other orders that have a prefix of their own (options first), after
   everything that reuses the given prefix, so that prefix is evaluated once (and
   ``rotations.read_with_own_prefix`` likewise);
4. ``prior.apply``: content-free priors (evaluated by ``prior.evaluate`` before step 1) divided out;
5. ``second_look.run``: greedy reasoning, then the labels again, for the ambiguous answers;
6. ``injection.attach`` and the core's result.

What a pass may use of the core (``Core`` below); underscored names are the engine package's own:

- reading: ``_score_question(plan, qplan, prefix, after=None) -> (Distribution, memo suffix tokens)`` (one
  question in the order ``qplan`` shows, after ``prefix`` or the question's own prefix; ``after``: the question's
  first read, whose suffix's lead this read shares), ``_score_labels(qplan, prefix, suffix)``, and ``_execute(plan, cancel, started)`` (a whole plan through this sequence, e.g. the
  content-free plan);
- the context: ``_ensure_prefix``, ``_forward``, ``_decode``, ``_rewind``, ``_ends_generation``, and
  ``_decoded_tokens`` (every token the serial path decoded: what a pass stopped part-way spent);
- the request: ``_running(plan, cancel)`` (the cancel hook installed, failures empty the context),
  ``_cancel`` (the hook the context's batches ask; a pass may replace it for its own work and puts it back),
  ``_progress(done, total)`` (what a Cancelled raised inside the context reports), ``_note_prefix``;
- what the model is: ``template``, ``llm`` (detokenize, token ids), ``n_ctx``, ``partial_rewind``,
  ``_tokenize``, ``prior_memo`` (the content-free priors kept across requests).

A pass never touches the KV cache, the segments or the memo directly, and never imports ``context``.
Math on logits that core and passes share lives in ``engine/readout.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np

    from ..plan import PromptPlan, QuestionPlan
    from ..prompt import PromptTemplate
    from ..results import Distribution, ScoreResult

__all__ = ["Answers", "Core", "PASSES"]

# Every pass module, in the order Engine._execute runs them (tests/test_engine_passes.py keeps it so).
PASSES = ("orders", "rotations", "injection", "prior", "second_look")


@dataclass
class Answers:
    """One plan's answers as the passes build them, and what they cost."""

    distributions: list["Distribution"] = field(default_factory=list)
    evaluated: int = 0  # tokens run through the model for the plan (a re-evaluated token counts each time)
    # Question suffix tokens answered from the label memo, counted as cached (a read that evaluated the first
    # read's block again takes that read's credit back: Distribution.redone_tokens).
    memo_suffix_tokens: int = 0
    # Leading prefix tokens a pass of this request decoded before the plan's own reads reused them (the
    # template head the content-free pass shares): not reused from an earlier request, so not "cached".
    prefix_decoded_by_passes: int = 0
    # Per injection check (by id; copies of one question share one): p(yes).
    suspected: dict[int, float] = field(default_factory=dict)


class Core(Protocol):
    """What a pass may call on the scoring core (see the module docstring)."""

    template: "PromptTemplate"
    llm: object
    n_ctx: int
    partial_rewind: bool
    prior_memo: "OrderedDict[bytes, list[float]]"  # a prior.PriorMemo
    _cancel: Optional[Callable[[], bool]]
    _decoded_tokens: int

    def _tokenize(self, text: str, *, special: bool, add_bos: bool = False) -> list[int]: ...
    def _score_question(self, plan: "PromptPlan", qplan: "QuestionPlan", prefix: list[list[int]],
                        after: Optional["QuestionPlan"] = None) -> tuple["Distribution", int]: ...
    def _score_labels(self, qplan: "QuestionPlan", prefix: list[list[int]], suffix: list[int], *,
                      fuse: bool = False, record: bool = False,
                      lead: Optional[tuple[Sequence[int], int]] = None) -> "Distribution": ...
    def _execute(self, plan: "PromptPlan", cancel: Optional[Callable[[], bool]], started: float,
                 priors=None) -> "ScoreResult": ...
    def _running(self, plan: "PromptPlan", cancel: Optional[Callable[[], bool]]) -> ContextManager[None]: ...
    def _progress(self, done: int, total: int, *, restart_batch_count: bool = True) -> None: ...
    def _note_prefix(self, prefix: Sequence[Sequence[int]]) -> None: ...
    def _ensure_prefix(self, prefix: list[list[int]]) -> None: ...
    def _forward(self, segments: list[Sequence[int]], positions: list[int]) -> tuple[dict[int, "np.ndarray"], int, int]: ...
    def _decode(self, tokens: Sequence[int], want: set[int]) -> dict[int, "np.ndarray"]: ...
    def _rewind(self, n_segments: int) -> None: ...
    def _ends_generation(self, token: int) -> bool: ...
