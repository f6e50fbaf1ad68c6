#!/usr/bin/env python3
"""Answers that do not depend on the order the caller lists the options: reads in several orders, measured.

    nice -n 5 .venv/bin/python tools/order_study.py \\
        --model ~/.cache/semif/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --limit 120

Each row of the labeled file (default: data/decisions-dev.jsonl) is read, in-process and without calibration
(debias "none"), in these option orders over one cached state:

- the order the row lists (`given`) and its reverse (`reversed`): what a caller gets today in either order;
- every cyclic rotation of the canonical order (options sorted by id: a function of the option set, not of
  the listing), in the schedule a request would read them (`rotation_schedule`).

Per read, the option logits (indexed by canonical position) and the read's compute time are recorded, so
every combination below comes from the same model calls:

- `given`, `reversed`: one read each; their agreement is the "same choice reversed" figure today.
- `reverse_pair`: debias "reverse", the mean log-probability of those two reads; the listing and its reverse
  make the same pair, so both give this answer.
- `rotations_k`: the mean log-probability of the first k scheduled rotations, k = 1 … n (k = 1 is the
  canonical order alone; the same whatever the listing).
- `reverse_stop_rules(δ)`: debias "reverse" with its stop rule: the direction `plan.first_direction` picks
  alone where its margin exceeds δ, else the pair; with how often it changes the pair's choice.
- `stop_rule(δ)`: read rotations in schedule until the combined answer cannot change any more if each unread
  rotation moved the margin by at most δ against the leader (k · margin_k > (n − k) · δ, margins in mean
  log-probability), or all are read. δ is chosen as the smallest value whose early stop changes the final
  choice in at most 2% of rows compared with reading every rotation, with one standard error of that share
  to spare (`within_budget`); `shared_delta` is the larger of the two passes' choices, the one the server uses.

With --abstain-last, the rows that mark an abstain option (`abstain_option`, data/README.md) are read once more
in every cyclic rotation of the other options' canonical order with the abstain option kept last (n − 1 reads,
to a side file `<out>.abstain-last.jsonl`): what `rotations` reads when the caller marks that option, since
"none of these" or "needs more information" reads as the last choice, not as one among the others. The summary
then reports `abstain_last` beside the plain rotations (rows without a mark count their plain rotations).

With --content-free, each row's content-free prior is read for the listing and for its reverse (the prior
depends on the order shown; to a side file `<out>.content-free.jsonl`, in canonical order), and the summary
reports `content_free` (the raw reads less the content-free log-prior, the server's calibration) and
`content_free_keep_abstain` (the row's marked abstain option keeps its content-free share) in both listings,
so that calibration is judged by the same figures as the reads in several orders.

Rows are taken stratified (`--limit`, the groups of tools/calibration_study.py). Records go to --out as JSON
Lines as they come (a rerun resumes); the summary is written beside it (`.summary.json`). Choose on the dev
split only, and settle the rule before a holdout run: the guard on the change budget (`within_budget`) was added
after one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "container"))
sys.path.insert(0, str(REPO / "tools"))

from calibration_study import chosen_rows, group, records_so_far  # noqa: E402

from semif.serving.engine.plan import rotation_schedule  # noqa: E402  (the schedule a request reads in)

CHANGE_BUDGET = 0.02  # the share of rows whose final choice the stop rule may change
# The allowances tried: every 0.05 up to 1, then coarser; the chosen one is the smallest within the budget.
DELTAS = [round(0.05 * i, 2) for i in range(21)] + [1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 1e9]


def within_budget(changed_rows: int, rows: int) -> bool:
    """Whether a stop rule that changed ``changed_rows`` of ``rows`` final choices keeps to CHANGE_BUDGET with one
    standard error of that share to spare: a few hundred rows measure a share of 2% to about ±1%, so a rule at
    the budget's edge on them is as likely over it on new decisions as under it."""
    share = changed_rows / rows
    return share + math.sqrt(share * (1 - share) / rows) <= CHANGE_BUDGET


