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
OPTIONAL_FIELDS = {"abstain_option"}
# Option ids that only ever mean "none of the options can be chosen from this state": a row offering one
# must name it in abstain_option, so that no escape goes unmarked.
ESCAPE_IDS = {
    "needs_more_info", "unclear", "not_stated", "none_of_these", "escalate_to_human", "ask_user", "no_tool",
    "none_given", "no_topic", "no_decision", "unknown", "cannot_tell", "ask_device", "not_enough_info",
    "inaudible", "unreadable",
}
MIN_SHARE = 0.15  # of each split: rows whose right answer is the escape, and rows whose option set is seen once


def rows_of(path: Path) -> list[dict]:
    return load_rows(path)


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def answer_position(row: dict) -> int:
    return [o["id"] for o in row["options"]].index(row["answer"])


def option_set(row: dict) -> tuple[str, str]:
    """What a caller sends besides the state: contextual priors and prefix caches key on it."""
    return row["question"], json.dumps([[o["id"], o.get("description")] for o in row["options"]])


def abstains(row: dict) -> bool:
    return row.get("abstain_option") == row["answer"]


@pytest.fixture(scope="module")
def dev() -> list[dict]:
    return rows_of(DEV)


@pytest.fixture(scope="module")
def holdout() -> list[dict]:
    return rows_of(HOLDOUT)


@pytest.fixture(scope="module")
def option_set_counts(dev, holdout) -> Counter:
    """How many rows of the set and of the older sample files ask each question with each option list."""
    return Counter(option_set(r) for r in dev + holdout + [r for p in OLDER_SETS for r in rows_of(p)])


