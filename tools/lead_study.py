#!/usr/bin/env python3
"""Reads in other orders with and without the shared lead, on the same decisions, in one run.

    nice -n 5 .venv/bin/python tools/lead_study.py \\
        --model ~/.cache/semif/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --limit 40 --n-threads 2

A read in another order shares the first read's lead (the question text and the options header are the same
tokens in every order): the engine keeps those cells from the first read's evaluation and evaluates only what
follows (Engine._hold_lead). This study answers each row of the labeled file (default: data/decisions-dev.jsonl)
with the server's default debiasing ("reverse", its stop rule), in-process and cold (an empty context, no memo:
a state seen for the first time), twice: with the lead shared (`shared`) and with every read evaluating its
whole question block (`whole`, the lead cut to zero), alternating which arm goes first. Per arm: accuracy
against the label, evaluated tokens, compute time; and how often the two arms choose alike (the lead's cells
come from another batch shape than a whole block's, so the second read's logits move within the kernels'
precision). Records go to --out as JSON Lines as they come (a rerun resumes); the summary is printed and
written beside it (`.summary.json`).
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
sys.path.insert(0, str(REPO / "container"))
sys.path.insert(0, str(REPO / "tools"))

from calibration_study import chosen_rows, records_so_far  # noqa: E402


def summarise(records: list[dict]) -> dict:
    out: dict = {"rows": len(records)}
    for arm in ("shared", "whole"):
        ms = [r[arm]["ms"] for r in records]
        tokens = [r[arm]["evaluated_tokens"] for r in records]
        out[arm] = {"accuracy": round(sum(r[arm]["choice"] == r["answer"] for r in records) / len(records), 3),
                    "evaluated_tokens_mean": round(statistics.mean(tokens), 1),
                    "evaluated_tokens_p50": statistics.median(tokens),
                    "ms_p50": round(statistics.median(ms), 1), "ms_mean": round(statistics.mean(ms), 1),
                    "one_read_share": round(sum(r[arm]["reads"] == 1 for r in records) / len(records), 3)}
    two = [r for r in records if r["whole"]["reads"] == 2 and r["shared"]["reads"] == 2]
    out["same_choice"] = sum(r["shared"]["choice"] == r["whole"]["choice"] for r in records)
    out["two_read_rows"] = len(two)
    if two:
        out["two_read_ms_p50"] = {arm: round(statistics.median(r[arm]["ms"] for r in two), 1) for arm in ("shared", "whole")}
        out["two_read_tokens_mean"] = {arm: round(statistics.mean(r[arm]["evaluated_tokens"] for r in two), 1)
                                       for arm in ("shared", "whole")}
        out["lead_tokens_mean"] = round(statistics.mean(r["lead"] for r in two), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--data", default=str(REPO / "data" / "decisions-dev.jsonl"))
    parser.add_argument("--limit", type=int, default=None, help="rows, taken stratified")
    parser.add_argument("--n-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(REPO / "results" / "lead-study.jsonl"))
    args = parser.parse_args(argv)

    from rich.progress import Progress

    from semif.serving.engine import plan as planning
    from semif.serving.engine.context import Engine
    from semif.serving.engine.prompt import Outcome, Question

    chosen, _ = chosen_rows(args.data, args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = records_so_far(out)
    engine = Engine(os.path.expanduser(args.model), n_ctx=4096, n_threads=args.n_threads)
    sharing = planning.shared_lead  # the plan decides each later read's lead (QuestionPlan.lead)

    def answer(row: dict, question: Question, arm: str) -> dict:
        planning.shared_lead = sharing if arm == "shared" else (lambda first, other: 0)
        try:
            engine.invalidate()
            engine.clear_prefix_snapshots()
            engine._label_memo.clear()
            started = time.perf_counter()
            result = engine.score(row["state"], [question], scoring="label", debias="reverse")
            ms = (time.perf_counter() - started) * 1000
        finally:
            planning.shared_lead = sharing
        dist = result.distributions[0]
        choice = row["options"][max(range(len(dist.probabilities)), key=dist.probabilities.__getitem__)]["id"]
        return {"choice": choice, "ms": round(ms, 1), "evaluated_tokens": result.evaluated_tokens,
                "reads": len(dist.orders or {}) or 1}

    with out.open("a") as sink, Progress() as progress:
        task = progress.add_task("rows", total=len(chosen), completed=sum(r["id"] in done for r in chosen))
        for index, row in enumerate(chosen):
            if row["id"] in done:
                continue
            arms = ("shared", "whole") if index % 2 == 0 else ("whole", "shared")
            record = {"id": row["id"], "category": row.get("category"), "answer": row["answer"]}
            question = Question(row["question"], tuple(Outcome(o["id"], o.get("description")) for o in row["options"]),
                                kind="choice")
            for arm in arms:
                record[arm] = answer(row, question, arm)
            plan = engine.plan(row["state"], [question], scoring="label", debias="reverse", reads=2)
            q = plan.questions[0]
            record["lead"] = sharing(q.suffix_tokens, q.reversed.suffix_tokens)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            done[row["id"]] = record
            progress.advance(task)
    records = [done[r["id"]] for r in chosen if r["id"] in done]
    summary = summarise(records)
    Path(str(out) + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