def smallest_within_budget(rules: list[dict], rows: int) -> float | None:
    """The smallest allowance whose early stop keeps to the change budget (within_budget, counted in rows)."""
    fitting = [r for r in rules if within_budget(r["changed_rows"], rows)]
    return min(fitting, key=lambda r: r["delta"])["delta"] if fitting else None


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def combined(reads: list[np.ndarray]) -> np.ndarray:
    return np.mean([log_softmax(r) for r in reads], axis=0)


def margin(logp: np.ndarray) -> float:
    top = np.sort(logp)[::-1]
    return float(top[0] - top[1]) if len(top) > 1 else math.inf


def stop_after(reads: list[np.ndarray], delta: float) -> int:
    """How many scheduled reads the stop rule takes (at least one)."""
    n = len(reads)
    for k in range(1, n + 1):
        if k == n or k * margin(combined(reads[:k])) > (n - k) * delta:
            return k
    return n


def calibrated(rec: dict, priors: dict, which: str, keep_abstain: bool) -> int:
    """The choice content-free calibration makes on the ``which`` listing ("given" or "reversed")."""
    from semif.serving.engine.passes.prior import content_free_shift  # what the adapter subtracts

    abstain = rec.get("abstain_index") if keep_abstain else None
    raw = np.asarray(rec[which], dtype=np.float64)
    return int(np.argmax(raw - content_free_shift(np.log(np.maximum(priors[which], 1e-300)), abstain)))


def reverse_stop_rules(records: list[dict], first_listed: dict, by_group: dict[str, list[int]]) -> list[dict]:
    """debias "reverse" with its stop rule: the first direction (plan.first_direction; ``first_listed[id]``:
    whether it is the row's listing) alone where its margin exceeds δ (1 · margin > 1 · δ), else the pair. The
    answer is the same for the listing and its reverse, so one accuracy covers both."""
    rules = []
    for delta in DELTAS:
        picks, pairs, ones, ms = [], [], [], []
        for r in records:
            listed, back = log_softmax(r["given"]), log_softmax(r["reversed"])
            first, first_ms = (listed, r["given_ms"]) if first_listed[r["id"]] else (back, r["reversed_ms"])
            pair = int(np.argmax(combined([listed, back])))
            one = margin(first) > delta
            picks.append(int(np.argmax(first)) if one else pair)
            pairs.append(pair)
            ones.append(one)
            ms.append(first_ms if one else r["given_ms"] + r["reversed_ms"])
        changed = sum(a != b for a, b in zip(picks, pairs))
        rules.append({"delta": delta,
                      "accuracy": round(sum(int(p == r["answer"]) for p, r in zip(picks, records)) / len(records), 3),
                      "changed_vs_pair": round(changed / len(records), 3), "changed_rows": changed,
                      "one_read_share": round(sum(ones) / len(records), 3), "p50_ms": round(statistics.median(ms), 1),
                      "per_group": {g: round(sum(int(picks[i] == records[i]["answer"]) for i in ix) / len(ix), 3)
                                    for g, ix in by_group.items()}})
    return rules


