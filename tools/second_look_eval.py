#!/usr/bin/env python
"""What the second look buys on labeled decisions, in-process: accuracy and time with and without it.

Each decision is scored once at the server's defaults (the first pass), then with a second look
(engine.plan.SecondLook) at each budget given: an answer whose margin is below ``--below-margin`` reasons
for at most that many tokens before its label is read again. Reports, per budget, how many answers looked
again, the accuracy of the first pass and of the served answer, right→wrong and wrong→right flips, and the
time per decision (all of them, and those that looked again).

With ``--settle-every 0,16`` each budget runs once per value: 0 never peeks; N peeks at the labels every N
reasoning tokens and stops once they have settled (SecondLook.settled, at ``--settle-agree`` and
``--settle-margin``). Each look records its peeks (choice and margin), and each variant that peeks is
compared with the one that does not: how many choices it changed, its reasoning tokens and its time.

To choose the settle rule, run once with peeks that never settle (``--settle-every 8 --settle-margin 1.01``:
the reasoning is the same as without peeks, and every peek is recorded), then replay other rules on that
record without the model: ``--replay OUT.json`` prints, per rule, the looks that would settle, their mean
reasoning tokens and the choices that would differ from the look without peeks.

usage: python tools/second_look_eval.py MODEL.gguf [--data FILE] [--limit N] [--budgets 32,128]
       [--below-margin 0.2] [--settle-every 0,16] [--debias content_free] [--n-threads 2] [--json OUT]
       python tools/second_look_eval.py --replay OUT.json
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
from semif.serving.engine.passes import second_look as second_look_pass
from semif.serving.engine.plan import SecondLook
from semif.serving.engine.results import softmax

REPO = Path(__file__).resolve().parents[1]
console = Console(stderr=True)


def question_of(row: dict) -> P.Question:
    return P.Question(row["question"], tuple(P.Outcome(o["id"], o.get("description")) for o in row["options"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("--replay", type=Path, default=None,
                        help="a --json record of a run whose peeks never settled: replay settle rules on it")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "decisions-dev.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="the first N decisions of the file")
    parser.add_argument("--budgets", default="128", help="comma-separated reasoning budgets, in tokens")
    parser.add_argument("--below-margin", type=float, default=0.2)
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument("--n-threads", "--threads", dest="threads", type=int, default=2)
    parser.add_argument("--settle-every", default=str(SecondLook.settle_every),
                        help="comma-separated peek intervals, in reasoning tokens (0: never peek; default "
                             f"{SecondLook.settle_every}, the server's own default)")
    parser.add_argument("--settle-agree", type=int, default=SecondLook.settle_agree)
    parser.add_argument("--settle-margin", type=float, default=SecondLook.settle_margin)
    parser.add_argument("--debias", choices=DEBIAS_MODES, default=DEFAULT_DEBIAS,
                        help=f"the first pass's debiasing (default {DEFAULT_DEBIAS}, the server's own default)")
    parser.add_argument("--json", type=Path, default=None, help="every decision's passes")
    args = parser.parse_args()
    if args.replay is not None:
        return replay(json.loads(args.replay.read_text()))
    if args.model is None:
        parser.error("MODEL.gguf is required (or --replay)")
    def integers(flag: str, text: str, least: int) -> list[int]:
        """A comma-separated list of integers, each ≥ least; a usage error otherwise."""
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            parser.error(f"{flag}: comma-separated integers, got {text!r}")
        if not values or min(values) < least:
            parser.error(f"{flag}: at least one value, each ≥ {least}")
        return values

    budgets = integers("--budgets", args.budgets, 1)
    settles = integers("--settle-every", args.settle_every, 0)
    if args.settle_agree < 1:
        parser.error("--settle-agree: at least 1")
    if not 0.0 <= args.below_margin <= 1.0:
        parser.error("--below-margin: between 0 and 1")
    if not args.model.is_file():
        parser.error(f"{args.model}: no such file")
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: args.limit]

    engine = Engine(str(args.model), n_ctx=4096, n_threads=args.threads)
    engine.default_debias = args.debias  # as serve sets it from SEMIF_DEBIAS
    peeked: list[tuple[int, float]] = []
    real_peek = second_look_pass._peek

    def recording_peek(*peek_args):
        """Each peek's choice and margin, for the record (the answer's second_look keeps the choices only)."""
        logits, mass = real_peek(*peek_args)
        ranked = sorted(softmax(logits), reverse=True)
        peeked.append((int(np.argmax(logits)), round(float(ranked[0] - (ranked[1] if len(ranked) > 1 else 0.0)), 4)))
        return logits, mass

    second_look_pass._peek = recording_peek
    variants = [(budget, settle) for budget in budgets for settle in settles]
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
            for budget, settle in variants:
                config = SecondLook(below_margin=args.below_margin, max_tokens=budget, deadline_s=args.deadline_s,
                                    settle_every=settle, settle_agree=args.settle_agree,
                                    settle_margin=args.settle_margin)
                peeked.clear()
                dist = engine.score(row["state"], [question], second_look=config).distributions[0]
                look = dist.second_look
                # The served time: the first pass (measured cold above) plus the second look's own time.
                record["looks"][variant_key(budget, settle, settles)] = {
                    "choice": int(np.argmax(dist.probabilities)), "ran": look["ran"],
                    "ms": record["first_pass"]["ms"] + look.get("ms", 0.0), "look_ms": look.get("ms", 0.0),
                    "reasoning_tokens": look.get("reasoning_tokens", 0),
                    "stopped": look.get("stopped"), "reasoning": look.get("reasoning"), "peeks": list(peeked)}
            records.append(record)
            progress.advance(task)
    second_look_pass._peek = real_peek
    summary = summarise(records, [variant_key(b, s, settles) for b, s in variants])
    report(summary, len(rows), args.below_margin)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": engine.info["file"], "model_sha256": engine.info["sha256"],
                                         "template_version": P.TEMPLATE_VERSION, "debias": args.debias, "data": str(args.data),
                                         "below_margin": args.below_margin, "n_threads": args.threads,
                                         "settle_agree": args.settle_agree, "settle_margin": args.settle_margin,
                                         "summary": summary, "records": records}, indent=1) + "\n")


def replay(run: dict) -> None:
    """Settle rules replayed on a run whose peeks never settled (each look recorded every peek): where each
    rule would have stopped, and with which choice (the peek's), against the look's own final choice."""
    key = next(k for k in run["records"][0]["looks"] if "/settle" in k and not k.endswith("/settle0"))
    interval = int(key.split("/settle")[1])
    looks = [(r, r["looks"][key]) for r in run["records"] if r["looks"][key]["ran"]]
    table = Table(title=f"{len(looks)} looks of {key} replayed (settle_margin {run['settle_margin']} in the run)")
    for column in ("settle_every", "settle_agree", "settle_margin", "settled", "mean reasoning tokens",
                   "choices changed", "right"):
        table.add_column(column)
    table.add_row("0", "", "", "0", f"{np.mean([l['reasoning_tokens'] for _, l in looks]):.1f}", "0",
                  str(sum(l["choice"] == r["gold_index"] for r, l in looks)))
    for every in (interval, 2 * interval):
        for agree in (1, 2, 3):
            for margin in (0.0, 0.3, 0.5, 0.7):
                rule = SecondLook(settle_every=every, settle_agree=agree, settle_margin=margin)
                tokens, settled, changed, right = [], 0, 0, 0
                for record, look in looks:
                    # (choice, margin, clear): a peek clears the look's own threshold at the run's below_margin
                    peeks = [(c, m, m >= run["below_margin"]) for i, (c, m) in enumerate(look["peeks"])
                             if (i + 1) * interval % every == 0]
                    stop = next((k for k in range(1, len(peeks) + 1) if rule.settled(peeks[:k])), None)
                    choice = look["choice"] if stop is None else peeks[stop - 1][0]
                    tokens.append(look["reasoning_tokens"] if stop is None else stop * every)
                    settled += stop is not None
                    changed += choice != look["choice"]
                    right += choice == record["gold_index"]
                table.add_row(str(every), str(agree), f"{margin:.1f}", str(settled), f"{np.mean(tokens):.1f}",
                              str(changed), str(right))
    Console().print(table)


def variant_key(budget: int, settle: int, settles: list[int]) -> str:
    """A look's name in the record: its budget, and its peek interval where more than one ran or it peeks."""
    return str(budget) if settles == [0] else f"{budget}/settle{settle}"


def summarise(records: list[dict], budgets: list[str]) -> dict:
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
            "p50_look_ms": float(np.median([l.get("look_ms", 0.0) for _, l in ran])) if ran else 0.0,
            "settled": sum(l.get("stopped") == "settled" for _, l in ran),
            "mean_peeks": float(np.mean([len(l.get("peeks", [])) for _, l in ran])) if ran else 0.0,
        }
        budget = str(budget)
        off = budget.split("/")[0] + "/settle0"
        if "/settle" in budget and not budget.endswith("/settle0") and all(off in r["looks"] for r in records):
            out[budget]["choice_changes_vs_no_peeks"] = sum(r["looks"][budget]["choice"] != r["looks"][off]["choice"]
                                                            for r in records)
    return out


def report(summary: dict, n_rows: int, below_margin: float) -> None:
    table = Table(title=f"{n_rows} decisions; second look below margin {below_margin}")
    for column in ("budget", "accuracy", "looked again", "wrong→right", "right→wrong", "p50 ms", "mean ms",
                   "p50 ms when it looked", "reasoning tokens", "settled", "changes vs no peeks"):
        table.add_column(column)
    first = summary["first_pass"]
    table.add_row("first pass only", f"{first['accuracy']:.3f}", "", "", "", f"{first['p50_ms']:.0f}", "", "", "", "", "")
    for budget, s in summary.items():
        if budget == "first_pass":
            continue
        table.add_row(budget, f"{s['accuracy']:.3f}", str(s["looked_again"]), str(s["wrong_to_right"]),
                      str(s["right_to_wrong"]), f"{s['p50_ms']:.0f}", f"{s['mean_ms']:.0f}",
                      f"{s['p50_ms_looked_again']:.0f}", f"{s['mean_reasoning_tokens']:.1f}", str(s["settled"]),
                      str(s.get("choice_changes_vs_no_peeks", "")))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
