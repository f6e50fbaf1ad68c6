#!/usr/bin/env python
"""Benchmark the SemIf adapter against raw llama.cpp, on the embedded model (or --model).

Prints ratios measured in one run (not a timed test):
  1. adapter HTTP p50 / raw llama.cpp prefill of the same tokens          (target <= 1.10)
  2. 8 questions on one ~300-token state in one request
     / the same 8 as separate requests with the prefix cache off         (target <= 0.40)
  3. repeat of an identical request / the first (cold) one               (target <= 0.20)
  4. p50/p95 of serial decisions over the labeled sample, accuracy for label and sequence scoring

usage: python tools/bench_adapter.py [--model PATH] [--repeats N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import BenchServer  # noqa: E402
import numpy as np

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "decisions-sample.jsonl"

STATE_300 = (
    "Ticket 88213 from Dana Whitfield, account tier Enterprise, region EU-West. Dana writes: since the "
    "update on Monday our team of forty cannot sign in to the reporting dashboard; the login page accepts "
    "the password, then loops back to the start. Two colleagues on the older mobile app can still sign in. "
    "We were also charged twice on the March invoice (INV-20931), which finance noticed this morning, and "
    "our contract renewal is due on the 30th. We have a board presentation on Thursday that depends on the "
    "dashboard exports, so this is blocking. We already cleared caches, tried three browsers and reset two "
    "passwords. Previous ticket 87002 about slow exports was closed last month without a fix. Please call "
    "me back today; I am available until 18:00 CET. If this cannot be fixed quickly we will escalate to our "
    "account manager and consider pausing the renewal. Attached: screenshots of the login loop and the invoice."
)
EIGHT_QUESTIONS = [
    ("queue", "Which queue should handle this ticket first?", ["account_access", "billing", "technical", "sales"]),
    ("priority", "What priority should the ticket get?", ["low", "normal", "high", "urgent"]),
    ("sentiment", "What is the customer's sentiment?", ["positive", "neutral", "negative"]),
    ("churn", "Is the customer at risk of churning?", ["yes", "no"]),
    ("callback", "Did the customer ask for a call back?", ["yes", "no"]),
    ("billing_issue", "Does the ticket mention a billing error?", ["yes", "no"]),
    ("product", "Which product area is affected?", ["dashboard", "mobile_app", "api", "billing_portal"]),
    ("next_step", "What should the agent do next?", ["reset_sessions", "refund", "escalate", "close"]),
]


def pct(values, q):
    return float(np.percentile(values, q))


def decision(qid, question, options, state=STATE_300):
    return {"decision": {"id": qid, "state": state, "question": question, "options": [{"id": o} for o in options]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.config import embedded_model_path

    model = args.model or embedded_model_path()
    figures: dict = {"model": model.name, "host": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    samples = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]

    # --- prefix cache off: the adapter's per-request overhead and the separate-request baseline ----
    off = BenchServer(model, SEMIF_PREFIX_CACHE=0)
    try:
        body = decision(*EIGHT_QUESTIONS[0])
        off.invoke_ms(body)  # warm-up
        adapter_ms = [off.invoke_ms(body)[0] for _ in range(args.repeats)]
        _, first = off.invoke_ms({**body, "return_prompt": True})
        prompt_text = first["prompt"]["text"]
        separate_ms = []
        for _ in range(3):
            started = time.perf_counter()
            for q in EIGHT_QUESTIONS:
                off.invoke_ms(decision(*q))
            separate_ms.append((time.perf_counter() - started) * 1000)
    finally:
        off.close()

    # --- raw llama.cpp prefill of exactly the same tokens ------------------------------------------
    import llama_cpp

    threads = os.cpu_count() or 1  # the adapter's default (SEMIF_N_THREADS); llama-cpp-python alone would use half
    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
        logits_all=False, verbose=False,
    )
    tokens = llm.tokenize(prompt_text.encode(), add_bos=True, special=True)
    raw_ms = []
    for _ in range(args.repeats + 1):
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
        started = time.perf_counter()
        llm.eval(tokens)
        llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        raw_ms.append((time.perf_counter() - started) * 1000)
    raw_ms = raw_ms[1:]
    llm.close()

    # --- prefix cache on: batching, repeats, sample latency and accuracy --------------------------
    on = BenchServer(model)
    try:
        batch = {
            "state": STATE_300,
            "decisions": [{"id": q, "question": t, "options": [{"id": o} for o in opts]} for q, t, opts in EIGHT_QUESTIONS],
        }
        batch_ms = []
        for i in range(3):
            # a distinct state each time so the batch itself is cold
            cold_batch = {**batch, "state": f"{STATE_300} (variant {i})"}
            batch_ms.append(on.invoke_ms(cold_batch)[0])
        cold_ms, repeat_ms = [], []
        for i in range(5):
            body = decision(*EIGHT_QUESTIONS[0], state=f"{STATE_300} (repeat probe {i})")
            cold_ms.append(on.invoke_ms(body)[0])
            repeat_ms.append(statistics.median(on.invoke_ms(body)[0] for _ in range(3)))
        per_method = {}
        for scoring in ("label", "sequence"):
            latencies, correct = [], 0
            for row in samples:
                ms, result = on.invoke_ms({"decision": {k: row[k] for k in ("id", "state", "question", "options")}, "scoring": scoring})
                latencies.append(ms)
                correct += result["choice"] == row["answer"]
            per_method[scoring] = {
                "accuracy": correct / len(samples),
                "p50_ms": pct(latencies, 50),
                "p95_ms": pct(latencies, 95),
                "n": len(samples),
            }
    finally:
        on.close()

    figures.update(
        prompt_tokens=len(tokens),
        adapter_http_p50_ms=pct(adapter_ms, 50),
        raw_prefill_p50_ms=pct(raw_ms, 50),
        ratio_adapter_over_raw=pct(adapter_ms, 50) / pct(raw_ms, 50),
        batch8_ms=statistics.median(batch_ms),
        separate8_nocache_ms=statistics.median(separate_ms),
        ratio_batch_over_separate=statistics.median(batch_ms) / statistics.median(separate_ms),
        cold_ms=statistics.median(cold_ms),
        repeat_ms=statistics.median(repeat_ms),
        ratio_repeat_over_cold=statistics.median(repeat_ms) / statistics.median(cold_ms),
        sample=per_method,
    )
    targets = [("ratio_adapter_over_raw", 1.10), ("ratio_batch_over_separate", 0.40), ("ratio_repeat_over_cold", 0.20)]
    print(f"model {figures['model']} on {figures['cpus']} CPUs; prompt {len(tokens)} tokens")
    print(f"{'measure':<44}{'value':>10}{'target':>10}  verdict")
    print(f"{'adapter HTTP p50 (ms)':<44}{figures['adapter_http_p50_ms']:>10.1f}")
    print(f"{'raw llama.cpp prefill p50 (ms)':<44}{figures['raw_prefill_p50_ms']:>10.1f}")
    print(f"{'8 questions, one request (ms)':<44}{figures['batch8_ms']:>10.1f}")
    print(f"{'8 separate requests, cache off (ms)':<44}{figures['separate8_nocache_ms']:>10.1f}")
    print(f"{'identical request: cold (ms)':<44}{figures['cold_ms']:>10.1f}")
    print(f"{'identical request: repeat (ms)':<44}{figures['repeat_ms']:>10.1f}")
    for key, target in targets:
        verdict = "PASS" if figures[key] <= target else "MISS"
        print(f"{key:<44}{figures[key]:>10.3f}{target:>10.2f}  {verdict}")
    for scoring, stats in per_method.items():
        print(
            f"sample ({stats['n']} decisions), {scoring:<8} accuracy {stats['accuracy']:.3f}  "
            f"p50 {stats['p50_ms']:.1f} ms  p95 {stats['p95_ms']:.1f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
