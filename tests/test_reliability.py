"""Reliability of the real `serve` process: overload, faults, hostile input at the socket, memory.

Bounded for CI (short states, label scoring). The longer soak with figures is tools/soak.py;
results and commands are in docs/explanation/reliability.md."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest

from serving import SERVE

pytestmark = pytest.mark.reliability

OPTIONS = [{"id": "account_access"}, {"id": "billing"}, {"id": "shipping"}]


def _decision(i: int, state: str | None = None) -> dict:
    return {
        "decision": {
            "id": f"d{i}",
            "state": state or f"Ticket {i}: the customer was charged twice.",
            "question": "Which queue?",
            "options": OPTIONS,
        }
    }


def _serve(start_serve, **env):
    """`serve` with one llama.cpp thread: its spinning thread pool degrades badly when the 2 CPUs are
    shared with the test clients (and CI neighbours); the model is small enough for one."""
    env.setdefault("SEMIF_N_THREADS", 1)
    return start_serve(**env)


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _request_lines(server) -> list[dict]:
    return [line for line in server.log_lines() if line.get("message") == "request"]


def _raw(port: int, payload: bytes, *, timeout: float = 30.0) -> bytes:
    """Send raw bytes, return everything the server answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (413) and closed; its answer is still readable
        return _read_until_closed(sock)


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
            if b"\r\n\r\n" in received and _complete(received):
                break
    except (ConnectionResetError, socket.timeout):
        pass
    return received


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _status(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def _json(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])


