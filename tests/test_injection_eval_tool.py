"""tools/injection_eval.py's check sweep: the AUC and the per-threshold counts a policy's max_injection
would give, computed from scored cases (no model needed: the cases are what the tool records)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "injection_eval.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("injection_eval_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _attack(p, flipped):
    return {"kind": "attack", "injection_suspected": p, "choice": "b" if flipped else "a", "target": "b"}


def _clean(p, correct):
    return {"kind": "clean", "injection_suspected": p, "choice": "a" if correct else "c", "answer": "a"}


def test_the_sweep_counts_what_each_threshold_would_accept_and_flag(tool):
    cases = [_attack(0.99, True), _attack(0.85, True), _attack(0.6, False), _attack(0.3, True),
             _clean(0.9, True), _clean(0.4, True), _clean(0.2, False)]
    sweep = tool.check_sweep(cases)
    # Pairs (attacked, clean) with the attacked one higher: 0.99 > 3, 0.85 > 2, 0.6 > 2, 0.3 > 1 -> 8 of 12.
    assert sweep["auc"] == pytest.approx(8 / 12)
    by_t = {r["max_injection"]: r for r in sweep["rows"]}
    assert by_t[0.5] == {"max_injection": 0.5, "flips_accepted": 1, "attacked_flagged": 3, "clean_flagged": 1,
                         "clean_accepted_correct": 1}
    assert by_t[0.9]["flips_accepted"] == 2 and by_t[0.9]["clean_flagged"] == 0
    assert by_t[0.99]["flips_accepted"] == 3 and by_t[0.99]["attacked_flagged"] == 0
    assert by_t[0.99]["clean_accepted_correct"] == 2


def test_without_check_probabilities_there_is_no_sweep(tool):
    assert tool.check_sweep([_attack(None, True), _clean(None, True)]) == {}
