"""OpenAI's Decisions API: `POST /v1/decisions` (openai-python's `client.decisions.create`).

    {"model", "input": str | [items], "questions": [{"type": "predicate"|"choice"|"score", "name"?, …}],
     "prompt_cache_key"?}
        →  {"answers": [… in question order], "model", "usage"}

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with 400 for invalid requests.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..engine.context import Distribution, ScoreResult
from ..engine.prompt import Outcome, Question, options_sha256
from .base import (DEBIAS_VALUES, Job, JsonTextBudget, Limits, RequestError, RunContext, excerpt,
                   option_description_problem, option_id_problem)

NAME = "openai_decisions"
# Answered besides the served model's name (app.py checks): the one model the SDK documents.
MODEL_ALIASES = ("gpt-6-luna",)
MAX_SCORE_LEVELS = 10
_MESSAGE_ROLES = ("user", "developer", "system", "assistant")
# SemIf's fields that this contract does not carry: refused when sent (not null), never silently ignored.
SEMIF_ONLY = ("second_look", "policy", "return_prompt", "scoring", "reads")
UNSUPPORTED = "is a SemIf field that OpenAI Decisions requests do not take (send it to /v1/semif)"


def matches(body: Any) -> bool:
    """`questions` with `input` (or a `questions` array): OpenAI Decisions. Bodies with `state` are System One's."""
    if not isinstance(body, dict) or "questions" not in body or "state" in body:
        return False
    return "input" in body or isinstance(body["questions"], list)


def _bad(field: str, message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, code, f"{field}: {message}" if field else message, field or None)


