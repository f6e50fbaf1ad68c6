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

from .prompt import TEMPLATE_VERSION, Labels, PromptTemplate, Question

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
    temperature: Optional[float] = None  # a native decision model's own (semif/serving/native.py); None: 1

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
    prefix_pieces: tuple[Piece, ...]  # template head (special tokens allowed), fenced state (plain text)
    prefix_segments: tuple[tuple[int, ...], ...]  # the prefix as the engine evaluates it: head, state blocks
    questions: tuple[QuestionPlan, ...]
    return_prompt: bool = False

    @property
    def prefix_text(self) -> str:
        return "".join(piece.text for piece in self.prefix_pieces)

    @property
    def state_tokens(self) -> int:
        return sum(len(s) for s in self.prefix_segments)

    @property
    def input_tokens(self) -> int:
        """Distinct prompt tokens: the state prefix once plus every question's suffix."""
        return self.state_tokens + sum(len(q.suffix_tokens) for q in self.questions)

    @property
    def worst_case_tokens(self) -> int:
        """What the request evaluates when nothing is cached: the budget is checked against this."""
        return self.state_tokens + sum(q.worst_case_tokens for q in self.questions)


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
    end_of_turn_token: Optional[int] = None,
) -> PromptPlan:
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
    head_tokens = tokenize(head_text, special=True, add_bos=True)
    if not head_tokens and adds_bos and bos_token is not None:
        head_tokens = [bos_token]
    state_tokens = tokenize(block_text, special=False)
    prefix_pieces = (
        Piece("template", head_text, tuple(head_tokens), True),
        Piece("state", block_text, tuple(state_tokens), False),
    )
    segments = [tuple(head_tokens)] if head_tokens else []
    segments += [tuple(state_tokens[i : i + n_batch]) for i in range(0, len(state_tokens), n_batch)]
    prefix_len = sum(len(s) for s in segments)

    planned = []
    for question, field, name in zip(questions, fields, names):
        if scoring == "label":
            label_set = labels.for_question(question)
            n = len(question.outcomes)
            label_texts, label_ids = label_set.texts[:n], label_set.token_ids[:n]
        else:
            label_texts, label_ids = None, None
        block, tail = template.question_suffix_parts(question, label_texts)
        pieces = (
            Piece("question", block, tuple(tokenize(block, special=False)), False),
            Piece("template", tail, tuple(tokenize(tail, special=True)), True),
        )
        answers: tuple[tuple[int, ...], ...] = ()
        if scoring == "sequence":
            end = eos_token if end_of_turn_token is None else end_of_turn_token
            cue_tokens = tokenize(tail, special=True)  # the answer cue: the text right before the answer
            answers = tuple(
                answer_tokens_in_context(tokenize, tail, cue_tokens, template.label_prefix + text, end)
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
            if suffix_len + max((len(a) for a in answers), default=0) > prefix_len:
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
    )
    if max_request_tokens is not None and result.worst_case_tokens > max_request_tokens:
        raise TokenBudgetExceeded(result.worst_case_tokens, max_request_tokens, field=budget_field)
    return result
