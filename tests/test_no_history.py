"""No line of the project recounts how it was made: docs, code, comments, tests and messages say what the
project is and why; a measured figure carries its date and commit instead of the piece of work that ran it.

The patterns are assembled from fragments so that this file's own definitions do not match them; the file is
scanned like any other.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|earlier|previous|next"
_SECTION = "\u00a7"
HISTORY_PATTERNS = {
    "a numbered or relative working session": re.compile(r"\b(" + _ORDINALS + r") " + "session" + r"s?\b", re.I),
    "an issue number": re.compile(r"\b" + "issue" + r"s? #?[0-9]+", re.I),
    "an issue section": re.compile("#[0-9]+ ?" + _SECTION),
    "a section number": re.compile(_SECTION + " ?[0-9]"),
    "a work round": re.compile(r"\bround " + "of work", re.I),
}
# Data files hold what tools wrote (case texts, raw results); the lines to police are prose and code.
SKIPPED_SUFFIXES = {".json", ".jsonl", ".png", ".gguf", ".gz", ".whl", ".ico"}


def history_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, line) for every line of `text` that recounts the project's making."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in HISTORY_PATTERNS.items():
            if pattern.search(line):
                found.append((number, name, line.strip()))
    return found


def project_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    files = []
    for name in filter(None, listed):
        path = REPO / name
        if path.suffix.lower() in SKIPPED_SUFFIXES or not path.is_file():
            continue
        files.append(path)
    return files


@pytest.mark.parametrize("line", [
    "Rerun on the current code (fifth " "session).",
    "Measured in the last " "session on 2 cores.",
    "Order debiasing (issue " "#11 \u00a73).",
    "see issue " "12 for the ABI check",
    "the layout of #14 \u00a73",
    "## Per-request overhead (\u00a7 2 and \u00a74)",
    "each labelled by the round " "of work that produced it",
])
def test_each_history_pattern_catches_the_phrasing_it_names(line):
    assert history_lines(line), line


@pytest.mark.parametrize("line", [
    "one real llama.cpp model per test session (loading costs seconds)",
    "role chaining caps an assumed session at one hour",
    "tissue 12 samples",
    "round-robin sharding, rounded down to whole MiB",
    "Measured 2026-12-02 on commit dd5781d.",
])
def test_ordinary_lines_are_not_taken_for_history(line):
    assert not history_lines(line), line


def test_no_tracked_text_file_recounts_the_making_of_the_project():
    files = project_text_files()
    assert len(files) > 100, "git listed too few files: is this a checkout of the repository?"
    offending = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for number, name, line in history_lines(text):
            offending.append(f"{path.relative_to(REPO)}:{number}: {name}: {line[:160]}")
    assert not offending, "lines that recount how the project was made (say what it is, date a figure " \
                          "and name its commit instead):\n" + "\n".join(offending)
