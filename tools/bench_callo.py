#!/usr/bin/env python
"""Side by side: the adapter against callo, on the same GGUF, llama.cpp, threads and System One requests.

callo (PyPI `callo`, pinned in requirements-callo.txt) is a proxy in front of stock llama-server that answers
System One from llama-server's next-token log-probabilities. This script installs it in its own virtualenv
(.venv-callo), launches `callo serve --model M --llama-server BIN` on the llama-server that `make llama-server`
builds from the same vendored llama.cpp as the adapter's llama-cpp-python, launches the adapter (`serve`) on the
same GGUF with the same threads, and sends every labeled decision to both as the same System One `choice`
request, alternating which side goes first; then again with the options in reverse order. Where a labeled row
names its abstain option (`abstain_option`, data/README.md), the adapter's request marks it as an application
would (System One's `x_abstain_option`), so that its content-free calibration keeps that option's share; callo's
request is the same without the mark (it has no such field). --no-abstain-marks sends both the same request.

It reports, per side: accuracy (options as written, and reversed), order stability (the same option chosen
both ways), the accuracy of the mean of both orders' probabilities (what order debiasing would give),
p50/p95 client-side latency, and the prompt tokens per request: all of them, those evaluated, those reused
from a cache, and those generated (the adapter's `x_semif`; for callo, llama-server's own `/metrics` counters
read before and after each request). Per category and per decision it shows where each side wins.
Timings are noisy on a shared machine: compare the ratios measured within one run, not runs with each other.

With --think-budget N both sides reason before the label: callo on every request (its `think_budget`, only on
a model whose chat template has a thinking mode), the adapter only where its first pass is ambiguous (its
`second_look`, below --below-margin, on any chat model), which is how each is meant to be used; the report then
counts the adapter's second looks and both sides' generated tokens.

usage: python tools/bench_callo.py --model GGUF [--data FILE] [--limit N] [--threads N] [--out JSON]
                                  [--llama-server BIN] [--callo-arg ARG]... [--adapter-env NAME=VALUE]...
                                  [--think-budget N [--below-margin M] [--think-deadline-ms MS]] [--forward-only]
                                  [--no-abstain-marks]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import BenchServer, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "data" / "decisions-dev.jsonl"
DEFAULT_SERVER = REPO / ".build" / "llama-server" / "build" / "bin" / "llama-server"
CALLO_VENV = REPO / ".venv-callo"
CALLO_REQUIREMENTS = REPO / "requirements-callo.txt"
# callo's launch settings in the comparison it is measured by: one context of 8192 tokens shared by 2 slots.
CALLO_DEFAULT_ARGS = ("--ctx", "8192", "--parallel", "2")
QUESTION_ID = "decision"
WARMUP_STATE = "Warm-up request: the printer on floor two is out of toner."
DIRECTIONS = ("forward", "reversed")
console = Console(stderr=True)


# ---- the two sides ---------------------------------------------------------------------------------


@dataclass
class Reply:
    """One side's answer to one request."""

    ms: float
    choice: Optional[str] = None
    probabilities: dict = field(default_factory=dict)
    prompt_tokens: Optional[int] = None  # every prompt token of the request
    evaluated_tokens: Optional[int] = None  # those run through the model for it
    cached_tokens: Optional[int] = None  # those reused from what the context already held
    generated_tokens: Optional[int] = None  # tokens decoded after the prompt (callo's readout may sample some)
    looked_again: Optional[bool] = None  # the adapter's second look ran (with --think-budget)
    error: Optional[str] = None


def systemone_body(row: dict, reverse: bool, *, abstain_mark: bool = False) -> dict:
    """The System One request both sides get: the row's question as a `choice`, options as criteria. With
    `abstain_mark`, the row's abstain option (if it names one) marked as the adapter's contract takes it."""
    options = row["options"][::-1] if reverse else row["options"]
    criteria = {o["id"]: o.get("description") for o in options}
    question = {"type": "choice", "instructions": row["question"], "criteria": criteria}
    if abstain_mark and row.get("abstain_option") is not None:
        question["x_abstain_option"] = row["abstain_option"]
    return {"state": row["state"], "questions": {QUESTION_ID: question}}


