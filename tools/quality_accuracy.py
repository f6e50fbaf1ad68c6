#!/usr/bin/env python
"""Label vs sequence accuracy and p50 latency of one GGUF on labeled decision files, in-process.

usage: python tools/quality_accuracy.py MODEL.gguf [--data FILE.jsonl ...] [--scoring label sequence]
                                         [--layout state_first options_first] [--json OUT]
  (e.g. the quality reference model, Qwen2.5-Coder-1.5B-Instruct Q4_K_M). Without --data it reads
  data/decisions-sample.jsonl and data/heldout-decisions.jsonl, and prints one line per file, method and
  layout. --json also writes every decision's choice and probabilities (ids only, no state text), so two
  runs (two builds, two versions of the code) can be compared decision by decision.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from semif.serving.engine.context import prompt as P
from semif.serving.engine.context import Engine

DATA = Path(__file__).resolve().parents[1] / "data"
DEFAULT_FILES = [DATA / "decisions-sample.jsonl", DATA / "heldout-decisions.jsonl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="GGUF file")
    parser.add_argument("--data", type=Path, nargs="+", default=DEFAULT_FILES, help="labeled JSON Lines files")
    parser.add_argument("--scoring", nargs="+", default=["label", "sequence"], choices=["label", "sequence"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layout", nargs="+", default=["state_first"], choices=["state_first", "options_first"])
    parser.add_argument("--json", type=Path, default=None, help="also write every decision's choice here")
    args = parser.parse_args()
    records = []

    engine = Engine(args.model, n_ctx=4096, n_threads=args.threads)
    print(engine.info["file"], engine.info["sha256"][:12], engine.info["template_version"], flush=True)
    for path in args.data:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for scoring in args.scoring:
            for layout in args.layout:
                correct, times = 0, []
                for done, row in enumerate(rows):
                    print(f"\r{path.name} {scoring} {layout} {done}/{len(rows)}", end="", file=sys.stderr, flush=True)
                    question = P.Question(row["question"], tuple(P.Outcome(o["id"], o.get("description")) for o in row["options"]))
                    started = time.perf_counter()
                    dist = engine.score(row["state"], [question], scoring=scoring, layout=layout).distributions[0]
                    times.append(time.perf_counter() - started)
                    ids = [o["id"] for o in row["options"]]
                    choice = ids[max(range(len(ids)), key=lambda i: dist.probabilities[i])]
                    correct += choice == row["answer"]
                    records.append({"file": path.name, "id": row.get("id", done), "scoring": scoring, "layout": layout,
                                    "choice": choice, "answer": row["answer"], "probabilities": dict(zip(ids, dist.probabilities))})
                times.sort()
                print("\r", end="", file=sys.stderr, flush=True)
                print(f"{path.name} {scoring} {layout} acc {correct}/{len(rows)}={correct / len(rows):.3f} "
                      f"p50 {times[len(times) // 2]:.2f}s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": engine.info["file"], "template_version": engine.info["template_version"],
                                         "records": records}, indent=1))


if __name__ == "__main__":
    main()
