#!/usr/bin/env python
"""Side by side: the SemIf adapter against upstream llama-server, same model, threads and prompts.

llama-server is built from the llama.cpp that the pinned llama-cpp-python sdist vendors, with the
Makefile's CPU flags (`make llama-server`, or tools/build_llama_server.sh). This script starts both
servers, then sends every labeled decision to each in turn, alternating which goes first per case,
and prints latency ratios measured in this one run (not a timed test).

Routes compared, all answering one cold single decision (every timed state starts with a token no other
request's state starts with, so no cache or memo can answer a repeat or reuse part of a state):
  adapter             POST /invocations (SemIf), label scoring: a probability per option
  server-chat         POST /v1/chat/completions, same messages, max_tokens 1 (greedy first token only)
  server-completion   POST /completion, the adapter's exact prompt text, n_predict 1
  server-probs        POST /completion, n_predict 1 with n_probs = 20 (llama-server's way to get probabilities)

The adapter's prompt comes back from the adapter itself (`return_prompt`), so both servers evaluate
the same text; the chat route is checked with llama-server's /apply-template to render that same text.

usage: python tools/bench_llama_server.py [--model GGUF] [--cases JSONL] [--rounds N] [--threads N]
                                         [--state-start unique|route] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import BenchServer, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = REPO / "data" / "heldout-decisions.jsonl"
DEFAULT_SERVER = REPO / ".build" / "llama-server" / "build" / "bin" / "llama-server"
N_CTX, N_BATCH = 4096, 512
ROUTE_WORDS = {"adapter": "Alpha", "server-chat": "Bravo", "server-completion": "Charlie", "server-probs": "Delta"}


class LlamaServer:
    """Upstream llama-server on a free loopback port: one slot, same context and batch sizes as the adapter."""

    def __init__(self, binary: Path, model: Path, threads: int, log_path: Path, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.log = open(log_path, "wb")
        cmd = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_BATCH),
            "--parallel", "1", "--no-webui", *extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}; see {log_path}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"llama-server did not become ready; see {log_path}")

    def post_ms(self, path: str, body: dict) -> tuple[float, dict]:
        started = time.perf_counter()
        response = self.http.post(path, json=body)
        elapsed = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise SystemExit(f"llama-server {path} answered {response.status_code}: {response.text[:300]}")
        return elapsed, response.json()

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def unique_state_words(server: "LlamaServer", opener: str, count: int, follow: str = " 1-2. Text") -> list[str]:
    """``count`` words that each tokenize as one token right after ``opener`` (the fence's ``<state>`` line),
    a different token for every word, from the model's own vocabulary through llama-server's /tokenize and
    /detokenize. A state that starts with one of them shares no state token with any other request, so no
    prompt cache on either side can reuse part of a state it has not seen. ``follow``: text like what comes
    after the word in the states (the word must stay one token before it)."""
    def tokenize(text: str) -> list[int]:
        return server.http.post("/tokenize", json={"content": text}).json()["tokens"]

    base = tokenize(opener)
    n_vocab = server.http.get("/v1/models").json()["data"][0]["meta"]["n_vocab"]
    words: list[str] = []
    seen: set[int] = set()
    for token in range(1000, n_vocab, 7):  # a deterministic sweep of the vocabulary
        piece = server.http.post("/detokenize", json={"tokens": [token]}).json().get("content", "")
        if not (len(piece) >= 4 and piece.isascii() and piece.isalpha() and piece[0].isupper()):
            continue
        ids = tokenize(f"{opener}{piece}{follow}")
        if ids[: len(base)] == base and ids[len(base)] == token and token not in seen:
            seen.add(token)
            words.append(piece)
            if len(words) == count:
                return words
    raise SystemExit(f"found only {len(words)} single-token state words of the {count} needed")


def split_messages(prompt_text: str, system_text: str) -> list[dict] | None:
    """The [system, user] messages whose chat rendering is ``prompt_text`` (checked by the caller)."""
    start = prompt_text.find(system_text)
    state_at = prompt_text.find("<state", start + len(system_text))
    if start < 0 or state_at < 0:
        return None
    user_end = prompt_text.rfind("<|im_end|>")  # ChatML; other templates fall back to /completion only
    if user_end < state_at:
        return None
    return [{"role": "system", "content": system_text}, {"role": "user", "content": prompt_text[state_at:user_end]}]


def pct(values, q) -> float:
    return float(np.percentile(values, q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--server", type=Path, default=DEFAULT_SERVER, help="llama-server binary (make llama-server)")
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES, help="labeled decisions, JSON Lines")
    parser.add_argument("--rounds", type=int, default=1, help="timed passes over the cases (fresh states each pass)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--adapter-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra SEMIF_* setting for the adapter (repeatable), e.g. SEMIF_FLASH_ATTN=1")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an extra llama-server argument (repeatable), e.g. --server-arg=--cache-ram --server-arg=0")
    parser.add_argument("--state-start", choices=("unique", "route"), default="unique",
                        help="unique (default): every timed state starts with its own single-token word, so no "
                             "state token is shared between requests; route: the earlier design, a word per "
                             "route then the round and case numbers (llama-server's RAM prompt cache then "
                             "reuses the word and the digits from that route's previous request)")
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.adapter_env)

    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.config import embedded_model_path
    from semif.serving.engine.prompt import SYSTEM_TEXT

    if not args.server.is_file():
        raise SystemExit(f"no llama-server at {args.server}: run `make llama-server` first")
    model = args.model or embedded_model_path()
    cases = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()]
    adapter = BenchServer(model, **{"SEMIF_N_THREADS": args.threads, "SEMIF_N_CTX": N_CTX, "SEMIF_N_BATCH": N_BATCH,
                                    **extra_env})
    server = LlamaServer(args.server, model, args.threads, Path("/tmp") / f"llama-server-{os.getpid()}.log",
                         tuple(args.server_arg))
    times: dict[str, list[float]] = {"adapter": [], "server-chat": [], "server-completion": [], "server-probs": []}
    chat_ok = True
    try:
        # The adapter's prompt for each case, from the adapter itself (untimed, once per case); every timed
        # request then gets its own state variant, so neither server has seen its state before
        # (llama-server caches prompts, the adapter caches prefixes and remembers label logits).
        probes = {}
        for index, case in enumerate(cases):
            probe_state = f"Probe {index}. {case['state']}"
            decision = {"id": case["id"], "question": case["question"], "options": case["options"]}
            _, probe = adapter.invoke_ms({"decision": {**decision, "state": probe_state}, "return_prompt": True})
            probes[index] = (probe_state, probe["prompt"]["text"])
        messages = split_messages(probes[0][1], SYSTEM_TEXT)
        rendered = server.http.post("/apply-template", json={"messages": messages or []}).json().get("prompt")
        chat_ok = messages is not None and rendered == probes[0][1]
        print(f"llama-server's chat template renders the adapter's prompt exactly: {chat_ok}", flush=True)
        warmup = [(0, i) for i in range(min(3, len(cases)))]
        schedule = warmup + [(r, i) for r in range(1, args.rounds + 1) for i in range(len(cases))]
        routes = list(ROUTE_WORDS)
        if args.state_start == "unique":
            opener = probes[0][1][: probes[0][1].find(probes[0][0])]
            opener = opener[opener.rfind("<state") :]  # the fence's opening line, as the prompt has it
            words = iter(unique_state_words(server, opener, len(schedule) * len(routes)))
            starts = {(r, i, route): next(words) for r, i in schedule for route in routes}
            print(f"{len(starts)} states, each starting with its own single token", flush=True)
        for step, (round_no, index) in enumerate(schedule):
            if step == len(warmup):
                print("warm-up done; timing", flush=True)
            case = cases[index]
            probe_state, probe_prompt = probes[index]
            decision = {"id": case["id"], "question": case["question"], "options": case["options"]}
            def variant(route: str) -> tuple[str, str]:
                # llama-server's prompt cache reuses the longest common token prefix of any prompt it
                # holds (the slot's, and with --cache-ram every earlier one), the adapter only whole
                # segments. A shared "Reference r-i-" tag gave it ~6 state tokens per request; a word per
                # route (--state-start route) still gave it the word and digits of that route's previous
                # request. With --state-start unique (default) every state's first token is its own.
                word = starts[(round_no, index, route)] if args.state_start == "unique" else ROUTE_WORDS[route]
                state = f"{word} {round_no}-{index}. {case['state']}"
                return state, probe_prompt.replace(probe_state, state)

            def adapter_run() -> float:
                state, _ = variant("adapter")
                return adapter.invoke_ms({"decision": {**decision, "state": state}})[0]

            def completion_run(route: str, **extra) -> float:
                _, prompt = variant(route)
                body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True, **extra}
                return server.post_ms("/completion", body)[0]

            def chat_run() -> float:
                _, prompt = variant("server-chat")
                body = {"messages": split_messages(prompt, SYSTEM_TEXT), "max_tokens": 1, "temperature": 0}
                return server.post_ms("/v1/chat/completions", body)[0]

            runs = [
                ("adapter", adapter_run),
                ("server-completion", lambda: completion_run("server-completion")),
                ("server-probs", lambda: completion_run("server-probs", n_probs=20)),
            ] + ([("server-chat", chat_run)] if chat_ok else [])
            if index % 2:
                runs.reverse()  # alternate who goes first
            for name, run in runs:
                ms = run()
                if round_no > 0:
                    times[name].append(ms)
    finally:
        adapter.close()
        server.close()

    figures = {"model": model.name, "threads": args.threads, "cases": len(cases), "rounds": args.rounds,
               "state_start": args.state_start, "adapter_env": extra_env, "server_args": args.server_arg}
    print(f"model {model.name}, {args.threads} threads, {len(cases)} cases x {args.rounds} rounds, cold single decisions")
    # Besides the ratio of the p50s, the median of the per-case ratios: the routes' requests for one case
    # run back to back, so a drift in the VM's speed over the run cancels out of each case's ratio.
    print(f"{'route':<20}{'p50 ms':>10}{'p95 ms':>10}{'adapter / route p50':>22}{'median per-case ratio':>24}")
    adapter_p50 = pct(times["adapter"], 50)
    for name, values in times.items():
        if not values:
            continue
        p50, p95 = pct(values, 50), pct(values, 95)
        paired = float(np.median(np.divide(times["adapter"], values)))
        figures[name] = {"p50_ms": p50, "p95_ms": p95, "n": len(values), "adapter_over_route_p50": adapter_p50 / p50,
                         "median_per_case_ratio": paired, "ms": values}
        print(f"{name:<20}{p50:>10.1f}{p95:>10.1f}{adapter_p50 / p50:>22.3f}{paired:>24.3f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