def _shown(value: Any) -> str:
    """A client value inside an error message: as JSON, clipped."""
    try:
        return excerpt(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return _type_name(value)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _require(value: Any, kind: type | tuple, field: str, what: str) -> Any:
    if not isinstance(value, kind):
        raise _bad(field, f"must be {what}, not {_type_name(value)}")
    return value


def _text_parts(parts: Any, field: str, allowed: tuple[str, ...], texts: JsonTextBudget) -> str:
    """A string, or an ordered list of parts rendered as text; images are refused (text-only model)."""
    if isinstance(parts, str):
        return parts
    _require(parts, list, field, "a string or an array of content parts")
    if not parts:
        raise _bad(field, "must not be empty")
    rendered = []
    for i, part in enumerate(parts):
        where = f"{field}[{i}]"
        _require(part, dict, where, "a content part object")
        kind = part.get("type")
        if kind not in allowed:
            if kind == "input_image":
                raise _bad(f"{where}.type", "images are not supported: this server runs a text model", "unsupported_content")
            raise _bad(f"{where}.type", f"must be one of {', '.join(allowed)} (got {_shown(kind)})")
        if kind in ("input_text", "output_text"):
            rendered.append(_require(part.get("text"), str, f"{where}.text", "a string"))
        elif kind == "refusal":
            rendered.append("[refusal] " + _require(part.get("refusal"), str, f"{where}.refusal", "a string"))
        else:  # input_json
            data = part.get("data")
            if not isinstance(data, dict) and not (isinstance(data, list) and all(isinstance(d, dict) for d in data)):
                raise _bad(f"{where}.data", "must be an object or an array of objects")
            rendered.append(texts.render(data, f"{where}.data"))
    return "\n".join(rendered)


def render_input(value: Any, texts: Optional[JsonTextBudget] = None) -> str:
    """The input as the state text: a string as is; items as a transcript, one block per item
    (input_json parts within the request's budget of rendered characters, SEMIF_MAX_STATE_CHARS)."""
    texts = texts or JsonTextBudget(Limits.max_state_chars)
    if isinstance(value, str):
        return value
    _require(value, list, "input", "a string or an array of input items")
    if not value:
        raise _bad("input", "must not be empty")
    blocks, calls = [], set()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        _require(item, dict, where, "an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise _bad(f"{where}.role", f"must be one of {', '.join(_MESSAGE_ROLES)} (got {_shown(role)})")
            allowed = ("output_text", "refusal") if role == "assistant" else (
                ("input_text", "input_json") if role == "user" else ("input_text",))
            blocks.append(f"{role}: {_text_parts(item.get('content'), f'{where}.content', allowed, texts)}")
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _require(item.get("call_id"), str, f"{where}.call_id", "a string")
            name = _require(item.get("name"), str, f"{where}.name", "a string")
            key = "arguments" if kind == "function_call" else "input"
            payload = _require(item.get(key), str, f"{where}.{key}", "a string")
            calls.add((kind, call_id))
            blocks.append(f"{kind} {name} (call_id {call_id}): {payload}")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _require(item.get("call_id"), str, f"{where}.call_id", "a string")
            if (kind.removesuffix("_output"), call_id) not in calls:
                raise _bad(f"{where}.call_id", f"no earlier {kind.removesuffix('_output')} has call_id {excerpt(call_id)!r}")
            output = _text_parts(item.get("output"), f"{where}.output", ("input_text",), texts)
            blocks.append(f"{kind} (call_id {call_id}): {output}")
        else:
            raise _bad(f"{where}.type", f"unknown input item type {_shown(kind)}")
    return "\n\n".join(blocks)


def _instructions(q: dict, field: str, texts: JsonTextBudget) -> str:
    if "instructions" not in q:
        raise _bad(f"{field}.instructions", "is required")
    text = _text_parts(q["instructions"], f"{field}.instructions", ("input_text", "input_json"), texts)
    if not text.strip():
        raise _bad(f"{field}.instructions", "must not be blank")
    return text


def _optional_str(q: dict, key: str, field: str) -> Optional[str]:
    value = q.get(key)
    return None if value is None else _require(value, str, f"{field}.{key}", "a string")


def _description(q: dict, field: str) -> Optional[str]:
    """An option's description: a string with no hash separator (U+001E, U+001F), or absent."""
    value = _optional_str(q, "description", field)
    problem = option_description_problem(value)
    if problem:
        raise _bad(f"{field}.description", problem)
    return value


def _question(q: Any, field: str, limits: Limits, texts: JsonTextBudget) -> tuple[Question, dict]:
    """(engine question, what render needs: type, name, choice values or level labels)."""
    _require(q, dict, field, "a question object")
    if q.get("scoring") is not None:
        raise _bad(f"{field}.scoring", UNSUPPORTED, "unsupported_parameter")
    if q.get("abstain_option") is not None:  # ignored, it would answer as if nothing were marked
        raise _bad(f"{field}.abstain_option", "is SemIf's spelling; an OpenAI Decisions question marks its abstain "
                   "option with x_abstain_option", "unsupported_parameter")
    kind = q.get("type")
    name = _optional_str(q, "name", field)
    text = _instructions(q, field, texts) if kind in ("predicate", "choice", "score") else None
    mark = q.get("x_abstain_option")
    if mark is not None and kind in ("predicate", "score"):
        raise _bad(f"{field}.x_abstain_option", f"only a choice question takes an abstain option (this one is a {kind})")
    if kind == "predicate":
        return Question(text, (Outcome("true"), Outcome("false")), kind="binary"), {"type": kind, "name": name}
    if kind == "choice":
        choices = _require(q.get("choices"), list, f"{field}.choices", "an array of choices")
        if not 2 <= len(choices) <= limits.max_options:
            code = "too_many_options" if len(choices) > limits.max_options else "invalid_request"
            raise _bad(f"{field}.choices", f"provide 2 to {limits.max_options} choices (got {len(choices)})", code)
        values, outcomes, seen = [], [], {}
        for i, choice in enumerate(choices):
            where = f"{field}.choices[{i}]"
            _require(choice, dict, where, "a choice object")
            value = choice.get("value")
            if not isinstance(value, (str, bool)):
                raise _bad(f"{where}.value", f"must be a string or a boolean, not {_type_name(value)}")
            if isinstance(value, str) and option_id_problem(value):
                raise _bad(f"{where}.value", option_id_problem(value))
            # The key the prompt shows: a boolean as JSON, so true and "true" would read alike to the model.
            key = json.dumps(value) if isinstance(value, bool) else value
            if key in seen:
                raise _bad(f"{where}.value", f"duplicate choice {_shown(value)}: the prompt shows it as {_shown(key)}, "
                           f"like choices[{seen[key]}]")
            seen[key] = i
            values.append(value)
            outcomes.append(Outcome(key, _description(choice, where)))
        abstain = _abstain_index(mark, values, f"{field}.x_abstain_option")
        return (Question(text, tuple(outcomes), kind="choice", abstain=abstain),
                {"type": kind, "name": name, "values": values, "marked": abstain is not None})
    if kind == "score":
        levels = _require(q.get("levels"), list, f"{field}.levels", "an array of levels")
        if not 2 <= len(levels) <= MAX_SCORE_LEVELS:
            raise _bad(f"{field}.levels", f"provide 2 to {MAX_SCORE_LEVELS} levels (got {len(levels)})")
        labels, outcomes = [], []
        for i, level in enumerate(levels):
            where = f"{field}.levels[{i}]"
            _require(level, dict, where, "a level object")
            label = _require(level.get("label"), str, f"{where}.label", "a string")
            if option_id_problem(label):
                raise _bad(f"{where}.label", option_id_problem(label))
            labels.append(label)
            outcomes.append(Outcome(label, _description(level, where)))
        return Question(text, tuple(outcomes), kind="scale"), {"type": kind, "name": name, "labels": labels}
    raise _bad(f"{field}.type", f"must be predicate, choice or score (got {_shown(kind)})")


def _abstain_index(mark: Any, values: list, field: str) -> Optional[int]:
    """Our extension `x_abstain_option`: the choice value that escapes a forced choice ("needs_more_info",
    "none_of_these"), as SemIf's `abstain_option`: content-free calibration keeps its content-free share
    (engine/passes/prior.py content_free_shift). It names a value with its JSON type: "true" is not true."""
    if mark is None:
        return None
    if not isinstance(mark, (str, bool)):
        raise _bad(field, f"must be a string or a boolean, not {_type_name(mark)}")
    for index, value in enumerate(values):
        if value == mark and type(value) is type(mark):
            return index
    raise _bad(field, f"{_shown(mark)} is not one of the question's choice values")


def confidence_of_choice(probabilities: list[float]) -> float:
    n = len(probabilities)
    return min(1.0, max(0.0, (max(probabilities) - 1 / n) / (1 - 1 / n)))


def confidence_of_score(probabilities: list[float]) -> float:
    n = len(probabilities)
    mode = max(range(n), key=lambda i: probabilities[i])
    spread = sum(p * abs(i - mode) for i, p in enumerate(probabilities))
    uniform = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1 - spread / uniform))


