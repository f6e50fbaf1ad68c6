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
from typing import Callable, Optional, Sequence

from .prompt import BINARY_LABELS, TEMPLATE_VERSION, Labels, PromptTemplate, Question

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


@dataclass(frozen=True)
class Piece:
    """One run of prompt text and its tokens. ``special_tokens``: whether the text was tokenized with
    special tokens allowed (template text) or as plain text (anything a client wrote)."""

    role: str  # "template" | "state" | "question"
    text: str
    tokens: tuple[int, ...]
    special_tokens: bool


DEBIAS_MODES = ("none", "reverse")


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
    # Order debiasing ("debias": "reverse"): the same question with its outcomes reversed, scored from
    # the same state prefix; the engine combines both distributions.
    reversed: Optional["QuestionPlan"] = None

    @property
    def suffix_tokens(self) -> list[int]:
        return [t for piece in self.pieces for t in piece.tokens]

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)

    @property
    def worst_case_tokens(self) -> int:
        """Tokens this question evaluates after the state prefix when nothing of it is cached."""
        own = len(self.suffix_tokens) + sum(len(a) for a in self.answer_tokens)
        return own + (self.reversed.worst_case_tokens if self.reversed is not None else 0)

    @property
    def input_tokens(self) -> int:
        """Distinct prompt tokens of this question after the state prefix (both orders when debiased)."""
        return len(self.suffix_tokens) + (len(self.reversed.suffix_tokens) if self.reversed is not None else 0)


@dataclass(frozen=True)
class PromptPlan:
    state_text: str
    scoring: str
    template_version: str
    prefix_pieces: tuple[Piece, ...]  # template head (special tokens allowed), fenced state (plain text)
    prefix_segments: tuple[tuple[int, ...], ...]  # the prefix as the engine evaluates it: head, state blocks
    questions: tuple[QuestionPlan, ...]
    return_prompt: bool = False
    debias: str = "none"

    @property
    def prefix_text(self) -> str:
        return "".join(piece.text for piece in self.prefix_pieces)

    @property
    def state_tokens(self) -> int:
        return sum(len(s) for s in self.prefix_segments)

    @property
    def input_tokens(self) -> int:
        """Distinct prompt tokens: the state prefix once plus every question's suffix."""
        return self.state_tokens + sum(q.input_tokens for q in self.questions)

    @property
    def worst_case_tokens(self) -> int:
        """What the request evaluates when nothing is cached: the budget is checked against this."""
        return self.state_tokens + sum(q.worst_case_tokens for q in self.questions)


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
    debias: str = "none",
) -> PromptPlan:
    """Pieces are tokenized with their neighbours so that their tokens equal the whole prompt's
    (_head_tokens, _tokenize_after, _question_tokens; tests/test_labels_debias.py checks BPE and
    SentencePiece vocabularies)."""
    fields = list(question_fields) if question_fields is not None else [f"questions[{i}]" for i in range(len(questions))]
    names = list(question_names) if question_names is not None else [str(i) for i in range(len(questions))]

    # Label capacity first: it needs no tokens and is the clearer error.
    if scoring == "label":
        for question, field, name in zip(questions, fields, names):
            label_set = labels.for_question(question)
            if question.kind != "binary" and len(question.outcomes) > len(label_set.texts):
                kind = "levels" if question.kind == "scale" else "options"
                raise LabelError(
                    f"question {name!r}: label scoring supports at most {len(label_set.texts)} {kind} with this "
                    f"model (got {len(question.outcomes)}); use scoring 'sequence'",
                    field=field,
                )

    head_text, block_text = template.state_prefix_parts(state_text)
    head_tokens = _head_tokens(tokenize, head_text, block_text[: block_text.index(">")])
    if not head_tokens and adds_bos and bos_token is not None:
        head_tokens = [bos_token]
    state_tokens = _tokenize_after(tokenize, head_text, block_text, special=False)
    prefix_pieces = (
        Piece("template", head_text, tuple(head_tokens), True),
        Piece("state", block_text, tuple(state_tokens), False),
    )
    segments = [tuple(head_tokens)] if head_tokens else []
    segments += [tuple(state_tokens[i : i + n_batch]) for i in range(0, len(state_tokens), n_batch)]
    prefix_len = sum(len(s) for s in segments)

    def plan_question(question: Question, field: str, name: str, order: tuple[int, ...]) -> QuestionPlan:
        label_texts = label_ids = variants = None
        if scoring == "label":
            label_set = labels.for_question(question)
            # Labels go with shown positions (A is the first option shown), except native Yes/No, which
            # stay with their meaning (the reversed binary question reads "Reply No or Yes.").
            native_binary = question.kind == "binary" and tuple(label_set.texts) == BINARY_LABELS
            slots = list(order) if native_binary else list(range(len(order)))
            label_texts = tuple(label_set.texts[i] for i in slots)
            label_ids = tuple(label_set.token_ids[i] for i in slots)
            variants = tuple(label_set.variants_of(i) for i in slots)
        block, tail = template.question_suffix_parts(question, label_texts, order)
        block_tokens, tail_tokens = _question_tokens(tokenize, block_text, block, tail)
        pieces = (
            Piece("question", block, tuple(block_tokens), False),
            Piece("template", tail, tuple(tail_tokens), True),
        )
        answers: tuple[tuple[int, ...], ...] = ()
        if scoring == "sequence":
            texts = question.answer_texts()
            answers = tuple(
                tuple(tokenize(template.label_prefix + texts[i], special=False) or [eos_token]) for i in order
            )
        return QuestionPlan(
            question=question, field=field, name=name, pieces=pieces,
            label_token_ids=label_ids, labels=label_texts, answer_tokens=answers,
            label_variants=variants, order=order,
        )

    planned = []
    for question, field, name in zip(questions, fields, names):
        given = tuple(range(len(question.outcomes)))
        plan = plan_question(question, field, name, given)
        if debias == "reverse":
            plan = replace(plan, reversed=plan_question(question, field, name, given[::-1]))
        suffix_len = max(len(p.suffix_tokens) + max((len(a) for a in p.answer_tokens), default=0)
                         for p in (plan, plan.reversed) if p is not None)
        need = prefix_len + suffix_len
        if need > n_ctx:
            # Blame what is longer: a long option list is the question's fault, a long state the state's.
            if suffix_len > prefix_len:
                raise PromptTooLong(need, n_ctx, field=field, what=f"question {name!r}")
            raise PromptTooLong(need, n_ctx, field=state_field, what="the state")
        planned.append(plan)

    result = PromptPlan(
        state_text=state_text,
        scoring=scoring,
        template_version=TEMPLATE_VERSION,
        prefix_pieces=prefix_pieces,
        prefix_segments=tuple(segments),
        questions=tuple(planned),
        return_prompt=return_prompt,
        debias=debias,
    )
    if max_request_tokens is not None and result.worst_case_tokens > max_request_tokens:
        raise TokenBudgetExceeded(result.worst_case_tokens, max_request_tokens, field=budget_field)
    return result
