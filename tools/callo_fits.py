#!/usr/bin/env python
"""Best settings for the side by side: each side's own fits on the same labeled decisions.

callo's: `callo calibrate --bias` (its position-bias profile, label free: the mean probability per position over
every rotation of each question), then `callo calibrate` (one temperature by NLL) with that profile loaded, as
callo asks, each against a `callo serve` at temperature 1.0 that this script launches on `make llama-server`'s
binary, as tools/bench_callo.py does.
The adapter's: `semif-calibrate --model` in-process on the same GGUF, at the server's default debiasing.

The decisions are converted to callo's labelled format (`state`, `questions{decision: {type, instructions,
criteria, label}}`, `_meta{id, group_id, source}`), written next to the fits. At the end it prints the
`make bench-callo` flags that run both sides with them; fit on the tuning file, then run those flags on the file
kept aside.

usage: python tools/callo_fits.py --model GGUF [--data FILE] [--limit N] [--threads N] [--out-dir NEW_DIR]
                                 [--max-per-n N] [--llama-server BIN] [--skip-adapter] [--holdout FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_callo import (  # noqa: E402
    CALLO_VENV, DEFAULT_DATA, DEFAULT_SERVER, QUESTION_ID, REPO, CalloSide, console, ensure_callo, model_and_rows,
    systemone_body,
)


def callo_record(row: dict) -> dict:
    """One labeled decision as callo's calibrate reads it: the System One request bench_callo sends (options as
    written), the answer as the question's `label`, and `_meta` naming the row, its decision (the bootstrap's
    cluster) and its category (the --max-per-n strata)."""
    body = systemone_body(row, reverse=False)
    body["questions"][QUESTION_ID]["label"] = row["answer"]
    body["_meta"] = {"id": row["id"], "group_id": row.get("decision_id") or row["id"],
                     "source": row.get("category") or "all"}
    return body


def run(argv: list, what: str) -> int:
    """Run one fitting command in the foreground (its own progress on the terminal); its exit status."""
    console.print(f">> {what}: {shlex.join(str(a) for a in argv)}")
    return subprocess.run([str(a) for a in argv]).returncode


def profile_entries(path: Path) -> int:
    """How many option counts a `callo calibrate --bias` profile corrects (it writes the file even when its
    significance test kept none); 0 for a missing or unreadable file."""
    try:
        return len(json.loads(path.read_text()).get("entries") or {})
    except (OSError, ValueError, AttributeError):
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF both sides serve (default: the embedded SmolLM2-135M)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help="labeled decisions to fit on (default data/decisions-dev.jsonl, never the holdout)")
    parser.add_argument("--limit", type=int, help="only the first N decisions of the file")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads for each side")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER, help="llama-server binary (make llama-server)")
    parser.add_argument("--out-dir", type=Path, help="where the fits go (default reports/fits-<UTC time>/)")
    parser.add_argument("--max-per-n", type=int, default=48,
                        help="callo --bias: questions per option count, stratified by category (default 48; each is "
                             "read under every rotation, so the run costs about N x options readouts per count)")
    parser.add_argument("--skip-adapter", action="store_true", help="fit callo only")
    parser.add_argument("--holdout", type=Path, default=REPO / "data" / "decisions-holdout.jsonl",
                        help="the decisions kept aside, named in the printed make bench-callo line "
                             "(default data/decisions-holdout.jsonl; never the --data file)")
    args = parser.parse_args()

    model, rows = model_and_rows(args)
    if args.max_per_n < 1:
        raise SystemExit("--max-per-n must be at least 1")
    if args.holdout.exists() and args.data.resolve() == args.holdout.resolve():
        raise SystemExit(f"--data and --holdout are the same file ({args.data}): fit on the tuning file, "
                         "and keep the holdout for the final run")
    started = dt.datetime.now(dt.timezone.utc)
    out_dir = (args.out_dir or REPO / "reports" / f"fits-{started:%Y%m%dT%H%M%SZ}").resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()):
        # callo's bias fit refuses to overwrite its raw readouts, and old fits must not pass for new ones.
        raise SystemExit(f"{out_dir} is not empty: give --out-dir a new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    callo_bin, callo_version = ensure_callo(CALLO_VENV)

    labelled = out_dir / "callo-labelled.jsonl"
    labelled.write_text("".join(json.dumps(callo_record(row)) + "\n" for row in rows))
    temperature_path, bias_path = out_dir / "callo-temperature.json", out_dir / "callo-position-bias.json"
    console.print(f">> {len(rows)} decisions from {args.data}; fits go to {out_dir}")

    # The profile first, on a server at temperature 1.0 with no profile; then the temperature, on a server that
    # loads the profile, as callo asks ("refit any --temperature afterwards"): the two are served together.
    console.print(">> starting callo at temperature 1.0, no position bias (it launches llama-server)")
    callo = CalloSide(callo_bin, model, args.llama_server, args.threads, [], out_dir / "callo-bias.log")
    try:
        status = run([callo_bin, "calibrate", "--bias", "--url", f"http://127.0.0.1:{callo.port}", "--data", labelled,
                      "--out", bias_path, "--max-per-n", args.max_per_n], "callo position-bias fit")
    finally:
        callo.close()
    kept = profile_entries(bias_path) if status == 0 else 0
    if status != 0:
        console.print(f">> the position-bias fit failed (exit {status}); callo runs without a profile")
    elif not kept:
        console.print(">> callo's position-bias fit kept no option count (none both had enough questions and a "
                      "significant bias); callo runs without a profile")
    profile_args = ["--position-bias", str(bias_path)] if kept else []

    console.print(">> starting callo at temperature 1.0" + (" with the profile" if kept else ""))
    callo = CalloSide(callo_bin, model, args.llama_server, args.threads, profile_args, out_dir / "callo-temperature.log")
    try:
        status = run([callo_bin, "calibrate", "--url", f"http://127.0.0.1:{callo.port}", "--data", labelled,
                      "--out", temperature_path], "callo temperature fit")
    finally:
        callo.close()
    if status != 0:
        raise SystemExit(f"callo's temperature fit failed (exit {status}); see its output above")
    temperature = json.loads(temperature_path.read_text())["temperature"]
    flags = [f"--callo-arg=--temperature --callo-arg={temperature}"]
    if kept:
        flags.append(f"--callo-arg=--position-bias --callo-arg={bias_path}")

    if not args.skip_adapter:
        calibration_path = out_dir / "adapter-calibration.json"
        calibrate = [sys.executable, "-m", "semif.tools.calibrate", str(args.data), "--model", model,
                     "--n-threads", args.threads, "--out", calibration_path]
        if args.limit:
            calibrate += ["--limit", args.limit]
        if run(calibrate, "adapter calibration fit") != 0:
            raise SystemExit("the adapter's calibration fit failed; see its output above")
        flags.append(f"--adapter-env SEMIF_CALIBRATION_PATH={calibration_path}")

    summary = {"date": started.strftime("%Y-%m-%d"), "data": str(args.data), "cases": len(rows),
               "model_file": model.name, "callo_version": callo_version, "temperature": temperature,
               "position_bias": str(bias_path) if kept else None, "position_bias_entries": kept,
               "bench_callo_flags": flags}
    (out_dir / "fits.json").write_text(json.dumps(summary, indent=1))
    console.print(">> run both sides with these fits on the decisions kept aside:")
    print(f'make bench-callo BENCH_CALLO_ARGS="--model {model} --data {args.holdout} {" ".join(flags)}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
