#!/usr/bin/env python
"""Flash attention on vs off (SEMIF_FLASH_ATTN), in one process, the same requests alternating.

Two engines on the same model and threads, one with llama.cpp's flash attention and one without,
answer the same requests in turn (which goes first alternates), so the ratio is measured under the
same machine conditions. Workloads:
  cold       every held-out decision with a state neither engine has seen (template head cached)
  routing    tools/bench_routing.py's 40-option question over its tickets, in --layout
Also prints the largest difference in any option probability between the two (same prompts): flash
attention on the CPU accumulates in half precision. Not a timed test; figures go in docs/benchmarks.md.

usage: python tools/bench_flash_attn.py [--model GGUF] [--workload cold|routing] [--layout state_first|options_first]
                                        [--n N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "container"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_routing import QUESTION, tickets  # noqa: E402
from semif.serving.config import embedded_model_path  # noqa: E402
from semif.serving.engine.context import Engine  # noqa: E402
from semif.serving.engine.prompt import Outcome, Question  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--workload", choices=("cold", "routing"), default="cold")
    parser.add_argument("--layout", choices=("state_first", "options_first"), default="state_first")
    parser.add_argument("--n", type=int, default=30, help="requests per engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or embedded_model_path()
    if args.workload == "cold":
        cases = [json.loads(line) for line in (REPO / "data" / "heldout-decisions.jsonl").read_text().splitlines() if line.strip()]
        requests = [(c["state"], Question(c["question"], tuple(Outcome(o["id"], o.get("description")) for o in c["options"])))
                    for c in (cases * (args.n // len(cases) + 1))[: args.n]]
        warm = ("Warm-up: the printer is out of toner.", requests[0][1])
    else:
        requests = [(text, QUESTION) for text in tickets(args.n)]
        warm = ("Warm-up ticket: the Wi-Fi is down.", QUESTION)
    layout = args.layout if args.workload == "routing" else "state_first"
    engines = {fa: Engine(model, n_ctx=4096, n_batch=512, n_threads=args.threads, label_memo=False, prefix_cache_mb=0,
                          flash_attn=fa) for fa in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    drift = []
    try:
        for engine in engines.values():
            engine.score(warm[0], [warm[1]], layout=layout)
        for index, (state, question) in enumerate(requests):
            probabilities = {}
            for fa in ((False, True) if index % 2 == 0 else (True, False)):
                # Each engine its own state variant, so neither answers from a state it has seen.
                started = time.perf_counter()
                result = engines[fa].score(f"#{index}{'f' if fa else 'n'} {state}", [question], layout=layout)
                times[fa].append((time.perf_counter() - started) * 1000)
            for fa in (False, True):  # the same prompt on both, for the probability difference (untimed)
                probabilities[fa] = engines[fa].score(f"Same {index}. {state}", [question], layout=layout).distributions[0].probabilities
            drift.append(max(abs(a - b) for a, b in zip(probabilities[False], probabilities[True])))
            print(f"\r{index + 1}/{len(requests)}", end="", file=sys.stderr, flush=True)
    finally:
        print(file=sys.stderr)
        for engine in engines.values():
            engine.close()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    what = f"{args.workload}" + (f" ({layout})" if args.workload == "routing" else "")
    print(f"model {model.name}, {args.threads} threads, {what}, {len(requests)} requests per engine")
    print(f"flash attention off p50 {off:.1f} ms, on p50 {on:.1f} ms, on / off {on / off:.3f}; "
          f"max |dp| between them {max(drift):.4f}")
    if args.json:
        args.json.write_text(json.dumps({"model": model.name, "workload": what, "off_p50_ms": off, "on_p50_ms": on,
                                         "ratio": on / off, "max_abs_dp": max(drift)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
