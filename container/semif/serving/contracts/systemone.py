"""TypeSafe's System One API (the API behind Jev): `POST /v1/systemone`.

    {"model", "state", "questions": {<id>: {"type": "noul"|"choice"|"score", "instructions", "criteria"}}}
        →  {"model", "answers": {<id>: …}, "usage": {"input_tokens", "output_tokens"}, "x_semif": {…}}

Errors follow the API's FastAPI conventions: validation failures are 422 `{"detail": [{"loc": ["body", …],
"msg", "type"}]}`, anything else `{"detail": {"error_type", "message"}}`. The rules are pinned by jevcompat's
spec (see docs/reference/api.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ..engine.context import Distribution, ScoreResult
from ..engine.prompt import TEMPLATE_VERSION, Outcome, Question, options_sha256
from .base import (MAX_ECHO, Job, JsonTextBudget, Limits, RequestError, RunContext, SecondLookSpec, excerpt,
                   option_description_problem, option_id_problem)

NAME = "systemone"
MODEL_ALIAS = "jev-latest"  # the official SDKs' default model name
MODEL_ALIASES = (MODEL_ALIAS,)  # answered besides the served model's name (app.py checks)
MAX_SCORE_LEVELS = 10

def _content(value: Any) -> Any:
    if isinstance(value, (str, dict, list)):
        return value
    raise ValueError("must be a string, an object or an array")


def _optional_content(value: Any) -> Any:
    return None if value is None else _content(value)


# Text, an object or an array: the API's "content" type (assets are not supported by a text model).
# Plain validators, not a Union, so that error locations name fields, not union branches.
Content = Annotated[Any, AfterValidator(_content)]
OptionalContent = Annotated[Any, AfterValidator(_optional_content)]


class _Lenient(BaseModel):
    # Unknown fields are ignored, as the API does; known fields are type-checked strictly.
    model_config = ConfigDict(extra="ignore", strict=True)


class NoulCriteria(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    true: OptionalContent = None
    false: OptionalContent = None


class _Question(_Lenient):
    # Our extension: the option that escapes a forced choice ("needs_more_info", "none_of_these"), by its
    # criteria key. Content-free calibration keeps its content-free share instead of dividing it out
    # (engine/passes/prior.py content_free_shift), as SemIf's `abstain_option`. Only a choice has one (_abstain_index).
    x_abstain_option: Optional[str] = None


class NoulQuestion(_Question):
    type: Literal["noul"]
    instructions: OptionalContent = None
    criteria: Optional[NoulCriteria] = None


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    instructions: OptionalContent = None
    criteria: dict[str, OptionalContent]


class ScoreQuestion(_Question):
    type: Literal["score"]
    instructions: OptionalContent = None
    criteria: list[Content]


AnyQuestion = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class SystemOneRequest(_Lenient):
    # Our extension: an optional record id, echoed at the top of the answer (joins batch output to input).
    id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    model: str = MODEL_ALIAS
    state: Content
    questions: dict[str, AnyQuestion] = Field(min_length=1)
    assets: Optional[dict[str, Any]] = None
    # Our extensions: prompt layout and the injection check, None = server default.
    layout: Optional[Literal["state_first", "options_first"]] = None
    injection_check: Optional[bool] = None
    # Our extension: debiasing ("none" | "reverse" | "content_free" | "rotations"); absent: the server default (SEMIF_DEBIAS).
    debias: Optional[Literal["none", "reverse", "content_free", "rotations"]] = None
    # Our extension: the opt-in second look for ambiguous answers (contracts/base.py, SecondLookSpec).
    second_look: Optional[SecondLookSpec] = None


def matches(body: Any) -> bool:
    """`questions` with `state` (or a `questions` object): System One. Bodies with `input` are OpenAI's."""
    if not isinstance(body, dict) or "questions" not in body or "input" in body:
        return False
    return "state" in body or isinstance(body["questions"], dict)


def as_text(value: Content, texts: Optional[JsonTextBudget] = None, field: str = "state") -> str:
    """Strings stay as they are; objects and arrays become JSON text (indent 2), keys in the order sent,
    within the request's budget of rendered characters (SEMIF_MAX_STATE_CHARS)."""
    if isinstance(value, str):
        return value
    return (texts or JsonTextBudget(Limits.max_state_chars)).render(value, field)


def _loc(loc: list) -> list:
    """A location as it may be echoed: ids and keys clipped (a question id can be any length)."""
    return [excerpt(p) if isinstance(p, str) else p for p in loc]


