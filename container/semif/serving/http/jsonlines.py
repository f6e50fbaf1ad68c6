"""JSON Lines on `POST /invocations`: the mini-batches of SageMaker Batch Transform (`SplitType=Line`,
`BatchStrategy=MultiRecord`), and `GET /execution-parameters`, which tells a transform job how to call us.

Each line is one request of any decision contract, detected per line as /invocations detects a JSON body.
The answer has one line per input line, in order: the contract's answer, or an error object in that
contract's error shape (plus the record's `id` where one is known; messages name the line within the
mini-batch). One bad line never fails the others. Each record's answer is held to the size a JSON answer may take
(`SEMIF_MAX_RESPONSE_BYTES`): a record over it gets its own 413 `response_too_large` line, naming `return_prompt`
when it asked for the prompt, else its decisions field. Records run one after another on the one context, so
consecutive lines that share a state reuse its prefix exactly as the questions of one request do.

One set of limits per route. In a Batch Transform job's container (`SEMIF_BATCH_TRANSFORM`, which
`SAGEMAKER_BATCH=true` implies) a mini-batch has the batch deadline (`SEMIF_BATCH_DEADLINE_S`) and each record
the batch token budget (`SEMIF_BATCH_MAX_REQUEST_TOKENS`). Anywhere else `/invocations` is the real-time route:
the mini-batch as a whole has the request deadline (`SEMIF_REQUEST_DEADLINE_S`) and each record the request
token budget (`SEMIF_MAX_REQUEST_TOKENS`), as a JSON request does. Lines not started by the deadline are
answered with a `deadline_exceeded` error object each, never dropped. Only a refusal to compute at all (queue full,
shutting down) fails the whole mini-batch with 503, so that Batch Transform retries it. A client that
goes away stops the mini-batch before its next question: nobody would read the rest (logged as 499 with
the lines answered).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from . import chat
from .admission import Cancellation, Overloaded
from .body import DEFAULT_MAX_JSON_VALUES, parse_json, read_bytes
from .headers import request_id_of
from .responses import json_bytes
from ..contracts import semif as semif_contract
from ..contracts.base import RequestError
from ..engine.context import EngineError, LabelError, PlanError, PromptTooLong, TokenBudgetExceeded

log = logging.getLogger("semif.http")

CONTENT_TYPES = frozenset({"application/jsonlines", "application/x-ndjson"})
MEDIA_TYPE = "application/jsonlines"
MIB = 1 << 20
PARSE_CHUNK_BYTES = 64 << 10  # bytes of lines (newlines included) parsed per trip to the worker thread
YIELD_EVERY = 64  # lines answered between two turns of the event loop to the other requests


@dataclass(frozen=True)
class RouteLimits:
    """The deadline of a mini-batch and the token budget of each of its records, with the settings that set them."""

    deadline_s: float
    deadline_setting: str
    max_request_tokens: Optional[int]  # None: no budget beyond the context
    budget_setting: str


def route_limits(settings) -> RouteLimits:
    """Batch Transform's limits in its own container; the real-time route's everywhere else, so that a JSON Lines
    body sent to an endpoint gets no more time or tokens than the same records sent as JSON."""
    if settings.batch_transform:
        return RouteLimits(settings.batch_deadline_s, "SEMIF_BATCH_DEADLINE_S",
                           settings.batch_max_request_tokens or None, "SEMIF_BATCH_MAX_REQUEST_TOKENS")
    return RouteLimits(settings.request_deadline_s, "SEMIF_REQUEST_DEADLINE_S",
                       settings.max_request_tokens, "SEMIF_MAX_REQUEST_TOKENS")


def is_json_lines(content_type: Optional[str]) -> bool:
    """`application/jsonlines; charset=utf-8` → True."""
    return (content_type or "").split(";", 1)[0].strip().lower() in CONTENT_TYPES


def max_payload_mb(settings) -> int:
    """The body limit in whole MiB (at least 1): what a mini-batch may weigh."""
    return max(1, settings.max_body_bytes // MIB)


def execution_parameters(settings) -> dict:
    """What Batch Transform asks `GET /execution-parameters` for when the job leaves them unset.

    One llama.cpp context computes one record at a time, so a second concurrent mini-batch would only
    wait in the admission queue (and interleave with the first, losing the prefix reuse of consecutive
    lines that share a state): one at a time. A mini-batch weighs at most the body limit."""
    return {"MaxConcurrentTransforms": 1, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": max_payload_mb(settings)}


def as_request_error(error: Exception) -> RequestError:
    """The engine's refusals as the 4xx/5xx a contract renders (the same mapping as a JSON request's)."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, TokenBudgetExceeded):
        return RequestError(413, error.code, str(error), error.field, {"tokens": error.tokens, "budget": error.budget})
    if isinstance(error, PromptTooLong):
        return RequestError(413, error.code, str(error), error.field or "state", {"tokens": error.tokens, "n_ctx": error.n_ctx})
    if isinstance(error, LabelError):
        return RequestError(422, error.code, str(error), error.field or "options")
    if isinstance(error, PlanError):
        return RequestError(422, error.code, str(error), error.field)
    if isinstance(error, EngineError):
        return RequestError(500, error.code, str(error), None)
    return RequestError(500, "internal_error", "internal error; see the server log", None)


