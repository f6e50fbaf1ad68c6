"""What every wire contract provides to the HTTP layer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from pydantic import ValidationError

from ..engine import ScoreResult
from ..prompt import Question


class RequestError(Exception):
    """A bad request: status 4xx, a stable code, a message and the offending field."""

    def __init__(self, status: int, code: str, message: str, field: Optional[str] = None, details: Any = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.details = details


@dataclass
class Limits:
    max_options: int
    max_questions: int


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


class Contract(Protocol):
    name: str

    def matches(self, body: Any) -> bool: ...

    def parse(self, body: Any, limits: Limits) -> Job: ...

    def error_body(self, error: RequestError) -> dict: ...


def state_sha256(state_text: str) -> str:
    return hashlib.sha256(state_text.encode("utf-8")).hexdigest()


def pydantic_field(loc: Sequence[Any]) -> str:
    """`('decision', 'options', 1, 'id')` → `decision.options[1].id`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<body>"


def first_validation_error(exc: ValidationError, code: str = "invalid_request") -> RequestError:
    err = exc.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    # union/tagged branches add type names to loc; keep only real field names and indices
    field_path = pydantic_field([p for p in loc if isinstance(p, int) or "[" not in str(p)])
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return RequestError(422, code, f"{field_path}: {message}", field=field_path)