def option_set_key(row: dict) -> str:
    """The question with its options as a set (ids and descriptions, listing aside): what a server's caches for a
    recurring decision (the adapter's content-free prior, the cached option block) can reuse."""
    options = sorted((o["id"], o.get("description") or "") for o in row["options"])
    return hashlib.sha256(json.dumps([row["question"], options]).encode()).hexdigest()


def first_sightings(rows: list[dict]) -> list[bool]:
    """Per row, whether its option set (option_set_key) is new: no earlier row of the run asked it."""
    seen: set[str] = set()
    new = []
    for row in rows:
        key = option_set_key(row)
        new.append(key not in seen)
        seen.add(key)
    return new


def side_bodies(row: dict, reverse: bool, abstain_marks: bool) -> dict[str, dict]:
    """Each side's request for one row: the same question; the adapter's marks the abstain option (when
    `abstain_marks` and the row names one), callo's never does (System One as callo serves it has no such field)."""
    return {"adapter": systemone_body(row, reverse, abstain_mark=abstain_marks), "callo": systemone_body(row, reverse)}


@dataclass(frozen=True)
class Thinking:
    """Reasoning before the label on both sides, at one token budget (--think-budget): callo thinks on every
    request (its `think_budget`, which needs a chat template with a thinking mode: callo answers 422 on
    others); the adapter looks again only where the first pass is ambiguous (its `second_look`, below
    `below_margin`, within `deadline_ms`; callo's thinking gets no deadline)."""

    budget: int
    below_margin: float = 0.2
    deadline_ms: int = 20_000

    def body(self, side: str, body: dict) -> dict:
        if side == "callo":
            return {**body, "think_budget": self.budget}
        return {**body, "second_look": {"below_margin": self.below_margin, "max_tokens": self.budget,
                                        "deadline_ms": self.deadline_ms}}


def post(http: httpx.Client, body: dict) -> tuple[float, Optional[httpx.Response], Optional[str]]:
    started = time.perf_counter()
    try:
        response = http.post("/v1/systemone", json=body)
    except httpx.HTTPError as exc:
        return (time.perf_counter() - started) * 1000, None, f"{type(exc).__name__}: {exc}"
    ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        return ms, response, f"HTTP {response.status_code}: {response.text[:300]}"
    return ms, response, None


def answer_of(response: httpx.Response) -> tuple[Optional[str], dict]:
    answer = response.json()["answers"][QUESTION_ID]
    return answer.get("choice"), answer.get("probabilities") or {}


class AdapterSide:
    name = "adapter"

    def __init__(self, model: Path, threads: int, env: dict):
        self.server = BenchServer(model, ready_timeout_s=600, SEMIF_N_THREADS=threads, **env)
        self.http = self.server.http
        self.first_record: dict = {}

    def decide(self, body: dict) -> Reply:
        ms, response, error = post(self.http, body)
        if error:
            return Reply(ms, error=error)
        choice, probabilities = answer_of(response)
        payload = response.json()
        record = payload.get("x_semif") or {}
        self.first_record = self.first_record or record
        usage = payload.get("usage") or {}
        second_look = payload["answers"][QUESTION_ID].get("x_second_look")
        return Reply(ms, choice, probabilities, prompt_tokens=usage.get("input_tokens"),
                     evaluated_tokens=record.get("evaluated_tokens"), cached_tokens=record.get("cached_tokens"),
                     generated_tokens=usage.get("output_tokens"),
                     looked_again=None if second_look is None else bool(second_look.get("ran")))

    def close(self) -> None:
        self.server.close()


