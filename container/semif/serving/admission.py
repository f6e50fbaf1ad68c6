"""Admission control: one computation at a time on the single llama.cpp context, at most
``max_queue`` requests waiting, and an immediate, retryable refusal beyond that."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


class Overloaded(Exception):
    """The request was not admitted (queue full, waited too long, or shutting down)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "queue_full" | "queue_timeout" | "shutting_down"


@dataclass
class Admitted:
    queue_ms: float
    compute_ms: float


class Admission:
    def __init__(self, *, max_queue: int, queue_timeout_s: float):
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._running = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        self.draining = False
        self.rejected = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def busy(self) -> bool:
        return self._running > 0 or self._waiting > 0

    async def run(self, work: Callable[[], T]) -> tuple[T, Admitted]:
        """Run ``work`` on the model thread once it is free. Raises Overloaded instead of queueing
        past the limit. The work itself is never cancelled half-way: the context must stay consistent."""
        if self.draining:
            self.rejected += 1
            raise Overloaded("shutting_down", "the server is shutting down; retry on another instance")
        # A request that finds the model free does not count as waiting.
        if self._lock.locked() and self._waiting >= self.max_queue:
            self.rejected += 1
            raise Overloaded("queue_full", f"{self._waiting} requests are already waiting for the model")
        arrived = time.perf_counter()
        self._waiting += 1
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout=self.queue_timeout_s)
        except asyncio.TimeoutError:
            self.rejected += 1
            raise Overloaded("queue_timeout", f"waited {self.queue_timeout_s:g} s for the model") from None
        finally:
            self._waiting -= 1
        queue_ms = (time.perf_counter() - arrived) * 1000
        self._running += 1
        try:
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            future = loop.run_in_executor(self._executor, work)
            # shield: if the client goes away we still wait for the thread before releasing the context
            result = await asyncio.shield(future)
            return result, Admitted(queue_ms=queue_ms, compute_ms=(time.perf_counter() - started) * 1000)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise
        finally:
            self._running -= 1
            self._lock.release()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
