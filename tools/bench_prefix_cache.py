#!/usr/bin/env python
"""Two prefixes alternating: p50 with and without the prefix snapshot cache (SEMIF_PREFIX_CACHE_MB).

Starts two real `serve` processes on the same model, one with the snapshot cache (default size, or
--cache-mb) and one with SEMIF_PREFIX_CACHE_MB=0, and sends every request to both, alternating which goes
first. The label memo is off in both, and every request differs from every other, so no answer is
recalled: what differs is only whether a prefix the other task evicted comes back from RAM or is
evaluated again. Prints p50/p95 per server and the ratio with / without, measured in this one run.

With --llama-server BINARY, upstream llama-server (tools/bench_llama_server.py's LlamaServer: same model,
threads, context and batch sizes, one slot, its default host-memory prompt cache `--cache-ram 8192`, which
keeps prompts in RAM as the adapter's snapshots do) answers every request too, with the adapter's exact
prompt text (`return_prompt`) through `/completion` (`n_predict` 1, `cache_prompt` on). It goes between
the two adapters on every step, so the VM's drift falls on all three alike; its cached share is
`timings.cache_n` over the prompt's tokens.

Scenarios (--layout):
  state_first    two busy states (~300-token tickets), A and B alternating, a different question each
                 time: the state prefix is what alternates.
  options_first  two routing tasks (a question with --options options and one-line descriptions each),
                 A and B alternating, a new ~100-token ticket each time: the question block before the
                 state is what alternates. Needs a server with the options-first layout.

usage: python tools/bench_prefix_cache.py [--model GGUF] [--layout state_first|options_first]
                                          [--requests N] [--options N] [--cache-mb MB] [--json OUT]
                                          [--llama-server BINARY]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import BenchServer  # noqa: E402
from bench_adapter import EIGHT_QUESTIONS, STATE_300  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 4  # requests before timing: each prefix is planned twice, so both are snapshotted

STATE_B = (
    "Ticket 90417 from Marco Lindqvist, account tier Business, region US-East. Marco writes: our warehouse "
    "scanners stopped uploading inventory counts to the dashboard on Tuesday night; the devices show a green "
    "sync icon but nothing arrives. The nightly CSV export also contains yesterday's figures twice, and our "
    "accountant says the April invoice (INV-31877) lists forty seats while we only have thirty-two. We "
    "restarted the scanners, re-paired two of them and checked the firewall with our IT contractor. A ticket "
    "about slow report generation (88120) is still open from three weeks ago. We run a stock audit on "
    "Friday and need correct counts by then; please have someone call the warehouse line before noon "
    "Eastern. If the counts are not fixed we will have to postpone the audit and we will ask for a credit "
    "on this month's invoice. Logs from one scanner and the duplicated export are attached to this ticket."
)
TEAMS = ["billing", "identity", "network", "hardware", "mobile", "reporting", "integrations", "security",
         "data", "platform", "payments", "shipping", "returns", "catalog", "search", "notifications",
         "accounts", "compliance", "legal", "sales", "onboarding", "training", "warehouse", "inventory",
         "pricing", "tax", "procurement", "facilities", "hr", "payroll", "travel", "marketing", "partners",
         "localization", "accessibility", "performance", "storage", "backups", "analytics", "support_tools"]
AREAS = ["sign-in", "invoices", "exports", "the mobile app", "VPN access", "printers", "the API", "the dashboard",
         "refunds", "deliveries", "permissions", "password resets", "email sync", "the audit log", "data imports"]


def routing_task(name: str, n_options: int) -> dict:
    options = [{"id": f"{name}_{team}", "description": f"Requests about {team.replace('_', ' ')} for the {name} "
                f"division, including escalations and follow-ups."} for team in TEAMS[:n_options]]
    return {"question": f"Which {name} team should handle this ticket first?", "options": options}


def ticket(i: int) -> str:
    rng = np.random.default_rng(i)
    area, other = rng.choice(AREAS, 2, replace=False)
    return (f"Ticket {10000 + i}. Since {['Monday', 'Tuesday', 'last week', 'this morning'][i % 4]} {area} fails "
            f"for {int(rng.integers(2, 90))} people in our {['Berlin', 'Austin', 'Osaka', 'Lima'][i % 4]} office: the "
            f"page loads, then shows an error and logs us out. {other.capitalize()} also behaves oddly since the "
            f"last update. We tried two browsers, cleared caches and restarted. Our deadline is on the "
            f"{int(rng.integers(1, 28))}th and this blocks the team; please tell us who picks this up and when.")


def requests(layout: str, n: int, n_options: int) -> list[dict]:
    out = []
    if layout == "state_first":
        states = [STATE_300, STATE_B]
        for i in range(n):
            qid, question, options = EIGHT_QUESTIONS[(i // 2) % len(EIGHT_QUESTIONS)]
            out.append({"decision": {"id": qid, "state": states[i % 2], "question": f"{question} (request {i})",
                                     "options": [{"id": o} for o in options]}})
    else:
        tasks = [routing_task("support", n_options), routing_task("operations", n_options)]
        for i in range(n):
            out.append({"decision": {"id": f"route-{i}", "state": ticket(i), **tasks[i % 2]}, "layout": "options_first"})
    return out


def pct(values, q) -> float:
    return float(np.percentile(values, q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--layout", choices=("state_first", "options_first"), default="state_first")
    parser.add_argument("--requests", type=int, default=40, help="timed requests per server")
    parser.add_argument("--options", type=int, default=40, help="options per routing task (options_first)")
    parser.add_argument("--cache-mb", type=float, default=None, help="SEMIF_PREFIX_CACHE_MB of the cached server")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--llama-server", type=Path, help="also time upstream llama-server (make llama-server)")
    args = parser.parse_args()
    if args.llama_server is not None and not args.llama_server.is_file():
        parser.error(f"--llama-server {args.llama_server}: no such file (build it with `make llama-server`)")

    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.config import embedded_model_path

    model = args.model or embedded_model_path()
    common = dict(SEMIF_N_THREADS=args.threads, SEMIF_N_CTX=4096, SEMIF_LABEL_MEMO=0)
    cached_env = dict(common, **({} if args.cache_mb is None else {"SEMIF_PREFIX_CACHE_MB": args.cache_mb}))
    servers = {"with snapshots": BenchServer(model, **cached_env),
               "without": BenchServer(model, **common, SEMIF_PREFIX_CACHE_MB=0)}
    bodies = requests(args.layout, WARMUP + args.requests, args.options)
    upstream = None
    if args.llama_server is not None:
        from bench_llama_server import LlamaServer

        upstream = LlamaServer(args.llama_server, model, args.threads, REPO / ".build" / "bench-prefix-llama-server.log")
    names = list(servers) + (["llama-server"] if upstream is not None else [])
    times = {name: [] for name in names}
    cached = {name: [] for name in names}
    try:
        for step, body in enumerate(bodies):
            order = list(servers) if step % 2 == 0 else list(servers)[::-1]
            prompt_text = None
            for position, name in enumerate(order):
                ms, answer = servers[name].invoke_ms({**body, "return_prompt": True})
                if args.layout == "options_first" and "options" not in answer["prompt"]["template_version"].replace("_", "-"):
                    raise SystemExit(f"the server did not use the options-first layout: {answer['prompt']['template_version']}")
                if step >= WARMUP:
                    times[name].append(ms)
                    cached[name].append(answer["prompt"]["cached_tokens"] / answer["prompt"]["tokens"])
                prompt_text = prompt_text or answer["prompt"]["text"]
                if upstream is not None and position == 0:
                    ms, reply = upstream.post_ms("/completion", {"prompt": prompt_text, "n_predict": 1, "cache_prompt": True,
                                                                 "temperature": 0})
                    timings = reply.get("timings", {})
                    if step >= WARMUP:
                        times["llama-server"].append(ms)
                        n_cached, n_new = timings.get("cache_n", 0), timings.get("prompt_n", 0)
                        cached["llama-server"].append(n_cached / max(n_cached + n_new, 1))
            print(f"\r{step + 1}/{len(bodies)} requests per server", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        for server in servers.values():
            server.close()
        if upstream is not None:
            upstream.close()

    load = os.getloadavg()[0]
    print(f"model {model.name}, {args.threads} threads, layout {args.layout}, two prefixes alternating, "
          f"{args.requests} timed requests per server, load average {load:.1f}")
    figures = {"model": model.name, "layout": args.layout, "requests": args.requests, "load": load}
    print(f"{'server':<18}{'p50 ms':>10}{'p95 ms':>10}{'cached share':>14}")
    for name in names:
        figures[name] = {"p50_ms": pct(times[name], 50), "p95_ms": pct(times[name], 95),
                         "cached_share": float(np.mean(cached[name]))}
        print(f"{name:<18}{figures[name]['p50_ms']:>10.1f}{figures[name]['p95_ms']:>10.1f}{figures[name]['cached_share']:>14.2f}")
    ratio = figures["with snapshots"]["p50_ms"] / figures["without"]["p50_ms"]
    figures["with_over_without_p50"] = ratio
    print(f"p50 with snapshots / without: {ratio:.3f}")
    if upstream is not None:
        versus = figures["with snapshots"]["p50_ms"] / figures["llama-server"]["p50_ms"]
        figures["with_snapshots_over_llama_server_p50"] = versus
        print(f"p50 adapter with snapshots / llama-server (--cache-ram default): {versus:.3f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
