"""What a request body costs before admission: time and peak memory of reading it as the server does
(strict JSON parse, then the contract's validation and rendering), for hostile shapes at 64 KiB, 256 KiB
and 1 MiB.

Each case runs in a subprocess of its own, so that its peak RSS (`resource.getrusage`) is its own; the
same subprocess then repeats the case under tracemalloc for the peak of Python allocations.

    .venv/bin/python tools/bench_body.py --json results/bench-body.json
    .venv/bin/python tools/bench_body.py --src /path/to/other/checkout/container --sizes 65536 --timeout 60

`--src` runs the same cases on another checkout's `semif` package (for a before/after); a case that does
not finish within `--timeout` seconds is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = (64 << 10, 256 << 10, 1 << 20)
SHAPES = ("escaped_quotes", "unterminated_string", "tiny_strings", "deep_nesting", "render_growth", "plain_state")

NOUL = '"questions":{"q":{"type":"noul","instructions":"Is it urgent?"}}'


def body_of(shape: str, size: int) -> bytes:
    """A body of about ``size`` bytes (never more) of the given shape."""
    if shape == "escaped_quotes":  # a SemIf state of escaped quotes whose string never closes
        head = b'{"decision":{"state":"'
        return head + b'\\"' * ((size - len(head)) // 2)
    if shape == "unterminated_string":
        head = b'{"decision":{"state":"'
        return head + b"a" * (size - len(head))
    if shape == "tiny_strings":  # 99 levels of arrays around many empty strings, as a System One state
        head, tail = b'{"state":' + b"[" * 98, b"]" * 98 + b"," + NOUL.encode() + b"}"
        count = (size - len(head) - len(tail) - 2) // 3
        return head + b'"",' * count + b'""' + tail
    if shape == "deep_nesting":
        return b"[" * (size // 2) + b"]" * (size // 2)
    if shape == "render_growth":  # a deep object of short strings (under the value cap) rendering to ~20x its size
        depth = 95
        head = b'{"state":' + b'{"a":' * depth + b"["
        tail = b"]" + b"}" * depth + b"," + NOUL.encode() + b"}"
        count = (size - len(head) - len(tail) - 8) // 9
        return head + b'"aaaaaa",' * count + b'"aaaaaa"' + tail
    if shape == "plain_state":  # a valid SemIf decision whose state fills the body: the cost of a legal body
        head = b'{"decision":{"id":"d","question":"Which queue?","options":[{"id":"a"},{"id":"b"}],"state":"'
        tail = b'"}}'
        words = b"The customer was charged twice. " * (size // 32 + 1)
        return head + words[: size - len(head) - len(tail)] + tail
    raise ValueError(shape)


WORKER = r"""
import json, resource, sys, time, tracemalloc
sys.path.insert(0, sys.argv[1])
from semif.serving.contracts import openai_decisions, semif as semif_contract, systemone
from semif.serving.contracts.base import Limits, RequestError
try:
    from semif.serving.http.body import parse_json
except ImportError:  # a checkout from before semif/serving/http/body.py
    from semif.serving.http.app import parse_json

def admit(raw):
    try:
        body = parse_json(raw)
        limits = Limits(255, 400)
        for contract in (semif_contract, systemone, openai_decisions):
            if contract.matches(body):
                job = contract.parse(body, limits)
                return "accepted", None, len(job.state_text)
        return "no_contract", None, None
    except RequestError as error:
        return f"{error.status} {error.code}", error.field, None

shape, path = sys.argv[2], sys.argv[3]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after the imports; the body counts
raw = open(path, "rb").read()
started = time.perf_counter()
outcome, field, state_chars = admit(raw)
seconds = time.perf_counter() - started
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
admit(raw)
traced_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
print(json.dumps({"shape": shape, "bytes": len(raw), "seconds": round(seconds, 4),
                  "peak_rss_increase_mib": round((after - before) / 1024, 1),
                  "traced_peak_mib": round(traced_peak / (1 << 20), 1),
                  "outcome": outcome, "field": field, "state_chars": state_chars}))
"""


def run_case(src: Path, shape: str, size: int, timeout: float) -> dict:
    raw = body_of(shape, size)
    with tempfile.NamedTemporaryFile(suffix=".json") as body_file:
        body_file.write(raw)
        body_file.flush()
        command = [sys.executable, "-c", WORKER, str(src), shape, body_file.name]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return {"shape": shape, "bytes": len(raw), "seconds": None, "outcome": f"not done in {timeout:g} s"}
    if done.returncode != 0:
        raise RuntimeError(f"{shape} {size}: {done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["wall_s"] = round(time.perf_counter() - started, 2)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=REPO / "container", help="directory holding the semif package")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'shape':<20} {'bytes':>8} {'seconds':>8} {'RSS+ MiB':>9} {'traced MiB':>10}  outcome")
    for shape in args.shapes:
        for size in args.sizes:
            row = run_case(args.src, shape, size, args.timeout)
            rows.append(row)
            secs = "-" if row["seconds"] is None else f"{row['seconds']:.4f}"
            print(f"{shape:<20} {row['bytes']:>8} {secs:>8} {row.get('peak_rss_increase_mib', '-'):>9} "
                  f"{row.get('traced_peak_mib', '-'):>10}  {row['outcome']} {row.get('field') or ''}", flush=True)
    if args.json:
        # The commit of the code measured: the checkout that holds --src.
        commit = subprocess.run(["git", "-C", str(args.src), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit, "python": sys.version.split()[0],
                  "command": "tools/bench_body.py " + " ".join(argv if argv is not None else sys.argv[1:]), "rows": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