def _post_head(path: str, length: int | None, *, chunked: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if chunked:
        head += "Transfer-Encoding: chunked\r\n"
    elif length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


# ---- load ---------------------------------------------------------------------------------------


def test_overload_answers_only_200_or_503_and_every_200_equals_its_serial_answer(start_serve):
    server = _serve(start_serve, SEMIF_MAX_QUEUE=2, SEMIF_RETRY_AFTER_S=1)
    url = server.base_url + "/invocations"
    bodies = [_decision(i) for i in range(8)]
    with httpx.Client(timeout=60) as http:
        serial = [http.post(url, json=b).json()["probabilities"] for b in bodies]

    clients, per_client = 16, 13
    done = threading.Event()
    ping_ms: list[float] = []

    def pinger():
        with httpx.Client(timeout=10) as http:
            while not done.is_set():
                started = time.perf_counter()
                assert http.get(server.base_url + "/ping").status_code == 200
                ping_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(0.02)

    def client(c: int):
        answers = []
        with httpx.Client(timeout=60) as http:
            for k in range(per_client):
                i = (c * per_client + k) % len(bodies)
                answers.append((i, http.post(url, json=bodies[i])))
        return answers

    with cf.ThreadPoolExecutor(max_workers=clients + 1) as pool:
        ping_future = pool.submit(pinger)
        answers = [a for chunk in pool.map(client, range(clients)) for a in chunk]
        done.set()
        ping_future.result()

    assert len(answers) == clients * per_client
    statuses = [r.status_code for _, r in answers]
    assert set(statuses) <= {200, 503}
    assert statuses.count(503) > 0, "a queue of 2 under 16 clients must refuse some requests"
    assert statuses.count(200) > 0
    for i, response in answers:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "overloaded"
        else:
            body = response.json()
            assert body["id"] == f"d{i}"
            assert body["prompt"]["evaluated_tokens"] > 0  # computed under load, not recalled (memo off)
            np.testing.assert_allclose(body["probabilities"], serial[i], rtol=0, atol=1e-6)
    logged = _request_lines(server)
    assert len(logged) == len(bodies) + len(answers)  # every request sent was answered and logged
    assert sorted(line["status"] for line in logged[len(bodies):]) == sorted(statuses)
    assert len(ping_ms) >= 10
    assert np.percentile(ping_ms, 95) < 100, sorted(ping_ms)[-5:]


async def _exchange(reader, writer, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request on an open keep-alive connection: (status, headers, body)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write((head + "\r\n").encode() + (body or b""))
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


async def _crowd(port: int, *, idle: int, active: int, seconds: float, bodies: list[bytes]) -> dict:
    """``idle`` keep-alive connections that only ping now and then, ``active`` clients sending decisions
    as fast as they are answered, and one pinger, all at once for ``seconds``."""
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(idle)]
    # Every idle connection is open before any of them speaks: the server holds `idle` connections.
    first_pings = await asyncio.gather(*(_exchange(r, w, "GET", "/ping") for r, w in connections))
    stop = asyncio.Event()
    idle_pings, decisions, pings_ms = [s for s, _, _ in first_pings], [], []

    async def keep_alive(reader, writer):
        while not stop.is_set():
            await asyncio.sleep(1.0)  # well inside uvicorn's 5 s keep-alive
            idle_pings.append((await _exchange(reader, writer, "GET", "/ping"))[0])

    async def client(c: int):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        k = 0
        while not stop.is_set():
            i = (c + k) % len(bodies)
            decisions.append((i, *await _exchange(reader, writer, "POST", "/invocations", bodies[i])))
            k += 1
        writer.close()

    async def pinger():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not stop.is_set():
            started = time.perf_counter()
            status = (await _exchange(reader, writer, "GET", "/ping"))[0]
            pings_ms.append((status, (time.perf_counter() - started) * 1000))
            await asyncio.sleep(0.05)
        writer.close()

    tasks = [asyncio.ensure_future(keep_alive(r, w)) for r, w in connections]
    tasks += [asyncio.ensure_future(client(c)) for c in range(active)] + [asyncio.ensure_future(pinger())]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    for _, writer in connections:
        writer.close()
    return {"idle_pings": idle_pings, "decisions": decisions, "pings": pings_ms}


def test_two_hundred_connections_get_only_200_or_json_503_with_retry_after_and_ping_always_answers(start_serve):
    server = _serve(start_serve, SEMIF_MAX_QUEUE=2, SEMIF_RETRY_AFTER_S=1)
    url = server.base_url + "/invocations"
    bodies = [_decision(i) for i in range(4)]
    with httpx.Client(timeout=60) as http:
        serial = [http.post(url, json=b).json()["probabilities"] for b in bodies]
    crowd = asyncio.run(_crowd(server.port, idle=200, active=40, seconds=4.0, bodies=[json.dumps(b).encode() for b in bodies]))

    idle_pings, decisions, pings = crowd["idle_pings"], crowd["decisions"], crowd["pings"]
    assert len(idle_pings) >= 400 and set(idle_pings) == {200}  # 200 keep-alives pinged at least twice each
    assert pings and {status for status, _ in pings} == {200}
    statuses = [status for _, status, _, _ in decisions]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) > 0 and statuses.count(503) > 0, "a queue of 2 under 40 clients must refuse some"
    for i, status, headers, raw in decisions:
        body = json.loads(raw)  # every answer is JSON, refusals included
        if status == 503:
            assert headers["retry-after"] == "1" and body["error"]["code"] == "overloaded"
        else:
            assert body["id"] == f"d{i}" and body["prompt"]["evaluated_tokens"] > 0
            np.testing.assert_allclose(body["probabilities"], serial[i], rtol=0, atol=1e-6)
    print(f"connections: 200 idle + 40 active + 1 pinger; decisions {len(statuses)} "
          f"(200: {statuses.count(200)}, 503: {statuses.count(503)}); idle pings {len(idle_pings)}; "
          f"/ping p95 {np.percentile([ms for _, ms in pings], 95):.1f} ms, max {max(ms for _, ms in pings):.1f} ms")


# ---- abandoned work -----------------------------------------------------------------------------

MANY_QUESTIONS = [{"id": f"q{k}", "question": f"Does point {k} of the ticket concern billing?",
                   "options": [{"id": "yes"}, {"id": "no"}]} for k in range(400)]
LONG_TICKET = "The customer lists many points about invoices, deliveries and logins. " * 4