def _parse_line(raw: bytes, number: int, max_values: int = DEFAULT_MAX_JSON_VALUES) -> Any:
    """A record, parsed as strictly as a JSON body (unique keys, bounded depth and value count, finite
    numbers, no lone surrogates); the error says which line of the mini-batch."""
    if not raw.strip():
        raise RequestError(400, "invalid_json", f"line {number} is empty; send one JSON object per line", "<line>")
    try:
        return parse_json(raw, max_values=max_values)
    except RequestError as error:
        raise RequestError(error.status, error.code, f"line {number}: {error}", error.field, error.details) from None


def parse_chunk(lines: list[bytes], start: int, max_values: int = DEFAULT_MAX_JSON_VALUES,
                chunk_bytes: int = PARSE_CHUNK_BYTES) -> list[tuple[Any, Optional[RequestError]]]:
    """(record, error) for the lines from ``start`` on, up to ``chunk_bytes`` of them (at least one line).
    Each line weighs its bytes and its newline, so a run of empty lines is chunked like any other."""
    out: list[tuple[Any, Optional[RequestError]]] = []
    size = 0
    for index in range(start, len(lines)):
        weight = len(lines[index]) + 1
        if out and size + weight > chunk_bytes:
            break
        size += weight
        try:
            out.append((_parse_line(lines[index], index + 1, max_values), None))
        except RequestError as error:
            out.append((None, error))
    return out


class Records:
    """The records of a mini-batch, parsed in a worker thread a bounded chunk at a time, just ahead of
    the record being answered: the event loop never parses, and parsed records never pile up."""

    def __init__(self, lines: list[bytes], max_values: int = DEFAULT_MAX_JSON_VALUES):
        self.lines = lines
        self.max_values = max_values
        self._start = 0
        self._parsed: list[tuple[Any, Optional[RequestError]]] = []

    async def get(self, index: int) -> Any:
        """Record ``index`` (records are asked for in order); its RequestError if it is refused."""
        if not self._start <= index < self._start + len(self._parsed):
            self._start = index
            self._parsed = await asyncio.to_thread(parse_chunk, self.lines, index, self.max_values)
        body, error = self._parsed[index - self._start]
        self._parsed[index - self._start] = (None, None)  # the caller holds it now
        if error is not None:
            raise error
        return body