def by_decision(rows: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[row["decision_id"]].append(row)
    return grouped


def abstention_decisions(rows: list[dict]) -> set[str]:
    """Recurring decisions built to test abstention: their escape is the answer in a third of rows or more.

    An escape that is one option among many (the coding agent's ask_user) stays in the position-balance check.
    """
    return {
        d for d, group in by_decision(rows).items()
        if len(group) > 1 and group[0].get("abstain_option") and sum(map(abstains, group)) >= len(group) / 3
    }


@pytest.mark.parametrize("path", [DEV, HOLDOUT], ids=["dev", "holdout"])
def test_every_row_is_a_complete_decision_with_its_answer_among_the_options(path):
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        row = json.loads(line)
        where = f"{path.name}:{number}"
        assert FIELDS <= set(row) <= FIELDS | OPTIONAL_FIELDS, f"{where}: fields {sorted(row)}"
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
        if "abstain_option" in row:
            assert row["abstain_option"] in ids, f"{where}: abstain_option {row['abstain_option']!r} is not one of {ids}"
        escapes = ESCAPE_IDS & set(ids)
        assert not escapes or row.get("abstain_option") in escapes, f"{where}: offers {sorted(escapes)} without abstain_option"
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


def test_each_decision_keeps_one_question_one_option_list_and_one_escape(dev, holdout):
    # Calibration groups by decision_id, and contextual priors by (question, options): one of each per decision,
    # and one decision per (question, options), or two "once-seen" rows would share an option set under two names.
    shapes: dict[str, set] = defaultdict(set)
    categories: dict[str, set] = defaultdict(set)
    escapes: dict[str, set] = defaultdict(set)
    owners: dict[tuple, set] = defaultdict(set)
    for row in dev + holdout:
        shapes[row["decision_id"]].add(option_set(row))
        categories[row["decision_id"]].add(row["category"])
        escapes[row["decision_id"]].add(row.get("abstain_option"))
        owners[option_set(row)].add(row["decision_id"])
    assert {d: len(s) for d, s in shapes.items() if len(s) > 1} == {}
    assert {d: c for d, c in categories.items() if len(c) > 1} == {}
    assert {d: e for d, e in escapes.items() if len(e) > 1} == {}
    assert [sorted(d) for d in owners.values() if len(d) > 1] == []


@pytest.mark.parametrize("split", ["dev", "holdout", "both"])
def test_the_answer_sits_at_every_option_position_about_equally_often(split, dev, holdout):
    everything = dev + holdout
    # Left out, and checked by the abstention tests below instead: an abstention decision has its escape as the answer
    # in about half its rows, so half its answers sit at the escape's position by design; and a once-seen row with an
    # escape keeps the escape where a caller would write it (first, middle or last), not where the balance needs it.
    # Every other row (every decision without such an escape, and every other once-seen row) is checked as before.
    skewed = abstention_decisions(everything)
    sizes = Counter(r["decision_id"] for r in everything)
    rows = [r for r in {"dev": dev, "holdout": holdout, "both": everything}[split]
            if r["decision_id"] not in skewed and not (r.get("abstain_option") and sizes[r["decision_id"]] == 1)]
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


@pytest.mark.parametrize("split", ["dev", "holdout"])
def test_each_split_has_enough_escape_answers_and_once_seen_option_sets(split, dev, holdout, option_set_counts):
    # Callers abstain through an escape option, and agents bring a new option set with every request: a figure
    # measured without either says nothing about them.
    rows = {"dev": dev, "holdout": holdout}[split]
    escape_answers = sum(map(abstains, rows))
    once_seen = sum(1 for r in rows if option_set_counts[option_set(r)] == 1)
    assert escape_answers >= MIN_SHARE * len(rows), f"{escape_answers} of {len(rows)} rows answer their escape"
    assert once_seen >= MIN_SHARE * len(rows), f"{once_seen} of {len(rows)} rows have an option set seen once"


def test_abstention_decisions_reward_neither_always_nor_never_abstaining(dev, holdout):
    everything = dev + holdout
    groups = by_decision(everything)
    decisions = abstention_decisions(everything)
    assert len(decisions) >= 6, sorted(decisions)
    # Stratified like every decision: the same decisions test abstention in each split, none only in one.
    assert abstention_decisions(dev) == abstention_decisions(holdout) == decisions
    positions = set()
    for decision in sorted(decisions):
        group = groups[decision]
        escape = group[0]["abstain_option"]
        share = sum(map(abstains, group)) / len(group)
        assert 0.4 <= share <= 0.6, f"{decision}: the escape is the answer in {share:.0%} of rows"
        for split, rows in (("dev", dev), ("holdout", holdout)):
            mine = [r for r in rows if r["decision_id"] == decision]
            assert any(map(abstains, mine)) and not all(map(abstains, mine)), f"{decision}: {split} needs both kinds of answer"
        # The other answers cover every regular option, none with more than twice its fair share.
        regular = Counter(r["answer"] for r in group if not abstains(r))
        others = [o["id"] for o in group[0]["options"] if o["id"] != escape]
        fair = sum(regular.values()) / len(others)
        assert all(1 <= regular[o] <= 2 * fair for o in others), f"{decision}: regular answers {dict(regular)}"
        ids = [o["id"] for o in group[0]["options"]]
        index = ids.index(escape)
        positions.add("first" if index == 0 else "last" if index == len(ids) - 1 else "middle")
    # A model that learned "the escape is the last option" must not score on these.
    assert positions == {"first", "middle", "last"}, positions


def test_once_seen_rows_with_an_escape_do_not_always_answer_it(dev, holdout, option_set_counts):
    rows = [r for r in dev + holdout if r.get("abstain_option") and option_set_counts[option_set(r)] == 1]
    share = sum(map(abstains, rows)) / len(rows)
    assert 1 / 3 <= share <= 2 / 3, f"once-seen rows with an escape answer it in {share:.0%}"
    places = Counter(
        "first" if i == 0 else "last" if i == len(r["options"]) - 1 else "middle"
        for r in rows for i in [[o["id"] for o in r["options"]].index(r["abstain_option"])]
    )
    assert set(places) == {"first", "middle", "last"}, places


def test_once_seen_option_sets_are_new_to_everything_else(dev, holdout, option_set_counts):
    # A decision with one row is one-off: its question and options appear in no other row, of either split or of the
    # older sample files, so the holdout shares no once-seen option set with dev.
    dev_sets = {option_set(r) for r in dev}
    for decision, group in by_decision(dev + holdout).items():
        if len(group) == 1:
            assert option_set_counts[option_set(group[0])] == 1, f"{decision}: its option set is used elsewhere"
            assert 3 <= len(group[0]["options"]) <= 8, f"{decision}: {len(group[0]['options'])} options"
    holdout_once = {option_set(r) for r in holdout if option_set_counts[option_set(r)] == 1}
    assert not holdout_once & dev_sets


def test_the_holdout_is_about_forty_percent_and_covers_every_recurring_decision(dev, holdout):
    share = len(holdout) / (len(dev) + len(holdout))
    assert 0.35 <= share <= 0.45, f"holdout share {share:.3f}"
    # A decision seen once sits in one split by definition; every recurring one is stratified over both.
    for decision, group in by_decision(dev + holdout).items():
        if len(group) > 1:
            in_holdout = sum(1 for r in holdout if r["decision_id"] == decision)
            assert 0 < in_holdout < len(group), f"{decision}: {in_holdout} of {len(group)} rows in the holdout"
            if decision in abstention_decisions(dev + holdout):
                assert 0.3 <= in_holdout / len(group) <= 0.5, f"{decision}: {in_holdout} of {len(group)} rows in the holdout"


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
