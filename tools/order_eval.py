#!/usr/bin/env python
"""Option-order sensitivity with and without order debiasing, on labeled decisions (issue #11 §3).

For each labeled decision, four real scorings through the engine: the options as given and reversed,
each without debiasing ("none") and with it ("reverse": both orders scored over one cached state and
combined). Reports, per mode, the share of decisions whose choice is unchanged when the options are
reversed, accuracy (on the given order), and the mean compute time; then the latency ratio
debias/none, measured in the same run. The context is emptied before every timed call, so each one
evaluates its state: the ratio is what debiasing costs a request whose state is new.

usage: python tools/order_eval.py MODEL.gguf [--data data/decisions-sample.jsonl data/heldout-decisions.jsonl]
                                             [--scoring label] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from rich.progress import Progress

from semif.serving.engine import Engine
from semif.serving.prompt import Outcome, Question

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = [REPO / "data" / "decisions-sample.jsonl", REPO / "data" / "heldout-decisions.jsonl"]


def load(paths):
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            rows += [dict(json.loads(line), _file=Path(path).name) for line in handle if line.strip()]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--data", nargs="+", default=[str(p) for p in DEFAULT_DATA])
    parser.add_argument("--scoring", default="label", choices=["label", "sequence"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", help="write per-decision results and the summary here")
    args = parser.parse_args(argv)

    rows = load(args.data)
    engine = Engine(args.model, n_ctx=4096, n_threads=args.threads, label_memo=False)
    print(f"{engine.info['file']} sha256 {engine.info['sha256'][:12]}… template {engine.info['template_version']} "
          f"scoring {args.scoring}; {len(rows)} decisions from {', '.join(Path(p).name for p in args.data)}", flush=True)
    records = []
    with Progress() as progress:
        task = progress.add_task("decisions", total=len(rows))
        for row in rows:
            options = [(o["id"], o.get("description")) for o in row["options"]]
            record = {"id": row["id"], "file": row["_file"], "answer": row["answer"]}
            for mode in ("none", "reverse"):
                for order in ("given", "reversed"):
                    shown = options if order == "given" else options[::-1]
                    question = Question(row["question"], tuple(Outcome(k, d) for k, d in shown))
                    engine.invalidate()  # every timed call evaluates its state: equal footing for both modes
                    started = time.perf_counter()
                    dist = engine.score(row["state"], [question], scoring=args.scoring, debias=mode).distributions[0]
                    elapsed = time.perf_counter() - started
                    top = max(range(len(shown)), key=lambda i: dist.probabilities[i])
                    record[f"{mode}_{order}"] = {"choice": shown[top][0], "seconds": elapsed,
                                                 "p": dist.probabilities[top], "label_mass": dist.label_mass}
            records.append(record)
            progress.advance(task)

    summary = {}
    for mode in ("none", "reverse"):
        unchanged = sum(r[f"{mode}_given"]["choice"] == r[f"{mode}_reversed"]["choice"] for r in records)
        correct = sum(r[f"{mode}_given"]["choice"] == r["answer"] for r in records)
        correct_rev = sum(r[f"{mode}_reversed"]["choice"] == r["answer"] for r in records)
        seconds = [r[f"{mode}_{o}"]["seconds"] for r in records for o in ("given", "reversed")]
        summary[mode] = {"unchanged": unchanged, "accuracy_given": correct, "accuracy_reversed": correct_rev,
                         "n": len(records), "mean_s": statistics.mean(seconds), "median_s": statistics.median(seconds)}
    by_file = {}
    for name in sorted({r["file"] for r in records}):
        part = [r for r in records if r["file"] == name]
        by_file[name] = {mode: {"unchanged": sum(r[f"{mode}_given"]["choice"] == r[f"{mode}_reversed"]["choice"] for r in part),
                                "accuracy_given": sum(r[f"{mode}_given"]["choice"] == r["answer"] for r in part),
                                "n": len(part)} for mode in ("none", "reverse")}
    ratio = summary["reverse"]["mean_s"] / summary["none"]["mean_s"]
    print(f"\n{'debias':8} {'unchanged when reversed':>24} {'accuracy (given)':>17} {'accuracy (reversed)':>20} {'mean s':>8}")
    for mode, s in summary.items():
        n = s["n"]
        print(f"{mode:8} {s['unchanged']:>3}/{n} = {s['unchanged'] / n:6.1%}        {s['accuracy_given']:>3}/{n} = {s['accuracy_given'] / n:.3f}"
              f"    {s['accuracy_reversed']:>3}/{n} = {s['accuracy_reversed'] / n:.3f}   {s['mean_s']:7.3f}")
    for name, modes in by_file.items():
        print(f"  {name}: " + "; ".join(f"{m}: unchanged {v['unchanged']}/{v['n']}, accuracy {v['accuracy_given']}/{v['n']}"
                                          for m, v in modes.items()))
    print(f"latency ratio debias/none (mean compute per request, same run): {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": engine.info["file"], "sha256": engine.info["sha256"],
                                               "scoring": args.scoring, "summary": summary, "by_file": by_file,
                                               "latency_ratio": ratio, "records": records}, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
