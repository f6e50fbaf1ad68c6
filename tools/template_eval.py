#!/usr/bin/env python
"""Accuracy per prompt template change, in-process: every style on the same decisions, both option orders.

For each labeled decision and each style (a template version, or one change to it), the engine scores the
question with the options as written and reversed. Per style it reports accuracy both ways, order stability
(the same option chosen both ways), the accuracy of the mean of both orders' probabilities, what the served
readout answers (`debias: "reverse"`: the mean of both orders' log-probabilities, reading both, and with its stop
rule reading the first direction alone where it settles, with the share answered from one read), contextual
calibration (each option's probability divided by its probability for a content-free state with
the same question and options, fitted once per option set and order), the label mass, and the prompt tokens
per request: all of them and those after the template head (what a request evaluates when the head is cached
and the state is new). Decisions go row by row through every style, so a run stopped early still compares
the styles on the same decisions.

usage: python tools/template_eval.py MODEL.gguf [--data FILE] [--limit N | --stratified N] [--styles a,b,...] [--json OUT]
       python tools/template_eval.py --summarise REPORT.json     # a stored report's figures again, from its records

The "content-free" columns are what `debias: content_free` answers: each order's
probabilities divided by that order's content-free ones, the same prompt and the same arithmetic.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from semif.serving.engine import prompt as P
from semif.serving.engine.context import Engine
from semif.serving.engine.passes.orders import combine_orders, settled
from semif.serving.engine.plan import first_direction

REPO = Path(__file__).resolve().parents[1]
V3 = P.STYLES["v3"]
# name: (style, layout). Each v3-… entry changes one thing of v3.
STYLES = {
    "v2": (P.STYLES["v2"], "state_first"),
    "v3": (V3, "state_first"),
    "v3-key": (replace(V3, option_text="key_description"), "state_first"),
    "v3-noreply": (replace(V3, reply="none"), "state_first"),
    "v3-reply-lead": (replace(V3, reply_at="lead"), "state_first"),
    "v3-range": (replace(V3, reply="range"), "state_first"),
    "v3-v2system": (replace(V3, system=P.SYSTEM_TEXT), "state_first"),
    "v3-restate": (replace(V3, restate=True), "state_first"),
    "v3-options-first": (V3, "options_first"),
    "v3-of-question": (replace(V3, recap="question"), "options_first"),
    "v3-of-keys": (replace(V3, recap="question_keys"), "options_first"),
}
CONTENT_FREE_STATE = "N/A"
console = Console(stderr=True)


def question_of(row: dict, reverse: bool = False) -> P.Question:
    options = row["options"][::-1] if reverse else row["options"]
    return P.Question(row["question"], tuple(P.Outcome(o["id"], o.get("description")) for o in options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("--summarise", type=Path, default=None, metavar="REPORT",
                        help="print (and store in REPORT) the figures of a stored report, from its records")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "decisions-dev.jsonl")
    rows_from = parser.add_mutually_exclusive_group()
    rows_from.add_argument("--limit", type=int, default=None, help="the first N decisions of the file")
    rows_from.add_argument("--stratified", type=int, default=None, metavar="N",
                           help="the N decisions the dev studies read, taken in turn from their four groups "
                                "(tools/calibration_study.py), instead of the file's first ones")
    parser.add_argument("--styles", default="v2,v3", help=f"comma-separated, of {', '.join(STYLES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="every decision's probabilities per style")
    args = parser.parse_args()
    if args.summarise is not None:
        return resummarise(args.summarise)
    if args.model is None:
        parser.error("MODEL is required (or --summarise REPORT)")
    names = [n.strip() for n in args.styles.split(",") if n.strip()]
    unknown = [n for n in names if n not in STYLES]
    if unknown:
        parser.error(f"unknown style(s) {', '.join(unknown)}; known: {', '.join(STYLES)}")
    if not args.model.is_file():
        parser.error(f"{args.model}: no such file")
    if args.stratified is not None:
        sys.path.insert(0, str(REPO / "tools"))
        from calibration_study import chosen_rows
        rows = chosen_rows(args.data, args.stratified)[0]
    else:
        rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: args.limit]

    engine = Engine(str(args.model), n_ctx=4096, n_threads=args.threads)
    base = engine.template
    templates = {n: base.variant_of(STYLES[n][0]) for n in names}
    head_tokens = {n: len(engine._tokenize(t.state_prefix_parts("x")[0], special=True)) for n, t in templates.items()}
    content_free: dict[tuple, np.ndarray] = {}
    records: list[dict] = []
    started = time.time()

    def score(name: str, state: str, question: P.Question):
        engine.template = templates[name]
        return engine.score(state, [question], layout=STYLES[name][1], debias="none")

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("decisions", total=len(rows))
        for row in rows:
            ids = [o["id"] for o in row["options"]]
            for name in names:
                entry = {"id": row["id"], "category": row["category"], "decision_id": row["decision_id"],
                         "answer": row["answer"], "gold_index": ids.index(row["answer"]), "style": name,
                         "first_listed": _first_listed(row)}
                for direction, reverse in (("forward", False), ("reversed", True)):
                    result = score(name, row["state"], question_of(row, reverse))
                    dist = result.distributions[0]
                    probs = np.asarray(dist.probabilities)
                    if reverse:
                        probs = probs[::-1]
                    key = (name, row["decision_id"], row["question"], tuple(ids), reverse)
                    if key not in content_free:
                        cf = np.asarray(score(name, CONTENT_FREE_STATE, question_of(row, reverse)).distributions[0].probabilities)
                        content_free[key] = cf[::-1] if reverse else cf
                    entry[direction] = {"probabilities": probs.round(6).tolist(), "label_mass": dist.label_mass,
                                        "tokens": dist.tokens, "evaluated": dist.evaluated_tokens,
                                        "content_free": content_free[key].round(6).tolist()}
                records.append(entry)
            progress.advance(task)
    engine.template = base
    summary = summarise(records, names, head_tokens)
    report(summary, len(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": engine.info["file"], "model_sha256": engine.info["sha256"], "data": str(args.data),
            "rows": f"stratified {args.stratified}" if args.stratified is not None else f"first {len(rows)}",
            "decisions": len(rows), "elapsed_s": round(time.time() - started, 1),
            # A variant keeps its version name; its template hash tells it apart.
            "styles": {n: {"version": STYLES[n][0].version, "layout": STYLES[n][1], "template_sha256": templates[n].sha256}
                       for n in names},
            "summary": summary, "records": records}, indent=1) + "\n")


def resummarise(path: Path) -> int:
    """A stored report's summary recomputed from its records (figures added since it ran included)."""
    stored = json.loads(path.read_text())
    names = list(stored["styles"])
    data = Path(stored["data"])
    if data.is_file() and any("first_listed" not in r for r in stored["records"]):  # reports from before it was kept
        rows = {row["id"]: row for row in map(json.loads, filter(str.strip, data.read_text().splitlines()))}
        for r in stored["records"]:
            if r["id"] in rows:
                r.setdefault("first_listed", _first_listed(rows[r["id"]]))
    old = stored.get("summary", {})
    head = {n: old[n]["prompt_tokens"] - old[n]["after_head_tokens"] for n in names}
    stored["summary"] = summarise(stored["records"], names, head)
    report(stored["summary"], stored["decisions"])
    path.write_text(json.dumps(stored, indent=1) + "\n")
    return 0


