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
# Phrasings that date a page by the work behind it. Code and tests may say them (a test may name a request that
# "was stopped"); README.md and docs/ are for users, who need the current figure and what to do, not its history.
# This file is not under docs/, so these may be written out plainly.
DOCS_HISTORY_PATTERNS = {
    "a change dated by its commit": re.compile(r"\bsince commit\b", re.I),
    "a run told against another": re.compile(r"\ba later run\b", re.I),
    "a measurement that was cut short": re.compile(r"\bwas stopped\b", re.I),
    "the code as it was": re.compile(r"\bthe code before\b", re.I),
    "what used to be": re.compile(r"\bpreviously\b", re.I),
}
# Data files hold what tools wrote (case texts, raw results); the lines to police are prose and code.
SKIPPED_SUFFIXES = {".json", ".jsonl", ".png", ".gguf", ".gz", ".whl", ".ico"}


def history_lines(text: str, patterns: dict[str, re.Pattern] = HISTORY_PATTERNS) -> list[tuple[int, str, str]]:
    """(line number, pattern name, line) for every line of `text` that recounts the project's making."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in patterns.items():
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


def user_pages() -> list[Path]:
    """README.md and every text file under docs/ that git tracks or would track."""
    return [path for path in project_text_files()
            if path == REPO / "README.md" or (REPO / "docs") in path.parents]


@pytest.mark.parametrize("line", [
    "v3 is what the server runs Since Commit `6d9410f`.",
    "(A later run of label scoring alone gave 0.70.)",
    "The injection run was stopped after 29 attacks.",
    "the same cases on the code before `body.py`",
    "Labels were previously read after an appended cue.",
])
def test_each_docs_history_pattern_catches_the_phrasing_it_names(line):
    assert history_lines(line, DOCS_HISTORY_PATTERNS), line


@pytest.mark.parametrize("line", [
    "A request still computing after its deadline stops between two questions.",
    "the code path before admission reads the body",
    "a run that stopped at its deadline answers 504",
    "Measured 2026-12-03 on commit 0688c74; rerun the command to refresh it.",
])
def test_ordinary_docs_lines_are_not_taken_for_history(line):
    assert not history_lines(line, DOCS_HISTORY_PATTERNS), line


def test_no_page_of_the_readme_or_docs_dates_itself_by_the_work_behind_it():
    pages = user_pages()
    assert REPO / "README.md" in pages and len(pages) >= 20, [str(p) for p in pages]
    offending = [f"{path.relative_to(REPO)}:{number}: {name}: {line[:160]}"
                 for path in pages for number, name, line in history_lines(path.read_text(encoding="utf-8"),
                                                                          DOCS_HISTORY_PATTERNS)]
    assert not offending, "lines of the README or docs/ that tell how a figure or the code came to be (give the " \
                          "current figure, its command, date and commit instead):\n" + "\n".join(offending)


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
