#!/usr/bin/env python3
"""Where a side-by-side run's time goes: first-sight time against evaluated tokens, per side.

    .venv/bin/python tools/time_per_token.py results/bench-callo-qwen-holdout349-shared-lead.cases.jsonl

Reads a `tools/bench_callo.py` cases file (one decision per line) and, for each side (adapter, callo) and
for decisions whose option set was new to the run and those where it recurred, prints the p50 time and p50
evaluated tokens of the first request that saw each state (the options as listed), and the least-squares line
ms = a + b · evaluated tokens over those requests: b is the time per evaluated token, a what a request costs
besides them (HTTP, planning, the calls into llama.cpp). On a CPU both sides' b come out alike, so the ratio of
their p50 times follows the ratio of the tokens they evaluate.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b·x (all x alike: b = 0, a their mean y)."""
    if len(set(xs)) < 2:
        return statistics.fmean(ys), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def summarise(cases: list[dict]) -> list[dict]:
    rows = []
    for side in ("adapter", "callo"):
        for novelty, new in (("new", True), ("recurring", False)):
            first = [c[side]["forward"] for c in cases if c.get("option_set_new") is new
                     and c[side]["forward"].get("ms") and c[side]["forward"].get("evaluated_tokens") is not None]
            if len(first) < 2:
                continue
            tokens = [float(f["evaluated_tokens"]) for f in first]
            ms = [float(f["ms"]) for f in first]
            a, b = fit(tokens, ms)
            rows.append({"side": side, "option_set": novelty, "n": len(first), "p50_ms": round(statistics.median(ms)),
                         "p50_evaluated_tokens": statistics.median(tokens),
                         "mean_evaluated_tokens": round(statistics.fmean(tokens), 1),
                         "ms_per_token": round(b, 2), "ms_besides_tokens": round(a)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", help="a bench_callo cases file (*.cases.jsonl)")
    args = parser.parse_args(argv)
    path = Path(args.cases)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (bench_callo writes <out>.cases.jsonl beside its --out)")
    cases = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = summarise(cases)
    if not rows:
        raise SystemExit(f"{path}: no first-sight requests with times and evaluated tokens")
    print(f"{'side':8} {'option set':10} {'n':>4} {'p50 ms':>7} {'p50 tok':>7} {'mean tok':>8} {'ms/tok':>6} {'ms besides':>10}")
    for r in rows:
        print(f"{r['side']:8} {r['option_set']:10} {r['n']:>4} {r['p50_ms']:>7} {r['p50_evaluated_tokens']:>7} "
              f"{r['mean_evaluated_tokens']:>8} {r['ms_per_token']:>6} {r['ms_besides_tokens']:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
