#!/usr/bin/env python3
"""Which spellings of an answer label to read: the adapter's readout against callo's, from the same logits.

    nice -n 5 .venv/bin/python tools/readout_study.py \\
        --model ~/.cache/semif/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --limit 120 \\
        --out results/readout-study-qwen-dev120.jsonl

Each labeled row (default: data/decisions-dev.jsonl) is planned by the adapter's engine (`Engine.plan`, debias
"content_free": the exact prompt tokens the server evaluates, for the row and for its content-free prompt), and
those tokens are evaluated here with llama-cpp-python directly, so every readout below comes from the same
next-token logits row at the answer position:

- `current`: the engine's label variants (`A`, and `▁A`/` A` where that is one token too), summed.
- `case`: `current` plus the other case (`a`, ` a`) where those are single tokens.
- `surface`: callo 0.3.1's equivalence sets (`callo/marginalize.py`, `option_surface_sets`): every vocabulary
  token whose decoded text, NFKC-normalised and stripped at both ends of whitespace, markdown, brackets and
  punctuation, uppercases to the label (`A`, ` a`, `(A`, `A.`, `**A` where that is one token, ...).
- `current+walk`, `surface+walk`: callo's divergence walk (`divergence_walk`) on top: while the labels carry
  less than 10% of the mass and one token holds at least half of it (a shared preamble such as `**`, `(` or a
  newline), that token is appended and the next position is read instead; never past an end-of-generation
  token, at most 8 tokens deep.

Each readout is scored raw (`none`) and with the content-free prior read the same way from the content-free
prompt (`content_free`: `engine.context.content_free_shift`). Accuracy is reported per
readout, per group (tools/calibration_study.py's `group`: abstain answers, other rows of abstain decisions,
decisions seen once, recurring ones; rows taken stratified by its `stratified`) and per category, with the
paired wins and losses of each readout against `current` and a two-sided exact sign test.

Per-row records go to --out as JSON Lines as they come (a rerun resumes); the summary prints at the end and is
written beside it (`.summary.json`). Choose on the dev split only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import unicodedata
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "container"))
sys.path.insert(0, str(REPO / "tools"))

from calibration_study import chosen_rows, group, records_so_far  # noqa: E402

READOUTS = ("current", "case", "surface", "current+walk", "surface+walk")
DEBIASES = ("none", "content_free")

# callo 0.3.1, callo/marginalize.py: the characters stripped from both ends of a decoded token (whitespace,
# markdown, brackets, punctuation, dashes, quotes), and the walk's defaults.
WRAPPER_CHARS = (" \t\n\r\f\v\xa0\u3000" "*_~`" "()[]{}<>" ".,:;!?-/\\|#+=" "\u2013\u2014" "'\""
                 "\u2018\u2019\u201c\u201d\u00ab\u00bb")
WALK_MAX_DEPTH = 8
WALK_DIVERGENCE_MASS = 0.10
WALK_DOMINANCE = 0.50


def normalize_surface(text: str) -> str:
    """callo's normalize_surface: NFKC, wrappers stripped from both ends to a fixed point, uppercased."""
    text = unicodedata.normalize("NFKC", text)
    previous = None
    while previous != text:
        previous = text
        text = text.strip().strip(WRAPPER_CHARS)
    return text.upper()


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - math.log(float(np.exp(shifted).sum()))


def logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return -math.inf
    return top + math.log(sum(math.exp(v - top) for v in values))


def label_sets(current: Sequence[Sequence[int]], labels: Sequence[str], pieces: Sequence[str]) -> dict[str, list[list[int]]]:
    """Per readout, each label's token ids. ``pieces``: every vocabulary token's decoded text."""
    lower = [{label.lower(), " " + label.lower()} for label in labels]
    by_surface: dict[str, list[int]] = defaultdict(list)
    for token, piece in enumerate(pieces):
        key = normalize_surface(piece)
        if key:
            by_surface[key].append(token)
    wanted_lower: dict[str, int] = {}
    for i, spellings in enumerate(lower):
        for spelling in spellings:
            wanted_lower[spelling] = i
    extra: dict[int, set[int]] = defaultdict(set)
    for token, piece in enumerate(pieces):
        if piece in wanted_lower:
            extra[wanted_lower[piece]].add(token)
    case = [sorted(set(v) | extra[i]) for i, v in enumerate(current)]
    surface = [sorted(set(v) | set(by_surface.get(label.upper(), ()))) for label, v in zip(labels, current)]
    sets = {"current": [list(v) for v in current], "case": case, "surface": surface}
    for name, groups in sets.items():
        seen: set[int] = set()
        for ids in groups:
            if seen & set(ids):
                raise SystemExit(f"readout {name}: two labels share a token ({sorted(seen & set(ids))[:5]}); labels {labels}")
            seen |= set(ids)
    return sets