def test_a_long_request_whose_client_disconnects_stops_within_about_one_question(start_serve):
    server = _serve(start_serve)
    url = server.base_url + "/invocations"
    with httpx.Client(timeout=120) as http:
        sample = http.post(url, json={"state": LONG_TICKET + "(sample)", "decisions": MANY_QUESTIONS[:20]}).json()
    per_question_ms = float(np.median([r["timing"]["compute_ms"] for r in sample["results"]]))
    body = json.dumps({"state": LONG_TICKET, "decisions": MANY_QUESTIONS}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post_head("/invocations", len(body)) + body)
        time.sleep(2.0)  # the model is well into the 400 questions (~{400 x per_question_ms} ms of work)
    gone = time.monotonic()
    probe = httpx.post(url, json=_decision(0), timeout=120)
    waited_s = time.monotonic() - gone
    assert probe.status_code == 200
    queue_ms = probe.json()["timing"]["queue_ms"]
    # The abandoned request gave the model back between two questions (plus the 50 ms disconnect poll),
    # not after the ~400 x per_question_ms it had left.
    assert queue_ms < 5 * per_question_ms + 500, (queue_ms, per_question_ms)
    deadline = time.monotonic() + 10
    while not [l for l in _request_lines(server) if l.get("status") == 499] and time.monotonic() < deadline:
        time.sleep(0.1)
    abandoned = [line for line in _request_lines(server) if line.get("status") == 499]
    assert abandoned and abandoned[0]["questions_done"] < 400
    print(f"per question {per_question_ms:.1f} ms; the probe waited {queue_ms:.0f} ms for the model "
          f"({waited_s * 1000:.0f} ms end to end); the abandoned request stopped after "
          f"{abandoned[0]['questions_done']} of 400 questions")


def test_a_request_past_its_deadline_gets_a_json_504_and_the_next_is_served_promptly(start_serve):
    """SEMIF_REQUEST_DEADLINE_S: the 400-question request (~400 x one question of work) stops at the deadline."""
    deadline_s = 8.0  # long enough for the 3-question sample below even on a loaded machine
    server = _serve(start_serve, SEMIF_REQUEST_DEADLINE_S=deadline_s)
    url = server.base_url + "/invocations"
    with httpx.Client(timeout=120) as http:
        sample = http.post(url, json={"state": LONG_TICKET, "decisions": MANY_QUESTIONS[:3]})
    assert sample.status_code == 200, sample.text[:300]
    sample = sample.json()
    # what one question costs on this machine now, its state prefix included (the 400-question request
    # below shares the sample's state, so its prefix is cached: each question costs about this much)
    per_question_s = max(r["timing"]["compute_ms"] for r in sample["results"]) / 1000
    started = time.monotonic()
    late = httpx.post(url, json={"state": LONG_TICKET, "decisions": MANY_QUESTIONS, "debias": "content_free"},
                      timeout=120)
    late_s = time.monotonic() - started
    assert late.status_code == 504, late.text[:300]
    error = late.json()["error"]
    assert error["code"] == "deadline_exceeded" and "SEMIF_REQUEST_DEADLINE_S" in error["message"]
    # the deadline plus the question running when it passed (with slack for a loaded machine),
    # not the 400 x per_question_s that all questions take
    assert late_s < deadline_s + 3 * per_question_s + 2, (late_s, per_question_s)
    probe = httpx.post(url, json=_decision(0), timeout=60)
    assert probe.status_code == 200 and probe.json()["timing"]["queue_ms"] < 1000 * per_question_s + 500
    line = [l for l in _request_lines(server) if l.get("status") == 504][0]
    # Under content-free calibration its 397 new questions first need their content-free priors: the
    # deadline passes in that pass, before any question of its own was answered.
    assert line["questions_done"] == 0
    # Without priors to evaluate (the server's default debiasing), it stops between its own questions.
    started = time.monotonic()
    plain = httpx.post(url, json={"state": LONG_TICKET, "decisions": MANY_QUESTIONS}, timeout=120)
    assert plain.status_code == 504 and time.monotonic() - started < deadline_s + 3 * per_question_s + 2
    line = [l for l in _request_lines(server) if l.get("status") == 504][-1]
    assert 0 < line["questions_done"] < 400
    print(f"504 after {late_s:.2f} s ({line['questions_done']} of 400 questions done; one question {per_question_s:.2f} s)")