def _invalid(loc: list, msg: str, kind: str, code: str = "invalid_request") -> RequestError:
    loc = _loc(loc)
    field = ".".join(str(p) for p in loc)
    return RequestError(422, code, f"{field}: {msg}", field, details=[{"loc": ["body", *loc], "msg": msg, "type": kind}])


def _from_validation_error(exc: ValidationError) -> RequestError:
    details = []
    for err in exc.errors(include_url=False):
        loc = list(err["loc"])
        if len(loc) > 2 and loc[0] == "questions" and loc[2] in ("noul", "choice", "score"):
            del loc[2]  # the discriminated union's branch name, not a field
        msg = excerpt(err["msg"].removeprefix("Value error, "), MAX_ECHO)
        details.append({"loc": ["body", *_loc(loc)], "msg": msg, "type": err["type"]})
    first = details[0]
    field = ".".join(str(p) for p in first["loc"][1:]) or "<body>"
    return RequestError(422, "invalid_request", f"{field}: {first['msg']}", field, details=details)


def _where(loc: list, *more) -> str:
    return ".".join(str(p) for p in _loc([*loc, *more]))


def _check_description(text: Optional[str], loc: list) -> None:
    problem = option_description_problem(text)
    if problem:
        raise _invalid(loc, problem, "value_error")


def _abstain_index(q: Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], loc: list) -> Optional[int]:
    """The question's abstain option as an index into its criteria, or None when it marks none. A noul's
    outcomes and a score's levels are not options a caller escapes to: marking one is refused, never ignored."""
    mark = q.x_abstain_option
    if mark is None:
        return None
    where = [*loc, "x_abstain_option"]
    if not isinstance(q, ChoiceQuestion):
        raise _invalid(where, f"only a choice question takes an abstain option (this one is a {q.type})", "value_error")
    names = list(q.criteria)
    if mark not in names:
        raise _invalid(where, f"{excerpt(mark)!r} is not one of the question's criteria", "value_error")
    return names.index(mark)


def _noul_question(q: NoulQuestion, loc: list, texts: JsonTextBudget) -> Question:
    criteria = q.criteria or NoulCriteria()
    yes = None if criteria.true is None else as_text(criteria.true, texts, _where(loc, "criteria", "true"))
    no = None if criteria.false is None else as_text(criteria.false, texts, _where(loc, "criteria", "false"))
    if q.instructions is None and yes is None and no is None:
        raise _invalid(loc, "a noul needs instructions or a described outcome (criteria.true or criteria.false)", "value_error")
    _abstain_index(q, loc)
    lines = [as_text(q.instructions, texts, _where(loc, "instructions")) if q.instructions is not None
             else "Which description fits the state?"]
    if yes is not None:
        lines.append(f"Yes means: {yes}")
    if no is not None:
        lines.append(f"No means: {no}")
    _check_description(yes, [*loc, "criteria", "true"])
    _check_description(no, [*loc, "criteria", "false"])
    return Question("\n".join(lines), (Outcome("true", yes), Outcome("false", no)), kind="binary")


def _choice_question(q: ChoiceQuestion, loc: list, limits: Limits, texts: JsonTextBudget) -> Question:
    n = len(q.criteria)
    if n < 2 or n > limits.max_options:
        raise _invalid([*loc, "criteria"], f"a choice needs 2 to {limits.max_options} options (got {n})",
                       "too_short" if n < 2 else "too_long", "too_many_options" if n > limits.max_options else "invalid_request")
    if "" in q.criteria:
        raise _invalid([*loc, "criteria"], "option names must not be empty", "value_error")
    for name in q.criteria:
        problem = option_id_problem(name)
        if problem:
            raise _invalid([*loc, "criteria", name], f"the option name {problem}", "value_error")
    text = (as_text(q.instructions, texts, _where(loc, "instructions")) if q.instructions is not None
            else "Which option fits the state best?")
    outcomes = tuple(Outcome(name, None if d is None else as_text(d, texts, _where(loc, "criteria", name)))
                     for name, d in q.criteria.items())
    for outcome in outcomes:
        _check_description(outcome.description, [*loc, "criteria", outcome.key])
    return Question(text, outcomes, kind="choice", abstain=_abstain_index(q, loc))


def _score_question(q: ScoreQuestion, loc: list, texts: JsonTextBudget) -> Question:
    n = len(q.criteria)
    if n < 2 or n > MAX_SCORE_LEVELS:
        raise _invalid([*loc, "criteria"], f"a score needs 2 to {MAX_SCORE_LEVELS} levels (got {n})",
                       "too_short" if n < 2 else "too_long")
    _abstain_index(q, loc)
    text = (as_text(q.instructions, texts, _where(loc, "instructions")) if q.instructions is not None
            else "Which level fits the state best?")
    levels = tuple(Outcome(as_text(level, texts, _where(loc, "criteria", i))) for i, level in enumerate(q.criteria))
    for i, level in enumerate(levels):  # a level's text is its option key: free text, but no hash separator
        _check_description(level.key, [*loc, "criteria", i])
    return Question(text, levels, kind="scale")


