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

Drift: one engine whose context has N sequences answers each sample decision serially (Engine.execute
from an emptied context: bit-equal to the default one-sequence context, tests/test_batching.py proves
it) and batched (execute_batch, N decisions with different states per decode). Printed: max and mean
|Δp| over all outcome probabilities, and how often the top choice agrees. Figures go in
docs/benchmarks.md ("Several sequences per decode").
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
SAMPLE = REPO / "data" / "decisions-sample.jsonl"


def sample_decisions(limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
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
            env = dict(SEMIF_LABEL_MEMO=0, SEMIF_MAX_QUEUE=max(args.clients) + 4, SEMIF_N_CTX=args.n_ctx,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF for the throughput runs (default: the embedded SmolLM2-135M)")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts")
    parser.add_argument("--requests", type=int, default=32, help="single-decision requests per client count and mode (two halves each)")
    parser.add_argument("--n-seq", type=int, default=4, help="SEMIF_N_SEQ of the batched runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (SEMIF_N_THREADS)")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--drift-model", action="append", default=[], help="GGUF to measure drift on (repeatable; default: the embedded model)")
    parser.add_argument("--drift-decisions", type=int, default=0, help="sample decisions for the drift table (0: all)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-drift", action="store_true")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.2f}; "
          f"threads {args.threads}, n_seq {args.n_seq}, n_ctx {args.n_ctx}", flush=True)
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
