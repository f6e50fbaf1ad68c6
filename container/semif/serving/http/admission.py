"""Admission control: one computation at a time on the single llama.cpp context, at most
``max_queue`` requests waiting, and an immediate, retryable refusal beyond that.

A waiting request leaves the queue as soon as its client goes away or its deadline passes
(``Cancellation``), so a departed client never holds a place meant for a live one."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")


class Overloaded(Exception):
    """The request was not admitted (queue full, waited too long, or shutting down)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "queue_full" | "queue_timeout" | "shutting_down"


class Abandoned(Exception):
    """The request stopped waiting for the model: its client went away, or its deadline passed first."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "client_gone" | "deadline"


class Cancellation:
    """Why a request should stop: its client went away (``leave``, called on the event loop) or its
    deadline passed (on ``clock``; None: no deadline). Calling it answers "stop now?", cheap
    enough for the model thread to ask between questions and at every generated token; the queue
    waits on ``left`` alongside the model lock."""

    def __init__(self, deadline: Optional[float] = None, *, clock: Callable[[], float] = time.monotonic):
        self.deadline = deadline
        self.clock = clock  # the clock ``deadline`` is on
        self._gone = threading.Event()
        self._left = asyncio.Event()

    def leave(self) -> None:
        """The client went away. Event-loop thread only (it wakes the queue)."""
        self._gone.set()
        self._left.set()

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    def expired(self) -> bool:
        return self.deadline is not None and self.clock() > self.deadline

    def remaining_s(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - self.clock())

    async def left(self) -> None:
        await self._left.wait()

    def __call__(self) -> bool:
        return self._gone.is_set() or self.expired()


async def wait_admitted(admit: Callable[[], Awaitable[object]], cancel: Optional[Cancellation], *,
                        queue_timeout_s: float, give_back: Callable[[], bool]) -> None:
    """Wait until ``admit()`` completes ("this request may use the model now").

    Ends early with Overloaded("queue_timeout") after ``queue_timeout_s``, or with Abandoned as soon
    as the client leaves or the deadline passes. If ``admit()`` completed in that same instant,
    ``give_back()`` tries to hand the model on and returns True; when it cannot (the work has already
    been taken), the request counts as admitted and its work reads ``cancel`` itself."""
    timeout, late = queue_timeout_s, "queue_timeout"
    remaining = cancel.remaining_s() if cancel is not None else None
    if remaining is not None and remaining < timeout:
        timeout, late = remaining, "deadline"
    admitted = asyncio.ensure_future(admit())
    left = asyncio.ensure_future(cancel.left()) if cancel is not None else None
    try:
        await asyncio.wait({admitted, left} - {None}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task itself was cancelled: leave the queue
        await _withdraw(admitted, give_back)
        raise
    finally:
        if left is not None:
            left.cancel()
    if cancel is not None and cancel.gone:
        if await _withdraw(admitted, give_back):
            return
        raise Abandoned("client_gone", "the client went away while waiting for the model")
    if admitted.done() or await _withdraw(admitted, give_back):
        admitted.result()
        return
    if late == "deadline":
        raise Abandoned("deadline", "the deadline passed while waiting for the model")
    raise Overloaded("queue_timeout", f"waited {queue_timeout_s:g} s for the model")


async def _withdraw(admitted: "asyncio.Future", give_back: Callable[[], bool]) -> bool:
    """Stop waiting on ``admitted``. True when the request holds the model after all: ``admitted``
    completed before the cancel landed and ``give_back()`` could not return it."""
    admitted.cancel()
    await asyncio.wait([admitted])
    if admitted.cancelled() or admitted.exception() is not None:
        return False
    return not give_back()


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

    async def run(self, work: Callable[[], T], cancel: Optional[Cancellation] = None) -> tuple[T, Admitted]:
        """Run ``work`` on the model thread once it is free. Raises Overloaded instead of queueing
        past the limit, and Abandoned when ``cancel`` says the client left or the deadline passed while
        waiting: that request's place in the queue is freed at once. The work itself is never
        interrupted from outside: it reads ``cancel`` at its own safe points (between questions, at
        each token), so the context stays consistent."""
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
            await wait_admitted(self._lock.acquire, cancel, queue_timeout_s=self.queue_timeout_s,
                                give_back=self._give_back)
        except Overloaded:
            self.rejected += 1
            raise
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

    def _give_back(self) -> bool:
        self._lock.release()
        return True

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