# ---- abandoned chats, queued clients and mini-batches ---------------------------------------------

# Sampled at temperature 2 the embedded model rambles on without emitting its end token (this prompt and
# seed run to the 1,000-token limit, about a minute on one thread of the shared 2-vCPU VM, 2026-12-02):
# left alone, one such reply holds the model for a minute, so a test that finds the model free soon after its client left measures
# cancellation, not a short reply.
LONG_CHAT = {"messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
             "max_tokens": 1000, "temperature": 2.0, "seed": 1}


def _open_request(port: int, path: str, body: dict, content_type: str = "application/json") -> socket.socket:
    """Send a whole request and keep the connection open (the client is waiting for its answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    return received


def _wait_for_lines(server, predicate, *, count: int = 1, timeout: float = 10.0) -> list[dict]:
    """The request log lines matching ``predicate``, once there are ``count`` of them or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in _request_lines(server) if predicate(line)]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_four_abandoned_chats_give_the_queue_and_the_model_back_to_the_next_decision(start_serve):
    server = _serve(start_serve, SEMIF_MAX_QUEUE=3, SEMIF_QUEUE_TIMEOUT_S=300)
    url = server.base_url + "/invocations"
    chats = []
    for _ in range(4):  # the first generates, the other three wait for the model
        chats.append(_open_request(server.port, "/v1/chat/completions", LONG_CHAT))
        time.sleep(0.3)
    refused = httpx.post(url, json=_decision(0), timeout=30)
    assert refused.status_code == 503, refused.text  # the queue of 3 is full: the premise of what follows
    time.sleep(0.5)
    # The three waiting chats are abandoned while the first still generates: their places are freed
    # at once, not when each would have reached the model.
    for sock in chats[1:]:
        sock.close()
    closed = time.monotonic()
    queued = _wait_for_lines(server, lambda line: line.get("contract") == "chat", count=3)
    queued_s = time.monotonic() - closed
    assert [line["status"] for line in queued] == [499] * 3, queued
    assert all(line["completion_tokens"] == 0 and "compute_ms" not in line for line in queued), queued
    assert queued_s < 2, queued_s
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        sent = time.monotonic()
        probe = pool.submit(httpx.post, url, json=_decision(1), timeout=120)
        time.sleep(0.3)
        assert not probe.done(), probe.result().text  # queued in a freed place, not refused
        # Then the generating chat is abandoned too: it stops at its next token.
        chats[0].close()
        closed = time.monotonic()
        answer = probe.result()
    assert answer.status_code == 200, answer.text
    # how long the decision still waited for the model once the chat's client had gone
    waited_s = answer.json()["timing"]["queue_ms"] / 1000 - (closed - sent)
    assert waited_s < 1.5, waited_s  # not the rest of the ~1,000 tokens
    generating = _wait_for_lines(server, lambda line: line.get("contract") == "chat" and "compute_ms" in line)
    assert generating and generating[0]["status"] == 499 and generating[0]["stopped"] == "client_gone", generating
    assert 0 < generating[0]["completion_tokens"] < LONG_CHAT["max_tokens"]
    print(f"4 chats abandoned: the 3 waiting ones left the queue {queued_s * 1000:.0f} ms after their clients went; "
          f"the generating one stopped after {generating[0]['completion_tokens']} tokens and the next decision "
          f"reached the model {max(waited_s, 0) * 1000:.0f} ms after its client went")


