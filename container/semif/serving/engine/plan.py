"""The prompt plan: everything about one request that does not need the llama.cpp context.

Built before admission, outside the model lock (tokenization only reads the vocabulary): the fenced
state, every piece of the prompt as tokens, the label token ids or cloze answers of each question,
token counts, and the checks that depend on them (context length, the per-request token budget,
label capacity). The engine then executes a finished plan on the model thread. Knows tokens, not
contexts or HTTP.

Each piece records whether its text may hold special tokens: template text may (it opens and closes
turns); client text (the state, the question block) never does, so it cannot forge a turn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Sequence

from .prompt import (
    BINARY_LABELS, DEFAULT_LAYOUT, INJECTION_CHECK_QUESTION, LAYOUTS, Labels, Outcome, PromptTemplate, Question,
    render_question_block,
)

Tokenize = Callable[..., list]  # (text, *, special: bool, add_bos: bool = False) -> token ids


class EngineError(Exception):
    """A request the engine cannot score as asked; ``code`` is stable for clients. (Defined here, beside
    the plan's errors, so that both the plan and the engine raise one family.)"""

    code = "engine_error"

    def __init__(self, message: str, *, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


class PlanError(EngineError):
    """A request that cannot be planned as asked; ``field`` names the contract's own field (the
    contract passes its field names into the plan)."""

    code = "plan_error"


class PromptTooLong(PlanError):
    code = "prompt_too_long"

    def __init__(self, tokens: int, n_ctx: int, *, field: Optional[str] = None, what: str = ""):
        prefix = f"{what}: " if what else ""
        super().__init__(f"{prefix}prompt needs {tokens} tokens but the context holds {n_ctx}", field=field)
        self.tokens = tokens
        self.n_ctx = n_ctx


class TokenBudgetExceeded(PlanError):
    code = "token_budget_exceeded"

    def __init__(self, tokens: int, budget: int, *, field: Optional[str] = None):
        super().__init__(
            f"the request may evaluate up to {tokens} tokens; this server allows {budget} per request "
            "(SEMIF_MAX_REQUEST_TOKENS): send fewer or shorter questions, or split the request",
            field=field,
        )
        self.tokens = tokens
        self.budget = budget


class LabelError(PlanError):
    code = "unsupported_options"


class SecondLookUnsupported(LabelError):
    """A second look asked of scoring that reads no labels after generated text (sequence scoring, a
    native decision model): a 422 naming the request's `second_look`."""

    code = "unsupported_second_look"


@dataclass(frozen=True)
class Piece:
    """One run of prompt text and its tokens. ``special_tokens``: whether the text was tokenized with
    special tokens allowed (template text) or as plain text (anything a client wrote)."""

    role: str  # "template" | "state" | "question"
    text: str
    tokens: tuple[int, ...]
    special_tokens: bool


# "reverse": each question in the given option order and its reverse, their log-probabilities averaged (the
# other order's question block after the lead both share); the direction first_direction picks is read first, and the other only
# while the combined answer could still change (passes/orders.py, the stop rule). "content_free": contextual calibration (Zhao et al., 2021) at run time: each
# probability divided by the model's probability for that option when the state says nothing
# (CONTENT_FREE_STATE), with the same question and options; that prior depends on the question, not the
# state, so the engine keeps it (Engine.content_free_entries) and a recurring decision pays for it once.
# "rotations": each question read first in its canonical order (the options sorted by id: the same prompt
# whatever order the caller lists them in) and then, while the combined answer could still change, in further
# cyclic rotations of that order (rotation_schedule), their log-probabilities averaged (passes/orders.py).
# Ordered scales and yes/no questions keep their order: their reads are the given order and its reverse.
DEBIAS_MODES = ("none", "reverse", "content_free", "rotations")


def served_debias(default: str, *, scoring: str, layout: str, native: bool) -> str:
    """The debiasing a request that does not send ``debias`` gets under the server default ``default``
    (SEMIF_DEBIAS): the default applies where it was measured, label scoring through the adapter's template.
    Cloze (sequence) scoring and native decision models read "none"; so do reads in several orders
    ("reverse", "rotations") in the options-first layout, where each further order would evaluate the state
    again after its own options. A request that asks for a mode gets it, or a 422 naming ``debias``."""
    if scoring != "label" or native:
        return "none"
    if default in ("reverse", "rotations") and layout == "options_first":
        return "none"
    return default
CONTENT_FREE_STATE = "N/A"
MAX_READS = 64  # the most orders a request may ask one question to be read in (more than any option count)


def canonical_order(question: Question) -> tuple[int, ...]:
    """The order a question's first read shows its outcomes in, as indices into question.outcomes: the
    options sorted by key (code points), so that it depends on the option set, not on the caller's listing.
    Ordered kinds keep their order: a scale's levels and yes/no mean something in the order given."""
    n = len(question.outcomes)
    if question.kind in ("scale", "binary"):
        return tuple(range(n))
    return tuple(sorted(range(n), key=lambda i: question.outcomes[i].key))


def first_direction(question: Question) -> tuple[int, ...]:
    """debias "reverse": of the given order and its reverse, the one read first, as indices into
    question.outcomes: the one whose first option's key sorts before its last's (code points). A listing and
    its reverse make the same pair of orders, and this picks the same one of the two for both, so a question
    the stop rule answers from one read gets the same answer whichever way the caller lists its options.
    Ordered kinds are read as given first: a scale's levels are listed lowest first (the order is their
    meaning) and a yes/no question is built Yes first, so neither has another listing."""
    given = tuple(range(len(question.outcomes)))
    if question.kind == "choice" and len(given) > 1 and question.outcomes[-1].key < question.outcomes[0].key:
        return given[::-1]
    return given


def rotation_schedule(n: int) -> list[int]:
    """The order in which the cyclic rotations of the canonical order are read, as offsets: the canonical
    order (0), then each time the rotation farthest from every rotation read so far (each option's position
    moves most), ties to the smaller offset. rotation_schedule(4) == [0, 2, 1, 3]."""
    chosen = [0]
    while len(chosen) < n:
        def gap(r: int) -> int:
            return min(min((r - c) % n, (c - r) % n) for c in chosen)
        chosen.append(max((r for r in range(n) if r not in chosen), key=lambda r: (gap(r), -r)))
    return chosen


def read_orders(question: Question) -> list[tuple[int, ...]]:
    """Every order debias "rotations" may read a question in, first to last: the canonical order's cyclic
    rotations in rotation_schedule; an ordered kind's given order and its reverse."""
    first = canonical_order(question)
    n = len(first)
    if question.kind in ("scale", "binary"):
        return [first, first[::-1]] if n > 1 else [first]
    return [tuple(first[(i + r) % n] for i in range(n)) for r in rotation_schedule(n)]


@dataclass(frozen=True)
class QuestionPlan:
    question: Question
    field: str  # the contract's path for this question (errors name it)
    name: str  # how the contract's client knows the question (decision id, question id or name)
    pieces: tuple[Piece, ...]  # question block (plain text), template tail (special tokens allowed)
    label_token_ids: Optional[tuple[int, ...]] = None  # label scoring
    labels: Optional[tuple[str, ...]] = None
    answer_tokens: tuple[tuple[int, ...], ...] = ()  # sequence (cloze) scoring: one token run per outcome
    # Every token scored per label (``A`` and ``▁A`` where both are single tokens; see LabelSet).
    label_variants: Optional[tuple[tuple[int, ...], ...]] = None
    # The outcomes as shown, as indices into question.outcomes; labels, variants and answers follow it.
    order: Optional[tuple[int, ...]] = None
    # Order debiasing ("debias": "reverse"): the same question with its outcomes in this plan's order reversed
    # (this plan shows first_direction), scored from the same state prefix while the answer could still change;
    # the engine combines both distributions (passes/orders.py).
    reversed: Optional["QuestionPlan"] = None
    # debias "rotations": the reads after this one (this plan is the first, in the canonical order), each
    # the same question in another order (read_orders), scored from the same state prefix while the combined
    # answer could still change (passes/orders.py). Empty otherwise.
    reads: tuple["QuestionPlan", ...] = ()
    # Options-first layout with order debiasing: the reversed question's options come before the state,
    # so it has its own prefix (head, reversed options, state) instead of the plan's; None otherwise.
    own_prefix_pieces: Optional[tuple[Piece, ...]] = None
    own_prefix_segments: Optional[tuple[tuple[int, ...], ...]] = None
    # Of those, the leading tokens the request's own prefix already holds when this question runs (the
    # template head of a state-first injection check): evaluated once per request, so counted once.
    own_prefix_held: int = 0
    temperature: Optional[float] = None  # a native decision model's own (semif/serving/engine/native.py); None: 1
    # A read in another order (``reversed``, ``reads``): its leading suffix tokens held from the question's first
    # read (question_lead; the question text, the options header), not evaluated again, so not counted again.
    # 0 where each order is read whole (cloze scoring, options-first, models that cannot rewind partially).
    lead: int = 0

    @property
    def suffix_tokens(self) -> list[int]:
        return [t for piece in self.pieces for t in piece.tokens]

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)

    @property
    def worst_case_tokens(self) -> int:
        """Tokens this question evaluates after the state prefix when nothing of it is cached."""
        own = (len(self.suffix_tokens) - self.lead + sum(len(a) for a in self.answer_tokens) + self.own_prefix_tokens
               - self.own_prefix_held)
        return (own + (self.reversed.worst_case_tokens if self.reversed is not None else 0)
                + sum(r.worst_case_tokens for r in self.reads))

    @property
    def own_prefix_tokens(self) -> int:
        return sum(len(s) for s in self.own_prefix_segments or ())

    @property
    def input_tokens(self) -> int:
        """Prompt tokens of this question after the state prefix: each order it may be read in, the lead later
        orders share with the first counted once (``lead``)."""
        own = len(self.suffix_tokens) - self.lead + self.own_prefix_tokens
        return (own + (self.reversed.input_tokens if self.reversed is not None else 0)
                + sum(r.input_tokens for r in self.reads))


@dataclass(frozen=True)
class SecondLook:
    """The second look for ambiguous decisions (opt-in per request or per policy): when the first pass's
    top probability, margin or label mass is below its threshold, the model reasons greedily for at most
    ``max_tokens`` tokens and ``deadline_s`` seconds from the same prefix, then the label is read again.
    The first pass's answer stays in the result; the second pass's decides.

    Every ``settle_every`` reasoning tokens (0, the default: never) the labels are peeked at: read after the
    answer cue on a side branch that is dropped again, so the reasoning goes on exactly as without peeks.
    When the last ``settle_agree`` peeks chose the same option, the last one's margin is at least
    ``settle_margin`` and it clears the thresholds that started the look (``reason`` finds nothing), the
    reasoning has settled: it stops there, and that peek decides (it is the read after the cue at that
    point)."""

    below_probability: float = 0.0
    below_margin: float = 0.0
    below_label_mass: float = 0.0
    max_tokens: int = 128
    deadline_s: float = 20.0
    settle_every: int = 0
    settle_agree: int = 2
    settle_margin: float = 0.5

    def max_peeks(self) -> int:
        """The most peeks one look makes: one per ``settle_every`` tokens, before the budget (the read at the
        budget is the final one, not a peek)."""
        return (self.max_tokens - 1) // self.settle_every if self.settle_every > 0 else 0

    def settled(self, peeks: Sequence[tuple[int, float, bool]]) -> bool:
        """Whether the reasoning has settled, from the peeks so far as (choice, margin, clear), oldest first;
        ``clear``: the peek misses none of the look's own thresholds (``reason`` is None)."""
        if len(peeks) < self.settle_agree:
            return False
        recent = peeks[-self.settle_agree:]
        choice, margin, clear = recent[-1]
        return all(c == choice for c, _, _ in recent) and margin >= self.settle_margin and clear

    def reason(self, probabilities: Sequence[float], label_mass: Optional[float]) -> Optional[str]:
        """Why the first pass is ambiguous (the first threshold it misses), or None: no second look."""
        ranked = sorted(probabilities, reverse=True)
        top, margin = ranked[0], ranked[0] - (ranked[1] if len(ranked) > 1 else 0.0)
        # The same tolerance as the policy's own test (postprocess/policy.py), so that a policy's second
        # look runs for exactly the answers it would not accept.
        eps = 1e-9
        if top < self.below_probability - eps:
            return f"probability {top:.3f} < {self.below_probability}"
        if margin < self.below_margin - eps:
            return f"margin {margin:.3f} < {self.below_margin}"
        if label_mass is not None and label_mass < self.below_label_mass - eps:
            return f"label mass {label_mass:.3f} < {self.below_label_mass}"
        return None


@dataclass(frozen=True)
class PromptPlan:
    state_text: str
    scoring: str
    template_version: str
    # state_first: template head (special tokens allowed), fenced state (plain text).
    # options_first: template head, question block, blank line + fenced state (the last two plain text).
    prefix_pieces: tuple[Piece, ...]
    # The prefix as the engine evaluates it. state_first: head, fence opener, state blocks. options_first:
    # head, question block(s) ending in the fence opener, state blocks; the leading ``shared_segments`` are
    # what stays cached across states (the opener stays in the state's block where it cannot be split off).
    prefix_segments: tuple[tuple[int, ...], ...]
    questions: tuple[QuestionPlan, ...]
    # How many leading prefix segments are the same for every state: the template head and the fence
    # opener (state_first), or the head and the question block with the opener (options_first).
    shared_segments: int = 1
    return_prompt: bool = False
    layout: str = DEFAULT_LAYOUT
    # The injection check: a yes/no question label-scored after the state and one question's options; p(yes)
    # is that question's injection_suspected. One per question, in order (copies of a question share one
    # object); empty when not asked for.
    injection_checks: tuple[QuestionPlan, ...] = ()
    debias: str = "none"
    # debias "rotations" and "reverse": how many reads each question asked for (its reads are planned up to
    # this many), or None: read while the combined answer could still change (passes/orders.py, the stop rule).
    reads: Optional[int] = None
    # Options-first, label scoring, nothing else scored after this state (no injection check, no order
    # debiasing): the state's last block and the question suffix are evaluated as one segment. Nothing
    # could reuse the state there (the state comes after the options, so another question means another
    # prefix, and an exact repeat is answered by the label memo), and one llama_decode instead of two took
    # 0.81x the time of a routing decision in-process (docs/benchmarks.md). Decided by the request alone, never by the cache, so the answer does not
    # depend on what the context happened to hold (the exactness rule in engine.py).
    fuse_state_and_question: bool = False
    # The second look, when asked for (label scoring only): Engine.execute runs it on ambiguous answers.
    second_look: Optional[SecondLook] = None
    # Its worst case: every question looks again with the whole budget (Engine.plan counts it).
    second_look_tokens: int = 0
    # Per question, the second look's suffix tokens, tokenized here, off the model thread.
    second_look_suffixes: tuple = ()
    # debias "content_free": the same questions about CONTENT_FREE_STATE (debias "none", no checks), whose
    # label distributions are each question's prior (Engine.execute runs it when its priors are not held).
    content_free: Optional["PromptPlan"] = None
    # Per content_free question, its prior as the engine held it when the plan was made (None: evaluated by
    # this request), and what that pass may evaluate: its prefix and each distinct prior not held, or 0.
    content_free_held: tuple = ()
    content_free_tokens: int = 0

    @property
    def prefix_text(self) -> str:
        return "".join(piece.text for piece in self.prefix_pieces)

    @property
    def state_tokens(self) -> int:
        return sum(len(s) for s in self.prefix_segments)

    @property
    def shared_tokens(self) -> int:
        """Prefix tokens that do not depend on the state (see ``shared_segments``)."""
        return sum(len(s) for s in self.prefix_segments[: self.shared_segments])

    @property
    def injection_check(self) -> Optional[QuestionPlan]:
        """The first question's injection check (a one-question request's only one), or None."""
        return self.injection_checks[0] if self.injection_checks else None

    @property
    def _all_questions(self) -> tuple[QuestionPlan, ...]:
        return self.questions + tuple({id(check): check for check in self.injection_checks}.values())

    @property
    def input_tokens(self) -> int:
        """Distinct prompt tokens: the shared prefix once plus every question's suffix (every order it may be
        read in when debiased, each later order after its shared lead; and the injection check's)."""
        return self.state_tokens + sum(q.input_tokens for q in self._all_questions)

    @property
    def worst_case_tokens(self) -> int:
        """What the request evaluates when nothing is cached: the budget is checked against this."""
        content_free = self.content_free_tokens if self.content_free is not None else 0
        return (self.state_tokens + sum(q.worst_case_tokens for q in self._all_questions) + self.second_look_tokens
                + content_free)


class _Prefix(NamedTuple):
    """A prefix as build_plan assembles it."""

    pieces: tuple[Piece, ...]
    segments: list[tuple[int, ...]]
    before_suffix: str  # the text right before the question suffix
    n_shared: int  # leading segments that are the same for every state (PromptPlan.shared_segments)
    between: str = ""  # template text moved from the start of every suffix to the end of the prefix


# How much of the text before a piece is tokenized with it (see _tokenize_after): enough for any merge
# across the boundary, little enough that tokenizing it again costs nothing.
CONTEXT_CHARS = 32


def _context_tail(text: str) -> str:
    """The end of ``text`` that a piece after it is tokenized with: its last line (from the newline),
    at most CONTEXT_CHARS characters."""
    cut = max(len(text) - CONTEXT_CHARS, text.rfind("\n", 0, max(len(text) - 1, 0)))
    return text[max(cut, 0):]


def _tokenize_after(tokenize: Tokenize, before: str, text: str, *, special: bool) -> list:
    """``text``'s tokens as they come out when it follows ``before`` in the whole prompt.

    Tokenizing a piece on its own is not the same as tokenizing it inside the prompt: a SentencePiece
    vocabulary with ``add_space_prefix`` (Llama 2, Mistral) prepends ``▁`` at the start of every
    tokenize call, and a merge may span the boundary. Tokenizing the end of the text before together
    with the piece, then dropping the context's own tokens, gives the tokens the whole text has there.
    The context is tokenized as plain text (special tokens off) when the piece is: client text never
    becomes a special token, even at a boundary. When the context's tokens are not a prefix (the
    boundary is inside a token of the whole text), the piece is tokenized alone: then no split at this
    boundary can equal the whole text, and the plan stays consistent (tests check both models)."""
    if not text:
        return []
    context = _context_tail(before)
    if not context:
        return tokenize(text, special=special)
    head = tokenize(context, special=special)
    both = tokenize(context + text, special=special)
    if both[: len(head)] == head:
        return both[len(head):]
    return tokenize(text, special=special)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _head_tokens(tokenize: Tokenize, head: str, fence_open: str) -> list:
    """The template head's tokens as the whole prompt has them: tokenized together with the start of
    the fence that follows it (template text too), then the fence's own tokens cut off. A BPE
    pre-tokenizer splits trailing whitespace by what follows (`\n\n` alone is one token, `\n\n<` is
    `\n`,`\n`,`<`), so the head alone can end in a different token. When the joint tokens do not end
    in the fence's tokens (a merge across the boundary), the head is tokenized alone."""
    alone = tokenize(head, special=True, add_bos=True)
    if not head:
        return alone
    joint = tokenize(head + fence_open, special=True, add_bos=True)
    fence = _tokenize_after(tokenize, head, fence_open, special=True)
    if fence and joint[-len(fence):] == fence:
        return joint[: -len(fence)]
    return alone


def _join_across(tokenize: Tokenize, text: str, tokens: Sequence[int], extra: str) -> Optional[list]:
    """``text``'s ``tokens`` (as the whole prompt has them) followed by plain ``extra`` text, tokenized as
    the whole text has them, when a token merges across that boundary; None when it splits cleanly there.

    Llama 3's and Qwen 2's pre-tokenizers keep trailing newlines with punctuation: `</state>` + a blank
    line is `</`,`state`,`>\n\n`, and an options block's last `.` + a blank line is `.\n\n`. Only the
    last line of ``text`` is tokenized again (the state can be long, and this runs for every request)."""
    if not extra or tokenize(extra, special=True) != tokenize(extra, special=False):
        return None
    cut = text.rfind("\n") + 1
    before, line = text[:cut], text[cut:]  # the last line, after its newline
    tail = _tokenize_after(tokenize, before, line, special=False)
    if not tail or list(tokens[len(tokens) - len(tail):]) != tail:
        return None  # the line's start merges with the newline before it: leave the boundary as it is
    joint = _tokenize_after(tokenize, before, line + extra, special=False)
    if joint == tail + _tokenize_after(tokenize, text, extra, special=False):
        return None
    return list(tokens[: len(tokens) - len(tail)]) + joint


def _split_fence_opener(tokenize: Tokenize, before: str, block_text: str, block_tokens: Sequence[int]) -> tuple[list, list]:
    """(fence opener tokens, the rest of the state block's tokens): the block's text up to the newline
    after its opening tag (`<state>` and that newline, with any blank line before it that the question
    segment did not take) is the same for
    almost every state, so the plan evaluates it as a segment of its own that the next state reuses
    (tools/bench_decode_account.py measured it: these tokens were most of what upstream llama-server's
    token-level prefix reuse spared and the adapter did not). Split only where the block's own tokens
    start with the opener's tokens in context, so the prompt's tokens never change; else (a state that
    starts with whitespace merging into the newline) nothing is split off."""
    end = block_text.find("\n", block_text.find(">") + 1)
    if end < 0:
        return [], list(block_tokens)
    opener = _tokenize_after(tokenize, before, block_text[: end + 1], special=False)
    if opener and len(opener) < len(block_tokens) and list(block_tokens[: len(opener)]) == opener:
        return opener, list(block_tokens[len(opener):])
    return [], list(block_tokens)


def _question_tokens(tokenize: Tokenize, before: str, block: str, tail: str) -> tuple[list, list]:
    """(question block tokens, template tail tokens) as the whole prompt has them.

    The block is client text and never gets special tokens; the tail is template text. When the block
    holds no special-token text (tokenizing it with and without special tokens agrees), block and tail
    are tokenized together, after the end of the fence before them: a merge across the boundary (a
    plain-text `[/INST]` after "option." on SentencePiece gives `.[/`) then comes out as in the whole
    text. The run is split where it stops agreeing with the block tokenized on its own (in context);
    a merged token goes to the tail. Otherwise each is tokenized in context on its own."""
    plain = _tokenize_after(tokenize, before, block, special=False)
    if tokenize(block, special=True) == tokenize(block, special=False):
        context = _context_tail(before)
        head = tokenize(context, special=True) if context else []
        joint = tokenize(context + block + tail, special=True)
        if joint[: len(head)] == head:
            suffix = joint[len(head):]
            cut = _common_prefix(plain, suffix)
            return suffix[:cut], suffix[cut:]
    return plain, _tokenize_after(tokenize, block, tail, special=True)


def answer_tokens_in_context(
    tokenize: Tokenize, cue_text: str, cue_tokens: Sequence[int], answer_text: str, end_token: int
) -> tuple[int, ...]:
    """The tokens of one cloze answer as the model would write them after the answer cue, then the
    end-of-turn token.

    In context: the answer is tokenized together with the cue and the cue's own tokens are cut off, so a
    SentencePiece vocabulary does not give the answer a second word-start ``▁`` that it would never write
    after the cue, and a BPE merge across the boundary is seen. The answer is client text: it is
    tokenized with special tokens allowed only when that changes nothing in it (otherwise, and when the
    cue's tokens change at the boundary, it is tokenized alone as plain text). The end-of-turn token
    makes a finished answer different from the start of a longer one: ``yes`` pays for ending the turn
    where the model wanted to go on to ``yes_but_later``."""
    plain = list(tokenize(answer_text, special=False)) if answer_text else []
    tokens = plain
    if cue_text and plain and list(tokenize(answer_text, special=True)) == plain:
        full = list(tokenize(cue_text + answer_text, special=True))
        if full[: len(cue_tokens)] == list(cue_tokens) and len(full) > len(cue_tokens):
            tokens = full[len(cue_tokens):]
    return tuple(tokens) + (end_token,)


def shared_lead(first: Sequence[int], other: Sequence[int]) -> int:
    """How many leading tokens a read's suffix shares with the first read's (the question text, the options
    header): at most one less than either, so that each read still evaluates its own last token."""
    limit = min(len(first), len(other)) - 1
    n = 0
    while n < limit and first[n] == other[n]:
        n += 1
    return n


def question_lead(first: QuestionPlan) -> int:
    """The lead every later read of a question keeps from its first read: the fewest leading suffix tokens any
    of its planned later orders shares with the first (``shared_lead``), so that one held lead serves every
    read, in whatever order and however many the stop rule reads."""
    others = [o for o in (first.reversed, *first.reads) if o is not None]
    if not others:
        return 0
    return min(shared_lead(first.suffix_tokens, o.suffix_tokens) for o in others)


def with_lead(first: QuestionPlan) -> QuestionPlan:
    """``first`` with each later read's ``lead`` set to the question's (question_lead)."""
    lead = question_lead(first)
    if not lead:
        return first
    return replace(first, reversed=replace(first.reversed, lead=lead) if first.reversed is not None else None,
                   reads=tuple(replace(r, lead=lead) for r in first.reads))


def build_plan(
    *,
    template: PromptTemplate,
    labels: Labels,
    tokenize: Tokenize,
    eos_token: int,
    bos_token: Optional[int],
    adds_bos: bool,
    n_ctx: int,
    n_batch: int,
    state_text: str,
    questions: Sequence[Question],
    scoring: str,
    state_field: str = "state",
    question_fields: Optional[Sequence[str]] = None,
    question_names: Optional[Sequence[str]] = None,
    budget_field: str = "questions",
    max_request_tokens: Optional[int] = None,
    return_prompt: bool = False,
    layout: str = DEFAULT_LAYOUT,
    injection_check: bool = False,
    layout_field: str = "layout",
    debias: str = "none",
    reads: Optional[int] = None,
    end_of_turn_token: Optional[int] = None,
    injection_check_field: str = "injection_check",
    partial_rewind: bool = False,
) -> PromptPlan:
    """``layout``: "state_first" (the default) or "options_first" (single-question requests only: a plan
    with several questions is refused with a PlanError naming ``layout_field``; contracts and the HTTP
    layer decide before this whether a server default falls back to state_first).

    Pieces are tokenized with their neighbours so that their tokens equal the whole prompt's
    (_head_tokens, _tokenize_after, _question_tokens; tests/test_labels_debias.py checks BPE and
    SentencePiece vocabularies).

    The token budget (``max_request_tokens``) is checked for the request without its injection checks first
    (naming ``budget_field``), then as each check is planned (naming ``injection_check_field``: the request
    fits without them). ``partial_rewind``: whether the context keeps a prefix's leading segments when it
    drops the rest (the engine's), so that a check's own prefix reuses the template head the request evaluated
    and a later read keeps its first read's lead (QuestionPlan.lead); False (the default) plans neither, which
    counts more tokens, never fewer."""
    fields = list(question_fields) if question_fields is not None else [f"questions[{i}]" for i in range(len(questions))]
    names = list(question_names) if question_names is not None else [str(i) for i in range(len(questions))]
    if layout not in LAYOUTS:
        raise PlanError(f"layout {layout!r} must be one of {', '.join(LAYOUTS)}", field=layout_field)
    if layout == "options_first" and len(questions) != 1:
        raise PlanError(
            f"layout 'options_first' applies to single-question requests (got {len(questions)} questions); "
            "several questions on one state use 'state_first', which evaluates the state once",
            field=layout_field,
        )

    # Label capacity first: it needs no tokens and is the clearer error.
    if scoring == "label":
        for question, field, name in zip(questions, fields, names):
            label_set = labels.for_question(question)
            if len(question.outcomes) > len(label_set.texts):
                # A binary question needs two labels too: Yes/No, else the first two letters (prompt.py).
                kind = {"scale": "levels", "binary": "outcomes (yes/no)"}.get(question.kind, "options")
                raise LabelError(
                    f"question {name!r}: label scoring supports at most {len(label_set.texts)} {kind} with this "
                    f"model (got {len(question.outcomes)}); use scoring 'sequence'",
                    field=field,
                )

    def label_choice(question: Question, order: tuple[int, ...]):
        """(label texts, label ids, label variants) in shown order; Nones under sequence scoring."""
        if scoring != "label":
            return None, None, None
        label_set = labels.for_question(question)
        # Labels go with shown positions (A is the first option shown), except native Yes/No, which
        # stay with their meaning (the reversed binary question reads "Reply No or Yes.").
        native_binary = question.kind == "binary" and tuple(label_set.texts) == BINARY_LABELS
        slots = list(order) if native_binary else list(range(len(order)))
        return (tuple(label_set.texts[i] for i in slots), tuple(label_set.token_ids[i] for i in slots),
                tuple(label_set.variants_of(i) for i in slots))

    full_block_text = template.options_first_state_part(state_text) if layout == "options_first" or injection_check else ""

    def blocks(tokens: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[i : i + n_batch]) for i in range(0, len(tokens), n_batch)]

    def make_prefix(order: Optional[tuple[int, ...]]) -> _Prefix:
        """The shared prefix. ``order``: options-first only, the order the options are shown in before the
        state."""
        if layout == "state_first":
            head_text, block_text = template.state_prefix_parts(state_text)
            head_tokens = _head_tokens(tokenize, head_text, block_text[: block_text.index(">")])
            if not head_tokens and adds_bos and bos_token is not None:
                head_tokens = [bos_token]
            state_tokens = _tokenize_after(tokenize, head_text, block_text, special=False)
            # Where the blank line after `</state>` merges with the tag, it ends the state's segment and
            # every suffix drops it (after_state), so the prompt's tokens are the text's own.
            joined = _join_across(tokenize, block_text, state_tokens, template.between)
            moved = template.between if joined else ""
            if joined:
                block_text, state_tokens = block_text + moved, joined
            pieces: tuple[Piece, ...] = (
                Piece("template", head_text, tuple(head_tokens), True),
                Piece("state", block_text, tuple(state_tokens), False),
            )
            opener, rest = _split_fence_opener(tokenize, head_text, block_text, state_tokens)
            lead = ([tuple(head_tokens)] if head_tokens else []) + ([tuple(opener)] if opener else [])
            return _Prefix(pieces, lead + blocks(rest), block_text, len(lead), moved)
        question = questions[0]
        head_text, question_text = template.options_first_prefix_parts(question, label_choice(question, order)[0], order)
        return questions_then_state(head_text, question_text)

    # The fenced state's tokens after a question block depend on the state and on the block's last line only
    # (_tokenize_after reads that much of what precedes): tokenized once per distinct line, not once per
    # question, so that a request's injection checks tokenize the state about once (they end alike: the reply line).
    state_after: dict[tuple[str, str], tuple[str, tuple, str, list, list]] = {}

    def questions_then_state(head_text: str, question_text: str) -> _Prefix:
        """[head][question text][blank line + fenced state]: the options-first prefix's shape."""
        block_text = full_block_text
        head_tokens = _head_tokens(tokenize, head_text, question_text.split(" ", 1)[0])
        if not head_tokens and adds_bos and bos_token is not None:
            head_tokens = [bos_token]
        # The question block is its own segment(s) right after the head: these stay the same from one
        # state to the next, so the engine's segment reuse keeps them cached across routing requests.
        question_tokens = _tokenize_after(tokenize, head_text, question_text, special=False)
        between = template.between
        # Where the block's last token merges with the blank line before `<state>`, that line ends the
        # question's segment (the same for every state), and after `</state>` likewise the state's.
        joined = _join_across(tokenize, question_text, question_tokens, between) if block_text.startswith(between) else None
        if joined:
            question_text, question_tokens, block_text = question_text + between, joined, block_text[len(between):]
        key = (_context_tail(question_text), "moved" if joined else "")
        if key not in state_after:
            state_tokens = _tokenize_after(tokenize, question_text, block_text, special=False)
            joined = _join_across(tokenize, block_text, state_tokens, between)
            moved = between if joined else ""
            if joined:
                block_text, state_tokens = block_text + moved, joined
            # The fence opener (blank line, `<state>`, newline) is the same for every state: it goes with the
            # question block, so it stays cached across states too.
            opener, rest = _split_fence_opener(tokenize, question_text, block_text, state_tokens)
            state_after[key] = (block_text, tuple(state_tokens), moved, opener, blocks(rest))
        block_text, state_tokens, moved, opener, rest_blocks = state_after[key]
        pieces = (
            Piece("template", head_text, tuple(head_tokens), True),
            Piece("question", question_text, tuple(question_tokens), False),
            Piece("state", block_text, state_tokens, False),
        )
        lead = ([tuple(head_tokens)] if head_tokens else []) + blocks(question_tokens + opener)
        return _Prefix(pieces, lead + rest_blocks, block_text, len(lead), moved)

    def after_state(text: str, moved: str) -> str:
        """A suffix's first piece without the text its prefix took over (_join_across)."""
        if not moved:
            return text
        assert text.startswith(moved), "every suffix after the state starts with the template's between text"
        return text[len(moved):]

    def first_order(question: Question) -> tuple[int, ...]:
        """The order a question is read in first: under debias "rotations" the canonical one, under "reverse"
        the first direction (first_direction), else the given one."""
        if debias == "rotations":
            return canonical_order(question)
        if debias == "reverse":
            return first_direction(question)
        return tuple(range(len(question.outcomes)))

    main_prefix = make_prefix(first_order(questions[0]) if questions else ())
    prefix_pieces, segments, before_suffix, n_shared = main_prefix[:4]
    prefix_len = sum(len(s) for s in segments)
    state_len = len(prefix_pieces[-1].tokens)

    def plan_question(question: Question, field: str, name: str, order: tuple[int, ...], before: str,
                      moved: str) -> QuestionPlan:
        label_texts, label_ids, variants = label_choice(question, order)
        if layout == "state_first":
            block, tail = template.question_suffix_parts(question, label_texts, order)
        else:
            block, tail = template.options_first_suffix_parts(question, label_texts, order)
        block = after_state(block, moved)
        block_tokens, tail_tokens = _question_tokens(tokenize, before, block, tail)
        pieces = (
            Piece("question", block, tuple(block_tokens), False),
            Piece("template", tail, tuple(tail_tokens), True),
        )
        answers: tuple[tuple[int, ...], ...] = ()
        if scoring == "sequence":
            end = eos_token if end_of_turn_token is None else end_of_turn_token
            cue_tokens = tokenize(tail, special=True)  # the answer cue: the text right before the answer
            answers = tuple(
                answer_tokens_in_context(tokenize, tail, cue_tokens, template.label_prefix + text, end)
                for text in [question.answer_texts()[i] for i in order]
            )
        return QuestionPlan(
            question=question, field=field, name=name, pieces=pieces,
            label_token_ids=label_ids, labels=label_texts, answer_tokens=answers,
            label_variants=variants, order=order,
        )

    planned = []
    for question, field, name in zip(questions, fields, names):
        first = first_order(question)
        plan = plan_question(question, field, name, first, before_suffix, main_prefix.between)
        if debias == "rotations":
            later = []
            for order in read_orders(question)[1:reads]:  # reads None: every order, the stop rule decides
                if layout == "state_first":
                    later.append(plan_question(question, field, name, order, before_suffix, main_prefix.between))
                else:  # options-first: each order's options are their own block, and the state follows it
                    o_pieces, o_segments, o_before, _, o_moved = make_prefix(order)
                    later.append(replace(plan_question(question, field, name, order, o_before, o_moved),
                                         own_prefix_pieces=o_pieces, own_prefix_segments=tuple(o_segments)))
            plan = replace(plan, reads=tuple(later))
        if debias == "reverse" and len(first) > 1 and (reads is None or reads >= 2):
            # The other direction: the first one reversed (the given order or its reverse); not planned where
            # the request asked for one read, so the budget counts what it may read.
            if layout == "state_first":
                plan = replace(plan, reversed=plan_question(question, field, name, first[::-1], before_suffix,
                                                            main_prefix.between))
            else:
                # Options-first: the reversed options are their own cached block, and the state follows it.
                r_pieces, r_segments, r_before, _, r_moved = make_prefix(first[::-1])
                r_plan = replace(plan_question(question, field, name, first[::-1], r_before, r_moved),
                                 own_prefix_pieces=r_pieces, own_prefix_segments=tuple(r_segments))
                plan = replace(plan, reversed=r_plan)
        if scoring == "label" and layout == "state_first" and partial_rewind:
            # Later reads keep the first read's lead (Engine._hold_lead): it is evaluated, and counted, once.
            plan = with_lead(plan)
        suffix_len = max(len(p.suffix_tokens) + max((len(a) for a in p.answer_tokens), default=0)
                         for p in (plan, plan.reversed, *plan.reads) if p is not None)
        need = prefix_len + suffix_len
        if need > n_ctx:
            # Blame what is longer: a long option list is the question's fault, a long state the state's.
            question_len, blamed_state = suffix_len, prefix_len
            if layout == "options_first":
                question_len, blamed_state = suffix_len + prefix_len - state_len, state_len
            if question_len > blamed_state:
                raise PromptTooLong(need, n_ctx, field=field, what=f"question {name!r}")
            raise PromptTooLong(need, n_ctx, field=state_field, what="the state")
        planned.append(plan)

    unchecked = PromptPlan(
        state_text=state_text,
        scoring=scoring,
        template_version=template.version(layout),
        prefix_pieces=prefix_pieces,
        prefix_segments=tuple(segments),
        shared_segments=n_shared,
        questions=tuple(planned),
        return_prompt=return_prompt,
        layout=layout,
        debias=debias,
        reads=reads if debias in ("rotations", "reverse") else None,
        fuse_state_and_question=(layout == "options_first" and scoring == "label" and debias in ("none", "content_free")
                                 and len(planned) == 1),
    )
    # The request without its checks must fit before any check is planned (each tokenizes the state again).
    if max_request_tokens is not None and unchecked.worst_case_tokens > max_request_tokens:
        raise TokenBudgetExceeded(unchecked.worst_case_tokens, max_request_tokens, field=budget_field)

    checks: list[QuestionPlan] = []
    if injection_check:
        # Always label-scored on the binary labels, whatever the request's scoring: one forward pass.
        binary = labels.binary
        if len(binary.texts) < 2:
            raise LabelError(
                f"the injection check needs two single-token yes/no labels; this model has {len(binary.texts)}",
                field="injection_check",
            )
        check_block, check_tail = template.injection_check_parts(binary.texts)

        def plan_check(check_prefix: Optional[_Prefix]) -> QuestionPlan:
            before, moved = (check_prefix.before_suffix, check_prefix.between) if check_prefix else (before_suffix, main_prefix.between)
            block = after_state(check_block, moved)
            block_tokens, tail_tokens = _question_tokens(tokenize, before, block, check_tail)
            check_plan = QuestionPlan(
                question=Question(INJECTION_CHECK_QUESTION, (Outcome("yes"), Outcome("no")), kind="binary"),
                field=state_field, name="injection_check",
                pieces=(
                    Piece("template", block, tuple(block_tokens), False),
                    Piece("template", check_tail, tuple(tail_tokens), True),
                ),
                label_token_ids=tuple(binary.token_ids[:2]), labels=tuple(binary.texts[:2]),
                label_variants=tuple(binary.variants_of(i) for i in range(2)), order=(0, 1),
                own_prefix_pieces=check_prefix.pieces if check_prefix else None,
                own_prefix_segments=tuple(check_prefix.segments) if check_prefix else None,
            )
            need = (sum(len(s) for s in check_prefix.segments) if check_prefix else prefix_len) + len(check_plan.suffix_tokens)
            if need > n_ctx:
                raise PromptTooLong(need, n_ctx, field=state_field, what="the injection check")
            return check_plan

        # The budget first: the request without its checks, then each check as it is planned, so that a request
        # the checks push over the budget is refused after planning at most the checks that fit, naming
        # ``injection_check_field``.
        counted = unchecked.worst_case_tokens

        def count(check: QuestionPlan) -> None:
            nonlocal counted
            counted += check.worst_case_tokens
            if max_request_tokens is not None and counted > max_request_tokens:
                over = TokenBudgetExceeded(counted, max_request_tokens, field=injection_check_field)
                over.args = (f"the request with its injection checks may evaluate at least {counted} tokens (without "
                             f"them {unchecked.worst_case_tokens}); this server allows {max_request_tokens} per request "
                             "(SEMIF_MAX_REQUEST_TOKENS). Each distinct question's check reads the state again after "
                             f"that question's options: leave the check out ({injection_check_field}) or send fewer "
                             "questions",)
                raise over

        by_block: dict[str, QuestionPlan] = {}
        if layout == "state_first":
            # Each question's check reads the state after that question and its options alone
            # (INJECTION_CHECK_LAYOUT): its own prefix, the state evaluated again after the options, and a
            # value that does not depend on the request's other questions. Copies of a question share one.
            for q in questions:
                # The options as the request's first read shows them: under debias "rotations" the canonical
                # order, under "reverse" the first direction, so that the check, like the answer, does not depend
                # on the caller's listing (or, under "reverse", on which of a listing and its reverse it is).
                first = first_order(q)
                shown = render_question_block(q, label_choice(q, first)[0], first, style=template.style)
                if shown not in by_block:
                    check_prefix = questions_then_state(*template.injection_check_prefix_parts([shown]))
                    # Its leading segments that the request's own prefix holds (the template head) are reused
                    # where the context rewinds partially: evaluated once for the request.
                    held = 0
                    if partial_rewind:
                        for mine, theirs in zip(check_prefix.segments, segments):
                            if mine != theirs:
                                break
                            held += len(mine)
                    by_block[shown] = replace(plan_check(check_prefix), own_prefix_held=held)
                    count(by_block[shown])
                checks.append(by_block[shown])
        else:
            checks.append(plan_check(None))  # options-first: the decision's own prefix already shows its options
            count(checks[0])

    # Counted above, check by check (copies of a question share one, as in worst_case_tokens).
    return replace(unchecked, injection_checks=tuple(checks),
                   fuse_state_and_question=unchecked.fuse_state_and_question and not checks)
