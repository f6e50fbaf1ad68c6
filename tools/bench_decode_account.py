#!/usr/bin/env python
"""Where the adapter's time goes against upstream llama-server on one cold decision, token by token.

tools/bench_llama_server.py compares end-to-end latency; this script explains the difference. On every
held-out decision (a state neither side has seen), in one run:

  engine      the adapter's engine in this process: ``llama_decode`` time and tokens evaluated for the
              plan as the adapter runs it (template head cached, then the state and the question as
              two segments)
  server      llama-server ``POST /completion`` with the same prompt text: its own ``timings``
              (``prompt_n`` tokens evaluated after its prompt cache, ``prompt_ms``)
  one batch   the same engine evaluating the same tokens as one segment (what llama-server does),
              alternating with the segmented evaluation, cache off: the cost of the extra call
  empty       on the first --empty-pairs cases: the whole prompt as one batch from an empty context,
              engine against llama-server (cache_prompt off): the kernels alone, with no reuse on
              either side

and prints the medians: tokens evaluated, milliseconds per evaluated token, and the ratios. Flash
attention is the same on both sides (``--flash-attn``). Not a timed test; figures go in
docs/benchmarks.md ("Side by side with upstream llama-server").

usage: python tools/bench_decode_account.py [--model GGUF] [--server BIN] [--threads N] [--flash-attn on|off]
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

from bench_llama_server import DEFAULT_CASES, DEFAULT_SERVER, N_BATCH, N_CTX, LlamaServer, unique_state_words  # noqa: E402
from semif.serving.config import embedded_model_path  # noqa: E402
from semif.serving.engine.context import Engine  # noqa: E402
from semif.serving.engine.prompt import Outcome, Question  # noqa: E402


class TimedDecode:
    """Wraps the engine's llama_cpp module so every llama_decode call is timed."""

    def __init__(self, module):
        self._module = module
        self.seconds = 0.0

    def llama_decode(self, ctx, batch):
        started = time.perf_counter()
        status = self._module.llama_decode(ctx, batch)
        self.seconds += time.perf_counter() - started
        return status

    def __getattr__(self, name):
        return getattr(self._module, name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--server", type=Path, default=DEFAULT_SERVER, help="llama-server binary (make llama-server)")
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="on", help="both sides (adapter default: on)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an extra llama-server argument (repeatable), e.g. --server-arg=--cache-ram --server-arg=0")
    parser.add_argument("--empty-pairs", type=int, default=12, metavar="N",
                        help="on the first N cases, also time the whole prompt as one batch from an empty context on "
                             "both sides (llama-server with cache_prompt off): the kernels alone, no reuse (0: skip)")
    args = parser.parse_args()
    if not args.server.is_file():
        raise SystemExit(f"no llama-server at {args.server}: run `make llama-server` first")
    model = args.model or embedded_model_path()
    cases = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()]
    engine = Engine(model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=args.threads, label_memo=False,
                    prefix_cache_mb=0, flash_attn=args.flash_attn == "on")
    timed = engine._lc = TimedDecode(engine._lc)
    server = LlamaServer(args.server, model, args.threads, Path("/tmp/bench_decode_account_llama_server.log"),
                         ("-fa", args.flash_attn, *args.server_arg))
    rows = {"engine_tokens": [], "engine_ms_per_token": [], "engine_decode_ms": [],
            "server_tokens": [], "server_ms_per_token": [], "server_prompt_ms": [],
            "segmented_ms": [], "one_batch_ms": [], "empty_engine_ms": [], "empty_server_ms": []}
    try:
        warm = "Warm-up: the printer on floor 2 is out of toner."
        # Every server state starts with its own single-token word: llama-server's prompt cache matches a
        # prompt against every prompt it holds, so a word shared with an earlier state would be reused.
        probe = engine.plan("Probe.", [Question(cases[0]["question"], tuple(Outcome(o["id"]) for o in cases[0]["options"]))],
                            return_prompt=True).prefix_text
        opener = probe[probe.rfind("<state") : probe.rfind("Probe.")]
        words = unique_state_words(server, opener, len(cases))
        for index, case in enumerate(cases):
            question = Question(case["question"], tuple(Outcome(o["id"], o.get("description")) for o in case["options"]))
            # Each side gets its own state, and no two server states share their first token: neither cache
            # holds any of the state (both reuse the template head and the fence opener, as in real traffic).
            plan = engine.plan(f"Engine {index}. {case['state']}", [question])
            text_plan = engine.plan(f"{words[index]} {index}. {case['state']}", [question], return_prompt=True)
            text = text_plan.prefix_text + text_plan.questions[0].text
            if index == 0:
                warm_plan = engine.plan(warm, [question], return_prompt=True)
                engine.execute(warm_plan)
                server.post_ms("/completion", {"prompt": warm_plan.prefix_text + warm_plan.questions[0].text,
                                               "n_predict": 1, "temperature": 0, "cache_prompt": True})

            def engine_run():
                timed.seconds = 0.0
                result = engine.execute(plan)
                rows["engine_tokens"].append(result.evaluated_tokens)
                rows["engine_decode_ms"].append(timed.seconds * 1000)
                rows["engine_ms_per_token"].append(timed.seconds * 1000 / result.evaluated_tokens)

            def server_run():
                _, answer = server.post_ms("/completion", {"prompt": text, "n_predict": 1, "temperature": 0,
                                                           "cache_prompt": True})
                timings = answer["timings"]
                rows["server_tokens"].append(timings["prompt_n"])
                rows["server_prompt_ms"].append(timings["prompt_ms"])
                rows["server_ms_per_token"].append(timings["prompt_ms"] / timings["prompt_n"])

            for run in ((engine_run, server_run) if index % 2 == 0 else (server_run, engine_run)):
                run()
            # Segmented (as the engine does it) against one batch, same tokens, from an empty context.
            segments = [list(s) for s in plan.prefix_segments] + [list(plan.questions[0].suffix_tokens)]
            tokens = [t for s in segments for t in s]
            for one in ((False, True) if index % 2 == 0 else (True, False)):
                engine.invalidate()
                started = time.perf_counter()
                if one:
                    engine._decode(tokens, {len(tokens) - 1})
                else:
                    engine._forward(segments, [len(tokens) - 1])
                rows["one_batch_ms" if one else "segmented_ms"].append((time.perf_counter() - started) * 1000)
            if index < args.empty_pairs:
                # The whole prompt, one batch, nothing cached, on both sides: the same text, so the same tokens.
                same = [t for s in text_plan.prefix_segments for t in s] + list(text_plan.questions[0].suffix_tokens)

                def engine_empty():
                    engine.invalidate()
                    started = time.perf_counter()
                    engine._decode(same, {len(same) - 1})
                    rows["empty_engine_ms"].append((time.perf_counter() - started) * 1000)

                def server_empty():
                    _, answer = server.post_ms("/completion", {"prompt": text, "n_predict": 1, "temperature": 0,
                                                               "cache_prompt": False})
                    rows["empty_server_ms"].append(answer["timings"]["prompt_ms"])

                for run in ((engine_empty, server_empty) if index % 2 == 0 else (server_empty, engine_empty)):
                    run()
            engine.invalidate()
            engine.execute(engine.plan(warm, [question]))  # the head cached again, as in serving
            print(f"\r{index + 1}/{len(cases)}", end="", file=sys.stderr, flush=True)
    finally:
        print(file=sys.stderr)
        server.close()
        engine.close()
    med = {name: statistics.median(values) for name, values in rows.items() if values}
    print(f"model {model.name}, {args.threads} threads, flash attention {args.flash_attn} (both sides), "
          f"{len(cases)} cold decisions")
    print(f"tokens evaluated per decision     engine {med['engine_tokens']:.1f}   llama-server {med['server_tokens']:.1f}"
          f"   ratio {med['engine_tokens'] / med['server_tokens']:.3f}")
    print(f"ms per evaluated token            engine {med['engine_ms_per_token']:.2f}   llama-server "
          f"{med['server_ms_per_token']:.2f}   ratio {med['engine_ms_per_token'] / med['server_ms_per_token']:.3f}")
    print(f"decode ms per decision            engine {med['engine_decode_ms']:.1f}   llama-server "
          f"{med['server_prompt_ms']:.1f}   ratio {med['engine_decode_ms'] / med['server_prompt_ms']:.3f}")
    per_case = statistics.median(e / s for e, s in zip(rows["engine_decode_ms"], rows["server_prompt_ms"]))
    print(f"decode, median of per-case ratios (drift in the VM's speed cancels)   {per_case:.3f}")
    print(f"segmented / one batch (cold, all tokens)  {med['segmented_ms']:.1f} / {med['one_batch_ms']:.1f} ms = "
          f"{med['segmented_ms'] / med['one_batch_ms']:.3f}")
    if "empty_engine_ms" in med:
        print(f"whole prompt, one batch, empty context ({len(rows['empty_engine_ms'])} cases)  engine "
              f"{med['empty_engine_ms']:.1f}   llama-server {med['empty_server_ms']:.1f} ms   ratio "
              f"{med['empty_engine_ms'] / med['empty_server_ms']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"model": model.name, "threads": args.threads, "flash_attn": args.flash_attn,
                                         "server_args": args.server_arg, "medians": med,
                                         "decode_median_per_case_ratio": per_case, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
