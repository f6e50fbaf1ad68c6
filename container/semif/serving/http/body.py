"""Reading and checking request bodies: bounded in bytes, in memory and in time, before admission.

A body is read under a byte budget shared by every body being read or parsed at once
(SEMIF_BODY_BUDGET_BYTES): past it, the next body gets 503 with Retry-After before more of it is read.
It is then parsed as strict JSON: UTF-8, unique keys, finite numbers, no NaN/Infinity, no lone
surrogates, nesting at most MAX_JSON_DEPTH levels and at most SEMIF_MAX_JSON_VALUES values.

Depth and value count are checked before ``json.loads`` builds anything, by one linear pass over the
text: escaped backslashes and quotes are masked first (two ``str.replace`` calls, lengths kept), so that
a string is simply a quote, no quote, a quote. An odd number of quotes left means a string never
closed: the pass stops there and json.loads says where. Otherwise every quote the tokenizer meets has
a partner ahead, so no match ever fails and nothing backtracks. That matters beyond time: a C call (a
regex match) holds the GIL for as long as it runs, and each match here is short and linear, which is
what keeps ``/ping`` answering while a hostile body is checked in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from typing import Any, Optional

from starlette.requests import Request

from ..contracts.base import RequestError, excerpt, pydantic_field

MAX_JSON_DEPTH = 100  # deeper bodies are refused: json.dumps(indent=…) of a state recurses per level
DEFAULT_MAX_JSON_VALUES = 131072  # SEMIF_MAX_JSON_VALUES: twice the default token budget
SHOWN_PATH = 8  # path elements named in an error; deeper ones are elided


class JsonRefusal(ValueError):
    """The JSON is well-formed but refused (status, code, field)."""

    def __init__(self, code: str, message: str, field: str = "<body>", status: int = 400):
        super().__init__(message)
        self.code = code
        self.field = field
        self.status = status


class BodyBudgetExceeded(RequestError):
    """503: the bodies being read or parsed right now already hold the byte budget; retry shortly."""


_TOKEN = re.compile(r'"[^"]*"|[\[\]{},:]')  # on masked text: a whole string, or one structural character
_NON_SPACE = re.compile(r"[^ \t\n\r]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _path_text(path: list) -> str:
    shown = [excerpt(p) if isinstance(p, str) else p for p in path[:SHOWN_PATH]]
    text = pydantic_field(shown) if shown else "<body>"
    return text + ("…" if len(path) > SHOWN_PATH else "")


def _frames_path(text: str, frames: list) -> list:
    """The path of the innermost open container, keys decoded only now (on error)."""
    path = []
    for is_object, where, _ in frames:
        if not is_object:
            path.append(where)
        elif where is not None:
            start, end = where
            try:
                path.append(json.loads(text[start:end]))
            except ValueError:
                path.append(text[start + 1:end - 1])
    return path


def check_structure(text: str, *, max_depth: int = MAX_JSON_DEPTH, max_values: int = DEFAULT_MAX_JSON_VALUES) -> None:
    """Refuse ``text`` if it nests deeper than ``max_depth`` or holds more than ``max_values`` values
    (scalars and containers, keys not counted), naming the path where it crossed the limit. Linear in
    ``len(text)``; malformed text is left for json.loads to describe."""
    # Per open container: [is_object, index (array) or (start, end) of the current key (object), expecting_key]
    frames: list[list] = []
    key_span: Optional[tuple[int, int]] = None
    values = 1 if text.strip() else 0
    find_non_space = _NON_SPACE.search
    # Outside strings a backslash is invalid JSON anyway (json.loads refuses it); inside, after the
    # pairs of backslashes, a backslash before a quote escapes it. Masking keeps every offset.
    masked = text.replace("\\\\", "__").replace('\\"', "__") if "\\" in text else text
    if masked.count('"') % 2:
        return

    def too_many() -> JsonRefusal:
        return JsonRefusal("too_many_values", f"the JSON holds more than {max_values} values (SEMIF_MAX_JSON_VALUES)",
                           _path_text(_frames_path(text, frames)), status=413)

    for match in _TOKEN.finditer(masked):
        start = match.start()
        char = masked[start]
        if char == '"':
            if frames:
                frame = frames[-1]
                if frame[0] and frame[2]:
                    key_span = match.span()
        elif char == "[" or char == "{":
            if len(frames) >= max_depth:
                raise JsonRefusal("too_deep", f"the JSON is nested more than {max_depth} levels deep",
                                  _path_text(_frames_path(text, frames)))
            if char == "{":
                frames.append([True, None, True])
            else:
                frames.append([False, 0, False])
                following = find_non_space(masked, start + 1)
                if following is not None and text[following.start()] != "]":
                    values += 1
                    if values > max_values:
                        raise too_many()
        elif char == "]" or char == "}":
            if frames:
                frames.pop()
        elif char == ",":
            if frames:
                frame = frames[-1]
                if frame[0]:
                    frame[2] = True
                else:
                    frame[1] += 1
                    values += 1
                    if values > max_values:
                        raise too_many()
        else:  # ":"
            if frames and frames[-1][0]:
                frame = frames[-1]
                frame[1], frame[2] = key_span, False
                values += 1
                if values > max_values:
                    raise too_many()


def _reject_constant(name: str):
    raise JsonRefusal("invalid_json", f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf: no field of any contract means that
        raise JsonRefusal("number_out_of_range", f"number {excerpt(text)} is out of range")
    return value


def _unique_keys(pairs: list) -> dict:
    """Duplicate keys are refused, not resolved last-wins: two clients (or a client and a proxy)
    could otherwise read the same body differently."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonRefusal("duplicate_key", f"duplicate key {excerpt(key)!r} in a JSON object", excerpt(key))
            seen.add(key)
    return result