def summarise(records: list[dict], abstain_last: dict | None = None, content_free: dict | None = None,
              first_listed: dict | None = None) -> dict:
    def acc(picks):
        return sum(int(p == r["answer"]) for p, r in zip(picks, records)) / len(records)

    by_group: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_group.setdefault(r["group"], []).append(i)
    per_row = []
    for r in records:
        rot = [np.asarray(x) for x in r["rotations"]]
        per_row.append({"given": int(np.argmax(r["given"])), "reversed": int(np.argmax(r["reversed"])),
                        "pair": int(np.argmax(combined([np.asarray(r["given"]), np.asarray(r["reversed"])]))),
                        "all": int(np.argmax(combined(rot))), "rot": rot})
    out: dict = {"rows": len(records)}
    out["given"] = {"accuracy": round(acc([p["given"] for p in per_row]), 3)}
    out["reversed"] = {"accuracy": round(acc([p["reversed"] for p in per_row]), 3)}
    out["same_choice_reversed_none"] = round(sum(p["given"] == p["reversed"] for p in per_row) / len(per_row), 3)
    out["both_orders_mean_accuracy_none"] = round((out["given"]["accuracy"] + out["reversed"]["accuracy"]) / 2, 3)
    out["reverse_pair"] = {"accuracy": round(acc([p["pair"] for p in per_row]), 3), "reads": 2}
    if first_listed is not None:
        out["reverse_stop_rules"] = reverse_stop_rules(records, first_listed, by_group)
        out["reverse_chosen_delta"] = smallest_within_budget(out["reverse_stop_rules"], len(records))
    curve = []
    for k in range(1, 13):
        picks = [int(np.argmax(combined(p["rot"][:k]))) for p in per_row]
        curve.append({"reads_at_most": k, "accuracy": round(acc(picks), 3),
                      "mean_reads": round(statistics.mean(min(k, len(p["rot"])) for p in per_row), 2)})
    out["rotations_curve"] = curve
    out["all_rotations"] = {"accuracy": round(acc([p["all"] for p in per_row]), 3),
                            "mean_reads": round(statistics.mean(len(p["rot"]) for p in per_row), 2)}
    rules = []
    for delta in DELTAS:
        ks = [stop_after(p["rot"], delta) for p in per_row]
        picks = [int(np.argmax(combined(p["rot"][:k]))) for p, k in zip(per_row, ks)]
        changed = sum(pk != p["all"] for pk, p in zip(picks, per_row))
        ms = [sum(r["rotation_ms"][:k]) for r, k in zip(records, ks)]
        rules.append({"delta": delta, "accuracy": round(acc(picks), 3),
                      "changed_vs_all": round(changed / len(per_row), 3), "changed_rows": changed,
                      "mean_reads": round(statistics.mean(ks), 2), "one_read_share": round(ks.count(1) / len(ks), 3),
                      "p50_ms": round(statistics.median(ms), 1),
                      "per_group": {g: round(sum(int(picks[i] == records[i]["answer"]) for i in ix) / len(ix), 3)
                                    for g, ix in by_group.items()}})
    out["stop_rules"] = rules
    out["chosen_delta"] = smallest_within_budget(rules, len(records))
    if out.get("reverse_chosen_delta") is not None and out["chosen_delta"] is not None:
        # One allowance serves both passes (passes/orders.py STOP_MARGIN_PER_READ): the larger of the two.
        out["shared_delta"] = max(out["reverse_chosen_delta"], out["chosen_delta"])
    out["per_group"] = {g: {"n": len(ix),
                            "given": round(sum(int(per_row[i]["given"] == records[i]["answer"]) for i in ix) / len(ix), 3),
                            "reversed": round(sum(int(per_row[i]["reversed"] == records[i]["answer"]) for i in ix) / len(ix), 3),
                            "reverse_pair": round(sum(int(per_row[i]["pair"] == records[i]["answer"]) for i in ix) / len(ix), 3),
                            "canonical": round(sum(int(np.argmax(per_row[i]["rot"][0]) == records[i]["answer"]) for i in ix) / len(ix), 3),
                            "all_rotations": round(sum(int(per_row[i]["all"] == records[i]["answer"]) for i in ix) / len(ix), 3)}
                        for g, ix in by_group.items()}
    out["given_ms_p50"] = round(statistics.median(r["given_ms"] for r in records), 1)
    covered = [r for r in records if r["id"] in (abstain_last or {})]
    if covered:
        # Marked rows read with the abstain option kept last; the others as plain rotations.
        reads = [[np.asarray(x) for x in abstain_last[r["id"]]["rotations"]] if r["id"] in abstain_last else p["rot"]
                 for r, p in zip(records, per_row)]
        picks_all = [int(np.argmax(combined(rs))) for rs in reads]
        entry = {"marked_rows": len(covered), "accuracy": round(acc(picks_all), 3),
                 "mean_reads": round(statistics.mean(len(rs) for rs in reads), 2), "stop_rules": []}
        for delta in DELTAS:
            ks = [stop_after(rs, delta) for rs in reads]
            picks = [int(np.argmax(combined(rs[:k]))) for rs, k in zip(reads, ks)]
            entry["stop_rules"].append({
                "delta": delta, "accuracy": round(acc(picks), 3), "mean_reads": round(statistics.mean(ks), 2),
                "changed_vs_all": round(sum(a != b for a, b in zip(picks, picks_all)) / len(picks), 3),
                "per_group": {g: round(sum(int(picks[i] == records[i]["answer"]) for i in ix) / len(ix), 3)
                              for g, ix in by_group.items()}})
        out["abstain_last"] = entry
    with_cf = [r for r in records if r["id"] in (content_free or {})]
    if with_cf:
        # Over the rows whose priors were read (all of them once the side file is complete).
        for name, keep in (("content_free", False), ("content_free_keep_abstain", True)):
            picks = {w: [calibrated({**r, "abstain_index": content_free[r["id"]].get("abstain_index")},
                                    content_free[r["id"]], w, keep) for r in with_cf] for w in ("given", "reversed")}
            hit = {w: [int(p == r["answer"]) for p, r in zip(picks[w], with_cf)] for w in picks}
            out[name] = {"rows": len(with_cf),
                         "given": round(sum(hit["given"]) / len(with_cf), 3),
                         "reversed": round(sum(hit["reversed"]) / len(with_cf), 3),
                         "same_choice_reversed": round(sum(a == b for a, b in zip(picks["given"], picks["reversed"]))
                                                       / len(with_cf), 3),
                         "per_group": {g: {"n": len(ix), **{w: round(sum(hit[w][i] for i in ix) / len(ix), 3)
                                                            for w in ("given", "reversed")}}
                                       for g in sorted({r["group"] for r in with_cf})
                                       for ix in [[i for i, r in enumerate(with_cf) if r["group"] == g]]}}
    return out


