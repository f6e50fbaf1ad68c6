#!/usr/bin/env python
"""Per-request overhead of the engine: where the time of one cold decision goes, without HTTP.

For every held-out decision (each with a state the engine has not seen), measures
  plan      building the prompt plan (fence, template, tokenization, label checks)
  execute   running the plan on the context
  decode    of execute, the time inside llama_decode (the model itself)
  python    execute - decode: the engine's own work per request (batch filling, logits reading, hashing)
as wall-clock milliseconds and as CPU milliseconds of the calling thread (`time.thread_time`: what the
Python side costs, nearly unaffected by other processes competing for the cores), and prints medians.
The decode time is the floor; `plan + python` is the overhead this script exists to show.

Before/after in one run: `--container DIR` loads the `semif` package from another checkout (e.g. the
parent commit, `git archive HEAD~1 container | tar -x -C /tmp/before`); with `--compare DIR` both run in
this process, alternating per case, and the ratios after/before are printed.

usage: python tools/bench_overhead.py [--model GGUF] [--rounds N] [--threads N] [--scoring label|sequence]
                                      [--compare BEFORE_CONTAINER_DIR]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = REPO / "data" / "heldout-decisions.jsonl"
COLUMNS = ("plan", "execute", "decode", "python", "overhead")


def load_semif(container: Path, alias: str):
    """The `semif` package of ``container`` imported under ``alias`` (its modules import each other
    relatively, so two checkouts can live in one process)."""
    package = container / "semif"
    spec = importlib.util.spec_from_file_location(alias, package / "__init__.py", submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{alias}.serving.engine"), importlib.import_module(f"{alias}.serving.prompt")


class Probe:
    """One engine with llama_decode timed (wall and this thread's CPU)."""

    def __init__(self, name, engine_module, prompt_module, model, threads):
        self.name = name
        self.prompt = prompt_module
        self.engine = engine_module.Engine(model, n_ctx=4096, n_batch=512, n_threads=threads, label_memo=False)
        self.rows = {kind: {c: [] for c in COLUMNS} for kind in ("wall", "cpu")}

    def run(self, case, state, scoring, record):
        import llama_cpp

        P = self.prompt
        question = P.Question(case["question"], tuple(P.Outcome(o["id"], o.get("description")) for o in case["options"]))
        real_decode = llama_cpp.llama_decode
        spent = {"wall": 0.0, "cpu": 0.0}

        def timed_decode(ctx, batch):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return real_decode(ctx, batch)
            finally:
                spent["wall"] += time.perf_counter() - wall
                spent["cpu"] += time.thread_time() - cpu

        llama_cpp.llama_decode = timed_decode  # the engine calls it through the module: this sees every decode
        try:
            marks = [(time.perf_counter(), time.thread_time())]
            plan = self.engine.plan(state, [question], scoring=scoring)
            marks.append((time.perf_counter(), time.thread_time()))
            self.engine.execute(plan)
            marks.append((time.perf_counter(), time.thread_time()))
        finally:
            llama_cpp.llama_decode = real_decode
        if not record:
            return
        for i, kind in enumerate(("wall", "cpu")):
            plan_ms = (marks[1][i] - marks[0][i]) * 1000
            execute_ms = (marks[2][i] - marks[1][i]) * 1000
            decode_ms = spent[kind] * 1000
            for column, value in zip(COLUMNS, (plan_ms, execute_ms, decode_ms, execute_ms - decode_ms,
                                               plan_ms + execute_ms - decode_ms)):
                self.rows[kind][column].append(value)

    def medians(self):
        return {kind: {c: statistics.median(v) for c, v in cols.items()} for kind, cols in self.rows.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, help="use only the first N cases")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--scoring", choices=("label", "sequence"), default="label")
    parser.add_argument("--compare", type=Path, metavar="DIR", help="a `container` folder of the code before the change")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.config import embedded_model_path

    model = args.model or embedded_model_path()
    probes = []
    if args.compare:
        probes.append(Probe("before", *load_semif(args.compare, "semif_before"), model, args.threads))
    probes.append(Probe("after" if args.compare else "current", *load_semif(REPO / "container", "semif_current"),
                        model, args.threads))
    cases = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()][: args.limit]
    try:
        for round_no in range(args.rounds + 1):  # round 0 warms up
            for index, case in enumerate(cases):
                order = probes if index % 2 == 0 else probes[::-1]  # alternate who goes first
                for probe in order:
                    state = f"Round {round_no} case {index} ({probe.name}). {case['state']}"
                    probe.run(case, state, args.scoring, record=round_no > 0)
    finally:
        for probe in probes:
            probe.engine.close()

    print(f"model {model.name}, {args.threads} threads, {len(cases)} cases x {args.rounds} rounds, {args.scoring} "
          f"scoring, load average {os.getloadavg()[0]:.1f}")
    print("median ms per cold decision (cpu = this thread's CPU time)")
    figures = {"model": model.name, "scoring": args.scoring, "rounds": args.rounds, "load": os.getloadavg()[0]}
    print(f"{'':<16}" + "".join(f"{c:>10}" for c in COLUMNS))
    for probe in probes:
        medians = probe.medians()
        figures[probe.name] = medians
        for kind in ("wall", "cpu"):
            print(f"{probe.name + ' ' + kind:<16}" + "".join(f"{medians[kind][c]:>10.3f}" for c in COLUMNS))
    if args.compare:
        before, after = figures["before"], figures["after"]
        ratios = {kind: {c: after[kind][c] / before[kind][c] for c in COLUMNS if before[kind][c] > 0} for kind in ("wall", "cpu")}
        figures["after_over_before"] = ratios
        for kind in ("wall", "cpu"):
            print(f"{'after/before ' + kind:<16}" + "".join(f"{ratios[kind].get(c, float('nan')):>10.3f}" for c in COLUMNS))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