class Reader:
    """Next-token logits after a token sequence, reusing the context's common prefix with the last one."""

    def __init__(self, model: str, n_ctx: int, n_threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.evaluated = 0

    def pieces(self) -> list[str]:
        detokenize = self.llm._model.detokenize
        return [detokenize([t], special=False).decode("utf-8", errors="replace") for t in range(self.n_vocab)]

    def is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token))

    def logprobs_after(self, tokens: Sequence[int]) -> np.ndarray:
        held = self.llm.n_tokens
        common, limit = 0, min(held, len(tokens) - 1)
        while common < limit and int(self.llm.input_ids[common]) == tokens[common]:
            common += 1
        self.llm.n_tokens = common
        self.llm.eval(list(tokens[common:]))
        self.evaluated += len(tokens) - common
        row = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return log_softmax(np.array(row, dtype=np.float64))


def read_labels(row: np.ndarray, sets: Sequence[Sequence[int]]) -> tuple[list[float], float]:
    """(each label's log-probability: the log-sum-exp over its tokens, the labels' total mass)."""
    values = [logsumexp([float(row[t]) for t in ids]) for ids in sets]
    return values, float(sum(math.exp(v) for v in values))


def walk(tokens: Sequence[int], sets: Sequence[Sequence[int]], logprobs_after: Callable[[Sequence[int]], np.ndarray],
         is_eog: Callable[[int], bool], first: np.ndarray) -> dict:
    """callo's divergence walk: read where the labels carry mass, stepping over a dominant shared preamble."""
    cur, row, depth = list(tokens), first, 0
    while True:
        values, mass = read_labels(row, sets)
        top = int(np.argmax(row))
        dominant = math.exp(float(row[top])) >= WALK_DOMINANCE
        if mass >= WALK_DIVERGENCE_MASS:
            stop = "diverged"
        elif dominant and is_eog(top):
            stop = "eog"
        elif depth >= WALK_MAX_DEPTH:
            stop = "max_depth"
        elif not dominant:
            stop = "no_shared_prefix"
        else:
            cur.append(top)
            depth += 1
            row = logprobs_after(cur)
            continue
        return {"logprobs": values, "mass": mass, "depth": depth, "stop": stop,
                "walked": cur[len(tokens):]}


