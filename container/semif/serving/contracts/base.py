"""What every wire contract provides to the HTTP layer."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..engine.context import ScoreResult
from ..engine.plan import DEBIAS_MODES, SecondLook
from ..engine.prompt import Question


MAX_ECHO = 200  # an error never repeats more of the client's input than this many characters
ECHO_PART = 64  # one echoed value (an id, a type name, a key) inside a message or a field path
# The second look's budget: reasoning tokens and wall time, per question (engine.plan.SecondLook).
DEFAULT_SECOND_LOOK_TOKENS = 128
MAX_SECOND_LOOK_TOKENS = 1024
DEFAULT_SECOND_LOOK_DEADLINE_MS = 20_000
MAX_SECOND_LOOK_DEADLINE_MS = 120_000
DEFAULT_SECOND_LOOK_MARGIN = 0.2  # a first pass whose top two options lie closer than this looks again
DEFAULT_SECOND_LOOK_SETTLE_EVERY = 0  # reasoning tokens between two peeks at the labels; 0: never peek (opt-in)


def excerpt(value: Any, limit: int = ECHO_PART) -> str:
    """A client-supplied value as it may appear in an error: at most ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    # A lone surrogate (a JSON key such as "\\ud800") cannot be encoded into the UTF-8 response: escape it.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestError(Exception):
    """A bad request: status 4xx, a stable code, a message and the offending field.

    Messages and fields are clipped here, as a last guard: whatever a contract echoes, an error
    repeats at most MAX_ECHO characters of client input in each."""

    def __init__(self, status: int, code: str, message: str, field: Optional[str] = None, details: Any = None):
        message = excerpt(message, 2 * MAX_ECHO)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = None if field is None else excerpt(field, MAX_ECHO)
        self.details = details


@dataclass
class Limits:
    max_options: int
    max_questions: int
    max_state_chars: int = 2 << 20  # SEMIF_MAX_STATE_CHARS


class JsonTextBudget:
    """Characters left for the objects and arrays of one request rendered as JSON text (indent 2, keys
    in the order sent). Indentation grows with depth, so a small deep body can render to many times its
    size: rendering stops, with a 413 naming the field, as soon as the request's texts pass the limit."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.left = max_chars

    def render(self, value: Any, field: str) -> str:
        parts: list[str] = []
        used = 0
        for chunk in json.JSONEncoder(ensure_ascii=False, indent=2).iterencode(value):
            used += len(chunk)
            if used > self.left:
                raise RequestError(413, "json_text_too_large",
                                   f"{field}: objects and arrays of this request render to more than {self.max_chars} "
                                   "characters of JSON text (SEMIF_MAX_STATE_CHARS); send less, or send it as a string",
                                   field)
            parts.append(chunk)
        self.left -= used
        return "".join(parts)


@dataclass
class RunContext:
    """What the HTTP layer knows about the run that produced a result."""

    request_id: str
    model: dict
    served_model_name: str
    queue_ms: float
    compute_ms: float
    total_ms: float
    image_digest: Optional[str] = None


@dataclass
class Job:
    """A parsed request: what to score and how to shape the answer."""

    state_text: str
    questions: list[Question]
    render: Callable[[ScoreResult, RunContext], dict]
    scoring: Optional[str] = None
    return_prompt: bool = False
    # For the log line: hashes of each question's option set, and per-result summaries.
    options_sha256: list[str] = field(default_factory=list)
    # Optional post-processing of probabilities (e.g. calibration), applied by the HTTP layer.
    decision_ids: list[Optional[str]] = field(default_factory=list)
    # The contract's own names for what the prompt plan may refuse (413, 422): the state, each
    # question (its path, and how its client knows it), and the request as a whole (token budget).
    state_field: str = "state"
    question_fields: Optional[list[str]] = None
    question_names: Optional[list[str]] = None
    budget_field: str = "questions"
    # Debiasing ("none" | "reverse" | "content_free" | "rotations"); None: the server default (SEMIF_DEBIAS).
    debias: Optional[str] = None
    # debias "rotations": the orders read per question as the request asked; None: the stop rule decides.
    reads: Optional[int] = None
    # Prompt layout and injection check as the request asked (None: the server's default), and the
    # contract's name for the layout field (errors name it).
    layout: Optional[str] = None
    injection_check: Optional[bool] = None
    layout_field: str = "layout"
    # The second look for ambiguous answers (engine.plan.SecondLook), when the request or its policy asks.
    second_look: Optional[SecondLook] = None
    second_look_field: str = "second_look"


def resolve_layout(job: Job, default: str) -> str:
    """The layout a request runs. Options-first applies to single-question requests: a request that asks
    for it with several questions is refused (422 naming the layout field: the client asked for something
    that cannot be done); a server default of options_first falls back to state_first for such requests,
    and the answer's template_version says which layout ran."""
    if job.layout is not None:
        if job.layout == "options_first" and len(job.questions) != 1:
            raise RequestError(
                422, "invalid_request",
                f"{job.layout_field}: 'options_first' applies to single-question requests (got {len(job.questions)} "
                "questions); several questions on one state use 'state_first', which evaluates the state once",
                job.layout_field,
            )
        return job.layout
    return default if len(job.questions) == 1 else "state_first"


