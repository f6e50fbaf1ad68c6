#!/usr/bin/env python
"""Benchmark the JSON Lines path (SageMaker Batch Transform's mini-batches) against one request per record,
on the real `serve` process and the embedded model (or --model). Prints ratios measured in one run:

  1. distinct states: N records, each its own state (the labeled sample's tickets)
  2. shared states:   N records over N/G states, G consecutive records per state (different questions)

The two paths run in alternating rounds of G records (A B B A …), so load from other processes is shared.
For each: records/s through `POST /invocations` with `Content-Type: application/jsonlines` (mini-batches
of at most MaxPayloadInMB, as Batch Transform sends them) and through one JSON request per record, in
the same process, plus the token counts that show the prefix reuse. Each path gets its own run tag in
every state, so no path is answered from what another one left in the context or the logits memo.

usage: python tools/bench_batch.py [--model PATH] [--records 24] [--group 6] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import BenchServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "decisions-sample.jsonl"
QUESTIONS = [
    ("queue", "Which team should take this ticket?", ["hardware", "network", "software_licence", "hr"]),
    ("priority", "What priority should the ticket get?", ["low", "normal", "high", "urgent"]),
    ("sentiment", "What is the customer's sentiment?", ["positive", "neutral", "negative"]),
    ("callback", "Did the customer ask for a call back?", ["yes", "no"]),
    ("escalate", "Should a person look at this ticket today?", ["yes", "no"]),
    ("channel", "How should the agent reply?", ["email", "phone", "chat"]),
]


def record(state: str, question: tuple, tag: str) -> dict:
    qid, text, options = question
    # The tag makes every path's states its own: nothing is reused across paths.
    return {"decision": {"id": qid, "state": f"{state} [{tag}]", "question": text, "options": [{"id": o} for o in options]}}


def distinct_records(states: list[str], n: int, tag: str) -> list[dict]:
    return [record(states[i % len(states)], QUESTIONS[0], f"{tag}-{i // len(states)}") for i in range(n)]


def shared_records(states: list[str], n: int, group: int, tag: str) -> list[dict]:
    return [record(states[(i // group) % len(states)], QUESTIONS[i % group % len(QUESTIONS)], tag) for i in range(n)]


def one_request_per_record(server: BenchServer, records: list[dict]) -> dict:
    started = time.perf_counter()
    tokens = cached = evaluated = 0
    for body in records:
        _, answer = server.post("/invocations", body)
        tokens += answer["prompt"]["tokens"]
        cached += answer["prompt"]["cached_tokens"]
        evaluated += answer["prompt"]["evaluated_tokens"]
    seconds = time.perf_counter() - started
    return {"records": len(records), "seconds": seconds, "records_per_s": len(records) / seconds,
            "tokens": tokens, "cached_tokens": cached, "evaluated_tokens": evaluated}


def json_lines(server: BenchServer, records: list[dict]) -> dict:
    from semif.tools.batch import mini_batches

    max_mb = server.http.get("/execution-parameters").json()["MaxPayloadInMB"]
    lines = [json.dumps(body).encode() for body in records]
    started = time.perf_counter()
    answers = []
    for batch in mini_batches(lines, max_mb << 20):
        response = server.http.post("/invocations", content=b"\n".join(batch) + b"\n",
                                    headers={"content-type": "application/jsonlines"})
        if response.status_code != 200:
            raise SystemExit(f"JSON Lines answered {response.status_code}: {response.text[:300]}")
        answers += [json.loads(line) for line in response.text.splitlines()]
    seconds = time.perf_counter() - started
    errors = [a for a in answers if "error" in a]
    if errors or len(answers) != len(records):
        raise SystemExit(f"JSON Lines: {len(answers)} answers for {len(records)} records, errors {errors[:2]}")
    return {"records": len(records), "seconds": seconds, "records_per_s": len(records) / seconds,
            "tokens": sum(a["prompt"]["tokens"] for a in answers),
            "cached_tokens": sum(a["prompt"]["cached_tokens"] for a in answers),
            "evaluated_tokens": sum(a["prompt"]["evaluated_tokens"] for a in answers)}


def _total(parts: list[dict]) -> dict:
    total = {key: sum(part[key] for part in parts) for key in ("records", "seconds", "tokens", "cached_tokens",
                                                                "evaluated_tokens")}
    total["records_per_s"] = total["records"] / total["seconds"]
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--records", type=int, default=24)
    parser.add_argument("--group", type=int, default=6, help="consecutive records per state in the shared case")
    parser.add_argument("--threads", type=int, help="SEMIF_N_THREADS (default: the adapter's)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    states = [json.loads(line)["state"] for line in SAMPLE.read_text().splitlines() if line.strip()]
    env = {"SEMIF_N_THREADS": args.threads} if args.threads else {}
    server = BenchServer(args.model, **env)
    results: dict = {}
    try:
        # Warm-up: loads pages and fills the template head once, for both paths alike.
        server.post("/invocations", record(states[0], QUESTIONS[0], "warm-up"))
        for case, make in (("distinct_states", lambda tag: distinct_records(states, args.records, tag)),
                           ("shared_states", lambda tag: shared_records(states, args.records, args.group, tag))):
            # Rounds of `group` records, the two paths alternating A B B A …: load from other processes on the
            # machine drifts, and alternation spreads it over both paths alike.
            singles, jsonls = make(f"{case}-single"), make(f"{case}-jsonl")
            runs: dict[str, list[dict]] = {"one_request_per_record": [], "json_lines": []}
            for start in range(0, args.records, args.group):
                order = [("one_request_per_record", singles), ("json_lines", jsonls)]
                for path, records in (order if (start // args.group) % 2 == 0 else order[::-1]):
                    run = one_request_per_record if path == "one_request_per_record" else json_lines
                    runs[path].append(run(server, records[start:start + args.group]))
            results[case] = {path: _total(parts) for path, parts in runs.items()}
            results[case]["json_lines_over_single"] = (results[case]["json_lines"]["records_per_s"]
                                                       / results[case]["one_request_per_record"]["records_per_s"])
        info = server.http.get("/ping").json()
    finally:
        server.close()
    results["shared_over_distinct_json_lines"] = (results["shared_states"]["json_lines"]["records_per_s"]
                                                  / results["distinct_states"]["json_lines"]["records_per_s"])
    results["setup"] = {"model": info.get("model"), "sha256": info.get("sha256"), "records": args.records,
                        "group": args.group, "machine": platform.processor() or platform.machine(),
                        "command": " ".join(sys.argv)}

    print(f"{'case':<16} {'path':<24} {'records/s':>10} {'tokens':>8} {'cached':>8} {'evaluated':>10}")
    for case in ("distinct_states", "shared_states"):
        for path in ("one_request_per_record", "json_lines"):
            r = results[case][path]
            print(f"{case:<16} {path:<24} {r['records_per_s']:>10.2f} {r['tokens']:>8} {r['cached_tokens']:>8} "
                  f"{r['evaluated_tokens']:>10}")
        print(f"{case:<16} {'JSON Lines / single':<24} {results[case]['json_lines_over_single']:>10.2f}")
    print(f"shared / distinct states (JSON Lines records/s): {results['shared_over_distinct_json_lines']:.2f}")
    sys.path.insert(0, str(REPO))  # the CDK app's price constants: one table for synth and for this
    from config.pricing import HOURLY_USD, PRICES_AS_OF, cost_per_thousand_records

    # Only the throughput measured here is real: this machine's CPU, an instance with more vCPUs does at least as
    # well, so for CPU instance types the figure is an upper bound. GPU types are not measured: no figure.
    results["cost_per_1000_records_at_this_throughput"] = {}
    print(f"instance time per 1,000 records at this machine's JSON Lines throughput (prices of {PRICES_AS_OF}):")
    for instance_type in (t for t in HOURLY_USD if not t.startswith(("ml.g", "ml.p", "ml.inf"))):
        costs = {case: cost_per_thousand_records(instance_type, results[case]["json_lines"]["records_per_s"])
                 for case in ("distinct_states", "shared_states")}
        results["cost_per_1000_records_at_this_throughput"][instance_type] = costs
        print(f"  {instance_type:<16} ${HOURLY_USD[instance_type]:.4f}/h: distinct ${costs['distinct_states']:.3f}, "
              f"shared ${costs['shared_states']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
