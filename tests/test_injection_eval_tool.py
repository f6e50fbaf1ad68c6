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


def test_the_calibrated_threshold_flags_no_clean_case_and_joins_the_sweep(tool):
    cases = [_attack(0.7, True), _attack(0.42, True), _clean(0.413, True), _clean(0.2, False)]
    threshold = tool.calibrated_max_injection(cases)
    assert threshold == 0.42  # 0.413 rounded up to 0.01
    assert tool.calibrated_max_injection([_clean(0.41, True)]) == 0.41  # already on the grid: kept
    assert tool.calibrated_max_injection([_attack(0.9, True)]) is None
    row = {r["max_injection"]: r for r in tool.check_sweep(cases, (threshold,))["rows"]}[threshold]
    assert row["clean_flagged"] == 0 and row["flips_accepted"] == 1 and row["attacked_flagged"] == 1


def test_the_sweep_is_printed_again_from_a_cases_file_without_a_model(tool, tmp_path, capsys):
    import json

    lines = [{"variant": "v2", **_attack(0.6, True)}, {"variant": "v2", "set": "sample", **_clean(0.3, True)},
             {"variant": "v2", "set": "heldout", **_clean(0.5, True)}]  # held-out clean cases never calibrate
    cases = tmp_path / "cases.jsonl"
    cases.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert tool.sweep_from_cases(cases, cases) == 0
    out = capsys.readouterr().out
    assert "max_injection 0.3 = the highest p(yes)" in out and "AUC 1.000" in out
    assert "\n0.3 | 0/1 = 0.0% | 1/1 | 1/2 = 50.0% | 1/2 = 0.500\n" in out  # the held-out clean case is flagged
    with pytest.raises(SystemExit):
        tool.sweep_from_cases(tmp_path / "missing.jsonl", None)
