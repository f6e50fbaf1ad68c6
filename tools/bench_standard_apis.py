#!/usr/bin/env python
"""Benchmark the standard decision APIs (System One and OpenAI Decisions) on the real `serve` process.

Prints ratios measured in one run (not a timed test):
  10 mixed questions (noul/predicate, choice, score) on one ~300-token state in ONE request, prefix cache on
  / the same 10 as single-question requests with the prefix cache off                   (target <= 0.35)

Two `serve` processes run one after the other: SEMIF_PREFIX_CACHE=1, then SEMIF_PREFIX_CACHE=0. Every
repetition changes the state's first line, so no repetition reuses an earlier one's state; only the template
text before the state (identical in every request) can come from the cache. Times are client wall-clock
per request (HTTP included), median over the repetitions.

usage: python tools/bench_standard_apis.py [--model PATH] [--repeats N] [--apis systemone,openai] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import BenchServer  # noqa: E402


STATE = (
    "Ticket {n} from Priya Raman, account tier Business, region US-East. Priya writes: for the last three "
    "days every export from the analytics workspace has failed with 'timeout while rendering'. Our weekly "
    "revenue report goes to the executive team every Friday at 9:00 and it is now two weeks late. We pay for "
    "the premium support add-on, yet the chat agent closed my last request (ticket 41177) without a fix and "
    "told me to clear my browser cache, which I had already done. On top of that the February invoice "
    "(INV-33812) lists twelve seats although we reduced to eight in January, and nobody answered my email "
    "about the refund. I have tried Chrome and Firefox, a different laptop and the mobile app; the problem "
    "is the same everywhere. If this is not fixed by Thursday I will ask procurement to look at alternatives "
    "before our renewal in April. Please escalate to someone senior and call me at the number on file; I am "
    "in meetings until 14:00 but free afterwards. Screenshots of the error and the invoice are attached."
)

SYSTEM_ONE_QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "churn": {"type": "noul", "instructions": "Is the customer at risk of leaving?"},
    "callback": {"type": "noul", "instructions": "Did the customer ask to be called back?"},
    "deadline": {"type": "noul", "instructions": "Does the ticket mention a deadline?",
                 "criteria": {"true": "A date or time by which something must happen", "false": "No date or time"}},
    "queue": {"type": "choice", "instructions": "Which queue should handle this ticket first?",
              "criteria": {"technical": "Bugs, failures, outages", "billing": "Invoices, seats, refunds",
                           "sales": "Renewals, upgrades", "account": "Sign-in and permissions"}},
    "product": {"type": "choice", "instructions": "Which product area is affected most?",
                "criteria": {"exports": None, "dashboard": None, "mobile_app": None, "billing_portal": None}},
    "next_step": {"type": "choice", "instructions": "What should the agent do next?",
                  "criteria": {"escalate": "Hand to a senior engineer", "refund": "Correct the invoice",
                               "close": "Nothing to do", "ask_info": "Ask for more details"}},
    "anger": {"type": "score", "instructions": "How frustrated is the customer?",
              "criteria": ["Calm", "Mildly annoyed", "Frustrated", "Very angry"]},
    "urgency": {"type": "score", "instructions": "How urgent is the ticket?",
                "criteria": ["Can wait", "This week", "Today", "Right now"]},
    "clarity": {"type": "score", "instructions": "How clearly is the problem described?",
                "criteria": ["Unclear", "Partly clear", "Clear", "Very clear", "Complete with evidence"]},
}


def to_openai(questions: dict) -> list[dict]:
    out = []
    for name, q in questions.items():
        text = q["instructions"]
        if q["type"] == "noul":
            out.append({"type": "predicate", "name": name, "instructions": text})
        elif q["type"] == "choice":
            out.append({"type": "choice", "name": name, "instructions": text,
                        "choices": [{"value": k, **({"description": d} if d else {})} for k, d in q["criteria"].items()]})
        else:
            out.append({"type": "score", "name": name, "instructions": text,
                        "levels": [{"label": level} for level in q["criteria"]]})
    return out


def state_for(n: int) -> str:
    return STATE.format(n=10000 + n)


def run_batched(server: BenchServer, api: str, repeats: int) -> list[float]:
    """One request with all ten questions, per repetition."""
    times = []
    for i in range(repeats + 1):  # +1: the first is a warm-up
        if api == "systemone":
            body = {"model": "jev-latest", "state": state_for(i), "questions": SYSTEM_ONE_QUESTIONS}
            elapsed, payload = server.post("/v1/systemone", body)
            assert len(payload["answers"]) == 10
        else:
            body = {"model": "gpt-6-luna", "input": state_for(1000 + i), "questions": to_openai(SYSTEM_ONE_QUESTIONS)}
            elapsed, payload = server.post("/v1/decisions", body)
            assert len(payload["answers"]) == 10
        if i:
            times.append(elapsed)
    return times


def run_single(server: BenchServer, api: str, repeats: int) -> list[float]:
    """Ten single-question requests, per repetition (the sum of the ten)."""
    times = []
    for i in range(repeats + 1):
        total = 0.0
        if api == "systemone":
            for name, q in SYSTEM_ONE_QUESTIONS.items():
                total += server.post("/v1/systemone", {"model": "jev-latest", "state": state_for(i), "questions": {name: q}})[0]
        else:
            for q in to_openai(SYSTEM_ONE_QUESTIONS):
                total += server.post("/v1/decisions", {"model": "gpt-6-luna", "input": state_for(1000 + i), "questions": [q]})[0]
        if i:
            times.append(total)
    return times


def state_token_count(model: Path | None) -> int:
    from llama_cpp import Llama

    from semif.serving.config import embedded_model_path

    llm = Llama(model_path=str(model or embedded_model_path()), vocab_only=True, verbose=False)
    return len(llm.tokenize(state_for(0).encode(), add_bos=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF to serve (default: the embedded SmolLM2-135M)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--apis", default="systemone,openai", help="comma-separated: systemone, openai")
    args = parser.parse_args()

    tokens = state_token_count(args.model)
    results: dict = {"state_tokens": tokens, "questions": len(SYSTEM_ONE_QUESTIONS), "repeats": args.repeats,
                     "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    server = BenchServer(args.model, SEMIF_PREFIX_CACHE=1)
    try:
        batched = {api: run_batched(server, api, args.repeats) for api in apis}
    finally:
        server.close()
    server = BenchServer(args.model, SEMIF_PREFIX_CACHE=0)
    try:
        single = {api: run_single(server, api, args.repeats) for api in apis}
    finally:
        server.close()

    print(f"state: {tokens} tokens; {len(SYSTEM_ONE_QUESTIONS)} mixed questions (4 noul, 3 choice, 3 score); "
          f"median of {args.repeats} repetitions; {os.cpu_count()} CPUs")
    for api in apis:
        b, s = statistics.median(batched[api]), statistics.median(single[api])
        ratio = b / s
        results[api] = {"batched_cache_on_s": round(b, 4), "single_cache_off_s": round(s, 4), "ratio": round(ratio, 3)}
        print(f"{api:>10}: one request, cache on {b * 1000:8.1f} ms | 10 single requests, cache off {s * 1000:8.1f} ms "
              f"| ratio {ratio:.3f} (target <= 0.35) {'OK' if ratio <= 0.35 else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
