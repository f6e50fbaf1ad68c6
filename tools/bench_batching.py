#!/usr/bin/env python3
"""Several sequences per decode (SEMIF_BATCHING): throughput and drift, batched vs serial, in one run.

    .venv/bin/python tools/bench_batching.py                       # throughput (HTTP) + drift, embedded model
    nice -n 5 .venv/bin/python tools/bench_batching.py --skip-throughput \\
        --drift-model ~/.cache/semif/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --drift-decisions 12

Throughput: the real `serve` process is started twice on the same model and threads, once serial (the
default) and once with SEMIF_BATCHING=1 SEMIF_N_SEQ=N; at each client count (default 1, 4, 16) the
same distinct single-decision requests go through HTTP from that many concurrent clients, in two halves
sent serial, batched, batched, serial (so a drift in the VM's speed weighs on both modes alike). The label
memo is off in both, so every answer is computed. Printed: decisions/s, p50, p95, and batched/serial
ratios from this run.

Drift through HTTP (--drift-http): the drift a client sees. A serial `serve` (the default) answers a
mixed workload once: single and multi-question requests (2-3 questions on one state, each with its own
option set), states and option sets from data/decisions-sample.jsonl and data/decisions-dev.jsonl, and a
share of requests the batch cannot decode (debias "reverse", the injection check), which a batching
server runs alone on its serial path. A `serve` with SEMIF_BATCHING=1 (default SEMIF_N_SEQ unless
--n-seq) then answers the same requests in --rounds rounds, each in another order, from --drift-clients
concurrent clients, so that each request shares its steps with different ones. Every answer is
compared with the serial one: max, mean, p50/p95/p99 of |Δp| over all probabilities, how many top
choices changed, and how many requests shared a step (each request's batch_requests, from the server's
log). Written as it goes to --out (default results/bench-batching-drift-http.json) with the command,
date and commit; a progress line at every few answers.

    nohup nice -n 5 .venv/bin/python tools/bench_batching.py --drift-http --threads 1 > drift-http.log 2>&1 &

On a few shared cores give llama.cpp one thread (--threads 1): with more threads than free cores its
threads spin while they wait for each other (here 2 threads took 5× the time of 1 under load).

Drift: one engine whose context has N sequences answers each sample decision serially (Engine.execute
from an emptied context: bit-equal to the default one-sequence context, tests/test_batching.py proves
it) and batched (execute_batch, N decisions with different states per decode). Printed: max and mean
|Δp| over all outcome probabilities, and how often the top choice agrees. Figures go in
docs/benchmarks.md ("Batching").
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
SAMPLE = REPO / "data" / "decisions-sample.jsonl"
DEV = REPO / "data" / "decisions-dev.jsonl"
HTTP_DRIFT_OUT = REPO / "results" / "bench-batching-drift-http.json"


def sample_decisions(limit: int | None = None) -> list[dict]:
    rows = read_jsonl(SAMPLE)
    return rows[:limit] if limit else rows


def request_body(row: dict, i: int) -> dict:
    """One SemIf decision; the ticket number makes every state distinct (nothing reused across requests
    but the template head, in both modes alike)."""
    return {"decision": {"id": f"{row['id']}-{i}", "state": f"Ticket {i}. {row['state']}",
                         "question": row["question"], "options": row["options"]}}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_clients(server, bodies: list[dict], clients: int) -> tuple[float, list[float]]:
    """Send ``bodies`` from ``clients`` concurrent HTTP clients; (wall seconds, per-request ms)."""
    import httpx

    chunks = [bodies[c::clients] for c in range(clients)]

    def client(chunk):
        out = []
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as http:
            for body in chunk:
                started = time.perf_counter()
                response = http.post("/invocations", json=body)
                out.append((time.perf_counter() - started) * 1000)
                if response.status_code != 200:
                    raise SystemExit(f"/invocations answered {response.status_code}: {response.text[:300]}")
        return out

    started = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=clients) as pool:
        latencies = [ms for chunk in pool.map(client, chunks) for ms in chunk]
    return time.perf_counter() - started, latencies


def throughput(args) -> list[dict]:
    """Both servers run at once (the idle one waits on its socket); at each client count the requests are
    split in two halves sent serial, batched, batched, serial, so a VM whose speed drifts over the run
    (this one moves by ~10% in minutes) weighs on both modes alike."""
    from bench_server import BenchServer

    rows = sample_decisions()
    servers = {}
    try:
        for mode in ("serial", "batched"):
            # Content-free calibration on both servers: the server default (reverse) reads two orders, which the
            # batched path leaves to the serial one, so it would measure no batching at all.
            env = dict(SEMIF_DEBIAS="content_free", SEMIF_LABEL_MEMO=0, SEMIF_MAX_QUEUE=max(args.clients) + 4, SEMIF_N_CTX=args.n_ctx,
                       SEMIF_N_THREADS=args.threads, SEMIF_QUEUE_TIMEOUT_S=600, SEMIF_REQUEST_DEADLINE_S=600)
            if mode == "batched":
                env.update(SEMIF_BATCHING=1, SEMIF_N_SEQ=args.n_seq)
            servers[mode] = BenchServer(Path(args.model) if args.model else None, **env)
            run_clients(servers[mode], [request_body(rows[0], -1), request_body(rows[1], -2)], 1)  # warm-up
        table = []
        for clients in args.clients:
            bodies = [request_body(rows[i % len(rows)], 1000 * clients + i) for i in range(args.requests)]
            halves = (bodies[: len(bodies) // 2], bodies[len(bodies) // 2 :])
            walls = {"serial": 0.0, "batched": 0.0}
            latencies: dict[str, list[float]] = {"serial": [], "batched": []}
            for mode, half in (("serial", 0), ("batched", 0), ("batched", 1), ("serial", 1)):
                wall, ms = run_clients(servers[mode], halves[half], clients)
                walls[mode] += wall
                latencies[mode] += ms
            for mode in ("serial", "batched"):
                entry = dict(mode=mode, clients=clients, requests=len(bodies), decisions_per_s=len(bodies) / walls[mode],
                             p50_ms=percentile(latencies[mode], 50), p95_ms=percentile(latencies[mode], 95))
                table.append(entry)
                print(f"{mode:8s} clients={clients:3d}  {entry['decisions_per_s']:7.2f} decisions/s  "
                      f"p50 {entry['p50_ms']:8.0f} ms  p95 {entry['p95_ms']:8.0f} ms", flush=True)
    finally:
        for server in servers.values():
            server.close()
    print("\n| clients | serial dec/s | batched dec/s | ratio | serial p50 / p95 ms | batched p50 / p95 ms |")
    print("|---|---|---|---|---|---|")
    for clients in args.clients:
        s = next(e for e in table if e["mode"] == "serial" and e["clients"] == clients)
        b = next(e for e in table if e["mode"] == "batched" and e["clients"] == clients)
        print(f"| {clients} | {s['decisions_per_s']:.2f} | {b['decisions_per_s']:.2f} | "
              f"{b['decisions_per_s'] / s['decisions_per_s']:.2f}× | {s['p50_ms']:.0f} / {s['p95_ms']:.0f} | "
              f"{b['p50_ms']:.0f} / {b['p95_ms']:.0f} |")
    return table


def drift(model: Path, args) -> dict:
    from semif.serving.engine.batching import execute_batch
    from semif.serving.engine.context import Engine
    from semif.serving.engine.prompt import Outcome, Question

    engine = Engine(model, n_ctx=args.n_ctx, n_threads=args.threads, label_memo=False, n_seq=args.n_seq)
    try:
        rows = sample_decisions(args.drift_decisions)
        plans = [engine.plan(r["state"], [Question(r["question"], tuple(Outcome(o["id"], o.get("description")) for o in r["options"]))])
                 for r in rows]
        serial = []
        for k, plan in enumerate(plans):
            engine.invalidate()
            serial.append(engine.execute(plan).distributions[0].probabilities)
            print(f"\r  serial {k + 1}/{len(plans)}", end="", flush=True)
        batched = []
        for start in range(0, len(plans), args.n_seq):
            engine.invalidate()
            batched += [r.distributions[0].probabilities for r in execute_batch(engine, plans[start : start + args.n_seq])]
            print(f"\r  batched {len(batched)}/{len(plans)}  ", end="", flush=True)
        print()
        deltas = [np.abs(np.subtract(a, b)) for a, b in zip(serial, batched)]
        agree = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(serial, batched))
        entry = dict(model=model.name, decisions=len(plans), n_seq=args.n_seq,
                     max_abs_dp=float(max(d.max() for d in deltas)), mean_abs_dp=float(np.mean(np.concatenate(deltas))),
                     top_agree=agree)
        print(f"| {entry['model']} | {entry['decisions']} | {args.n_seq} | {entry['max_abs_dp']:.4f} | "
              f"{entry['mean_abs_dp']:.4f} | {agree}/{len(plans)} |", flush=True)
        return entry
    finally:
        engine.close()


# ---- drift through HTTP, under concurrent mixed traffic ---------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    # Records end at "\n" only: a state may hold U+2028, which str.splitlines() would split on.
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def mixed_workload(limit: int, *, seed: int, multi_share: float, serial_share: float) -> list[dict]:
    """``limit`` SemIf requests: single decisions, and multi-question ones (this row's state and question
    plus 1-2 other rows' questions with their own option sets); a ``serial_share`` of them asks for
    debias "reverse" or the injection check, which a batching server cannot decode with others. Each
    entry: {"kind": "single" | "multi" | "serial_path", "body": ...}."""
    rows = read_jsonl(SAMPLE) + read_jsonl(DEV)
    rng = random.Random(seed)
    rng.shuffle(rows)
    workload = []
    for k in range(limit):
        row = rows[k % len(rows)]
        decision = {"id": row["id"], "question": row["question"], "options": row["options"]}
        if rng.random() < multi_share:
            others = [r for r in rng.sample(rows, 4) if r["question"] != row["question"]][: rng.choice((1, 2))]
            body = {"state": row["state"], "decisions": [decision] + [
                {"id": f"{r['id']}-q{n + 1}", "question": r["question"], "options": r["options"]} for n, r in enumerate(others)]}
            kind = "multi"
        else:
            body = {"decision": {**decision, "state": row["state"]}}
            kind = "single"
        if rng.random() < serial_share:
            body.update({"debias": "reverse"} if len(workload) % 2 else {"injection_check": True})
            kind = "serial_path"
        workload.append({"kind": kind, "body": body})
    return workload


def decision_answers(answer: dict) -> list[dict]:
    return answer["results"] if "results" in answer else [answer]


def post_answer(http, body: dict, request_id: str) -> dict:
    response = http.post("/invocations", json=body, headers={"x-request-id": request_id})
    if response.status_code != 200:
        raise SystemExit(f"/invocations answered {response.status_code}: {response.text[:500]}")
    return response.json()


def command_line() -> str:
    """This run's command as typed from the repository root, its niceness included."""
    python = Path(sys.executable)
    python = python.relative_to(REPO).as_posix() if python.is_relative_to(REPO) else str(python)
    niceness = os.nice(0)
    return (f"nice -n {niceness} " if niceness else "") + shlex.join([python, *sys.argv])


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def uncommitted_sources() -> list[str]:
    """Adapter sources that differ from the commit: what was measured is the working tree."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "container/semif"], cwd=REPO, capture_output=True, text=True).stdout
    return sorted(line[3:] for line in out.splitlines())


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def drift_summary(records: list[dict], deltas: list[float]) -> dict:
    if not records:
        return {"answers": 0}
    d = np.asarray(deltas)
    per_decision = [r["max_abs_dp"] for r in records]
    changed = [r for r in records if r["top_changed"]]
    return dict(
        answers=len(records), probabilities=int(d.size),
        max_abs_dp=float(d.max()), mean_abs_dp=float(d.mean()),
        p50_abs_dp=percentile(deltas, 50), p95_abs_dp=percentile(deltas, 95), p99_abs_dp=percentile(deltas, 99),
        decision_max_abs_dp_p95=percentile(per_decision, 95), decision_max_abs_dp_p99=percentile(per_decision, 99),
        max_abs_dlogit=float(max(r["max_abs_dlogit"] for r in records)),
        top_changed=len(changed), decisions_with_top_changed=len({(r["request"], r["decision"]) for r in changed}),
        top_changed_serial_margin_max=max((r["serial_margin"] for r in changed), default=None),
    )


def drift_http(args) -> dict:
    """Serial answers once, then --rounds rounds of the same requests through a batching server from
    concurrent clients; every batched answer compared with its serial one."""
    from bench_server import BenchServer

    out = Path(args.out)
    workload = mixed_workload(args.limit, seed=args.seed, multi_share=args.multi_share, serial_share=args.serial_share)
    started = time.perf_counter()
    report: dict = {
        "what": "batched (SEMIF_BATCHING=1) vs serial answers through HTTP under concurrent mixed traffic",
        "command": command_line(),
        "date": subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip(),
        "commit": git_commit(), "uncommitted_sources": uncommitted_sources(),
        "host": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load": os.getloadavg()[0]},
        "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "settings": {"clients": args.drift_clients, "rounds": args.rounds, "requests": len(workload), "seed": args.seed,
                     "multi_share": args.multi_share, "serial_share": args.serial_share, "threads": args.threads,
                     "n_seq": args.n_seq or "default"},
        "workload": {kind: sum(w["kind"] == kind for w in workload) for kind in ("single", "multi", "serial_path")},
        "status": "serial answers",
    }
    report["workload"]["questions"] = sum(len(w["body"].get("decisions", [None])) for w in workload)
    write_json(out, report)
    model = Path(args.model) if args.model else None
    common = dict(SEMIF_DEBIAS="content_free", SEMIF_MAX_QUEUE=args.drift_clients + 4, SEMIF_QUEUE_TIMEOUT_S=600, SEMIF_REQUEST_DEADLINE_S=600,
                  SEMIF_N_THREADS=args.threads, SEMIF_LOG_LEVEL="INFO")
    logs = Path(tempfile.mkdtemp(prefix="bench-batching-"))

    # 1. The serial server answers every request once (its answers do not depend on traffic or order).
    serial: list[dict] = []
    server = BenchServer(model, log_path=logs / "serial.log", **common)
    try:
        for k, entry in enumerate(workload):
            serial.append(post_answer(server.http, entry["body"], f"serial-{k}"))
            if (k + 1) % max(1, len(workload) // 10) == 0 or k + 1 == len(workload):
                print(f"serial {k + 1}/{len(workload)}  {time.perf_counter() - started:.0f} s", flush=True)
        # The serial path is exact: a repeat, after other traffic and in another order, must be equal.
        repeat = list(range(min(8, len(workload))))[::-1]
        report["serial_repeat_max_abs_dp"] = max(
            float(np.max(np.abs(np.subtract(a["probabilities"], b["probabilities"]))))
            for k in repeat
            for a, b in zip(decision_answers(post_answer(server.http, workload[k]["body"], f"repeat-{k}")), decision_answers(serial[k]))
        )
    finally:
        server.close()

    # 2. The batching server answers them in rounds, each in another order, from concurrent clients.
    env = dict(common, SEMIF_BATCHING=1)
    if args.n_seq:
        env["SEMIF_N_SEQ"] = args.n_seq
    server = BenchServer(model, log_path=logs / "batched.log", **env)
    records: list[dict] = []
    deltas: dict[str, list[float]] = {"batched": [], "serial_path": []}
    done = 0
    total = args.rounds * len(workload)
    lock = threading.Lock()

    def progress(final: bool = False) -> None:
        batchable = [r for r in records if r["kind"] != "serial_path"]
        report["batched"] = drift_summary(batchable, deltas["batched"])
        report["serial_path"] = drift_summary([r for r in records if r["kind"] == "serial_path"], deltas["serial_path"])
        report["by_kind"] = {kind: drift_summary([r for r in records if r["kind"] == kind],
                                                 [d for r in records if r["kind"] == kind for d in r["abs_dp"]])
                             for kind in ("single", "multi")}
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        report["answers"] = [{k: v for k, v in r.items() if k != "abs_dp"} for r in records]
        write_json(out, report)
        b = report["batched"]
        if b.get("answers"):
            print(f"batched {done}/{total} requests  answers {b['answers']}  max|Δp| {b['max_abs_dp']:.4f}  "
                  f"p99 {b['p99_abs_dp']:.4f}  top changed {b['top_changed']}  {report['elapsed_s']:.0f} s", flush=True)

    def client(queue: list, round_: int) -> None:
        import httpx

        nonlocal done
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    k = queue.pop()
                answer = post_answer(http, workload[k]["body"], f"r{round_}-{k}")
                with lock:
                    for got, want in zip(decision_answers(answer), decision_answers(serial[k]), strict=True):
                        assert got["id"] == want["id"] and got["option_ids"] == want["option_ids"]
                        dp = np.abs(np.subtract(got["probabilities"], want["probabilities"]))
                        ranked = sorted(want["probabilities"], reverse=True)
                        kind = workload[k]["kind"]
                        deltas["serial_path" if kind == "serial_path" else "batched"].extend(dp.tolist())
                        records.append(dict(round=round_, request=k, kind=kind, decision=got["id"], request_id=answer["request_id"],
                                            max_abs_dp=float(dp.max()), abs_dp=dp.tolist(),
                                            max_abs_dlogit=float(np.max(np.abs(np.subtract(got["option_logits"], want["option_logits"])))),
                                            top_changed=got["choice"] != want["choice"], serial_margin=ranked[0] - ranked[1]))
                    done += 1
                    if done % max(1, total // 40) == 0:
                        progress()

    try:
        report["status"] = "batched rounds"
        for round_ in range(args.rounds):
            order = list(range(len(workload)))
            random.Random(args.seed * 1000 + round_).shuffle(order)
            with cf.ThreadPoolExecutor(max_workers=args.drift_clients) as pool:
                list(pool.map(lambda _: client(order, round_), range(args.drift_clients)))
            shared = {}
            for line in (logs / "batched.log").read_text(errors="replace").splitlines():
                try:
                    logged = json.loads(line)
                except ValueError:
                    continue
                if logged.get("message") == "request" and "batch_requests" in logged:
                    shared[logged["request_id"]] = logged["batch_requests"]
                if logged.get("message") == "model loaded":
                    report["server_n_seq"] = logged.get("n_seq")
            for r in records:
                r["batch_requests"] = shared.get(r["request_id"])
            requests_shared = {r["request_id"] for r in records if (r["batch_requests"] or 1) > 1}
            report["requests_that_shared_a_step"] = len(requests_shared)
            report["requests_answered"] = len({r["request_id"] for r in records})
            report["status"] = f"round {round_ + 1}/{args.rounds} done"
            progress()
    finally:
        server.close()
    report["status"] = "done"
    progress()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF for the throughput runs (default: the embedded SmolLM2-135M)")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts")
    parser.add_argument("--requests", type=int, default=32, help="single-decision requests per client count and mode (two halves each)")
    parser.add_argument("--n-seq", type=int, help="SEMIF_N_SEQ of the batched runs (default 4; --drift-http: the server's default)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (SEMIF_N_THREADS)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context of the throughput and engine drift runs (--drift-http: the server's default)")
    parser.add_argument("--drift-model", action="append", default=[], help="GGUF to measure drift on (repeatable; default: the embedded model)")
    parser.add_argument("--drift-decisions", type=int, default=0, help="sample decisions for the drift table (0: all)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-drift", action="store_true")
    parser.add_argument("--json", help="write every figure to this file")
    http = parser.add_argument_group("drift through HTTP under concurrent mixed traffic")
    http.add_argument("--drift-http", action="store_true", help="run this measurement only")
    http.add_argument("--limit", type=int, default=64, help="distinct requests (default 64: about 17 min on 2 loaded cores)")
    http.add_argument("--rounds", type=int, default=3, help="times the batching server answers each request, in another order")
    http.add_argument("--drift-clients", type=int, default=8, help="concurrent clients")
    http.add_argument("--multi-share", type=float, default=0.35, help="share of multi-question requests")
    http.add_argument("--serial-share", type=float, default=0.1,
                      help='share of requests the batch cannot decode (debias "reverse", injection check)')
    http.add_argument("--seed", type=int, default=0)
    http.add_argument("--out", default=str(HTTP_DRIFT_OUT.relative_to(REPO)), help="JSON written as the run goes")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.2f}; "
          f"threads {args.threads}, n_seq {args.n_seq or 'default'}"
          + ("" if args.drift_http else f", n_ctx {args.n_ctx}"), flush=True)
    if args.drift_http:
        report = drift_http(args)
        print(json.dumps({k: report[k] for k in ("batched", "serial_path", "serial_repeat_max_abs_dp",
                                                 "requests_that_shared_a_step", "requests_answered")}, indent=1))
        return 0
    args.n_seq = args.n_seq or 4
    report: dict = {"load": load, "threads": args.threads, "n_seq": args.n_seq}
    if not args.skip_throughput:
        report["throughput"] = throughput(args)
    if not args.skip_drift:
        from semif.serving.config import embedded_model_path

        models = [Path(m).expanduser() for m in args.drift_model] or [embedded_model_path()]
        print("\n| model | decisions | n_seq | max abs Δp | mean abs Δp | top choice agrees |")
        print("|---|---|---|---|---|---|")
        report["drift"] = [drift(m, args) for m in models]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
