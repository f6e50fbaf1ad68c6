#!/usr/bin/env python
"""Per-request overhead of the engine: where the time of one cold decision goes, without HTTP.

For every held-out decision (each with a state the engine has not seen), times
  plan      building the prompt plan (fence, template, tokenization, label checks)
  execute   running the plan on the context
  decode    of execute, the time inside llama_decode (the model itself)
  python    execute - decode: the engine's own work per request (batch filling, logits reading, hashing)
and prints medians. The decode time is the floor; `plan + python` is the overhead this script exists to
show. Run it before and after a change on the same machine and compare the overhead columns (a ratio in
one run is what counts; the machine's load moves the decode column more than the overhead ones).

usage: python tools/bench_overhead.py [--model GGUF] [--rounds N] [--threads N] [--scoring label|sequence]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = REPO / "data" / "heldout-decisions.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--scoring", choices=("label", "sequence"), default="label")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.config import embedded_model_path
    from semif.serving.engine import Engine
    from semif.serving.prompt import Outcome, Question

    model = args.model or embedded_model_path()
    engine = Engine(model, n_ctx=4096, n_batch=512, n_threads=args.threads, label_memo=False)
    lc = engine._lc
    real_decode = lc.llama_decode
    in_decode = [0.0]

    def timed_decode(ctx, batch):
        started = time.perf_counter()
        try:
            return real_decode(ctx, batch)
        finally:
            in_decode[0] += time.perf_counter() - started

    lc.llama_decode = timed_decode  # the engine calls it through the module, so this sees every decode
    cases = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()]
    rows = {"plan": [], "execute": [], "decode": [], "python": []}
    try:
        for round_no in range(args.rounds + 1):  # round 0 warms up
            for index, case in enumerate(cases):
                question = Question(case["question"], tuple(Outcome(o["id"], o.get("description")) for o in case["options"]))
                state = f"Round {round_no} case {index}. {case['state']}"
                started = time.perf_counter()
                plan = engine.plan(state, [question], scoring=args.scoring)
                planned = time.perf_counter()
                in_decode[0] = 0.0
                engine.execute(plan)
                done = time.perf_counter()
                if round_no == 0:
                    continue
                rows["plan"].append((planned - started) * 1000)
                rows["execute"].append((done - planned) * 1000)
                rows["decode"].append(in_decode[0] * 1000)
                rows["python"].append((done - planned - in_decode[0]) * 1000)
    finally:
        lc.llama_decode = real_decode
        engine.close()
    figures = {name: statistics.median(values) for name, values in rows.items()}
    figures["overhead"] = figures["plan"] + figures["python"]
    print(f"model {model.name}, {args.threads} threads, {len(cases)} cases x {args.rounds} rounds, {args.scoring} scoring")
    print("median per cold decision, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    if args.json:
        args.json.write_text(json.dumps({"model": model.name, "scoring": args.scoring, **figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