def test_a_queued_client_that_leaves_frees_its_place_for_the_next_one(start_serve):
    server = _serve(start_serve, SEMIF_MAX_QUEUE=1, SEMIF_QUEUE_TIMEOUT_S=300)
    url = server.base_url + "/invocations"
    holder = _open_request(server.port, "/v1/chat/completions", {**LONG_CHAT, "stream": True})
    try:
        _read_until(holder, b"data: ")  # the model is generating for the holder
        queued = _open_request(server.port, "/invocations", _decision(1))
        time.sleep(0.3)
        assert httpx.post(url, json=_decision(2), timeout=30).status_code == 503  # the one place is taken
        queued.close()
        closed = time.monotonic()
        left = _wait_for_lines(server, lambda line: line.get("contract") == "semif" and line.get("status") == 499)
        left_s = time.monotonic() - closed
        assert left and left[0]["questions_done"] == 0, left
        assert left_s < 2, left_s  # while the holder still holds the model
        with cf.ThreadPoolExecutor(max_workers=1) as pool:
            third = pool.submit(httpx.post, url, json=_decision(3), timeout=120)
            time.sleep(0.5)
            assert not third.done(), third.result().text  # waiting in the freed place, not refused
            holder.close()
            answer = third.result()
    finally:
        holder.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "d3"
    print(f"the queued client's place was free {left_s * 1000:.0f} ms after it left")


def test_a_mini_batch_whose_client_leaves_stops_scoring_its_records(start_serve):
    server = _serve(start_serve)
    records = [_decision(i, f"Ticket {i}: the customer was charged twice for order {1000 + i}.") for i in range(300)]
    payload = b"".join(json.dumps(record).encode() + b"\n" for record in records)
    sock = _open_request(server.port, "/invocations", payload, content_type="application/jsonlines")
    time.sleep(2.0)  # a few records answered, most of the 300 still to score
    sock.close()
    closed = time.monotonic()
    batch = _wait_for_lines(server, lambda line: line.get("contract") == "jsonlines")
    stopped_s = time.monotonic() - closed
    assert batch and batch[0]["status"] == 499, batch
    assert 0 < batch[0]["answered"] < len(records), batch[0]
    assert stopped_s < 3, stopped_s
    assert httpx.post(server.base_url + "/invocations", json=_decision(0), timeout=60).status_code == 200
    print(f"mini-batch left after {batch[0]['answered']} of {len(records)} records; "
          f"logged {stopped_s * 1000:.0f} ms after the client left")


def test_a_mini_batch_on_the_real_time_route_stops_at_the_request_deadline_and_a_waiting_request_is_served(start_serve):
    """JSON Lines on an endpoint's /invocations has the real-time deadline (SEMIF_REQUEST_DEADLINE_S), not the
    batch one: one record of 400 questions (far more work than the deadline) gives the model back when it
    passes, and a small request sent meanwhile is answered, having waited no longer than that."""
    deadline_s, head_start_s = 10.0, 5.0  # the probe has head_start_s to compute after the record stops
    server = _serve(start_serve, SEMIF_REQUEST_DEADLINE_S=deadline_s)
    record = json.dumps({"state": LONG_TICKET, "decisions": MANY_QUESTIONS}).encode() + b"\n"
    started = time.monotonic()
    sock = _open_request(server.port, "/invocations", record, content_type="application/jsonlines")
    time.sleep(head_start_s)  # the record holds the model
    sent = time.monotonic()
    probe = httpx.post(server.base_url + "/invocations", json=_decision(0), timeout=120)
    assert probe.status_code == 200, probe.text[:300]
    waited_s = probe.json()["timing"]["queue_ms"] / 1000
    # Admitted once the record's deadline passed (plus the question running then, with slack for a loaded
    # machine), not after its 400 questions; with the batch deadline it waited until its own 504.
    assert waited_s < deadline_s - (sent - started) + 4.0, waited_s
    batch = _read_until_closed(sock)
    sock.close()
    assert _status(batch) == 200, batch[:300]
    (line,) = [json.loads(text) for text in batch.partition(b"\r\n\r\n")[2].splitlines() if text.strip()]
    assert line["error"]["code"] == "deadline_exceeded" and "SEMIF_REQUEST_DEADLINE_S" in line["error"]["message"]
    print(f"the probe waited {waited_s:.2f} s for the model; the record stopped at its {deadline_s:g} s deadline")