def callo_token_counts(header: Optional[str]) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(prompt tokens, evaluated, reused) of the question from callo's X-Callo-Timings header: llama-server's own
    `prompt_n` and `cache_n` for the question's first upstream pass. Nones where the header lacks them (callo
    fills them on its cached paths only; its plain readout reports `tokens` alone)."""
    try:
        entries = json.loads(header or "[]")
        entry = next(e for e in entries if isinstance(e, dict) and e.get("q") == QUESTION_ID)
    except (ValueError, StopIteration, TypeError):
        return None, None, None
    return entry.get("tokens"), entry.get("prompt_n"), entry.get("cache_n")


def llama_server_counters(metrics_text: str) -> dict[str, float]:
    """llama-server's Prometheus counters (`/metrics`), e.g. `llamacpp:prompt_tokens_total`: prompt tokens it
    has evaluated (cached ones are not counted), `llamacpp:tokens_predicted_total`: tokens it has decoded."""
    counters = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("llamacpp:") and value:
            try:
                counters[name] = float(value.split()[0])
            except ValueError:
                pass
    return counters


class CalloSide:
    """`callo serve` in launch mode: it starts llama-server itself (with `-- ARGS` passed through last)."""

    name = "callo"

    def __init__(self, callo: Path, model: Path, llama_server: Path, threads: int, extra: list[str], log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.argv = [str(callo), "serve", "--model", str(model), "--llama-server", str(llama_server),
                     "--host", "127.0.0.1", "--port", str(self.port), *CALLO_DEFAULT_ARGS, *extra,
                     # --metrics only turns on llama-server's /metrics (read between requests, untimed).
                     "--", "--threads", str(threads), "--threads-batch", str(threads), "--metrics"]
        # A session of its own, so that closing it also stops the llama-server it launched.
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"callo serve exited with {self.proc.returncode}; see {log_path}")
            try:
                if self.http.get("/callo/stats").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise SystemExit(f"callo serve did not become ready in 900 s; see {log_path}")

    def counters(self) -> dict[str, float]:
        try:
            return llama_server_counters(self.http.get("/metrics").text)  # callo passes the path to llama-server
        except httpx.HTTPError:
            return {}

    def decide(self, body: dict) -> Reply:
        before = self.counters()
        ms, response, error = post(self.http, body)
        if error:
            return Reply(ms, error=error)
        after = self.counters()
        choice, probabilities = answer_of(response)
        prompt, evaluated, cached = callo_token_counts(response.headers.get("x-callo-timings"))
        generated = None
        if before and after:
            # Every token llama-server evaluated or decoded for this request, whatever passes callo made.
            evaluated = int(after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"])
            generated = int(after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"])
            if cached is None and prompt is not None and 0 <= evaluated <= prompt:
                cached = prompt - evaluated
        return Reply(ms, choice, probabilities, prompt_tokens=prompt, evaluated_tokens=evaluated, cached_tokens=cached,
                     generated_tokens=generated)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def side_order(index: int, turn: int) -> list[str]:
    """Who goes first: alternating from one case to the next and between a case's two directions, so that each
    side goes first equally often in each direction and neither always meets the machine in the same state."""
    return ["adapter", "callo"] if (index + turn) % 2 == 0 else ["callo", "adapter"]


# ---- setup ------------------------------------------------------------------------------------------


def pinned_callo_version() -> str:
    for line in CALLO_REQUIREMENTS.read_text().splitlines():
        if line.startswith("callo=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"{CALLO_REQUIREMENTS} pins no callo version")


def ensure_callo(venv: Path) -> tuple[Path, str]:
    """callo in its own virtualenv, at the pinned version (installed or replaced when it is not)."""
    want = pinned_callo_version()
    python, callo = venv / "bin" / "python", venv / "bin" / "callo"

    def installed() -> Optional[str]:
        if not callo.exists():
            return None
        probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('callo'))"],
                               capture_output=True, text=True)
        return probe.stdout.strip() or None

    if installed() != want:
        console.print(f">> installing callo {want} into {venv} (its own virtualenv)")
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--progress-bar", "off", "-r",
                        str(CALLO_REQUIREMENTS)], check=True)
        if installed() != want:
            raise SystemExit(f"callo {want} did not install into {venv}")
    return callo, want


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def host_record(llama_server: Path) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    version = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True)
    build = next((line.strip() for line in (version.stdout + version.stderr).splitlines() if line.startswith("version")), None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "llama_server_build": build,
            "commit": commit + ("-dirty" if dirty else ""), "loadavg_start": list(os.getloadavg())}


# ---- figures ----------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values else None


def mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def answer_nll(reply: Reply, answer: str) -> Optional[float]:
    p = reply.probabilities.get(answer)
    return None if reply.error or p is None else -math.log(max(float(p), 1e-12))


def both_orders_choice(replies: dict) -> Optional[str]:
    """The option with the highest mean probability over the two orders (what order debiasing would answer from
    these two requests), or None when either request failed or was not sent (--forward-only)."""
    if "reversed" not in replies:
        return None
    forward, backward = replies["forward"]["probabilities"], replies["reversed"]["probabilities"]
    if replies["forward"]["error"] or replies["reversed"]["error"] or set(forward) != set(backward) or not forward:
        return None
    return max(forward, key=lambda option: forward[option] + backward[option])


def side_summary(cases: list[dict], side: str) -> dict:
    """One side's figures. Without the reversed requests (--forward-only) the figures that need them are None."""
    forward = [c[side]["forward"] for c in cases]
    both = all("reversed" in c[side] for c in cases)
    backward = [c[side]["reversed"] for c in cases] if both else []
    directions = DIRECTIONS if both else DIRECTIONS[:1]
    n = len(cases)
    correct = sum(r["choice"] == c["answer"] for c, r in zip(cases, forward))
    correct_reversed = sum(r["choice"] == c["answer"] for c, r in zip(cases, backward)) if both else None
    stable = sum(f["choice"] is not None and f["choice"] == b["choice"] for f, b in zip(forward, backward)) if both else None
    averaged = sum(both_orders_choice(c[side]) == c["answer"] for c in cases) if both else None
    ms_forward = [r["ms"] for r in forward if not r["error"]]
    ms_all = ms_forward + [r["ms"] for r in backward if not r["error"]]
    # First sight of each state, split by whether the decision's option set is new to the run or recurs.
    ms_by_novelty = {novelty: [c[side]["forward"]["ms"] for c in cases if not c[side]["forward"]["error"]
                               and c["option_set_new"] is (novelty == "new")]
                     for novelty in ("new", "recurring")}
    looked = [r.get("looked_again") for r in forward + backward]

    def ratio(count: Optional[int]) -> Optional[float]:
        return count / n if n and count is not None else None

    def tokens(replies: list[dict], key: str) -> dict:
        values = [r[key] for r in replies if r[key] is not None]
        return {"mean": mean(values), "min": min(values) if values else None, "max": max(values) if values else None,
                "n": len(values)}

    return {
        "n": n,
        "accuracy": ratio(correct), "correct": correct,
        "accuracy_reversed": ratio(correct_reversed), "correct_reversed": correct_reversed,
        "order_stable": stable, "order_stability": ratio(stable),
        "correct_both_orders": averaged, "accuracy_both_orders": ratio(averaged),
        "errors": sum(1 for r in forward + backward if r["error"]),
        "nll": mean([c[side]["forward"]["nll"] for c in cases]),
        "requests": len(forward) + len(backward),
        "looked_again": sum(1 for v in looked if v) if any(v is not None for v in looked) else None,
        "latency_ms": {"forward": {"p50": pct(ms_forward, 50), "p95": pct(ms_forward, 95)},
                       "all": {"p50": pct(ms_all, 50), "p95": pct(ms_all, 95)},
                       **{f"forward_{novelty}": {"p50": pct(values, 50), "p95": pct(values, 95), "n": len(values)}
                          for novelty, values in ms_by_novelty.items()}},
        "tokens": {direction: {key: tokens([c[side][direction] for c in cases], key)
                               for key in ("prompt_tokens", "evaluated_tokens", "cached_tokens", "generated_tokens")}
                   for direction in directions},
    }