def choice_confidence(probabilities: list[float]) -> float:
    """The reference formula: the top probability rescaled so that uniform is 0 and certain is 1."""
    n = len(probabilities)
    return _unit((max(probabilities) - 1 / n) / (1 - 1 / n)) if n > 1 else 1.0


def score_confidence(probabilities: list[float]) -> float:
    """The reference formula: 1 − (expected distance from the most probable level) / (that of uniform)."""
    n = len(probabilities)
    if n <= 1:
        return 1.0
    mode = max(range(n), key=lambda i: probabilities[i])
    spread = sum(p * abs(i - mode) for i, p in enumerate(probabilities))
    uniform = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return _unit(1 - spread / uniform)


def _unit(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


# SemIf's fields that this contract does not carry. Unknown fields are ignored, as the API does; these are
# refused when sent (not null), since a client asking for them would otherwise get neither, with no sign.
SEMIF_ONLY = ("policy", "return_prompt", "scoring", "reads")


def _refuse_semif_fields(body: dict) -> None:
    where = [[key] for key in SEMIF_ONLY if body.get(key) not in (None, False)]  # null or false asks for nothing
    questions = body.get("questions") if isinstance(body.get("questions"), dict) else {}
    where += [["questions", qid, "scoring"] for qid, q in questions.items()
              if isinstance(q, dict) and q.get("scoring") is not None]
    if where:
        raise _invalid(where[0], "a SemIf field that System One requests do not take (send it to /v1/semif)",
                       "extra_forbidden", "unsupported_parameter")
    # SemIf's name for the abstain option: ignored, it would silently answer as if nothing were marked.
    renamed = [["questions", qid, "abstain_option"] for qid, q in questions.items()
               if isinstance(q, dict) and q.get("abstain_option") is not None]
    if renamed:
        raise _invalid(renamed[0], "SemIf's spelling; a System One question marks its abstain option with x_abstain_option",
                       "extra_forbidden", "unsupported_parameter")


def parse(body: Any, limits: Limits) -> Job:
    if not isinstance(body, dict):
        raise _invalid([], "the body must be a JSON object", "model_attributes_type")
    _refuse_semif_fields(body)
    try:
        request = SystemOneRequest.model_validate(body)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
    if request.assets:
        raise _invalid(["assets"], "assets (images) are not supported: this server runs a text model", "value_error")
    if len(request.questions) > limits.max_questions:
        raise _invalid(["questions"], f"{len(request.questions)} questions; at most {limits.max_questions}",
                       "too_long", "too_many_questions")
    ids = list(request.questions)
    if "" in ids:
        raise _invalid(["questions"], "question ids must not be empty", "value_error")
    questions: list[Question] = []
    fields: list[str] = []
    texts = JsonTextBudget(limits.max_state_chars)
    state_text = as_text(request.state, texts, "state")
    for qid, q in request.questions.items():
        loc = ["questions", qid]
        if isinstance(q, NoulQuestion):
            questions.append(_noul_question(q, loc, texts))
            fields.append(f"questions.{excerpt(qid)}")
        elif isinstance(q, ChoiceQuestion):
            questions.append(_choice_question(q, loc, limits, texts))
            fields.append(f"questions.{excerpt(qid)}.criteria")
        else:
            questions.append(_score_question(q, loc, texts))
            fields.append(f"questions.{excerpt(qid)}.criteria")
    hashes = [options_sha256([(o.key, o.description) for o in question.outcomes]) for question in questions]

    def render(result: ScoreResult, run: RunContext) -> dict:
        answers = {}
        for qid, q, dist, opt_hash in zip(ids, request.questions.values(), result.distributions, hashes):
            answers[qid] = _answer(q, dist, opt_hash)
        info = run.model
        echoed = {"id": request.id} if request.id is not None else {}
        return {
            **echoed,
            "model": run.served_model_name,
            "answers": answers,
            # Generated tokens: the second look's reasoning, when one ran; else nothing is generated.
            "usage": {"input_tokens": result.input_tokens,
                      "output_tokens": sum((getattr(d, "second_look", None) or {}).get("reasoning_tokens", 0)
                                           for d in result.distributions)},
            "x_semif": {
                "request_id": run.request_id,
                "model_sha256": info["sha256"],
                "model_file": info["file"],
                "llama_cpp_build": info["llama_cpp_build"],
                "hardware": info["hardware"],
                "n_gpu_layers": info["n_gpu_layers"],
                "flash_attn": info.get("flash_attn"),
                "template_version": getattr(result, "template_version", None) or info.get("template_version") or TEMPLATE_VERSION,
                "layout": getattr(result, "layout", "state_first"),
                # The highest of the answers' own x_injection_suspected (null when the check did not run).
                "injection_suspected": result.injection_suspected,
                "template_sha256": info.get("template_sha256"),
                "image_digest": run.image_digest,
                "base_image_digest": info.get("base_image_digest"),
                "scoring": result.distributions[0].scoring if result.distributions else None,
                "state_tokens": result.state_tokens,
                "cached_tokens": result.cached_tokens,
                "evaluated_tokens": result.evaluated_tokens,
                "debias": result.distributions[0].debias if result.distributions else None,
                "label_mass": {qid: dist.label_mass for qid, dist in zip(ids, result.distributions)},
                # debias "content_free": each answer's content-free prior and its raw answer.
                # The abstain option whose content-free share was kept (x_abstain_option) is named by its criteria key.
                **({"content_free": {qid: _content_free_record(q, dist.content_free)
                                     for qid, q, dist in zip(ids, request.questions.values(), result.distributions)}}
                   if any(getattr(d, "content_free", None) is not None for d in result.distributions) else {}),
                # With SEMIF_CALIBRATION_PATH: each answer's calibration record (applied, or why not).
                **({"calibration": {qid: dist.calibration for qid, dist in zip(ids, result.distributions)}}
                   if any(getattr(d, "calibration", None) is not None for d in result.distributions) else {}),
                "timing": {"queue_ms": round(run.queue_ms, 3), "compute_ms": round(run.compute_ms, 3),
                           "total_ms": round(run.total_ms, 3)},
            },
        }

    return Job(
        state_text=state_text,
        questions=questions,
        render=render,
        # No decision_ids: a calibration keyed by question id would make answers depend on the ids.
        options_sha256=hashes,
        state_field="state",
        question_fields=fields,
        question_names=[excerpt(qid) for qid in ids],
        budget_field="questions",
        layout=request.layout,
        injection_check=request.injection_check,
        debias=request.debias,
        second_look=request.second_look.config() if request.second_look is not None else None,
    )


def _content_free_record(q: Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], record: Optional[dict]) -> Optional[dict]:
    if record is None or record.get("abstain_kept") is None:
        return record
    return {**record, "abstain_kept": list(q.criteria)[record["abstain_kept"]]}  # a copy: the engine's stays an index