def test_chat_stops_at_its_deadline_with_finish_reason_length_and_a_queued_decision_at_its_own(start_serve):
    chat_deadline_s = 5.0
    server = _serve(start_serve, SEMIF_CHAT_DEADLINE_S=chat_deadline_s, SEMIF_REQUEST_DEADLINE_S=1,
                    SEMIF_QUEUE_TIMEOUT_S=300)
    chat_url = server.base_url + "/v1/chat/completions"
    started = time.monotonic()
    whole = httpx.post(chat_url, json=LONG_CHAT, timeout=120)
    took_s = time.monotonic() - started
    assert whole.status_code == 200, whole.text
    choice, usage = whole.json()["choices"][0], whole.json()["usage"]
    assert choice["finish_reason"] == "length"
    assert 0 < usage["completion_tokens"] < LONG_CHAT["max_tokens"] and choice["message"]["content"]
    assert took_s < chat_deadline_s + 3, took_s

    started = time.monotonic()
    events = []
    with httpx.stream("POST", chat_url, json={**LONG_CHAT, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as response:
        assert response.status_code == 200
        first = True
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line)
            if first:  # the model is busy with this reply: a decision now waits behind it
                first = False
                decision_started = time.monotonic()
                late = httpx.post(server.base_url + "/invocations", json=_decision(0), timeout=60)
                decision_s = time.monotonic() - decision_started
    streamed_s = time.monotonic() - started
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    assert 0 < chunks[-1]["usage"]["completion_tokens"] < LONG_CHAT["max_tokens"]
    assert streamed_s < chat_deadline_s + 3, streamed_s
    # SEMIF_REQUEST_DEADLINE_S ended the decision's wait, not the chat's end ~4 s later
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded", late.text
    assert "waited for the model" in late.json()["error"]["message"]
    assert decision_s < 3, decision_s
    lines = _wait_for_lines(server, lambda line: line.get("contract") == "chat", count=2)
    assert [line.get("stopped") for line in lines] == ["deadline", "deadline"], lines
    print(f"chat cut at the {chat_deadline_s:g} s deadline after {took_s:.2f} s ({usage['completion_tokens']} tokens), "
          f"streaming after {streamed_s:.2f} s; the queued decision got its 504 after {decision_s:.2f} s")


# ---- faults -------------------------------------------------------------------------------------


def _serve_once(env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(SERVE), "serve"], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=timeout)


def _log_messages(stdout: str) -> list[dict]:
    lines = []
    for line in stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    return lines


def test_missing_model_file_stops_startup_naming_the_variable(tmp_path):
    result = _serve_once({"SEMIF_MODEL_PATH": str(tmp_path / "absent.gguf")})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "SEMIF_MODEL_PATH" in result.stderr and "no such file" in result.stderr