DEBIAS_VALUES = DEBIAS_MODES  # the engine's (engine/plan.py)


class Contract(Protocol):
    name: str

    def matches(self, body: Any) -> bool: ...

    def parse(self, body: Any, limits: Limits) -> Job: ...

    def error_body(self, error: RequestError) -> dict: ...


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SEPARATORS = re.compile(r"[\x1e\x1f]")


def option_id_problem(value: str) -> Optional[str]:
    """Why ``value`` cannot be an option id, or None. Ids hold no control characters (U+0000–U+001F,
    U+007F): the option-set hash separates ids and descriptions with U+001F and U+001E, so that
    different option sets can never hash alike, and ids are echoed in answers and logs."""
    found = _CONTROL.search(value)
    if found is None:
        return None
    return f"must not hold control characters (U+{ord(found.group()):04X} at index {found.start()})"


def option_description_problem(value: Optional[str]) -> Optional[str]:
    """Why ``value`` cannot be an option description, or None: no U+001E or U+001F, the separators of
    the option-set hash (other control characters, newlines included, are fine in a description)."""
    found = None if value is None else _SEPARATORS.search(value)
    if found is None:
        return None
    return f"must not hold U+{ord(found.group()):04X} (at index {found.start()})"


def state_sha256(state_text: str) -> str:
    return hashlib.sha256(state_text.encode("utf-8")).hexdigest()


def pydantic_field(loc: Sequence[Any]) -> str:
    """`('decision', 'options', 1, 'id')` → `decision.options[1].id`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = excerpt(str(part))
            out += f".{part}" if out else part
    return out or "<body>"


def first_validation_error(exc: ValidationError, code: str = "invalid_request") -> RequestError:
    err = exc.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    # union/tagged branches add type names to loc; keep only real field names and indices
    field_path = pydantic_field([p for p in loc if isinstance(p, int) or "[" not in str(p)])
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return RequestError(422, code, f"{field_path}: {excerpt(message, MAX_ECHO)}", field=field_path)


class SecondLookBudget(BaseModel):
    """`second_look` inside a policy: only the budget (`max_tokens`, `deadline_ms`, `settle_every`); the
    thresholds are the policy's."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_tokens: int = Field(default=DEFAULT_SECOND_LOOK_TOKENS, ge=1, le=MAX_SECOND_LOOK_TOKENS)
    deadline_ms: int = Field(default=DEFAULT_SECOND_LOOK_DEADLINE_MS, ge=1, le=MAX_SECOND_LOOK_DEADLINE_MS)
    # Peek at the labels every this many reasoning tokens and stop once they agree (engine.plan.SecondLook);
    # 0: never. The default (not checked against max_tokens) simply never peeks under a smaller budget.
    settle_every: int = Field(default=DEFAULT_SECOND_LOOK_SETTLE_EVERY, ge=0, le=MAX_SECOND_LOOK_TOKENS)

    @field_validator("settle_every")
    @classmethod
    def _within_budget(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must be at most max_tokens ({max_tokens}), or 0 to never peek")
        return value

    def config(self, policy: Optional[dict] = None) -> SecondLook:
        """The engine's second look: below the policy's own thresholds (`min_probability`, `min_margin`,
        `min_label_mass`; none: the policy accepts every answer, so nothing looks again)."""
        return self._look(*((policy or {}).get(k) for k in ("min_probability", "min_margin", "min_label_mass")))

    def _look(self, probability: Optional[float], margin: Optional[float], mass: Optional[float]) -> SecondLook:
        return SecondLook(below_probability=probability or 0.0, below_margin=margin or 0.0,
                          below_label_mass=mass or 0.0, max_tokens=self.max_tokens,
                          deadline_s=self.deadline_ms / 1000, settle_every=self.settle_every)


class SecondLookSpec(SecondLookBudget):
    """`second_look` in a request: `{"below_margin", "below_probability", "below_label_mass", "max_tokens",
    "deadline_ms", "settle_every"}`. A first-pass answer below any threshold gets a second look; with no
    threshold given, `below_margin` is DEFAULT_SECOND_LOOK_MARGIN. In a policy the thresholds are the policy's
    own (`min_probability`, `min_margin`, `min_label_mass`): an answer the policy would not accept looks again."""

    below_probability: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    below_margin: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    below_label_mass: Optional[float] = Field(default=None, ge=0.0, le=1.0)

    def config(self, policy: Optional[dict] = None) -> SecondLook:
        if policy is not None:
            return super().config(policy)
        thresholds = (self.below_probability, self.below_margin, self.below_label_mass)
        if all(t is None for t in thresholds):
            thresholds = (None, DEFAULT_SECOND_LOOK_MARGIN, None)
        return self._look(*thresholds)