def _answer(q: Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], dist: Distribution, opt_hash: str) -> dict:
    probabilities = dist.probabilities
    extras = {"x_option_logits": dist.option_logits, "x_options_sha256": opt_hash}
    if getattr(dist, "injection_suspected", None) is not None:
        # This answer's own check: the state read after this question's options alone.
        extras["x_injection_suspected"] = dist.injection_suspected
    if getattr(dist, "second_look", None) is not None:
        extras["x_second_look"] = dist.second_look  # which pass decided, and the first pass's answer
    if isinstance(q, NoulQuestion):
        return {"type": "noul", "noul": probabilities[0], **extras}
    if isinstance(q, ChoiceQuestion):
        names = list(q.criteria)
        top = max(range(len(names)), key=lambda i: probabilities[i])
        return {
            "type": "choice",
            "choice": names[top],
            "probabilities": dict(zip(names, probabilities)),
            "confidence": choice_confidence(probabilities),
            **extras,
        }
    return {
        "type": "score",
        "score": sum(i * p for i, p in enumerate(probabilities)),
        "legend": {str(i): level for i, level in enumerate(q.criteria)},
        "probabilities": {str(i): p for i, p in enumerate(probabilities)},
        "confidence": score_confidence(probabilities),
        **extras,
    }


def error_status(error: RequestError) -> int:
    """Malformed JSON is a validation failure (422) in this API, as in FastAPI."""
    return 422 if error.code == "invalid_json" else error.status


def error_body(error: RequestError) -> dict:
    if error.status == 422 or error.code == "invalid_json":
        if isinstance(error.details, list) and error.details:
            return {"detail": error.details}
        loc = ["body"] + ([] if error.field in (None, "<body>") else error.field.split("."))
        return {"detail": [{"loc": loc, "msg": error.message, "type": error.code}]}
    error_type = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                  413: "request_too_large", 503: "overloaded_error"}.get(error.status)
    if error_type is None:
        error_type = "invalid_request_error" if error.status < 500 else "api_error"
    return {"detail": {"error_type": error_type, "message": error.message, "code": error.code, "field": error.field}}