def test_model_that_fails_its_manifest_sha_exits_3_with_a_log_line(tmp_path, model_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(model_path, model_dir / model_path.name)
    (model_dir / "model-manifest.json").write_text(
        json.dumps({"file": model_path.name, "sha256": "f" * 64, "size_bytes": model_path.stat().st_size})
    )
    result = _serve_once({"SEMIF_MODEL_DIR": str(model_dir)})
    assert result.returncode == 3
    errors = [line for line in _log_messages(result.stdout) if line["level"] == "ERROR"]
    assert errors and errors[0]["message"] == "model does not match its manifest"
    assert errors[0]["model_path"] == str(model_dir / model_path.name)


def test_truncated_gguf_exits_4_with_cannot_load_model(tmp_path, model_path):
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as source:
        truncated.write_bytes(source.read(model_path.stat().st_size // 2))
    result = _serve_once({"SEMIF_MODEL_PATH": str(truncated)})
    assert result.returncode == 4, result.stderr[-2000:]
    errors = [line for line in _log_messages(result.stdout) if line["level"] == "ERROR"]
    assert errors and errors[0]["message"] == "cannot load model"
    assert "cannot load model" in result.stderr


def test_clients_that_disconnect_mid_request_leave_later_answers_correct(start_serve):
    server = _serve(start_serve)
    url = server.base_url + "/invocations"
    probe = _decision(0)
    serial = httpx.post(url, json=probe, timeout=60).json()["probabilities"]

    long_state = " ".join(f"Line {k}: the customer repeats that the parcel never arrived." for k in range(30))
    body = json.dumps(_decision(1, long_state)).encode()
    head = _post_head("/invocations", len(body))
    for cut in (len(body) // 2, len(body)):  # inside the body; after it, while the model computes
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head + body[:cut])
            time.sleep(0.2)
    for _ in range(3):
        answer = httpx.post(url, json=probe, timeout=60)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["probabilities"], serial, rtol=0, atol=1e-6)

    deadline = time.monotonic() + 30
    while len(_request_lines(server)) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    statuses = [line["status"] for line in _request_lines(server)]
    assert len(statuses) == 6
    assert 499 in statuses  # the half-sent body
    assert all(s in (200, 499) for s in statuses), statuses


def test_sigterm_under_load_finishes_in_flight_refuses_new_and_exits_0(start_serve):
    # A deadline past the queue timeout: this test is about the drain, not about SEMIF_REQUEST_DEADLINE_S.
    server = _serve(start_serve, SEMIF_MAX_QUEUE=8, SEMIF_QUEUE_TIMEOUT_S=300, SEMIF_REQUEST_DEADLINE_S=600)
    url = server.base_url + "/invocations"
    in_flight_bodies = [
        _decision(i, " ".join(f"Note {i}.{k}: the shipment was delayed again at the depot." for k in range(20)))
        for i in range(4)
    ]
    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(httpx.post, url, json=b, timeout=120) for b in in_flight_bodies]
        time.sleep(1.0)  # all four are received and waiting for, or using, the model
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.2)
        refused = httpx.post(url, json=_decision(9), timeout=30)
        ping = httpx.get(server.base_url + "/ping", timeout=5)
        finished = [f.result() for f in futures]
    returncode = server.proc.wait(timeout=60)
    exit_s = time.monotonic() - signalled

    # Admitted before the signal: finished with its answer. A request the loaded machine had not yet
    # received when the signal came is refused like any new one (never dropped, never a 5xx).
    admitted = [i for i, r in enumerate(finished) if r.status_code == 200]
    assert admitted, [r.text for r in finished]
    for i, response in enumerate(finished):
        if i in admitted:
            assert response.json()["id"] == f"d{i}"
        else:
            assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
    assert refused.status_code == 503
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "overloaded"
    assert ping.status_code == 503
    assert returncode == 0
    assert exit_s < 45  # the drain bound (30 s) plus uvicorn's close
    lines = server.log_lines()
    drained = [line for line in lines if line.get("message") == "drain finished"]
    assert drained and drained[0]["drained"] is True
    assert any(line.get("reason") == "shutting_down" for line in lines)


# ---- hostile input at the socket ----------------------------------------------------------------


def test_slow_loris_bodies_get_408_and_stalled_headers_are_dropped_while_serving_continues(start_serve):
    server = _serve(start_serve, SEMIF_READ_TIMEOUT_S=2)
    url = server.base_url + "/invocations"
    expected = httpx.post(url, json=_decision(0), timeout=60).json()["probabilities"]
    slow_bodies, slow_headers = [], []
    for _ in range(12):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        sock.sendall(_post_head("/invocations", 1000) + b'{"decision": {')
        slow_bodies.append(sock)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        slow_headers.append(sock)
    try:
        during = httpx.post(url, json=_decision(0), timeout=60)
        assert during.status_code == 200
        np.testing.assert_allclose(during.json()["probabilities"], expected, rtol=0, atol=1e-6)
        for sock in slow_bodies:
            response = _read_until_closed(sock)
            assert _status(response) == 408
            assert _json(response)["error"]["code"] == "body_timeout"
        for sock in slow_headers:
            assert _read_until_closed(sock) == b""  # closed without an answer
    finally:
        for sock in slow_bodies + slow_headers:
            sock.close()
    after = httpx.post(url, json=_decision(0), timeout=60)
    np.testing.assert_allclose(after.json()["probabilities"], expected, rtol=0, atol=1e-6)


