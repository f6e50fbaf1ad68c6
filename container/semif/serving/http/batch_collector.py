"""The batching collector (SEMIF_BATCHING=1): beside admission control, it takes the requests waiting
for the model (up to N questions' worth) and hands them to ``execute_batch`` in one go, under the same
lock, queue limit, queue timeout and draining rules as the serial path, so 503s are unchanged."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..engine.batching import batchable, execute_batch
from ..engine.plan import PromptPlan
from .admission import Abandoned, Admission, Admitted, Cancellation, Overloaded, wait_admitted


@dataclass
class _Waiting:
    plan: PromptPlan
    cancel: Optional[Callable[[], bool]]
    future: asyncio.Future
    arrived: float
    started: asyncio.Event = field(default_factory=asyncio.Event)
    queue_ms: float = 0.0


class BatchCollector:
    """Runs decision plans through ``execute_batch``, several waiting requests at a time.

    Admission is the serial one's, on the same ``Admission`` object (its lock keeps chat generation
    and other serial work off the context meanwhile): a request waits while the model is busy; when
    ``max_queue`` requests already wait it gets 503 ``queue_full`` at once; after ``queue_timeout_s``
    of waiting, 503 ``queue_timeout``; while draining, 503 ``shutting_down``. A request being computed
    no longer waits, as in the serial path. When the model comes free, the collector takes the waiting
    requests in arrival order while their questions fit ``n_seq`` sequences (always at least one) and
    decodes them together. It adds no delay: a lone request on an idle server starts at once.

    A request ``execute_batch`` cannot decode with others (``batchable`` is False: cloze scoring, order
    debiasing, the injection check, a second look) is taken alone, in its turn, and runs on the serial
    path as a computation of its own: a batch never waits for it, and it never waits for a batch it is
    not part of. Requests that arrived after it still wait for it, as they would on the serial path;
    letting them overtake would let steady batchable traffic hold it until its queue timeout."""

    def __init__(self, admission: Admission, engine, *, n_seq: int):
        self.admission = admission
        self.engine = engine
        self.n_seq = n_seq
        self._pending: "collections.deque[_Waiting]" = collections.deque()
        self._wakeup: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None

    async def run(self, plan: PromptPlan, cancel: Optional[Cancellation] = None) -> tuple[Any, Admitted]:
        adm = self.admission
        if adm.draining:
            adm.rejected += 1
            raise Overloaded("shutting_down", "the server is shutting down; retry on another instance")
        # As in Admission.run: a request that finds the model free (and nobody waiting) does not queue.
        if (adm._lock.locked() or self._pending) and adm._waiting >= adm.max_queue:
            adm.rejected += 1
            raise Overloaded("queue_full", f"{adm._waiting} requests are already waiting for the model")
        loop = asyncio.get_running_loop()
        entry = _Waiting(plan, cancel, loop.create_future(), time.perf_counter())
        self._pending.append(entry)
        adm._waiting += 1
        self._start(loop)
        try:
            # A request already taken into a batch cannot be handed back: it stays admitted, and the
            # batch drops it at its next wave through its cancel hook.
            await wait_admitted(entry.started.wait, cancel, queue_timeout_s=adm.queue_timeout_s,
                                give_back=lambda: False)
        except (Overloaded, Abandoned, asyncio.CancelledError) as stopped:
            if not entry.started.is_set():
                self._forget(entry)
                if isinstance(stopped, Overloaded):
                    adm.rejected += 1
            raise
        # shield: a client that goes away does not stop the batch its request is part of
        outcome, admitted = await asyncio.shield(entry.future)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome, admitted

    def _forget(self, entry: _Waiting) -> None:
        try:
            self._pending.remove(entry)
            self.admission._waiting -= 1
        except ValueError:
            pass

    def _start(self, loop) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())

    def _take(self) -> list[_Waiting]:
        taken: list[_Waiting] = []
        questions = 0
        while self._pending:
            head = self._pending[0]
            n = max(1, len(head.plan.questions))
            alone = not batchable(self.engine, head.plan)
            if taken and (alone or questions + n > self.n_seq):
                break
            taken.append(self._pending.popleft())
            questions += n
            if alone:
                break
        return taken

    async def _loop(self) -> None:
        adm = self.admission
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await adm._lock.acquire()
            try:
                taken = self._take()
                if taken:
                    await self._run(taken)
            finally:
                adm._lock.release()

    async def _run(self, taken: list[_Waiting]) -> None:
        adm = self.admission
        now = time.perf_counter()
        adm._waiting -= len(taken)
        for entry in taken:
            entry.queue_ms = (now - entry.arrived) * 1000
            entry.started.set()
        adm._running += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(
                adm._executor, execute_batch, self.engine, [e.plan for e in taken], [e.cancel for e in taken]
            )
            try:
                outcomes = await asyncio.shield(work)
            except asyncio.CancelledError:  # the event loop is closing: wait for the thread, then stop
                await asyncio.wait([work])
                for entry in taken:
                    if not entry.future.done():
                        entry.future.cancel()
                raise
            except Exception as exc:  # the batch as a whole failed: every request in it hears why
                outcomes = [exc] * len(taken)
            compute_ms = (time.perf_counter() - now) * 1000
            for entry, outcome in zip(taken, outcomes):
                if not entry.future.done():
                    entry.future.set_result((outcome, Admitted(queue_ms=entry.queue_ms, compute_ms=compute_ms)))
        finally:
            adm._running -= 1