def _first_is_listed(row: dict) -> bool:
    """Whether debias "reverse" reads the row's listing first (plan.first_direction), not its reverse."""
    from semif.serving.engine.plan import first_direction
    from semif.serving.engine.prompt import Outcome, Question

    question = Question(row["question"], tuple(Outcome(o["id"]) for o in row["options"]), kind="choice")
    return first_direction(question)[0] == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--data", default=str(REPO / "data" / "decisions-dev.jsonl"))
    parser.add_argument("--limit", type=int, default=None, help="rows, taken stratified")
    parser.add_argument("--n-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(REPO / "results" / "order-study.jsonl"))
    parser.add_argument("--summary-only", action="store_true", help="summarise the records in --out, score nothing")
    parser.add_argument("--abstain-last", action="store_true",
                        help="also read marked rows with the abstain option kept last in every rotation")
    parser.add_argument("--content-free", action="store_true",
                        help="also read each row's content-free prior in the listing and its reverse")
    args = parser.parse_args(argv)

    chosen, once = chosen_rows(args.data, args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = records_so_far(out)
    side = Path(str(out) + ".abstain-last.jsonl")
    last_done = records_so_far(side)
    cf_side = Path(str(out) + ".content-free.jsonl")
    cf_done = records_so_far(cf_side)
    if not args.summary_only:
        from rich.progress import Progress

        from semif.serving.engine.context import Engine
        from semif.serving.engine.prompt import Outcome, Question

        engine = Engine(os.path.expanduser(args.model), n_ctx=4096, n_threads=args.n_threads)

        def read(row: dict, order: list[int]) -> tuple[list[float], float]:
            """The raw option logits of one read, options shown in ``order`` (canonical indices), put back
            in canonical order; and its compute time."""
            canon = sorted(row["options"], key=lambda o: o["id"])
            shown = [canon[i] for i in order]
            question = Question(row["question"], tuple(Outcome(o["id"], o.get("description")) for o in shown),
                                kind="choice")
            t0 = time.perf_counter()
            dist = engine.score(row["state"], [question], scoring="label", debias="none").distributions[0]
            ms = (time.perf_counter() - t0) * 1000
            logits = [0.0] * len(order)
            for position, index in enumerate(order):
                logits[index] = dist.option_logits[position]
            return logits, ms

        def prior(row: dict, order: list[int]) -> list[float]:
            """The content-free prior of the question with its options shown in ``order`` (canonical
            indices), put back in canonical order: what debias "content_free" divides out for that listing."""
            canon = sorted(row["options"], key=lambda o: o["id"])
            question = Question(row["question"], tuple(Outcome(canon[i]["id"], canon[i].get("description"))
                                                       for i in order), kind="choice")
            # The prior does not depend on the state: a one-word state keeps the request's own read cheap.
            dist = engine.score("-", [question], scoring="label", debias="content_free").distributions[0]
            out = [0.0] * len(order)
            for position, index in enumerate(order):
                out[index] = dist.content_free["prior"][position]
            return out

        with out.open("a", encoding="utf-8") as sink, Progress() as progress:
            task = progress.add_task("rows", total=len(chosen), completed=sum(r["id"] in done for r in chosen))
            for row in chosen:
                if row["id"] in done:
                    continue
                canon_ids = sorted(o["id"] for o in row["options"])
                n = len(canon_ids)
                given_order = [canon_ids.index(o["id"]) for o in row["options"]]
                rotations, rotation_ms, schedule = [], [], rotation_schedule(n)
                for r in schedule:
                    logits, ms = read(row, [(i + r) % n for i in range(n)])
                    rotations.append(logits)
                    rotation_ms.append(round(ms, 1))
                by_order = {tuple((i + r) % n for i in range(n)): (logits, ms)
                            for r, logits, ms in zip(schedule, rotations, rotation_ms)}
                # The listing (or its reverse) may be one of the rotations: the same prompt, read once.
                given, given_ms = by_order.get(tuple(given_order)) or read(row, given_order)
                back, back_ms = by_order.get(tuple(given_order[::-1])) or read(row, given_order[::-1])
                rec = {"id": row["id"], "decision_id": row["decision_id"], "group": group(row, once), "n": n,
                       "answer": canon_ids.index(row["answer"]), "schedule": schedule, "rotations": rotations,
                       "rotation_ms": rotation_ms, "given": given, "given_ms": round(given_ms, 1), "reversed": back,
                       "reversed_ms": round(back_ms, 1)}
                done[row["id"]] = rec
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                progress.advance(task)
        if args.abstain_last:
            marked = [r for r in chosen if r.get("abstain_option") is not None and r["id"] not in last_done]
            with side.open("a", encoding="utf-8") as sink, Progress() as progress:
                task = progress.add_task("abstain last", total=len(marked))
                for row in marked:
                    canon_ids = sorted(o["id"] for o in row["options"])
                    n, last = len(canon_ids), canon_ids.index(row["abstain_option"])
                    others = [i for i in range(n) if i != last]
                    reads, ms_list = [], []
                    for r in rotation_schedule(n - 1):
                        logits, ms = read(row, [others[(i + r) % (n - 1)] for i in range(n - 1)] + [last])
                        reads.append(logits)
                        ms_list.append(round(ms, 1))
                    rec = {"id": row["id"], "abstain_index": last, "rotations": reads, "rotation_ms": ms_list}
                    last_done[row["id"]] = rec
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                    progress.advance(task)
        if args.content_free:
            todo = [r for r in chosen if r["id"] not in cf_done]
            with cf_side.open("a", encoding="utf-8") as sink, Progress() as progress:
                task = progress.add_task("content-free priors", total=len(todo))
                for row in todo:
                    canon_ids = sorted(o["id"] for o in row["options"])
                    given_order = [canon_ids.index(o["id"]) for o in row["options"]]
                    rec = {"id": row["id"], "abstain_index": (canon_ids.index(row["abstain_option"])
                                                              if row.get("abstain_option") else None)}
                    for which, order in (("given", given_order), ("reversed", given_order[::-1])):
                        rec[which] = prior(row, order)
                    cf_done[row["id"]] = rec
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                    progress.advance(task)
    records = [done[r["id"]] for r in chosen if r["id"] in done]
    if not records:
        print("no records to summarise", file=sys.stderr)
        return 1
    summary = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip(),
               "model": Path(args.model).name, "data": Path(args.data).name,
               **summarise(records, last_done, cf_done, {row["id"]: _first_is_listed(row) for row in chosen})}
    Path(str(out) + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("stop_rules", "rotations_curve")}, indent=1))
    for r in summary["stop_rules"]:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
