"""The disconnect watch: a request's client going away stops its queue wait and its computation."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request

from .admission import Cancellation

DISCONNECT_POLL_S = 0.05  # how often a computing request checks that its client is still there


async def _watch_disconnect(request: Request, cancel: Cancellation) -> None:
    """Polls from the event loop; a waiting request leaves the queue when the client goes, and the
    model thread reads ``cancel`` between questions and at every generated token."""
    while not cancel.gone:
        if await request.is_disconnected():
            cancel.leave()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


@contextlib.asynccontextmanager
async def watching(request: Request, cancel: Cancellation):
    """Watch for the client going away while the block runs (queue wait and computation)."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, cancel))
    try:
        yield cancel
    finally:
        watcher.cancel()
