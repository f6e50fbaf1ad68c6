"""The labeled decision set (data/decisions-dev.jsonl, data/decisions-holdout.jsonl) is well formed.

No model runs here: these checks guard the data that accuracy figures are measured on, so that a broken
row (an answer that is not an option, a duplicated case, a split that leaks) fails before a benchmark
reports a number from it.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from semif.tools.evaluate import load_rows

DATA = Path(__file__).resolve().parents[1] / "data"
DEV = DATA / "decisions-dev.jsonl"
HOLDOUT = DATA / "decisions-holdout.jsonl"
OLDER_SETS = [DATA / "decisions-sample.jsonl", DATA / "heldout-decisions.jsonl"]
CATEGORIES = {"routing", "priority", "policy", "tool", "yesno", "score"}
FIELDS = {"id", "category", "decision_id", "state", "question", "options", "answer"}


def rows_of(path: Path) -> list[dict]:
    return load_rows(path)


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def answer_position(row: dict) -> int:
    return [o["id"] for o in row["options"]].index(row["answer"])


@pytest.fixture(scope="module")
def dev() -> list[dict]:
    return rows_of(DEV)


@pytest.fixture(scope="module")
def holdout() -> list[dict]:
    return rows_of(HOLDOUT)


@pytest.mark.parametrize("path", [DEV, HOLDOUT], ids=["dev", "holdout"])
def test_every_row_is_a_complete_decision_with_its_answer_among_the_options(path):
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        row = json.loads(line)
        where = f"{path.name}:{number}"
        assert set(row) == FIELDS, f"{where}: fields {sorted(row)}"
        for name in ("id", "decision_id", "state", "question", "answer"):
            assert isinstance(row[name], str) and row[name].strip(), f"{where}: {name} must be a non-empty string"
        assert row["category"] in CATEGORIES, f"{where}: category {row['category']!r}"
        ids = [o["id"] for o in row["options"]]
        assert 2 <= len(ids) <= 12, f"{where}: {len(ids)} options"
        assert len(set(ids)) == len(ids), f"{where}: repeated option id"
        for option in row["options"]:
            assert set(option) == {"id", "description"}, f"{where}: option fields {sorted(option)}"
            assert re.fullmatch(r"[a-z0-9_]+", option["id"]), f"{where}: option id {option['id']!r}"
            assert option["description"].strip(), f"{where}: option {option['id']} has no description"
        assert row["answer"] in ids, f"{where}: answer {row['answer']!r} is not one of {ids}"
    assert len(rows_of(path)) == number  # and semif-eval reads every one of them


def test_ids_are_unique_across_both_splits(dev, holdout):
    repeated = [i for i, n in Counter(r["id"] for r in dev + holdout).items() if n > 1]
    assert not repeated, f"ids used more than once: {repeated[:5]}"


def test_no_state_appears_twice_in_the_set_or_in_the_older_sample_files(dev, holdout):
    seen: dict[str, str] = {}
    for row in dev + holdout:
        key = normalised(row["state"])
        assert key not in seen, f"{row['id']} repeats the state of {seen[key]}"
        seen[key] = row["id"]
    for path in OLDER_SETS:
        for row in rows_of(path):
            assert normalised(row["state"]) not in seen, f"{row['id']} of {path.name} is in the set too"


def test_each_decision_keeps_one_question_and_one_option_list(dev, holdout):
    # Calibration groups by decision_id, and contextual priors by (question, options): one of each per decision.
    shapes: dict[str, set] = defaultdict(set)
    categories: dict[str, set] = defaultdict(set)
    for row in dev + holdout:
        shapes[row["decision_id"]].add((row["question"], json.dumps(row["options"])))
        categories[row["decision_id"]].add(row["category"])
    assert {d: len(s) for d, s in shapes.items() if len(s) > 1} == {}
    assert {d: c for d, c in categories.items() if len(c) > 1} == {}


@pytest.mark.parametrize("split", ["dev", "holdout", "both"])
def test_the_answer_sits_at_every_option_position_about_equally_often(split, dev, holdout):
    rows = {"dev": dev, "holdout": holdout, "both": dev + holdout}[split]
    by_count: dict[int, Counter] = defaultdict(Counter)
    for row in rows:
        by_count[len(row["options"])][answer_position(row)] += 1
    for n, positions in sorted(by_count.items()):
        total = sum(positions.values())
        fair = total / n
        counts = [positions[k] for k in range(n)]
        if total >= 4 * n:
            # Between half and one and a half times its fair share, at every position.
            assert all(0.5 * fair <= c <= 1.5 * fair for c in counts), f"{n} options, answers by position {counts}"
        elif split == "both":
            assert all(counts), f"{n} options: no answer at some position ({counts})"
    # Over all rows, the first and the last option are the answer as often as chance says (within 20%).
    for position in (0, -1):
        observed = sum(1 for r in rows if answer_position(r) == position % len(r["options"]))
        expected = sum(1 / len(r["options"]) for r in rows)
        assert abs(observed - expected) <= 0.2 * expected, f"position {position}: {observed} answers, {expected:.1f} by chance"


def test_the_holdout_is_about_forty_percent_and_covers_every_decision(dev, holdout):
    share = len(holdout) / (len(dev) + len(holdout))
    assert 0.35 <= share <= 0.45, f"holdout share {share:.3f}"
    assert {r["decision_id"] for r in holdout} == {r["decision_id"] for r in dev}


def test_the_set_is_large_and_covers_every_kind_of_decision(dev, holdout):
    rows = dev + holdout
    assert len(rows) >= 400
    per_category = Counter(r["category"] for r in rows)
    assert set(per_category) == CATEGORIES
    assert min(per_category.values()) >= 30, per_category
    option_counts = Counter(len(r["options"]) for r in rows)
    assert min(option_counts) == 2 and max(option_counts) > 8, option_counts
    lengths = sorted(len(r["state"]) for r in rows)
    assert lengths[0] < 40 and lengths[-1] > 800, "from one line to a long email or log"