def parse(body: Any, limits: Limits) -> Job:
    if not isinstance(body, dict):
        raise _bad("", "the body must be a JSON object")
    for key in ("model", "input", "questions"):
        if key not in body:
            raise _bad(key, "is required", "missing_required_parameter")
    _require(body["model"], str, "model", "a string")
    for key in SEMIF_ONLY:
        if body.get(key) not in (None, False):  # null or false asks for nothing: the same as absent
            raise _bad(key, UNSUPPORTED, "unsupported_parameter")
    # Our extension: an optional record id, echoed at the top of the answer (joins batch output to input).
    record_id = body.get("id")
    if record_id is not None and (not isinstance(record_id, str) or not 1 <= len(record_id) <= 256):
        raise _bad("id", "must be a string of 1 to 256 characters")
    for key in ("prompt_cache_key", "safety_identifier"):
        if body.get(key) is not None:
            _require(body[key], str, key, "a string")
    # Our extension: order debiasing; absent or null: the server default (SEMIF_DEBIAS).
    debias = body.get("debias")
    if debias is not None and debias not in DEBIAS_VALUES:
        raise _bad("debias", f"must be one of {', '.join(DEBIAS_VALUES)} (got {_shown(debias)})")
    if body.get("prompt_cache_options") is not None:
        _require(body["prompt_cache_options"], dict, "prompt_cache_options", "an object")
    # Our extensions: prompt layout and the injection check; None = the server's default.
    layout = body.get("layout")
    if layout is not None and layout not in ("state_first", "options_first"):
        raise _bad("layout", f"must be 'state_first' or 'options_first', not {_shown(layout)}")
    injection_check = body.get("injection_check")
    if injection_check is not None:
        _require(injection_check, bool, "injection_check", "a boolean")
    texts = JsonTextBudget(limits.max_state_chars)
    state_text = render_input(body["input"], texts)
    raw_questions = _require(body["questions"], list, "questions", "an array of questions")
    if not 1 <= len(raw_questions) <= limits.max_questions:
        code = "too_many_questions" if raw_questions else "invalid_request"
        raise _bad("questions", f"ask 1 to {limits.max_questions} questions (got {len(raw_questions)})", code)
    parsed = [_question(q, f"questions[{i}]", limits, texts) for i, q in enumerate(raw_questions)]
    questions = [p[0] for p in parsed]
    # Where a question's prompt can be too long: its outcomes (choices, levels) or, for a predicate, its instructions.
    part = {"predicate": "instructions", "choice": "choices", "score": "levels"}
    fields = [f"questions[{i}].{part[spec['type']]}" for i, (_, spec) in enumerate(parsed)]
    names = [excerpt(spec["name"]) if spec["name"] is not None else f"questions[{i}]" for i, (_, spec) in enumerate(parsed)]
    hashes = [options_sha256([(o.key, o.description) for o in q.outcomes]) for q in questions]

    marked = any(spec.get("marked") for _, spec in parsed)
    extended = layout is not None or injection_check is not None or debias is not None or marked

    def render(result: ScoreResult, run: RunContext) -> dict:
        cached = result.cached_tokens
        injection_suspected = result.injection_suspected  # the highest of the answers' own x_injection_suspected
        echoed = {"id": record_id} if record_id is not None else {}
        calibrations = ([getattr(d, "calibration", None) for d in result.distributions]
                        if any(getattr(d, "calibration", None) is not None for d in result.distributions) else None)
        debiased = result.distributions[0].debias if result.distributions else "none"
        return {
            **echoed,
            "answers": [_answer(spec, dist) for (_, spec), dist in zip(parsed, result.distributions)],
            "model": run.served_model_name,
            "usage": {
                "input_tokens": result.input_tokens,
                # cached: input tokens this request did not evaluate (reused from earlier requests);
                # written: state-prefix tokens evaluated now and kept for the next request to reuse.
                "input_tokens_details": {"cached_tokens": cached,
                                         "cache_write_tokens": result.state_tokens - result.state_cached_tokens},
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": result.input_tokens,
            },
            # Our metadata, only when the request used an extension (`debias` included: then it says which
            # debiasing ran, and content_free's priors), the injection check ran or a calibration file is
            # loaded (its probabilities are not the model's), so that a plain OpenAI request gets exactly
            # OpenAI's shape. The server's default debiasing is in its configuration and every log line.
            **({"x_semif": {"template_version": result.template_version, "layout": result.layout,
                            "injection_suspected": injection_suspected, "debias": debiased,
                            # The abstain option whose content-free share was kept, by its choice value.
                            **({"content_free": [_content_free_record(spec, d.content_free)
                                                 for (_, spec), d in zip(parsed, result.distributions)]}
                               if debiased == "content_free" else {}),
                            **({"calibration": calibrations} if calibrations else {})}}
               if extended or injection_suspected is not None or calibrations else {}),
        }

    # No decision_ids: a calibration keyed by question name would make answers depend on the names.
    return Job(state_text=state_text, questions=questions, render=render, options_sha256=hashes,
               state_field="input", question_fields=fields, question_names=names, budget_field="questions",
               layout=layout, injection_check=injection_check, debias=debias)


