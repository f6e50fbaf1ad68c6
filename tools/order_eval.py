#!/usr/bin/env python
"""Option-order sensitivity with and without order debiasing, on labeled decisions.

For each labeled decision, one debiased request through the engine: it scores the options as given
and reversed over one cached state, and its per-order answers are what "none" answers for each listing
(tests/test_labels_debias.py checks that equality). Reports the share of decisions whose choice is
unchanged when the options are reversed, and accuracy, without and with debiasing. The debiased answer
does not depend on the listing by construction (both listings score the same two prompts);
--check-reversed computes it for the reversed listing too. Latency: on the first --latency-decisions
decisions, "none" and "reverse" requests alternate with the context emptied before each, so every
timed request evaluates its state: the ratio debias/none is what debiasing costs a new state.

usage: python tools/order_eval.py MODEL.gguf [--data data/decisions-sample.jsonl data/heldout-decisions.jsonl]
                                             [--scoring label] [--latency-decisions 10] [--json out.json]
       python tools/order_eval.py --from-records records.jsonl   (the lines a --log-each run printed)
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

from semif.serving.engine.context import Engine
from semif.serving.engine.prompt import Outcome, Question

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
    parser.add_argument("model", nargs="?")
    parser.add_argument("--data", nargs="+", default=[str(p) for p in DEFAULT_DATA])
    parser.add_argument("--scoring", default="label", choices=["label", "sequence"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", help="write per-decision results and the summary here")
    parser.add_argument("--latency-decisions", type=int, default=10,
                        help="time this many decisions cold, none vs reverse alternated (default 10)")
    parser.add_argument("--check-reversed", action="store_true",
                        help="also score the reversed listing with debiasing (doubles the work; equal by construction)")
    parser.add_argument("--from-records", nargs="+", help="summarise the per-decision records a --log-each run printed (no model)")
    parser.add_argument("--log-each", action="store_true", help="print each decision's record to stderr as it is done")
    args = parser.parse_args(argv)

    if args.from_records:
        seen, records = set(), []
        for path in args.from_records:  # several runs' records, each decision once (the first seen)
            with open(path, encoding="utf-8") as handle:
                for record in (json.loads(line) for line in handle if line.startswith("{")):
                    if record["id"] not in seen:
                        seen.add(record["id"])
                        records.append(record)
        print(f"{len(records)} decision records from {', '.join(args.from_records)}")
        report(records, None, args)
        return 0
    if not args.model:
        parser.error("MODEL.gguf is required (or --from-records)")
    rows = load(args.data)
    engine = Engine(args.model, n_ctx=4096, n_threads=args.threads, label_memo=False)
    print(f"{engine.info['file']} sha256 {engine.info['sha256'][:12]}… template {engine.info['template_version']} "
          f"scoring {args.scoring}; {len(rows)} decisions from {', '.join(Path(p).name for p in args.data)}", flush=True)
    records = []
    with Progress() as progress:
        task = progress.add_task("decisions", total=len(rows))
        for index, row in enumerate(rows):
            options = [(o["id"], o.get("description")) for o in row["options"]]
            record = {"id": row["id"], "file": row["_file"], "answer": row["answer"]}
            given = Question(row["question"], tuple(Outcome(k, d) for k, d in options))
            reverse = Question(row["question"], tuple(Outcome(k, d) for k, d in options[::-1]))
            # One debiased request scores both orders over one cached state (reads 2: the stop rule off); its
            # per-order answers are exactly what "none" answers for the given and for the reversed listing.
            dist = engine.score(row["state"], [given], scoring=args.scoring, debias="reverse", reads=2).distributions[0]
            ids = [k for k, _ in options]
            for name, probabilities in (("none_given", dist.orders["given"]["probabilities"]),
                                        ("none_reversed", dist.orders["reversed"]["probabilities"]),
                                        ("reverse_given", dist.probabilities)):
                top = max(range(len(ids)), key=lambda i: probabilities[i])
                record[name] = {"choice": ids[top], "p": probabilities[top]}
            record["label_mass"] = dist.label_mass
            if args.check_reversed:  # the debiased answer to the reversed listing, computed for real
                back = engine.score(row["state"], [reverse], scoring=args.scoring, debias="reverse",
                                    reads=2).distributions[0]
                rids = [k for k, _ in options[::-1]]
                record["reverse_reversed"] = {"choice": rids[max(range(len(rids)), key=lambda i: back.probabilities[i])]}
            if index < args.latency_decisions:
                for mode in ("none", "reverse", "none", "reverse"):  # alternated: load drifts on a shared machine
                    engine.invalidate()  # cold: each timed request evaluates its state, as a new state would
                    started = time.perf_counter()
                    engine.score(row["state"], [given], scoring=args.scoring, debias=mode,
                                 **({"reads": 2} if mode == "reverse" else {}))  # both orders, as recorded above
                    record.setdefault(f"seconds_{mode}", []).append(time.perf_counter() - started)
            records.append(record)
            progress.advance(task)
            if args.log_each:
                print(json.dumps(record), file=sys.stderr, flush=True)

    report(records, engine, args)
    engine.close()
    return 0


def report(records, engine, args) -> None:
    n = len(records)
    summary = {
        "n": n,
        "none": {"unchanged": sum(r["none_given"]["choice"] == r["none_reversed"]["choice"] for r in records),
                 "accuracy_given": sum(r["none_given"]["choice"] == r["answer"] for r in records),
                 "accuracy_reversed": sum(r["none_reversed"]["choice"] == r["answer"] for r in records)},
        "reverse": {"accuracy_given": sum(r["reverse_given"]["choice"] == r["answer"] for r in records)},
    }
    checked = [r for r in records if "reverse_reversed" in r]
    if checked:
        summary["reverse"]["unchanged"] = sum(r["reverse_given"]["choice"] == r["reverse_reversed"]["choice"] for r in checked)
        summary["reverse"]["checked"] = len(checked)
    timed = [r for r in records if "seconds_none" in r]
    ratio = None
    if timed:
        none_s = statistics.mean(s for r in timed for s in r["seconds_none"])
        reverse_s = statistics.mean(s for r in timed for s in r["seconds_reverse"])
        ratio = reverse_s / none_s
        summary["latency"] = {"decisions": len(timed), "none_mean_s": none_s, "reverse_mean_s": reverse_s, "ratio": ratio}
    by_file = {}
    for name in sorted({r["file"] for r in records}):
        part = [r for r in records if r["file"] == name]
        by_file[name] = {"n": len(part),
                         "none_unchanged": sum(r["none_given"]["choice"] == r["none_reversed"]["choice"] for r in part),
                         "none_accuracy": sum(r["none_given"]["choice"] == r["answer"] for r in part),
                         "none_accuracy_reversed": sum(r["none_reversed"]["choice"] == r["answer"] for r in part),
                         "reverse_accuracy": sum(r["reverse_given"]["choice"] == r["answer"] for r in part)}
    none, rev = summary["none"], summary["reverse"]
    print(f"\ndecisions: {n}")
    print(f"debias none:    unchanged when reversed {none['unchanged']}/{n} = {none['unchanged'] / n:.1%}; "
          f"accuracy {none['accuracy_given']}/{n} = {none['accuracy_given'] / n:.3f} (given order), "
          f"{none['accuracy_reversed']}/{n} = {none['accuracy_reversed'] / n:.3f} (reversed)")
    unchanged = (f"{rev['unchanged']}/{rev['checked']} = {rev['unchanged'] / rev['checked']:.1%} (computed)"
                 if checked else "by construction (both listings score the same two prompts)")
    print(f"debias reverse: unchanged when reversed {unchanged}; accuracy {rev['accuracy_given']}/{n} = {rev['accuracy_given'] / n:.3f}")
    for name, v in by_file.items():
        print(f"  {name}: none unchanged {v['none_unchanged']}/{v['n']}, accuracy none {v['none_accuracy']}/{v['n']} "
              f"(reversed {v['none_accuracy_reversed']}/{v['n']}), reverse {v['reverse_accuracy']}/{v['n']}")
    if ratio is not None:
        lat = summary["latency"]
        print(f"latency (cold state, {lat['decisions']} decisions x 2 alternated runs each): none {lat['none_mean_s']:.3f} s, "
              f"reverse {lat['reverse_mean_s']:.3f} s, ratio debias/none {ratio:.2f}")
    if args.json and engine is not None:
        Path(args.json).write_text(json.dumps({"model": engine.info["file"], "sha256": engine.info["sha256"],
                                               "scoring": args.scoring, "summary": summary, "by_file": by_file,
                                               "latency_ratio": ratio, "records": records}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