def _first_listed(row: dict) -> bool:
    """Whether debias "reverse" reads the row's listing first (plan.first_direction), not its reverse."""
    return first_direction(question_of(row))[0] == 0


def _served(forward, reversed_, first_listed: bool) -> tuple[int, int, bool]:
    """debias "reverse" from the two reads' probabilities (given order): (its choice reading both, its choice
    with the stop rule, whether the stop rule answered from the first direction alone)."""
    logs = [np.log(np.clip(np.asarray(p, dtype=np.float64), 1e-300, None)) for p in (forward, reversed_)]
    both = int(np.argmax(combine_orders(*logs)))
    first = logs[0] if first_listed else logs[1]
    if settled([first - np.logaddexp.reduce(first)], 2):
        return both, int(np.argmax(first)), True
    return both, both, False


def summarise(records: list[dict], names: list[str], head_tokens: dict[str, int]) -> dict:
    out = {}
    for name in names:
        mine = [r for r in records if r["style"] == name]
        by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        fwd = rev = stable = mean = calibrated = cf_fwd = cf_rev = cf_stable = served_both = served = one_read = 0
        cf_by_cat: dict[str, int] = defaultdict(int)
        tokens, evaluated, mass = [], [], []
        for r in mine:
            f, b = np.asarray(r["forward"]["probabilities"]), np.asarray(r["reversed"]["probabilities"])
            gold = r["gold_index"]
            fwd += int(f.argmax() == gold)
            rev += int(b.argmax() == gold)
            stable += int(f.argmax() == b.argmax())
            mean += int((f + b).argmax() == gold)
            if "first_listed" in r:
                both, choice, alone = _served(f, b, r["first_listed"])
                served_both += int(both == gold)
                served += int(choice == gold)
                one_read += int(alone)
            cf = (f / np.maximum(r["forward"]["content_free"], 1e-9) + b / np.maximum(r["reversed"]["content_free"], 1e-9))
            calibrated += int(cf.argmax() == gold)
            # debias content_free, per order: that order's probabilities over its own content-free ones.
            cf_f = f / np.maximum(r["forward"]["content_free"], 1e-9)
            cf_b = b / np.maximum(r["reversed"]["content_free"], 1e-9)
            cf_fwd += int(cf_f.argmax() == gold)
            cf_rev += int(cf_b.argmax() == gold)
            cf_stable += int(cf_f.argmax() == cf_b.argmax())
            cf_by_cat[r["category"]] += int(cf_f.argmax() == gold)
            by_cat[r["category"]][0] += int(f.argmax() == gold)
            by_cat[r["category"]][1] += 1
            tokens.append(r["forward"]["tokens"])
            evaluated.append(r["forward"]["evaluated"])
            mass.append(r["forward"]["label_mass"] or 0.0)
        n = max(len(mine), 1)
        out[name] = {"n": len(mine), "forward": fwd / n, "reversed": rev / n, "stable": stable / n,
                     "mean_of_orders": mean / n, "calibrated_mean": calibrated / n,
                     **({"reverse_both_reads": served_both / n, "reverse_stop_rule": served / n,
                         "reverse_one_read_share": one_read / n} if all("first_listed" in r for r in mine) else {}),
                     "content_free_forward": cf_fwd / n, "content_free_reversed": cf_rev / n,
                     "content_free_stable": cf_stable / n,
                     "content_free_per_category": {c: cf_by_cat[c] / v[1] for c, v in sorted(by_cat.items())},
                     "prompt_tokens": float(np.mean(tokens)) if tokens else 0.0,
                     "after_head_tokens": float(np.mean(tokens)) - head_tokens[name] if tokens else 0.0,
                     "evaluated_tokens": float(np.mean(evaluated)) if evaluated else 0.0,
                     "label_mass": float(np.mean(mass)) if mass else 0.0,
                     "per_category": {c: v[0] / v[1] for c, v in sorted(by_cat.items())}}
    return out