def readouts(tokens: Sequence[int], sets: dict[str, list[list[int]]], reader: Reader) -> dict[str, dict]:
    row = reader.logprobs_after(tokens)
    out = {}
    for name in ("current", "case", "surface"):
        values, mass = read_labels(row, sets[name])
        out[name] = {"logprobs": values, "mass": mass}
    out["top_token"] = int(np.argmax(row))
    for name in ("current", "surface"):
        out[name + "+walk"] = walk(tokens, sets[name], reader.logprobs_after, reader.is_eog, row)
    return out


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of wins against losses (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def content_free_shift(log_prior: Sequence[float]) -> np.ndarray:
    """What the server subtracts under debias "content_free" (the engine's own function, wherever it lives)."""
    try:
        from semif.serving.engine.passes.prior import content_free_shift as shift
    except ImportError:
        from semif.serving.engine.context import content_free_shift as shift
    return shift(log_prior)


def served_logits(rec: dict, readout: str, debias: str) -> np.ndarray:
    """The logits the server would answer with under ``debias``, read the ``readout`` way."""
    values = np.asarray(rec["readouts"][readout]["logprobs"], dtype=np.float64)
    if debias == "content_free":
        prior = np.asarray(rec["content_free"][readout]["logprobs"], dtype=np.float64)
        values = values - content_free_shift(log_softmax(prior))
    return values


def picks(rec: dict, readout: str, debias: str) -> int:
    return int(np.argmax(served_logits(rec, readout, debias)))


def calibration(records: list[dict], folds: int = 5, seed: int = 0) -> dict:
    """Held-out (k-fold, as semif-calibrate) NLL, Brier and ECE of the `current` readout: raw, temperature
    scaling and Platt scaling, each fitted on the other folds (semif.serving.postprocess.calibration)."""
    from semif.serving.postprocess.calibration import Case, cross_validate

    out = {}
    for debias in DEBIASES:
        cases = [Case(rec["decision_id"], rec["answer_index"], served_logits(rec, "current", debias).tolist()) for rec in records]
        methods = cross_validate(cases, k=folds, seed=seed)["methods"]
        out[debias] = {name: {k: round(v, 4) for k, v in methods[name].items()} for name in ("raw", "temperature", "platt")}
    return out


def summarise(records: list[dict]) -> dict:
    table: dict[str, dict[str, dict[str, Counter]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(Counter)))
    paired = {debias: {readout: Counter() for readout in READOUTS} for debias in DEBIASES}
    for rec in records:
        for debias in DEBIASES:
            base = picks(rec, "current", debias) == rec["answer_index"]
            for readout in READOUTS:
                ok = picks(rec, readout, debias) == rec["answer_index"]
                for key in ("all", "group:" + rec["group"], "category:" + rec["category"]):
                    table[debias][readout][key]["n"] += 1
                    table[debias][readout][key]["correct"] += int(ok)
                if ok != base:
                    paired[debias][readout]["wins" if ok else "losses"] += 1
    accuracy = {debias: {readout: {key: {"n": c["n"], "correct": c["correct"], "accuracy": round(c["correct"] / c["n"], 3)}
                                   for key, c in sorted(keys.items())} for readout, keys in readouts_.items()}
                for debias, readouts_ in table.items()}
    versus = {debias: {readout: {"wins": c["wins"], "losses": c["losses"], "sign_test_p": round(sign_test(c["wins"], c["losses"]), 4)}
                       for readout, c in by.items()} for debias, by in paired.items()}
    mass = {readout: round(float(np.mean([rec["readouts"][readout]["mass"] for rec in records])), 4) for readout in READOUTS}
    least_mass = {readout: round(min(rec["readouts"][readout]["mass"] for rec in records), 4) for readout in READOUTS}

    def probabilities(rec: dict, readout: str, debias: str) -> np.ndarray:
        values = served_logits(rec, readout, debias)
        values = np.exp(values - values.max())
        return values / values.sum()

    # The largest change any readout makes to any option's probability, against `current`.
    moved = {debias: {readout: round(max(float(np.max(np.abs(probabilities(rec, readout, debias) - probabilities(rec, "current", debias))))
                                         for rec in records), 4) for readout in READOUTS} for debias in DEBIASES}
    stops = {readout: dict(Counter(rec["readouts"][readout]["stop"] for rec in records))
             for readout in ("current+walk", "surface+walk")}
    walked = {readout: sum(1 for rec in records if rec["readouts"][readout]["depth"] > 0) for readout in ("current+walk", "surface+walk")}
    return {"accuracy": accuracy, "versus_current": versus, "mean_label_mass": mass, "least_label_mass": least_mass,
            "largest_probability_change": moved, "walk_stops": stops,
            "rows_walked": walked, "calibration": calibration(records) if len(records) >= 5 else None}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--data", default=str(REPO / "data" / "decisions-dev.jsonl"))
    parser.add_argument("--limit", type=int, default=None, help="rows, taken stratified")
    parser.add_argument("--n-threads", type=int, default=1,
                        help="llama.cpp threads (1: on a shared machine more threads than free cores is several times slower)")
    parser.add_argument("--check", type=int, default=2,
                        help="rows whose `current` readout is checked against Engine.score's own probabilities")
    parser.add_argument("--part", default="0/1", help="K/N: score only the chosen rows whose index is K modulo N (to "
                        "split a run over processes; concatenate their --out files and rerun to summarise them all)")
    parser.add_argument("--out", default=str(REPO / "results" / "readout-study.jsonl"))
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from semif.serving.engine.context import Engine
    from semif.serving.engine.prompt import Outcome, Question

    console = Console(stderr=True)
    model = os.path.expanduser(args.model)
    chosen, once = chosen_rows(args.data, args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = records_so_far(out)
    engine = Engine(model, n_ctx=4096, n_threads=args.n_threads)
    reader = Reader(model, 4096, args.n_threads)
    pieces = reader.pieces()
    content_free_rows: dict[tuple, dict] = {}
    checked = 0
    started = time.perf_counter()
    part, parts = (int(x) for x in args.part.split("/"))
    todo = [row for i, row in enumerate(chosen) if row["id"] not in done and i % parts == part]
    with out.open("a", encoding="utf-8") as sink, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("readouts", total=len(todo))
        for row in todo:
            ids = [o["id"] for o in row["options"]]
            question = Question(row["question"], tuple(Outcome(o["id"], o.get("description")) for o in row["options"]),
                                kind="choice")
            plan = engine.plan(row["state"], [question], scoring="label", debias="content_free")
            qplan = plan.questions[0]
            tokens = [t for segment in plan.prefix_segments for t in segment] + list(qplan.suffix_tokens)
            sets = label_sets(qplan.label_variants, qplan.labels, pieces)
            t0 = time.perf_counter()
            found = readouts(tokens, sets, reader)
            cf = plan.content_free
            cf_tokens = tuple([t for segment in cf.prefix_segments for t in segment] + list(cf.questions[0].suffix_tokens))
            if cf_tokens not in content_free_rows:
                content_free_rows[cf_tokens] = readouts(cf_tokens, sets, reader)
            prior = content_free_rows[cf_tokens]
            if checked < args.check:
                # The same readout as the server's: Engine.score's probabilities, debias none, from its own context.
                served = engine.score(row["state"], [question], scoring="label", debias="none").distributions[0]
                mine = np.exp(found["current"]["logprobs"]) / np.exp(found["current"]["logprobs"]).sum()
                gap = float(np.max(np.abs(np.asarray(served.probabilities) - mine)))
                if gap > 0.02:
                    raise SystemExit(f"{row['id']}: the current readout differs from Engine.score by {gap:.4f}")
                checked += 1
            keep = {"logprobs", "mass", "depth", "stop", "walked"}
            rec = {"id": row["id"], "decision_id": row["decision_id"], "category": row["category"],
                   "group": group(row, once), "answer_index": ids.index(row["answer"]),
                   "abstain_index": ids.index(row["abstain_option"]) if row.get("abstain_option") else None,
                   "labels": list(qplan.labels), "tokens_per_label": {name: [len(v) for v in s] for name, s in sets.items()},
                   "top_token": pieces[found["top_token"]],
                   "readouts": {name: {k: v for k, v in found[name].items() if k in keep} for name in READOUTS},
                   "content_free": {name: {k: v for k, v in prior[name].items() if k in keep} for name in READOUTS},
                   "ms": round((time.perf_counter() - t0) * 1000, 1)}
            done[row["id"]] = rec
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            bar.advance(task)
    records = [done[r["id"]] for r in chosen if r["id"] in done]
    summary = {"command": " ".join([f"tools/{Path(__file__).name}"] + (argv if argv is not None else sys.argv[1:])),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip(),
               "model": Path(model).name, "data": Path(args.data).name, "rows": len(records),
               "seconds": round(time.perf_counter() - started, 1), **summarise(records)}
    Path(str(out) + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    for debias in DEBIASES:
        for readout in READOUTS:
            a = summary["accuracy"][debias][readout]["all"]
            v = summary["versus_current"][debias][readout]
            print(f"{debias:<13} {readout:<14} {a['correct']}/{a['n']} ({a['accuracy']:.3f})  vs current +{v['wins']} "
                  f"-{v['losses']} (p={v['sign_test_p']})")
    print(f"largest probability change against current: {summary['largest_probability_change']}")
    print(f"mean label mass {summary['mean_label_mass']}; least {summary['least_label_mass']}; walked {summary['rows_walked']}; stops {summary['walk_stops']}")
    for debias, methods in (summary["calibration"] or {}).items():
        print(f"calibration ({debias}, held-out): " + "  ".join(
            f"{name} NLL {m['nll']:.3f} Brier {m['brier']:.3f} ECE {m['ece']:.3f}" for name, m in methods.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
