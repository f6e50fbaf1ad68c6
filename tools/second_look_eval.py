#!/usr/bin/env python
"""What the second look buys on labeled decisions, in-process: accuracy and time with and without it.

Each decision is scored once at the server's defaults (the first pass), then with a second look
(engine.plan.SecondLook) at each budget given: an answer whose margin is below ``--below-margin`` reasons
for at most that many tokens before its label is read again. Reports, per budget, how many answers looked
again, the accuracy of the first pass and of the served answer, right→wrong and wrong→right flips, and the
time per decision (all of them, and those that looked again).

usage: python tools/second_look_eval.py MODEL.gguf [--data FILE] [--limit N] [--budgets 32,128]
       [--below-margin 0.2] [--debias content_free] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from semif.serving.config import DEBIAS_MODES, DEFAULT_DEBIAS
from semif.serving.engine import prompt as P
from semif.serving.engine.context import Engine
from semif.serving.engine.plan import SecondLook

REPO = Path(__file__).resolve().parents[1]
console = Console(stderr=True)


def question_of(row: dict) -> P.Question:
    return P.Question(row["question"], tuple(P.Outcome(o["id"], o.get("description")) for o in row["options"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "decisions-dev.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="the first N decisions of the file")
    parser.add_argument("--budgets", default="128", help="comma-separated reasoning budgets, in tokens")
    parser.add_argument("--below-margin", type=float, default=0.2)
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--debias", choices=DEBIAS_MODES, default=DEFAULT_DEBIAS,
                        help=f"the first pass's debiasing (default {DEFAULT_DEBIAS}, the server's own default)")
    parser.add_argument("--json", type=Path, default=None, help="every decision's passes")
    args = parser.parse_args()
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--budgets: comma-separated integers, got {args.budgets!r}")
    if not budgets or min(budgets) < 1:
        parser.error("--budgets: at least one budget, each ≥ 1")
    if not 0.0 <= args.below_margin <= 1.0:
        parser.error("--below-margin: between 0 and 1")
    if not args.model.is_file():
        parser.error(f"{args.model}: no such file")
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: args.limit]

    engine = Engine(str(args.model), n_ctx=4096, n_threads=args.threads)
    engine.default_debias = args.debias  # as serve sets it from SEMIF_DEBIAS
    records = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("decisions", total=len(rows))
        for row in rows:
            ids = [o["id"] for o in row["options"]]
            gold = ids.index(row["answer"])
            question = question_of(row)
            t0 = time.perf_counter()
            first = engine.score(row["state"], [question]).distributions[0]
            record = {"id": row["id"], "category": row["category"], "gold_index": gold,
                      "first_pass": {"choice": int(np.argmax(first.probabilities)),
                                     "ms": (time.perf_counter() - t0) * 1000}, "looks": {}}
            for budget in budgets:
                config = SecondLook(below_margin=args.below_margin, max_tokens=budget, deadline_s=args.deadline_s)
                dist = engine.score(row["state"], [question], second_look=config).distributions[0]
                look = dist.second_look
                # The served time: the first pass (measured cold above) plus the second look's own time.
                record["looks"][str(budget)] = {
                    "choice": int(np.argmax(dist.probabilities)), "ran": look["ran"],
                    "ms": record["first_pass"]["ms"] + look.get("ms", 0.0),
                    "reasoning_tokens": look.get("reasoning_tokens", 0),
                    "stopped": look.get("stopped"), "reasoning": look.get("reasoning")}
            records.append(record)
            progress.advance(task)
    summary = summarise(records, budgets)
    report(summary, len(rows), args.below_margin)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": engine.info["file"], "model_sha256": engine.info["sha256"],
                                         "template_version": P.TEMPLATE_VERSION, "debias": args.debias, "data": str(args.data),
                                         "below_margin": args.below_margin, "summary": summary,
                                         "records": records}, indent=1) + "\n")


def summarise(records: list[dict], budgets: list[int]) -> dict:
    n = max(len(records), 1)
    first_right = sum(r["first_pass"]["choice"] == r["gold_index"] for r in records)
    out = {"first_pass": {"accuracy": first_right / n,
                          "p50_ms": float(np.median([r["first_pass"]["ms"] for r in records])) if records else 0.0}}
    for budget in budgets:
        looks = [r["looks"][str(budget)] for r in records]
        ran = [(r, l) for r, l in zip(records, looks) if l["ran"]]
        right = sum(l["choice"] == r["gold_index"] for r, l in zip(records, looks))
        out[str(budget)] = {
            "accuracy": right / n, "looked_again": len(ran),
            "wrong_to_right": sum(r["first_pass"]["choice"] != r["gold_index"] and l["choice"] == r["gold_index"] for r, l in ran),
            "right_to_wrong": sum(r["first_pass"]["choice"] == r["gold_index"] and l["choice"] != r["gold_index"] for r, l in ran),
            "p50_ms": float(np.median([l["ms"] for l in looks])) if looks else 0.0,
            "mean_ms": float(np.mean([l["ms"] for l in looks])) if looks else 0.0,
            "p50_ms_looked_again": float(np.median([l["ms"] for _, l in ran])) if ran else 0.0,
            "mean_reasoning_tokens": float(np.mean([l["reasoning_tokens"] for _, l in ran])) if ran else 0.0,
        }
    return out


def report(summary: dict, n_rows: int, below_margin: float) -> None:
    table = Table(title=f"{n_rows} decisions; second look below margin {below_margin}")
    for column in ("budget", "accuracy", "looked again", "wrong→right", "right→wrong", "p50 ms", "mean ms",
                   "p50 ms when it looked", "reasoning tokens"):
        table.add_column(column)
    first = summary["first_pass"]
    table.add_row("first pass only", f"{first['accuracy']:.3f}", "", "", "", f"{first['p50_ms']:.0f}", "", "", "")
    for budget, s in summary.items():
        if budget == "first_pass":
            continue
        table.add_row(budget, f"{s['accuracy']:.3f}", str(s["looked_again"]), str(s["wrong_to_right"]),
                      str(s["right_to_wrong"]), f"{s['p50_ms']:.0f}", f"{s['mean_ms']:.0f}",
                      f"{s['p50_ms_looked_again']:.0f}", f"{s['mean_reasoning_tokens']:.1f}")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
