"""A hostile body costs time and memory linear in its size, is refused before admission with a 4xx JSON
error naming the field, and never stalls the event loop: `/ping` keeps answering while it is read.

The parser tests run each shape in a subprocess with a timeout, so that a parser that went quadratic
fails the test instead of hanging the run; the server tests send each shape at the default body limit
(1 MiB) to the real `serve` process while a second thread polls `/ping`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx
import pytest

from serving import ServeProcess, embedded_model, free_port

MIB = 1 << 20
PING_BOUND_S = 1.0
NOUL = '"questions":{"q":{"type":"noul","instructions":"Is it urgent?"}}'
DECISION = {"decision": {"id": "d", "state": "The customer was charged twice.", "question": "Which queue?",
                         "options": [{"id": "billing"}, {"id": "shipping"}]}}


def escaped_quotes(size: int) -> bytes:
    """A SemIf state of escaped quotes whose string never closes (each \\" used to restart a backtracking scan)."""
    head = b'{"decision":{"state":"'
    return head + b'\\"' * ((size - len(head)) // 2)


def unterminated_string(size: int) -> bytes:
    head = b'{"decision":{"state":"'
    return head + b"a" * (size - len(head))


def tiny_strings(size: int) -> bytes:
    """99 levels of arrays around many empty strings, as a System One state."""
    head, tail = b'{"state":' + b"[" * 98, b"]" * 98 + b"," + NOUL.encode() + b"}"
    count = (size - len(head) - len(tail) - 2) // 3
    return head + b'"",' * count + b'""' + tail


def deep_nesting(size: int) -> bytes:
    return b"[" * (size // 2) + b"]" * (size // 2)


def render_growth(size: int) -> bytes:
    """A deep System One state of short strings (under the value cap) whose indent-2 JSON text is ~20x the body."""
    head = b'{"state":' + b'{"a":' * 95 + b"["
    tail = b"]" + b"}" * 95 + b"," + NOUL.encode() + b"}"
    count = (size - len(head) - len(tail) - 8) // 9
    return head + b'"aaaaaa",' * count + b'"aaaaaa"' + tail


# shape → (status, code, what the field starts with)
EXPECTED = {
    escaped_quotes: (400, "invalid_json", "<body>"),
    unterminated_string: (400, "invalid_json", "<body>"),
    tiny_strings: (413, "too_many_values", "state[0][0]"),
    deep_nesting: (400, "too_deep", "[0][0]"),
    render_growth: (413, "json_text_too_large", "state"),
}
SHAPES = list(EXPECTED)

ADMIT = r"""
import json, sys, time
from semif.serving.http.body import parse_json
from semif.serving.contracts import semif, systemone
from semif.serving.contracts.base import Limits, RequestError
raw = open(sys.argv[1], "rb").read()
started = time.perf_counter()
try:
    body = parse_json(raw)
    contract = semif if semif.matches(body) else systemone
    contract.parse(body, Limits(255, 400))
    outcome = {"status": 200}
except RequestError as error:
    outcome = {"status": error.status, "code": error.code, "field": error.field}
outcome["seconds"] = time.perf_counter() - started
print(json.dumps(outcome))
"""


def _admit_in_subprocess(raw: bytes, tmp_path) -> dict:
    path = tmp_path / "body.json"
    path.write_bytes(raw)
    try:
        done = subprocess.run([sys.executable, "-c", ADMIT, str(path)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"parsing and validating {len(raw)} bytes did not finish within 60 s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
def test_each_hostile_shape_at_one_mib_is_refused_within_a_second_naming_the_field(shape, tmp_path):
    raw = shape(MIB)
    assert MIB - 16 <= len(raw) <= MIB
    outcome = _admit_in_subprocess(raw, tmp_path)
    status, code, field = EXPECTED[shape]
    assert (outcome["status"], outcome["code"]) == (status, code), outcome
    assert outcome["field"].startswith(field), outcome
    assert outcome["seconds"] < 1.0, outcome


def test_a_valid_deep_body_parses_without_copying_a_path_per_value():
    """98 levels of arrays around 130,000 strings (just under the value cap), with one escaped surrogate
    pair so that the string walk runs: its memory stays a small multiple of the body."""
    from semif.serving.http.body import parse_json

    raw = b"[" * 98 + b'"\\ud83d\\ude00",' + b'"",' * 129_999 + b'""' + b"]" * 98
    tracemalloc.start()
    try:
        body = parse_json(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    inner = body
    for _ in range(97):
        inner = inner[0]
    assert len(inner) == 130_001 and inner[0] == "😀"
    assert peak < 16 * MIB, f"peak {peak / MIB:.1f} MiB of Python allocations for a {len(raw) / MIB:.2f} MiB body"


def test_a_lone_surrogate_deep_in_a_large_body_is_named_by_its_path():
    from semif.serving.http.body import parse_json
    from semif.serving.contracts.base import RequestError

    items = ",".join(['""'] * 5000 + ['{"k":["ok","\\ud800"]}'])
    with pytest.raises(RequestError) as refused:
        parse_json(('{"state":[' + items + "]}").encode())
    assert (refused.value.code, refused.value.field) == ("invalid_unicode", "state[5000].k[1]")


def test_the_value_cap_counts_scalars_and_containers_and_names_where_it_was_passed():
    from semif.serving.http.body import parse_json
    from semif.serving.contracts.base import RequestError

    # body, a, b (3), the list (4), its two items: 6 values; keys are not counted.
    assert parse_json(b'{"a": 1, "b": {"c": [true, null]}}', max_values=6) == {"a": 1, "b": {"c": [True, None]}}
    with pytest.raises(RequestError) as refused:
        parse_json(b'{"a": 1, "b": {"c": [true, null]}}', max_values=5)
    assert (refused.value.status, refused.value.code, refused.value.field) == (413, "too_many_values", "b.c[1]")
    # Empty containers hold nothing; whitespace does not change the count.
    assert parse_json(b"[ [ ] , { } , [\n] ]", max_values=4) == [[], {}, []]


def test_structure_pass_ignores_brackets_and_commas_inside_strings():
    from semif.serving.http.body import check_structure

    check_structure('["' + "[" * 500 + '", "\\"[,,,:{"]', max_depth=2, max_values=3)


def test_object_state_rendered_past_the_cap_is_refused_413_naming_the_field():
    from semif.serving.contracts import openai_decisions, systemone
    from semif.serving.contracts.base import Limits, RequestError

    state = {"a": [{"b": ["x" * 10] * 50}] * 20}
    limits = Limits(255, 400, max_state_chars=len(json.dumps(state, ensure_ascii=False, indent=2)))
    question = {"q": {"type": "noul", "instructions": "Urgent?"}}
    job = systemone.parse({"state": state, "questions": question}, limits)
    assert job.state_text == json.dumps(state, ensure_ascii=False, indent=2)
    # One character more than the budget holds, from an instruction object: the request's texts share it.
    more = {"q": {"type": "noul", "instructions": {"i": 1}}}
    with pytest.raises(RequestError) as refused:
        systemone.parse({"state": state, "questions": more}, limits)
    assert (refused.value.status, refused.value.code, refused.value.field) == (413, "json_text_too_large", "questions.q.instructions")
    with pytest.raises(RequestError) as refused:
        systemone.parse({"state": [state, state], "questions": question}, limits)
    assert (refused.value.status, refused.value.field) == (413, "state")
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_json", "data": [state, state]}]}],
            "questions": [{"type": "predicate", "instructions": "Urgent?"}]}
    with pytest.raises(RequestError) as refused:
        openai_decisions.parse(body, limits)
    assert (refused.value.status, refused.value.field) == (413, "input[0].content[0].data")


def test_body_reservations_share_one_budget_and_give_it_back():
    from semif.serving.http.body import BodyBudget, BodyBudgetExceeded

    budget = BodyBudget(100)
    first, second = budget.reservation(), budget.reservation()
    first.grow_to(60)
    first.grow_to(40)  # never shrinks while held
    with pytest.raises(BodyBudgetExceeded) as refused:
        second.grow_to(41)
    assert refused.value.status == 503 and budget.in_use == 60
    second.grow_to(40)
    first.release()
    second.grow_to(100)
    second.release()
    assert budget.in_use == 0


def test_json_lines_records_are_parsed_in_bounded_chunks():
    from semif.serving.http.jsonlines import parse_chunk

    lines = [b'{"a": %d}' % i for i in range(100)] + [b"{bad", b'{"a": "\\ud800"}']
    chunk = parse_chunk(lines, 0, chunk_bytes=64)
    assert [body for body, _ in chunk] == [{"a": i} for i in range(len(chunk))]
    weighed = [len(line) + 1 for line in lines]  # a line weighs its newline too
    assert sum(weighed[:len(chunk)]) <= 64 < sum(weighed[:len(chunk) + 1])
    empties = parse_chunk([b""] * 1000, 0, chunk_bytes=64)  # empty lines are chunked, not taken whole
    assert len(empties) == 64 and {error.code for _, error in empties} == {"invalid_json"}
    rest = parse_chunk(lines, 100, chunk_bytes=1 << 20)
    assert [error.code for _, error in rest] == ["invalid_json", "invalid_unicode"]
    assert "line 102" in str(rest[1][1])
    assert len(parse_chunk([b"x" * 100], 0, chunk_bytes=10)) == 1  # one line, however long


# --- against the real `serve` process ---------------------------------------------------------------


def _serve(tmp_path, **env) -> ServeProcess:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    base.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_MODEL_PATH=str(embedded_model()),
                SEMIF_MODEL_DIR=str(tmp_path / "no-model-dir"), SEMIF_N_THREADS="1")
    base.update({k: str(v) for k, v in env.items()})
    return ServeProcess(base, port, tmp_path / f"serve-{port}.log").wait_ready()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = _serve(tmp_path_factory.mktemp("body-limits"))
    yield proc
    proc.stop()


class PingWatch:
    """Polls /ping from a second thread; ``worst`` is the slowest answer (or a failure) seen."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    status = client.get("/ping").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.02)

    def __enter__(self) -> "PingWatch":
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        time.sleep(0.1)
        self._stop.set()
        self._thread.join(10)

    @property
    def worst(self) -> float:
        return max(self.latencies)


@pytest.mark.reliability
@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
def test_hostile_body_at_the_limit_never_stalls_ping_and_is_refused_naming_the_field(server, shape):
    raw = shape(MIB)
    with PingWatch(server.base_url) as ping, httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        started = time.perf_counter()
        response = client.post("/invocations", content=raw, headers={"content-type": "application/json"})
        refused_s = time.perf_counter() - started
    status, code, field = EXPECTED[shape]
    assert response.status_code == status, response.text[:500]
    error = response.json()
    error = error["error"] if "error" in error else error["detail"]  # SemIf or System One shape
    assert error["code"] == code and error["field"].startswith(field), error
    assert not ping.failures, ping.failures[:3]
    assert len(ping.latencies) >= 3 and ping.worst < PING_BOUND_S, f"slowest /ping {ping.worst:.2f} s"
    assert refused_s < 5.0
    after = httpx.post(server.base_url + "/invocations", json=DECISION, timeout=60.0)
    assert after.status_code == 200 and after.json()["choice"] in ("billing", "shipping")


@pytest.mark.reliability
def test_hostile_json_lines_record_is_parsed_off_the_event_loop_and_its_neighbour_answers(server):
    good = json.dumps(DECISION).encode()
    raw = escaped_quotes(MIB - len(good) - 2) + b"\n" + good + b"\n"
    assert len(raw) <= MIB
    with PingWatch(server.base_url) as ping:
        response = httpx.post(server.base_url + "/invocations", content=raw, timeout=120.0,
                              headers={"content-type": "application/jsonlines"})
    assert response.status_code == 200, response.text[:500]
    first, second = [json.loads(line) for line in response.text.splitlines()]
    assert first["error"]["code"] == "invalid_json" and "line 1" in first["error"]["message"]
    assert second["choice"] in ("billing", "shipping")
    assert not ping.failures and ping.worst < PING_BOUND_S, f"slowest /ping {ping.worst:.2f} s"


@pytest.mark.reliability
def test_a_mini_batch_of_empty_lines_at_the_limit_is_refused_413_while_ping_answers(server):
    # A million empty lines: each would be a record with an error line of its own.
    raw = b"\n" * MIB
    with PingWatch(server.base_url) as ping:
        started = time.perf_counter()
        response = httpx.post(server.base_url + "/invocations", content=raw, timeout=120.0,
                              headers={"content-type": "application/jsonlines"})
        refused_s = time.perf_counter() - started
    assert response.status_code == 413, response.text[:500]
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("too_many_records", "<body>") and "SEMIF_MAX_JSONL_RECORDS" in error["message"]
    assert refused_s < 5.0 and len(response.content) < 1024
    assert not ping.failures and len(ping.latencies) >= 3 and ping.worst < PING_BOUND_S, f"slowest /ping {ping.worst:.2f} s"
    good = json.dumps(DECISION).encode() + b"\n"
    after = httpx.post(server.base_url + "/invocations", content=good * 3, timeout=120.0,
                       headers={"content-type": "application/jsonlines"})
    assert after.status_code == 200, after.text[:500]
    assert [json.loads(line)["choice"] in ("billing", "shipping") for line in after.text.splitlines()] == [True] * 3


@pytest.mark.reliability
def test_many_refused_lines_under_a_raised_record_cap_never_stall_ping(tmp_path):
    # Under the cap every line is answered (an error line each): the loop must still turn between
    # lines that never wait for the model, and the answer is serialised off the loop.
    records = 200_000
    proc = _serve(tmp_path, SEMIF_MAX_JSONL_RECORDS=records)
    try:
        good = json.dumps(DECISION).encode()
        raw = b"\n" * (records - 1) + good + b"\n"
        with PingWatch(proc.base_url) as ping:
            response = httpx.post(proc.base_url + "/invocations", content=raw, timeout=300.0,
                                  headers={"content-type": "application/jsonlines"})
        assert response.status_code == 200, response.text[:500]
        lines = response.text.splitlines()
        assert len(lines) == records
        assert json.loads(lines[0])["error"]["code"] == "invalid_json" and "line 1 " in json.loads(lines[0])["error"]["message"]
        assert json.loads(lines[-1])["choice"] in ("billing", "shipping")
        assert not ping.failures and len(ping.latencies) >= 3 and ping.worst < PING_BOUND_S, f"slowest /ping {ping.worst:.2f} s"
    finally:
        proc.stop()


def _status_and_headers(answer: bytes) -> tuple[int, str]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    return int(head.split()[1]), head.lower()


@pytest.mark.reliability
def test_bodies_past_the_byte_budget_get_503_with_retry_after_until_the_budget_is_given_back(tmp_path):
    limit = 64 << 10
    proc = _serve(tmp_path, SEMIF_MAX_BODY_BYTES=limit, SEMIF_BODY_BUDGET_BYTES=limit, SEMIF_RETRY_AFTER_S=2)
    try:
        body = json.dumps(DECISION).encode()
        padded = body + b" " * (60_000 - len(body))
        head = (f"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(padded)}\r\nConnection: close\r\n\r\n").encode()
        slow = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
        slow.sendall(head + padded[:59_000])  # 59,000 bytes in flight, the last 1,000 held back
        time.sleep(0.5)
        second = body + b" " * (10_000 - len(body))  # 59,000 + 10,000 > 65,536
        refused = httpx.post(proc.base_url + "/invocations", content=second, timeout=30.0,
                             headers={"content-type": "application/json"})
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "overloaded"
        assert "SEMIF_BODY_BUDGET_BYTES" in refused.json()["error"]["message"]
        assert httpx.get(proc.base_url + "/ping", timeout=5.0).status_code == 200
        slow.sendall(padded[59_000:])
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
        slow.close()
        assert _status_and_headers(answer)[0] == 200
        # Given back: the same request is read now, and a refused one leaves nothing held either.
        for _ in range(3):
            again = httpx.post(proc.base_url + "/invocations", content=second, timeout=30.0,
                               headers={"content-type": "application/json"})
            assert again.status_code == 200, again.text
    finally:
        proc.stop()


@pytest.mark.reliability
def test_sockets_that_declare_bodies_and_send_nothing_hold_no_budget(tmp_path):
    # Four sockets each declare a body at the limit (together the whole budget) and send one byte:
    # only the bytes that arrived count, so a decision posted meanwhile is read and answered.
    proc = _serve(tmp_path, SEMIF_MAX_BODY_BYTES=MIB, SEMIF_BODY_BUDGET_BYTES=4 * MIB)
    idle = []
    try:
        head = (f"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {MIB}\r\n\r\n{{").encode()
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
            sock.sendall(head)
            idle.append(sock)
        time.sleep(0.5)
        for _ in range(2):
            answer = httpx.post(proc.base_url + "/invocations", json=DECISION, timeout=60.0)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choice"] in ("billing", "shipping")
    finally:
        for sock in idle:
            sock.close()
        proc.stop()


def test_body_settings_default_to_four_bodies_and_the_budget_must_hold_one_body():
    from semif.serving.config import Settings, SettingsError

    env = {"SEMIF_MODEL_PATH": str(embedded_model())}
    settings = Settings.from_env(env)
    assert (settings.body_budget_bytes, settings.max_json_values, settings.max_state_chars) == (4 << 20, 131072, 2 << 20)
    assert Settings.from_env({**env, "SEMIF_MAX_BODY_BYTES": "4096"}).body_budget_bytes == 16384
    with pytest.raises(SettingsError, match="SEMIF_BODY_BUDGET_BYTES"):
        Settings.from_env({**env, "SEMIF_MAX_BODY_BYTES": "4096", "SEMIF_BODY_BUDGET_BYTES": "4095"})