def group_summary(cases: list[dict], key: str) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for case in cases:
        groups[case[key]].append(case)
    out = {}
    for name, members in sorted(groups.items()):
        entry = {"n": len(members)}
        for side in ("adapter", "callo"):
            right = [c[side]["forward"]["choice"] == c["answer"] for c in members]
            entry[side] = {
                "correct": sum(right),
                "order_stable": sum(c[side]["forward"]["choice"] == c[side]["reversed"]["choice"] for c in members)
                if all("reversed" in c[side] for c in members) else None,
                "evaluated_tokens": mean([c[side]["forward"]["evaluated_tokens"] for c in members]),
                "p50_ms": pct([c[side]["forward"]["ms"] for c in members], 50),
            }
        entry["adapter_only_right"] = sum(c["adapter"]["forward"]["choice"] == c["answer"] != c["callo"]["forward"]["choice"]
                                          for c in members)
        entry["callo_only_right"] = sum(c["callo"]["forward"]["choice"] == c["answer"] != c["adapter"]["forward"]["choice"]
                                        for c in members)
        out[name] = entry
    return out


def paired_ratio(cases: list[dict], directions: tuple[str, ...] = DIRECTIONS) -> Optional[float]:
    """Median over requests of adapter ms / callo ms: the two run back to back on the same request, so a drift in
    the machine's speed over the run (other work on a shared host) cancels out of each ratio."""
    ratios = [c["adapter"][d]["ms"] / c["callo"][d]["ms"] for c in cases for d in directions
              if d in c["adapter"] and d in c["callo"] and not c["adapter"][d]["error"] and not c["callo"][d]["error"]]
    return float(np.median(ratios)) if ratios else None