def _is_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path_to(root: Any, target: Any) -> list:
    """The path from ``root`` to the object ``target`` (by identity), found again on error only.
    Depth is already bounded by check_structure."""
    stack: list[tuple[Any, list]] = [(root, [])]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if isinstance(node, dict):
            for key, item in node.items():
                if key is target:
                    return path
                if isinstance(item, (dict, list, str)):
                    stack.append((item, path + [key]))
        elif isinstance(node, list):
            for index, item in enumerate(node):
                if isinstance(item, (dict, list, str)):
                    stack.append((item, path + [index]))
    return []


def check_strings(value: Any) -> None:
    """No lone surrogate in any key or string: no UTF-8 encoder, tokenizer or log line downstream can
    carry one. One iterative walk that keeps no path; the path is rebuilt only for the error."""
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _is_lone_surrogate(node):
                raise JsonRefusal("invalid_unicode", "a string holds a lone UTF-16 surrogate (e.g. \\ud800)",
                                  _path_text(_path_to(value, node)))
        elif isinstance(node, dict):
            for key in node:
                if _is_lone_surrogate(key):
                    raise JsonRefusal("invalid_unicode", "a key holds a lone UTF-16 surrogate (e.g. \\ud800)",
                                      _path_text(_path_to(value, key)))
            stack.extend(item for item in node.values() if isinstance(item, (dict, list, str)))
        elif isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list, str)))


def parse_json(raw: bytes, *, max_values: int = DEFAULT_MAX_JSON_VALUES) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, finite numbers, unique keys, bounded depth and value count,
    no lone surrogates. Time and memory linear in ``len(raw)``."""
    if not raw.strip():
        raise RequestError(400, "invalid_json", "the body is empty; send a JSON object", "<body>")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, "invalid_json", f"the body is not UTF-8 (byte {exc.start})", "<body>") from None
    try:
        check_structure(text, max_values=max_values)
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)
        if _SURROGATE_ESCAPE.search(text) is not None:
            check_strings(body)
        return body
    except RecursionError:
        raise RequestError(400, "invalid_json", "the JSON is nested too deeply", "<body>") from None
    except JsonRefusal as exc:
        raise RequestError(exc.status, exc.code, str(exc), exc.field) from None
    except ValueError as exc:
        raise RequestError(400, "invalid_json", f"malformed JSON: {excerpt(str(exc), 120)}", "<body>") from None


class BodyBudget:
    """Bytes of request bodies being read or parsed at once, across all requests of the process."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.in_use = 0
        self._lock = threading.Lock()

    def reservation(self) -> "BodyReservation":
        return BodyReservation(self)


class BodyReservation:
    """One body's share of the budget: it grows as the body arrives and is released once, when the
    body is parsed (or refused)."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.held = 0

    def grow_to(self, size: int) -> None:
        if size <= self.held:
            return
        budget = self.budget
        with budget._lock:
            if budget.in_use + size - self.held > budget.limit_bytes:
                in_use = budget.in_use
                raise BodyBudgetExceeded(
                    503, "overloaded",
                    f"request bodies being read now hold {in_use} of {budget.limit_bytes} bytes "
                    f"(SEMIF_BODY_BUDGET_BYTES); retry after the Retry-After delay", "<body>")
            budget.in_use += size - self.held
            self.held = size

    def release(self) -> None:
        with self.budget._lock:
            self.budget.in_use -= self.held
            self.held = 0

    def __enter__(self) -> "BodyReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


async def read_bytes(request: Request, max_bytes: int, *, what: str = "body",
                     reservation: Optional[BodyReservation] = None) -> bytes:
    """Read at most ``max_bytes`` of body, whatever Content-Length claims (``what`` names it in the 413).
    With a ``reservation``, the bytes are reserved as they arrive, never the declared length ahead of
    them: a socket that declares a large body and sends little holds only what it sent."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(413, "body_too_large", f"{what} of {excerpt(declared)} bytes exceeds {max_bytes}", "<body>")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(413, "body_too_large", f"{what} exceeds {max_bytes} bytes", "<body>")
        if reservation is not None:
            reservation.grow_to(size)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int, *, budget: Optional[BodyBudget] = None,
                    max_values: int = DEFAULT_MAX_JSON_VALUES) -> Any:
    """Read at most ``max_bytes`` of body under ``budget`` and parse it strictly, off the event loop."""
    reservation = budget.reservation() if budget is not None else None
    try:
        raw = await read_bytes(request, max_bytes, reservation=reservation)
        return await asyncio.to_thread(parse_json, raw, max_values=max_values)
    finally:
        if reservation is not None:
            reservation.release()
