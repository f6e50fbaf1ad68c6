#!/usr/bin/env python3
"""Soak the real `serve` process: concurrent clients against a small queue, optionally with chat
completions interleaved, and report throughput, 503 rate, latency percentiles, /ping latency and
RSS. Every 200 is checked against the same request answered serially (|Δp| ≤ 1e-6).

    .venv/bin/python tools/soak.py --clients 16 --requests 2000 --max-queue 2 --chat-every 10

Starts `serve` on a free loopback port with the embedded model unless --url is given.
Figures from runs are recorded in docs/explanation/reliability.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

OPTIONS = [{"id": "account_access"}, {"id": "billing"}, {"id": "shipping"}]
MESSAGES = [{"role": "user", "content": "My parcel is late. What can I do?"}]


def decision(i: int) -> dict:
    return {"decision": {"id": f"d{i}", "state": f"Ticket {i}: the customer was charged twice.", "question": "Which queue?", "options": OPTIONS}}


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(args) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_MAX_QUEUE=str(args.max_queue), SEMIF_N_CTX="2048")
    if args.model:
        env["SEMIF_MODEL_PATH"] = args.model
    if args.threads:
        env["SEMIF_N_THREADS"] = str(args.threads)
    log_path = Path(tempfile.mkstemp(prefix="soak-serve-", suffix=".log")[1])
    serve = Path(sys.executable).with_name("serve")
    proc = subprocess.Popen([str(serve), "serve"], env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/ping", timeout=1).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"serve did not become ready; see {log_path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running adapter (skips starting serve; no RSS figures)")
    parser.add_argument("--model", help="GGUF for the started serve (default: the embedded model)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="total requests over all clients")
    parser.add_argument("--max-queue", type=int, default=2)
    parser.add_argument("--distinct", type=int, default=16, help="distinct decision bodies")
    parser.add_argument("--chat-every", type=int, default=0, help="every Nth request is a chat completion (0: none)")
    parser.add_argument("--chat-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, help="SEMIF_N_THREADS for the started serve (default: all CPUs)")
    parser.add_argument("--backoff", action="store_true", help="after a 503, wait Retry-After × U(0.5, 1) before the next request")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()

    proc, log_path = None, None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url, log_path = start_serve(args)
    bodies = [decision(i) for i in range(args.distinct)]
    chat_body = {"messages": MESSAGES, "max_tokens": args.chat_tokens, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        serial = [http.post(url + "/invocations", json=b).json()["probabilities"] for b in bodies]
        serial_chat = http.post(url + "/v1/chat/completions", json=chat_body).json()["choices"][0]["message"]["content"] if args.chat_every else None
    rss_start = rss_mib(proc.pid) if proc else None

    done = threading.Event()
    ping_ms: list[float] = []
    ping_failures = 0

    def pinger():
        nonlocal ping_failures
        with httpx.Client(timeout=10) as http:
            while not done.is_set():
                started = time.perf_counter()
                if http.get(url + "/ping").status_code != 200:
                    ping_failures += 1
                ping_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(0.05)

    counter = iter(range(args.requests))
    lock = threading.Lock()
    records = []  # (kind, status, latency_ms, correct)

    def client(_):
        with httpx.Client(timeout=120) as http:
            while True:
                with lock:
                    n = next(counter, None)
                if n is None:
                    return
                is_chat = args.chat_every and n % args.chat_every == 0
                started = time.perf_counter()
                if is_chat:
                    response = http.post(url + "/v1/chat/completions", json=chat_body)
                else:
                    response = http.post(url + "/invocations", json=bodies[n % len(bodies)])
                latency = (time.perf_counter() - started) * 1000
                correct = None
                if response.status_code == 200:
                    if is_chat:
                        correct = response.json()["choices"][0]["message"]["content"] == serial_chat
                    else:
                        got = response.json()["probabilities"]
                        correct = bool(np.max(np.abs(np.subtract(got, serial[n % len(bodies)]))) <= 1e-6)
                elif response.status_code == 503:
                    correct = "retry-after" in response.headers and "error" in response.json()
                    if args.backoff and correct:
                        time.sleep(float(response.headers["retry-after"]) * random.uniform(0.5, 1.0))
                with lock:
                    records.append(("chat" if is_chat else "decision", response.status_code, latency, correct))

    started = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=args.clients + 1) as pool:
        ping_future = pool.submit(pinger)
        list(pool.map(client, range(args.clients)))
        elapsed = time.perf_counter() - started
        done.set()
        ping_future.result()
    rss_end = rss_mib(proc.pid) if proc else None

    statuses = [r[1] for r in records]
    ok = [r for r in records if r[1] == 200]
    ok_ms = np.array([r[2] for r in ok]) if ok else np.array([float("nan")])
    summary = {
        "clients": args.clients,
        "requests_sent": args.requests,
        "responses": len(records),
        "max_queue": args.max_queue,
        "chat_every": args.chat_every,
        "backoff": args.backoff,
        "threads": args.threads,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "seconds": round(elapsed, 2),
        "answered_200_per_s": round(len(ok) / elapsed, 2),
        "decisions_200_per_s": round(sum(1 for r in ok if r[0] == "decision") / elapsed, 2),
        "status_counts": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "rate_503": round(statuses.count(503) / max(len(statuses), 1), 4),
        "latency_200_ms": {"p50": round(float(np.percentile(ok_ms, 50)), 1), "p95": round(float(np.percentile(ok_ms, 95)), 1), "p99": round(float(np.percentile(ok_ms, 99)), 1)},
        "ping_ms": {"p50": round(float(np.percentile(ping_ms, 50)), 1), "p95": round(float(np.percentile(ping_ms, 95)), 1), "max": round(max(ping_ms), 1), "count": len(ping_ms), "failures": ping_failures},
        "wrong_answers": sum(1 for r in records if r[1] == 200 and not r[3]),
        "bad_503s": sum(1 for r in records if r[1] == 503 and not r[3]),
        "rss_mib": {"start": round(rss_start, 1), "end": round(rss_end, 1)} if proc else None,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    if proc:
        proc.terminate()
        summary["serve_exit_code"] = proc.wait(timeout=90)
        summary["serve_log"] = str(log_path)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    failed = summary["wrong_answers"] or summary["bad_503s"] or len(records) != args.requests or not set(statuses) <= {200, 503}
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