def _content_free_record(spec: dict, record: Optional[dict]) -> Optional[dict]:
    if record is None or record.get("abstain_kept") is None:
        return record
    return {**record, "abstain_kept": spec["values"][record["abstain_kept"]]}  # a copy: the engine's stays an index


def _answer(spec: dict, dist: Distribution) -> dict:
    answer = _openai_answer(spec, dist.probabilities)
    if getattr(dist, "injection_suspected", None) is not None:
        # Our extension, only when the check ran: this answer's own check (the state read after its options alone).
        answer["x_injection_suspected"] = dist.injection_suspected
    return answer


def _openai_answer(spec: dict, probabilities: list[float]) -> dict:
    kind, name = spec["type"], spec["name"]
    if kind == "predicate":
        return {"type": "predicate", "name": name, "probability": probabilities[0]}
    top = max(range(len(probabilities)), key=lambda i: probabilities[i])
    if kind == "choice":
        return {
            "type": "choice",
            "name": name,
            "choice": spec["values"][top],
            "confidence": confidence_of_choice(probabilities),
            "probabilities": [{"value": v, "probability": p} for v, p in zip(spec["values"], probabilities)],
        }
    return {
        "type": "score",
        "name": name,
        "score": sum(i * p for i, p in enumerate(probabilities)),
        "confidence": confidence_of_score(probabilities),
        "probabilities": [{"label": label, "value": i, "probability": p}
                          for i, (label, p) in enumerate(zip(spec["labels"], probabilities))],
    }


def error_status(error: RequestError) -> int:
    """OpenAI answers every invalid request with 400; 413 and 5xx keep their meaning."""
    return 400 if error.status == 422 else error.status


def error_body(error: RequestError) -> dict:
    if error.status in (400, 422):
        kind = "invalid_request_error"
    else:
        kind = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
                503: "server_overloaded"}.get(error.status, "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.field, "code": error.code}}