def record_id(body: Any) -> Optional[str]:
    """What joins an output line to its record: the top-level `id` (System One, OpenAI), else a single
    SemIf decision's id."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("id"), str):
        return body["id"]
    decision = body.get("decision")
    if isinstance(decision, dict) and isinstance(decision.get("id"), str):
        return decision["id"]
    return None


def _error_line(contract, error: RequestError, body: Any) -> dict:
    line = dict(contract.error_body(error))
    rid = record_id(body)
    if rid is not None:
        line.setdefault("id", rid)
    return line


def count_records(raw: bytes) -> int:
    """How many records ``split_lines`` would make of ``raw``, without making them."""
    if not raw:
        return 0
    return raw.count(b"\n") + (0 if raw.endswith(b"\n") else 1)


def serialise(out: list) -> bytes:
    """The answer lines as one UTF-8 JSON Lines body (run in a worker thread: a mini-batch can be large). An
    answered record is already its JSON bytes (answer_record serialises it to check its size); an error line is
    serialised here, the same way."""
    return b"".join((line if isinstance(line, bytes) else json_bytes(line)) + b"\n" for line in out)


def split_lines(raw: bytes) -> list[bytes]:
    """Records of a mini-batch: one per line; a final newline ends the last record, it does not add one."""
    if not raw:
        return []
    lines = raw.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


async def _answer_lines(service, lines: list[bytes], override: Optional[str], cancel: Cancellation, *,
                        request_id: str, out: list, errors: Counter, totals: Counter,
                        limits: Optional[RouteLimits] = None) -> None:
    """Answer the lines in order into ``out``. Raises ClientDisconnect as soon as the client is gone."""
    settings = service.settings
    limits = limits or route_limits(settings)
    records = Records(lines, settings.max_json_values)
    for index in range(len(lines)):
        if index % YIELD_EVERY == YIELD_EVERY - 1:
            # A record answered from the parsed chunk (or refused) never suspends: let /ping and the
            # other requests run between lines.
            await asyncio.sleep(0)
        if cancel.gone:
            raise ClientDisconnect()
        number = index + 1
        body, contract = None, semif_contract
        try:
            body = await records.get(index)
            found = service.contract_for(body, override)
            if found is None:
                detail = ("chat completions are not answered in a JSON Lines batch; send decisions"
                          if chat.matches(body) else
                          "cannot tell the contract from the record: send 'decision'/'decisions' (SemIf), "
                          "'questions' with 'state' (System One) or with 'input' (OpenAI Decisions)")
                raise RequestError(422, "unknown_body_shape", f"line {number}: {detail}", "<line>")
            contract = found
            if cancel.expired():
                raise RequestError(504, "deadline_exceeded", f"line {number} was not reached within the mini-batch "
                                   f"deadline of {limits.deadline_s:g} s ({limits.deadline_setting}); "
                                   "resubmit it", "<line>")
            status_of_line, answer, record_fields = await service.answer_record(
                body, contract, request_id=f"{request_id}:{number}", cancel=cancel, limits=limits)
            if status_of_line != 200:
                errors[record_fields.get("error_code", "error")] += 1
                answer = dict(answer)
                rid = record_id(body)
                if rid is not None:
                    answer.setdefault("id", rid)
            for key in ("tokens", "cached_tokens", "evaluated_tokens"):
                totals[key] += record_fields.get(key) or 0
            out.append(answer)
        except RequestError as error:
            errors[error.code] += 1
            out.append(_error_line(contract, error, body))


async def handle(service, request: Request) -> Response:
    """Answer one mini-batch: one line out per line in, in order."""
    settings = service.settings
    started = time.perf_counter()
    limits = route_limits(settings)
    cancel = Cancellation(time.monotonic() + limits.deadline_s, clock=time.monotonic)
    request_id = request_id_of(request.headers)
    headers = {"x-request-id": request_id}
    fields: dict[str, Any] = {"request_id": request_id, "route": request.url.path, "contract": "jsonlines",
                              "content_type": MEDIA_TYPE}
    errors: Counter = Counter()
    totals = Counter()
    out: list[dict] = []
    status = 200
    try:
        limit = max_payload_mb(settings) * MIB
        from .disconnect import watching
        from .headers import SAGEMAKER_ATTRIBUTES, custom_attribute  # as for a JSON request

        # The mini-batch counts against the body budget while it is read, as a JSON body does.
        with service.body_budget.reservation() as reservation:
            raw = await asyncio.wait_for(read_bytes(request, limit, what="mini-batch", reservation=reservation),
                                         service.body_timeout_s)

        override = custom_attribute(request.headers.get(SAGEMAKER_ATTRIBUTES, ""), "contract")
        records = count_records(raw)
        if records > settings.max_jsonl_records:
            fields["records"] = records
            raise RequestError(413, "too_many_records",
                               f"the mini-batch holds {records} records, more than {settings.max_jsonl_records} "
                               "(SEMIF_MAX_JSONL_RECORDS); send smaller mini-batches (a lower MaxPayloadInMB)",
                               "<body>")
        lines = await asyncio.to_thread(split_lines, raw)  # up to a record per byte: off the loop
        del raw
        fields["records"] = len(lines)
        async with watching(request, cancel):
            await _answer_lines(service, lines, override, cancel, limits=limits, request_id=request_id, out=out,
                                errors=errors, totals=totals)
        fields.update(answered=len(lines) - sum(errors.values()), errors=dict(errors),
                      deadline_exceeded=errors.get("deadline_exceeded", 0), **totals)
    except Overloaded as error:
        # Nothing can be computed now: a 503 makes Batch Transform retry the whole mini-batch.
        headers["retry-after"] = str(settings.retry_after_s)
        status = 503
        fields.update(status=503, error_code="overloaded", reason=error.reason)
        return JSONResponse(semif_contract.error_body(RequestError(503, "overloaded", str(error), None)),
                            status_code=503, headers=headers)
    except asyncio.TimeoutError:
        status = 408
        fields.update(status=408, error_code="body_timeout")
        error = RequestError(408, "body_timeout", f"the body did not arrive within {service.body_timeout_s:g} s", "<body>")
        return JSONResponse(semif_contract.error_body(error), status_code=408, headers=headers)
    except RequestError as error:  # the mini-batch as a whole (too large, or the body budget is spent)
        status = error.status
        fields.update(status=status, error_code=error.code)
        if status == 503:
            headers["retry-after"] = str(settings.retry_after_s)
        return JSONResponse(semif_contract.error_body(error), status_code=status, headers=headers)
    except ClientDisconnect:
        status = 499
        fields.update(status=499, error_code="client_disconnected", answered=len(out) - sum(errors.values()),
                      errors=dict(errors), **totals)
        return Response(status_code=499)
    finally:
        fields.setdefault("status", status)
        fields["total_ms"] = round((time.perf_counter() - started) * 1000, 3)
        fields["model_sha256"] = service.engine.info["sha256"]
        fields["template_version"] = service.engine.info["template_version"]
        fields["image_digest"] = settings.image_digest
        log.info("request", extra=fields)
    body = await asyncio.to_thread(serialise, out)
    del out
    return Response(body, status_code=200, media_type=MEDIA_TYPE, headers=headers)