def report(summary: dict, n_rows: int) -> None:
    table = Table(title=f"{n_rows} decisions, both orders")
    for column in ("style", "forward", "reversed", "same both ways", "mean of orders", "calibrated mean",
                   "content-free forward", "content-free reversed", "content-free same both ways",
                   "prompt tokens", "after head", "evaluated", "label mass"):
        table.add_column(column)
    for name, s in summary.items():
        table.add_row(name, f"{s['forward']:.3f}", f"{s['reversed']:.3f}", f"{s['stable']:.3f}",
                      f"{s['mean_of_orders']:.3f}", f"{s['calibrated_mean']:.3f}",
                      f"{s['content_free_forward']:.3f}", f"{s['content_free_reversed']:.3f}",
                      f"{s['content_free_stable']:.3f}", f"{s['prompt_tokens']:.1f}",
                      f"{s['after_head_tokens']:.1f}", f"{s['evaluated_tokens']:.1f}", f"{s['label_mass']:.3f}")
    Console().print(table)
    served = {name: s for name, s in summary.items() if "reverse_stop_rule" in s}
    if served:
        table = Table(title='the served readout, debias "reverse"')
        for column in ("style", "both reads", "stop rule", "answered from one read"):
            table.add_column(column)
        for name, s in served.items():
            table.add_row(name, f"{s['reverse_both_reads']:.3f}", f"{s['reverse_stop_rule']:.3f}",
                          f"{s['reverse_one_read_share']:.3f}")
        Console().print(table)
    cats = sorted({c for s in summary.values() for c in s["per_category"]})
    table = Table(title="accuracy per category, options as written")
    table.add_column("style")
    for c in cats:
        table.add_column(c)
    for name, s in summary.items():
        table.add_row(name, *[f"{s['per_category'].get(c, 0):.2f}" for c in cats])
        table.add_row(f"{name}, content-free", *[f"{s['content_free_per_category'].get(c, 0):.2f}" for c in cats])
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
