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

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .prompt import DEFAULT_LAYOUT, INJECTION_CHECK_QUESTION, LAYOUTS, Labels, Outcome, PromptTemplate, Question

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


@dataclass(frozen=True)
class QuestionPlan:
    question: Question
    field: str  # the contract's path for this question (errors name it)
    name: str  # how the contract's client knows the question (decision id, question id or name)
    pieces: tuple[Piece, ...]  # question block (plain text), template tail (special tokens allowed)
    label_token_ids: Optional[tuple[int, ...]] = None  # label scoring
    labels: Optional[tuple[str, ...]] = None
    answer_tokens: tuple[tuple[int, ...], ...] = ()  # sequence (cloze) scoring: one token run per outcome

    @property
    def suffix_tokens(self) -> list[int]:
        return [t for piece in self.pieces for t in piece.tokens]

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)

    @property
    def worst_case_tokens(self) -> int:
        """Tokens this question evaluates after the state prefix when nothing of it is cached."""
        return len(self.suffix_tokens) + sum(len(a) for a in self.answer_tokens)


@dataclass(frozen=True)
class PromptPlan:
    state_text: str
    scoring: str
    template_version: str
    # state_first: template head (special tokens allowed), fenced state (plain text).
    # options_first: template head, question block, blank line + fenced state (the last two plain text).
    prefix_pieces: tuple[Piece, ...]
    # The prefix as the engine evaluates it. state_first: head, state blocks. options_first: head, question
    # block(s), state blocks; the leading head + question segments are what stays cached across states.
    prefix_segments: tuple[tuple[int, ...], ...]
    questions: tuple[QuestionPlan, ...]
    return_prompt: bool = False
    layout: str = DEFAULT_LAYOUT
    # The injection check (issue #11 §4): a yes/no question label-scored from the same prefix as the
    # questions; p(yes) is reported as injection_suspected. None when not asked for.
    injection_check: Optional[QuestionPlan] = None

    @property
    def prefix_text(self) -> str:
        return "".join(piece.text for piece in self.prefix_pieces)

    @property
    def state_tokens(self) -> int:
        return sum(len(s) for s in self.prefix_segments)

    @property
    def _all_questions(self) -> tuple[QuestionPlan, ...]:
        return self.questions + ((self.injection_check,) if self.injection_check is not None else ())

    @property
    def input_tokens(self) -> int:
        """Distinct prompt tokens: the shared prefix once plus every question's suffix (and the check's)."""
        return self.state_tokens + sum(len(q.suffix_tokens) for q in self._all_questions)

    @property
    def worst_case_tokens(self) -> int:
        """What the request evaluates when nothing is cached: the budget is checked against this."""
        return self.state_tokens + sum(q.worst_case_tokens for q in self._all_questions)


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
) -> PromptPlan:
    """``layout``: "state_first" (the default) or "options_first" (single-question requests only: a plan
    with several questions is refused with a PlanError naming ``layout_field``; contracts and the HTTP
    layer decide before this whether a server default falls back to state_first)."""
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
            if question.kind != "binary" and len(question.outcomes) > len(label_set.texts):
                kind = "levels" if question.kind == "scale" else "options"
                raise LabelError(
                    f"question {name!r}: label scoring supports at most {len(label_set.texts)} {kind} with this "
                    f"model (got {len(question.outcomes)}); use scoring 'sequence'",
                    field=field,
                )

    def label_choice(question: Question):
        if scoring != "label":
            return None, None
        label_set = labels.for_question(question)
        n = len(question.outcomes)
        return label_set.texts[:n], label_set.token_ids[:n]

    def blocks(tokens: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[i : i + n_batch]) for i in range(0, len(tokens), n_batch)]

    if layout == "state_first":
        head_text, block_text = template.state_prefix_parts(state_text)
    else:
        head_text, question_text = template.options_first_prefix_parts(questions[0], label_choice(questions[0])[0])
        block_text = template.options_first_state_part(state_text)
    head_tokens = tokenize(head_text, special=True, add_bos=True)
    if not head_tokens and adds_bos and bos_token is not None:
        head_tokens = [bos_token]
    state_tokens = tokenize(block_text, special=False)
    segments = [tuple(head_tokens)] if head_tokens else []
    if layout == "state_first":
        prefix_pieces: tuple[Piece, ...] = (
            Piece("template", head_text, tuple(head_tokens), True),
            Piece("state", block_text, tuple(state_tokens), False),
        )
    else:
        # The question block is its own segment(s) right after the head: these stay the same from one
        # state to the next, so the engine's segment reuse keeps them cached across routing requests.
        question_tokens = tokenize(question_text, special=False)
        prefix_pieces = (
            Piece("template", head_text, tuple(head_tokens), True),
            Piece("question", question_text, tuple(question_tokens), False),
            Piece("state", block_text, tuple(state_tokens), False),
        )
        segments += blocks(question_tokens)
    segments += blocks(state_tokens)
    prefix_len = sum(len(s) for s in segments)

    planned = []
    for question, field, name in zip(questions, fields, names):
        label_texts, label_ids = label_choice(question)
        if layout == "state_first":
            block, tail = template.question_suffix_parts(question, label_texts)
        else:
            block, tail = template.options_first_suffix_parts(question, label_texts)
        pieces = (
            Piece("question", block, tuple(tokenize(block, special=False)), False),
            Piece("template", tail, tuple(tokenize(tail, special=True)), True),
        )
        answers: tuple[tuple[int, ...], ...] = ()
        if scoring == "sequence":
            answers = tuple(
                tuple(tokenize(template.label_prefix + text, special=False) or [eos_token])
                for text in question.answer_texts()
            )
        plan = QuestionPlan(
            question=question, field=field, name=name, pieces=pieces,
            label_token_ids=tuple(label_ids) if label_ids is not None else None,
            labels=tuple(label_texts) if label_texts is not None else None,
            answer_tokens=answers,
        )
        suffix_len = len(plan.suffix_tokens)
        need = prefix_len + suffix_len + max((len(a) for a in answers), default=0)
        if need > n_ctx:
            # Blame what is longer: a long option list is the question's fault, a long state the state's.
            question_len = suffix_len + max((len(a) for a in answers), default=0)
            state_len = len(state_tokens)
            if layout == "options_first":
                question_len += prefix_len - state_len
            else:
                state_len = prefix_len
            if question_len > state_len:
                raise PromptTooLong(need, n_ctx, field=field, what=f"question {name!r}")
            raise PromptTooLong(need, n_ctx, field=state_field, what="the state")
        planned.append(plan)

    check_plan = None
    if injection_check:
        # Always label-scored on the binary labels, whatever the request's scoring: one forward pass.
        binary = labels.binary
        check_block, check_tail = template.injection_check_parts(binary.texts)
        check_plan = QuestionPlan(
            question=Question(INJECTION_CHECK_QUESTION, (Outcome("yes"), Outcome("no")), kind="binary"),
            field=state_field, name="injection_check",
            pieces=(
                Piece("template", check_block, tuple(tokenize(check_block, special=False)), False),
                Piece("template", check_tail, tuple(tokenize(check_tail, special=True)), True),
            ),
            label_token_ids=tuple(binary.token_ids[:2]), labels=tuple(binary.texts[:2]),
        )
        need = prefix_len + len(check_plan.suffix_tokens)
        if need > n_ctx:
            raise PromptTooLong(need, n_ctx, field=state_field, what="the injection check")

    result = PromptPlan(
        state_text=state_text,
        scoring=scoring,
        template_version=template.version(layout),
        prefix_pieces=prefix_pieces,
        prefix_segments=tuple(segments),
        questions=tuple(planned),
        return_prompt=return_prompt,
        layout=layout,
        injection_check=check_plan,
    )
    if max_request_tokens is not None and result.worst_case_tokens > max_request_tokens:
        raise TokenBudgetExceeded(result.worst_case_tokens, max_request_tokens, field=budget_field)
    return result