def ratio_of(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either side has no figure (every request of one side failed)."""
    return a / b if a is not None and b else None


def abstain_marks_record(cases: list[dict], sent: bool) -> dict:
    """Whether the adapter's requests carried the rows' abstain options, how many rows name one, and how many
    of the adapter's requests carried it."""
    rows = sum(1 for c in cases if c.get("abstain_option") is not None)
    return {"sent": sent, "rows_with_abstain_option": rows,
            "marked_cases": sum(1 for c in cases if c.get("abstain_marked"))}


def print_report(report: dict) -> None:
    out = Console(width=None if sys.stdout.isatty() else 160)
    meta, sides = report["meta"], report["summary"]
    out.print(f"[bold]{meta['model_file']}[/], {meta['threads']} threads, {meta['cases']} cases from {meta['data']}, "
              f"commit {meta['host']['commit']}, {meta['date']}")
    table = Table(title="adapter vs callo: identical System One choice requests, alternating")
    for column in ("", "accuracy", "reversed", "same choice reversed", "both orders", "p50 ms", "p95 ms", "p50 all ms",
                   "prompt tok", "evaluated tok", "cached tok", "generated tok", "NLL", "errors"):
        table.add_column(column, justify="right" if column else "left")
    for side in ("adapter", "callo"):
        s = sides[side]
        t = s["tokens"]["forward"]

        def fmt(value, spec=".0f"):
            return "-" if value is None else format(value, spec)

        def of_n(count):
            return "-" if count is None else f"{count}/{s['n']}"

        table.add_row(side, f"{s['correct']}/{s['n']} = {s['accuracy']:.3f}", of_n(s["correct_reversed"]),
                      of_n(s["order_stable"]), of_n(s["correct_both_orders"]),
                      fmt(s["latency_ms"]["forward"]["p50"]),
                      fmt(s["latency_ms"]["forward"]["p95"]), fmt(s["latency_ms"]["all"]["p50"]),
                      fmt(t["prompt_tokens"]["mean"], ".1f"), fmt(t["evaluated_tokens"]["mean"], ".1f"),
                      fmt(t["cached_tokens"]["mean"], ".1f"), fmt(t["generated_tokens"]["mean"], ".1f"),
                      fmt(s["nll"], ".3f"), str(s["errors"]))
    out.print(table)
    r = {key: "-" if value is None else f"{value:.3f}" for key, value in report["ratios"].items()}
    out.print(f"adapter / callo: p50 (first sight of each state) {r['p50_forward']}, p50 (all requests) "
              f"{r['p50_all']}, median per-request ratio {r['median_per_request']}")
    if "p50_forward_new" in r:
        counts = {novelty: sides["adapter"]["latency_ms"][f"forward_{novelty}"]["n"] for novelty in ("new", "recurring")}
        out.print(f"adapter / callo, first sight of each state: p50 where the option set is new ({counts['new']}) "
                  f"{r['p50_forward_new']}, where it recurs ({counts['recurring']}) {r['p50_forward_recurring']}")
    marks = meta.get("abstain_marks")
    if marks is not None:
        out.print(f"abstain marks: {'sent' if marks['sent'] else 'not sent (--no-abstain-marks)'}: the adapter's "
                  f"requests marked x_abstain_option on {marks['marked_cases']} of {meta['cases']} decisions "
                  f"({marks['rows_with_abstain_option']} name one); callo's requests never do")
    if meta.get("thinking"):
        t, looked = meta["thinking"], sides["adapter"]["looked_again"]
        out.print(f"thinking: budget {t['budget']} tokens; callo thinks on every request, the adapter looked again on "
                  f"{'-' if looked is None else looked}/{sides['adapter']['requests']} requests "
                  f"(margin below {t['below_margin']})")
    for key, title in (("per_category", "per category"), ("per_decision", "per decision")):
        table = Table(title=f"{title}: correct (options as written), order-stable, evaluated tokens")
        for column in ("", "n", "adapter", "callo", "adapter only", "callo only", "stable A", "stable C", "eval tok A",
                       "eval tok C"):
            table.add_column(column, justify="right" if column else "left")
        for name, g in report[key].items():
            a, c = g["adapter"], g["callo"]
            table.add_row(name, str(g["n"]), str(a["correct"]), str(c["correct"]), str(g["adapter_only_right"]),
                          str(g["callo_only_right"]), str(a["order_stable"]) if a["order_stable"] is not None else "-",
                          str(c["order_stable"]) if c["order_stable"] is not None else "-",
                          f"{a['evaluated_tokens'] or 0:.0f}", f"{c['evaluated_tokens'] or 0:.0f}")
        out.print(table)


# ---- the run ----------------------------------------------------------------------------------------


def resumed_cases(path: Path, rows: list[dict]) -> list[dict]:
    """The cases a run stopped part-way wrote to `path`, checked to be the first of `rows` in order (a resumed run
    measures the rest); a clear exit when they are not (another --data or --limit) or a line is torn."""
    if not path.is_file():
        return []
    cases = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            cases.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the last line, torn by the stop: that decision is measured again
            raise SystemExit(f"{path}:{number}: not JSON; delete the file to start over")
    path.write_text("".join(json.dumps(case) + "\n" for case in cases))
    ids = [row["id"] for row in rows[:len(cases)]]
    if len(cases) > len(rows) or [c["id"] for c in cases] != ids:
        raise SystemExit(f"{path} holds decisions that are not the first {len(cases)} of this run's --data/--limit; "
                         "delete it to start over")
    console.print(f">> resuming after {len(cases)} decisions measured in {path}")
    return cases


def model_and_rows(args: argparse.Namespace) -> tuple[Path, list[dict]]:
    """The GGUF (--model, else the embedded one) and the labeled decisions (--data, --limit) both tools run on,
    after checking that llama-server (--llama-server) is built; a clear exit otherwise."""
    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.config import embedded_model_path
    from semif.tools.evaluate import load_rows

    if not args.llama_server.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    model = (args.model or embedded_model_path()).resolve()
    if not model.is_file():
        raise SystemExit(f"no model at {model}")
    try:
        return model, load_rows(args.data, args.limit)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read {args.data}: {exc}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF both sides serve (default: the embedded SmolLM2-135M)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labeled decisions, JSON Lines "
                        "(the format semif-eval reads; default data/decisions-dev.jsonl)")
    parser.add_argument("--limit", type=int, help="only the first N decisions of the file")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads for each side")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER, help="llama-server binary (make llama-server)")
    parser.add_argument("--out", type=Path, help="report JSON (default reports/bench-callo-<UTC time>.json)")
    parser.add_argument("--callo-arg", action="append", default=[], metavar="ARG",
                        help="an extra `callo serve` argument (repeatable; after the defaults "
                             f"{' '.join(CALLO_DEFAULT_ARGS)}, so it wins), e.g. --callo-arg=--temperature --callo-arg=1.9")
    parser.add_argument("--adapter-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra SEMIF_* setting for the adapter (repeatable), e.g. SEMIF_DEBIAS=reverse")
    parser.add_argument("--think-budget", type=int, metavar="TOKENS",
                        help="reason before the label, within this many tokens: callo's think_budget on every "
                             "request, the adapter's second look on answers below --below-margin")
    parser.add_argument("--below-margin", type=float, default=0.2,
                        help="with --think-budget: the adapter looks again below this margin (default 0.2)")
    parser.add_argument("--think-deadline-ms", type=int, default=20_000,
                        help="with --think-budget: the adapter's second-look deadline_ms (default 20000, at most "
                             "40000, inside the adapter's 50 s request deadline; callo's thinking has none)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the decisions already measured in OUT's .cases.jsonl (written as the run goes) "
                             "and measure the rest; the run's other flags must be the ones it started with")
    parser.add_argument("--forward-only", action="store_true",
                        help="send each decision once, options as written (no order stability)")
    parser.add_argument("--no-abstain-marks", dest="abstain_marks", action="store_false",
                        help="do not mark a row's abstain_option in the adapter's requests (x_abstain_option): "
                             "both sides get the very same body")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()

    model, rows = model_and_rows(args)
    adapter_env = {}
    for item in args.adapter_env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("SEMIF_"):
            raise SystemExit(f"--adapter-env {item!r}: expected SEMIF_NAME=VALUE")
        adapter_env[name] = value
    thinking = None
    if args.think_budget is not None:
        if not 1 <= args.think_budget <= 1024:
            raise SystemExit("--think-budget must be 1 to 1024 tokens (the adapter's second-look limit)")
        if not 0 < args.below_margin <= 1 or not 1 <= args.think_deadline_ms <= 40_000:
            # 40 s leaves the first pass room inside the adapter's request deadline (SEMIF_REQUEST_DEADLINE_S, 50 s)
            raise SystemExit("--below-margin must be in (0, 1] and --think-deadline-ms 1 to 40000")
        thinking = Thinking(args.think_budget, args.below_margin, args.think_deadline_ms)
    directions = DIRECTIONS[:1] if args.forward_only else DIRECTIONS
    if args.resume and args.out is None:
        raise SystemExit("--resume needs --out: the report whose .cases.jsonl the stopped run wrote")
    callo_bin, callo_version = ensure_callo(CALLO_VENV)
    started = dt.datetime.now(dt.timezone.utc)
    out_path = args.out or REPO / "reports" / f"bench-callo-{started:%Y%m%dT%H%M%SZ}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cases_path = out_path.with_suffix(".cases.jsonl")
    resumed = resumed_cases(cases_path, rows) if args.resume else []
    if not args.resume:
        cases_path.unlink(missing_ok=True)
    host = host_record(args.llama_server)
    marked = sum(1 for row in rows if row.get("abstain_option") is not None) if args.abstain_marks else 0
    console.print(f">> model {model.name}, {args.threads} threads, {len(rows)} decisions ({marked} with the abstain "
                  f"option marked for the adapter); load average {host['loadavg_start'][0]:.2f}")
    model_sha256 = sha256_file(model)

    sides: dict[str, object] = {}
    try:
        console.print(">> starting the adapter")
        sides["adapter"] = AdapterSide(model, args.threads, adapter_env)
        console.print(">> starting callo (it launches llama-server)")
        log_path = out_path.with_suffix(".callo.log")
        sides["callo"] = CalloSide(callo_bin, model, args.llama_server, args.threads, args.callo_arg, log_path)
        warmup = {"state": WARMUP_STATE, "question": "Which team?", "answer": "print",
                  "options": [{"id": "print", "description": "Printers"}, {"id": "network", "description": "Network"}]}
        for side in sides.values():
            for reverse in (False, True):
                body = side_bodies(warmup, reverse, args.abstain_marks)[side.name]
                reply = side.decide(thinking.body(side.name, body) if thinking else body)
                if reply.error:
                    # e.g. callo answers a think_budget with 422 on a model whose chat template has no
                    # thinking mode: better said now than after the whole run.
                    raise SystemExit(f"{side.name} failed its warm-up request: {reply.error}")

        cases = resumed
        new_sets = first_sightings(rows)
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console)
        with progress, open(cases_path, "a") as cases_file:
            task = progress.add_task("decisions", total=len(rows), completed=len(resumed))
            for index, row in enumerate(rows):
                if index < len(resumed):
                    continue
                case = {"id": row["id"], "category": row.get("category", "all"),
                        "decision_id": row.get("decision_id") or row.get("category", "all"), "answer": row["answer"],
                        "abstain_option": row.get("abstain_option"),
                        "abstain_marked": args.abstain_marks and row.get("abstain_option") is not None,
                        "option_set_new": new_sets[index], "adapter": {}, "callo": {}}
                for turn, direction in enumerate(directions):
                    bodies = side_bodies(row, direction == "reversed", args.abstain_marks)
                    order = side_order(index, turn)
                    for name in order:
                        body = bodies[name]
                        reply = sides[name].decide(thinking.body(name, body) if thinking else body)
                        case[name][direction] = {**asdict(reply), "nll": answer_nll(reply, row["answer"]),
                                                 "first": name == order[0]}
                cases.append(case)
                cases_file.write(json.dumps(case) + "\n")
                cases_file.flush()  # written as it goes: a run stopped part-way keeps what it measured
                progress.advance(task)
                if not console.is_terminal and (len(cases) % 10 == 0 or len(cases) == len(rows)):
                    # Off a terminal (a log file) the bar does not redraw: a line every ten decisions instead.
                    right = {n: sum(c[n]["forward"]["choice"] == c["answer"] for c in cases) for n in sides}
                    console.print(f"{len(cases)}/{len(rows)} decisions, correct so far: adapter {right['adapter']}, "
                                  f"callo {right['callo']}")
    finally:
        for side in sides.values():
            side.close()

    adapter_record = sides["adapter"].first_record
    report = {
        "meta": {
            "date": started.strftime("%Y-%m-%d"), "started": started.isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "model_file": model.name, "model_sha256": model_sha256, "threads": args.threads,
            "data": str(args.data), "data_sha256": sha256_file(args.data), "cases": len(cases),
            "callo_version": callo_version, "callo_argv": sides["callo"].argv[1:],
            "adapter_env": adapter_env, "adapter_template_version": adapter_record.get("template_version"),
            "adapter_llama_cpp_build": adapter_record.get("llama_cpp_build"),
            "directions": list(directions), "thinking": asdict(thinking) if thinking else None,
            "resumed_cases": len(resumed), "option_sets": {"new": sum(new_sets), "recurring": len(rows) - sum(new_sets)},
            # Whether the adapter's requests marked the rows' abstain options (x_abstain_option), and on how many.
            "abstain_marks": abstain_marks_record(cases, args.abstain_marks),
            "host": {**host, "loadavg_end": list(os.getloadavg())},
            "note": "client-side wall time per request, both servers on one shared machine, never at the same time",
        },
        "summary": {side: side_summary(cases, side) for side in ("adapter", "callo")},
        "per_category": group_summary(cases, "category"),
        "per_decision": group_summary(cases, "decision_id"),
        "cases": cases,
    }
    a, c = report["summary"]["adapter"]["latency_ms"], report["summary"]["callo"]["latency_ms"]
    report["ratios"] = {"p50_forward": ratio_of(a["forward"]["p50"], c["forward"]["p50"]),
                        "p50_all": ratio_of(a["all"]["p50"], c["all"]["p50"]), "median_per_request": paired_ratio(cases),
                        **{f"p50_forward_{novelty}": ratio_of(a[f"forward_{novelty}"]["p50"], c[f"forward_{novelty}"]["p50"])
                           for novelty in ("new", "recurring")}}
    out_path.write_text(json.dumps(report, indent=1))
    print_report(report)
    console.print(f">> report: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
