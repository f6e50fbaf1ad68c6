#!/usr/bin/env python3
"""Which calibration keeps abstention: the variants of one model's answers, measured per kind of decision.

    nice -n 5 .venv/bin/python tools/calibration_study.py \\
        --model ~/.cache/semif/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --limit 150

Each row of the labeled file (default: data/decisions-dev.jsonl) is scored once, in-process, with
debias "content_free"; the answer carries the raw label logits and the content-free prior, so every
variant below is computed from the same model call:

- `none`: the raw answer.
- `content_free`: the raw logits less the content-free log-prior (debias "content_free").
- `content_free_keep_abstain`: as `content_free` among the regular options, while the row's abstain
  option (`abstain_option`) keeps its content-free probability: the content-free state is itself a
  reason to abstain, so its share is not divided out.
- `position`: no extra model call: each option position's mean content-free log-prior, per option
  count, estimated on the other decisions (leave one decision out) and subtracted.
- `position_keep_abstain`: `position`, the abstain option not shifted.

Rows are taken stratified (`--limit`): answers that are the abstain option, other rows of decisions with
an abstain option, rows whose option set appears once, and the other recurring decisions, in turn.
Per-row records go to --out as JSON Lines as they come (a rerun resumes); the summary prints at the end
and is written beside it (`.summary.json`). Choose on the dev split only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "container"))

def group(row: dict, once: set[str]) -> str:
    if row.get("abstain_option") and row["answer"] == row["abstain_option"]:
        return "abstain_answer"
    if row.get("abstain_option"):
        return "abstain_decision_regular"
    if row["decision_id"] in once:
        return "once_seen"
    return "recurring"


def stratified(rows: list[dict], once: set[str], limit: int | None) -> list[dict]:
    buckets: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        buckets[group(row, once)].append(row)
    order = ["abstain_answer", "abstain_decision_regular", "once_seen", "recurring"]
    out: list[dict] = []
    i = 0
    while (limit is None or len(out) < limit) and any(i < len(buckets[g]) for g in order):
        for g in order:
            if i < len(buckets[g]) and (limit is None or len(out) < limit):
                out.append(buckets[g][i])
        i += 1
    return out


def chosen_rows(data: str | Path, limit: int | None) -> tuple[list[dict], set[str]]:
    """The labeled rows a study reads (stratified, up to ``limit``) and the decisions whose option set
    appears once in the file."""
    rows = [json.loads(line) for line in Path(data).read_text(encoding="utf-8").split("\n") if line.strip()]
    counts = Counter(r["decision_id"] for r in rows)
    once = {d for d, c in counts.items() if c == 1}
    return stratified(rows, once, limit), once


def records_so_far(out: Path) -> dict[str, dict]:
    """A study's records already written to ``out`` (JSON Lines), by row id: a rerun resumes after them."""
    done: dict[str, dict] = {}
    if out.exists():
        for line in out.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                rec = json.loads(line)
                done[rec["id"]] = rec
    return done


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - math.log(np.exp(x).sum())


def variants(rec: dict, offsets: dict[int, np.ndarray] | None) -> dict[str, np.ndarray]:
    from semif.serving.engine.passes.prior import content_free_shift  # what the adapter subtracts, abstain kept or not

    raw = np.asarray(rec["raw_logits"], dtype=np.float64)
    a = rec["abstain_index"]
    out = {"none": raw, "content_free": raw - content_free_shift(rec["log_prior"]),
           "content_free_keep_abstain": raw - content_free_shift(rec["log_prior"], a)}
    if offsets is not None and len(raw) in offsets:
        off = offsets[len(raw)]
        out["position"] = raw - off
        pk = raw - off
        if a is not None:
            pk[a] = raw[a] - float(np.mean(np.delete(off, a)))  # the abstain option is not shifted for its position
        out["position_keep_abstain"] = pk
    return out


def position_offsets(records: list[dict], leave_out: str) -> dict[int, np.ndarray]:
    """Per option count: each position's mean content-free log-prior (normalised), over the other decisions."""
    by_n: dict[int, list[np.ndarray]] = defaultdict(list)
    seen: set[str] = set()
    for rec in records:
        if rec["decision_id"] == leave_out or rec["decision_id"] in seen:
            continue
        seen.add(rec["decision_id"])
        by_n[len(rec["log_prior"])].append(log_softmax(np.asarray(rec["log_prior"], dtype=np.float64)))
    return {n: np.mean(v, axis=0) for n, v in by_n.items()}


def summarise(records: list[dict]) -> dict:
    table: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for rec in records:
        offsets = position_offsets(records, rec["decision_id"])
        for name, logits in variants(rec, offsets).items():
            pick = int(np.argmax(logits))
            for g in (rec["group"], "all"):
                table[name][g]["n"] += 1
                table[name][g]["correct"] += int(pick == rec["answer_index"])
                if rec["abstain_index"] is not None:
                    table[name][g]["abstained"] += int(pick == rec["abstain_index"])
    return {name: {g: {"n": c["n"], "accuracy": round(c["correct"] / c["n"], 3), "correct": c["correct"],
                       "abstained": c["abstained"]} for g, c in groups.items()} for name, groups in table.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--data", default=str(REPO / "data" / "decisions-dev.jsonl"))
    parser.add_argument("--limit", type=int, default=None, help="rows, taken stratified")
    parser.add_argument("--n-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(REPO / "results" / "calibration-study.jsonl"))
    args = parser.parse_args(argv)

    from semif.serving.engine.context import Engine
    from semif.serving.engine.prompt import Outcome, Question

    chosen, once = chosen_rows(args.data, args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = records_so_far(out)
    engine = Engine(os.path.expanduser(args.model), n_ctx=4096, n_threads=args.n_threads)
    started = time.perf_counter()
    with out.open("a", encoding="utf-8") as sink:
        for i, row in enumerate(chosen, 1):
            if row["id"] in done:
                continue
            ids = [o["id"] for o in row["options"]]
            question = Question(row["question"], tuple(Outcome(o["id"], o.get("description")) for o in row["options"]),
                                kind="choice")
            t0 = time.perf_counter()
            dist = engine.score(row["state"], [question], scoring="label", debias="content_free").distributions[0]
            cf = dist.content_free
            rec = {"id": row["id"], "decision_id": row["decision_id"], "category": row["category"],
                   "group": group(row, once), "answer_index": ids.index(row["answer"]),
                   "abstain_index": ids.index(row["abstain_option"]) if row.get("abstain_option") else None,
                   "raw_logits": list(cf["option_logits"]), "log_prior": [math.log(max(p, 1e-300)) for p in cf["prior"]],
                   "ms": round((time.perf_counter() - t0) * 1000, 1)}
            done[row["id"]] = rec
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            print(f"[{i}/{len(chosen)}] {rec['group']:<26} {rec['ms']:>8.0f} ms  elapsed {time.perf_counter() - started:.0f} s",
                  flush=True)
    records = [done[r["id"]] for r in chosen if r["id"] in done]
    summary = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip(),
               "model": Path(args.model).name, "data": Path(args.data).name, "rows": len(records),
               "variants": summarise(records)}
    Path(str(out) + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    for name, groups in summary["variants"].items():
        print(f"{name:<26} " + "  ".join(f"{g} {v['correct']}/{v['n']} ({v['accuracy']:.3f}) abst {v['abstained']}"
                                          for g, v in sorted(groups.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