def test_hostile_bodies_get_4xx_in_bounded_memory_and_the_server_keeps_serving(start_serve):
    server = _serve(start_serve)
    url = server.base_url + "/invocations"
    expected = httpx.post(url, json=_decision(0), timeout=60).json()["probabilities"]
    rss_before = _rss_kib(server.proc.pid)
    ten_mb = b'{"decision": {"state": "' + b"x" * (10 << 20) + b'"}}'

    def chunked(payload: bytes) -> bytes:
        step = 1 << 16
        parts = [f"{len(payload[i:i + step]):x}\r\n".encode() + payload[i:i + step] + b"\r\n" for i in range(0, len(payload), step)]
        return b"".join(parts) + b"0\r\n\r\n"

    thousands = json.dumps({"decision": {**_decision(0)["decision"], "options": [{"id": f"o{k}"} for k in range(5000)]}}).encode()
    cases = [
        (_post_head("/invocations", 6) + b'{"\xff\xfe":', 400, "<body>"),
        (_post_head("/invocations", 200_000) + b"[" * 100_000 + b"]" * 100_000, 400, "[0][0][0][0][0][0][0][0]…"),
        (_post_head("/invocations", 500_000) + b'{"a":' * 100_000, 400, "a.a.a.a.a.a.a.a…"),
        (_post_head("/invocations", len(ten_mb)) + ten_mb, 413, "<body>"),
        (_post_head("/invocations", None, chunked=True) + chunked(ten_mb), 413, "<body>"),
        (_post_head("/v1/chat/completions", len(ten_mb)) + ten_mb, 413, "<body>"),
        (_post_head("/invocations", len(thousands)) + thousands, 422, "decision.options"),
    ]
    for payload, status, field in cases:
        for _ in range(3):
            response = _raw(server.port, payload)
            assert _status(response) == status, (payload[:120], response[:300])
            error = _json(response)["error"]
            assert error.get("field", error.get("param")) == field
    grown_mib = (_rss_kib(server.proc.pid) - rss_before) / 1024
    assert grown_mib < 64, f"RSS grew by {grown_mib:.0f} MiB on hostile bodies"
    after = httpx.post(url, json=_decision(0), timeout=60)
    assert after.status_code == 200
    np.testing.assert_allclose(after.json()["probabilities"], expected, rtol=0, atol=1e-6)
    assert all(line["status"] < 500 for line in _request_lines(server))


# ---- memory -------------------------------------------------------------------------------------


@pytest.mark.slow  # ~45k evaluated tokens; minutes on 2 vCPUs (figures in docs/explanation/reliability.md)
def test_rss_after_1000_decisions_stays_within_10_percent_of_rss_after_50(start_serve):
    server = _serve(start_serve, SEMIF_N_THREADS=2)  # one sequential client: both cores go to the model
    url = server.base_url + "/invocations"
    # The smallest decisions the template allows (every question is evaluated from the state
    # boundary, ~30 tokens each), 10 per request, each request with its own short state.
    questions = [{"id": f"q{k}", "question": f"Q{k}?", "options": [{"id": "a"}, {"id": "b"}]} for k in range(10)]
    rss, decided = {}, 0
    with httpx.Client(timeout=120) as http:
        for r in range(100):
            response = http.post(url, json={"state": f"T{r}", "decisions": questions})
            assert response.status_code == 200, response.text
            decided += len(response.json()["results"])
            if decided in (50, 1000):
                rss[decided] = _rss_kib(server.proc.pid)
    assert set(rss) == {50, 1000}
    assert rss[1000] <= rss[50] * 1.10, rss
