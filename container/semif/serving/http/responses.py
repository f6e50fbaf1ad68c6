"""Decision answers as response bodies: serialised off the event loop, within a size cap."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.responses import Response

from ..contracts.base import RequestError


def json_bytes(payload: Any) -> bytes:
    """The body Starlette's JSONResponse would send."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def check_size(body: bytes, *, max_bytes: int, field: str, what: str = "the answer") -> bytes:
    """``body`` when it is within ``max_bytes`` (SEMIF_MAX_RESPONSE_BYTES); else a 413 naming ``field``, what the
    client can change (``return_prompt``, else the decisions)."""
    if len(body) > max_bytes:
        hint = ("ask for the prompt with fewer decisions or a shorter state, or without it" if field == "return_prompt"
                else "send fewer decisions or options per request")
        raise RequestError(413, "response_too_large",
                           f"{field}: {what} would be {len(body)} bytes, over the {max_bytes} bytes an answer may "
                           f"take (SEMIF_MAX_RESPONSE_BYTES); {hint}", field, {"bytes": len(body), "max_bytes": max_bytes})
    return body


async def json_answer(payload: Any, *, headers: dict, max_bytes: int, field: str) -> Response:
    """``payload`` as a 200 JSON response. It is serialised in a worker thread: an answer with many decisions
    (or with ``return_prompt``) takes milliseconds to serialise, which the event loop, and so ``/ping``, never
    waits for. An answer over ``max_bytes`` (SEMIF_MAX_RESPONSE_BYTES) is refused with 413 naming ``field``, what
    the client can change (``return_prompt``, else the decisions)."""
    body = check_size(await asyncio.to_thread(json_bytes, payload), max_bytes=max_bytes, field=field)
    return Response(body, status_code=200, headers=headers, media_type="application/json")
