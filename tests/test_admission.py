"""Admission control on its own (no model: the work is a real thread that waits): a waiting request
whose client leaves, or whose deadline passes, frees its place in the queue at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from semif.serving.http.admission import Abandoned, Admission, Cancellation, Overloaded, wait_admitted


async def _hold(admission: Admission, release: threading.Event) -> asyncio.Task:
    """A task that holds the model thread until ``release`` is set; returns once it holds it."""
    holding = threading.Event()

    def work():
        holding.set()
        release.wait(30)
        return "held"

    task = asyncio.ensure_future(admission.run(work))
    while not holding.is_set():
        await asyncio.sleep(0.005)
    return task


def test_a_waiting_request_whose_client_leaves_frees_its_place_at_once():
    async def scenario():
        admission = Admission(max_queue=1, queue_timeout_s=60)
        release = threading.Event()
        holder = await _hold(admission, release)
        ran = []
        cancel = Cancellation()
        waiter = asyncio.ensure_future(admission.run(lambda: ran.append("waiter"), cancel))
        await asyncio.sleep(0.05)
        assert admission.waiting == 1
        with pytest.raises(Overloaded):  # the queue of one is full
            await admission.run(lambda: None)
        cancel.leave()
        left = time.monotonic()
        with pytest.raises(Abandoned) as stopped:
            await waiter
        assert stopped.value.reason == "client_gone"
        assert time.monotonic() - left < 0.5  # not when the model comes free
        assert admission.waiting == 0
        third = asyncio.ensure_future(admission.run(lambda: "third"))  # takes the freed place
        await asyncio.sleep(0.05)
        assert not third.done() and admission.waiting == 1
        release.set()
        assert (await holder)[0] == "held"
        assert (await third)[0] == "third"
        assert ran == []  # the departed request never ran
        admission.shutdown()

    asyncio.run(scenario())


def test_a_waiting_request_stops_waiting_when_its_deadline_passes_not_at_the_queue_timeout():
    async def scenario():
        admission = Admission(max_queue=4, queue_timeout_s=60)
        release = threading.Event()
        holder = await _hold(admission, release)
        started = time.monotonic()
        with pytest.raises(Abandoned) as stopped:
            await admission.run(lambda: None, Cancellation(time.monotonic() + 0.3))
        waited = time.monotonic() - started
        assert stopped.value.reason == "deadline"
        assert 0.25 < waited < 2.0, waited
        assert admission.waiting == 0 and admission.rejected == 0  # not an overload refusal
        release.set()
        await holder
        admission.shutdown()

    asyncio.run(scenario())


def test_the_queue_timeout_still_applies_when_the_deadline_is_later():
    async def scenario():
        admission = Admission(max_queue=4, queue_timeout_s=0.2)
        release = threading.Event()
        holder = await _hold(admission, release)
        with pytest.raises(Overloaded) as refused:
            await admission.run(lambda: None, Cancellation(time.monotonic() + 30))
        assert refused.value.reason == "queue_timeout"
        release.set()
        await holder
        admission.shutdown()

    asyncio.run(scenario())


def test_a_client_that_leaves_as_the_model_comes_free_hands_the_model_on():
    """The lock is granted and the client leaves in the same instant: the lock must not leak."""

    async def scenario():
        for _ in range(50):
            lock = asyncio.Lock()
            cancel = Cancellation()
            cancel.leave()
            with pytest.raises(Abandoned):
                await wait_admitted(lock.acquire, cancel, queue_timeout_s=5,
                                    give_back=lambda: (lock.release(), True)[1])
            assert not lock.locked()
            await asyncio.wait_for(lock.acquire(), 1)  # the next request gets it
            lock.release()

    asyncio.run(scenario())
