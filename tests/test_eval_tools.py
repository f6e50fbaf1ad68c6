"""tools/template_eval.py and tools/second_look_eval.py: their figures computed from known records, and
each tool run end to end on two labeled decisions with the embedded model (real llama.cpp)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _side(probabilities, content_free=None, tokens=100, evaluated=60, mass=0.9):
    return {"probabilities": probabilities, "label_mass": mass, "tokens": tokens, "evaluated": evaluated,
            "content_free": content_free or [1 / len(probabilities)] * len(probabilities)}


def test_template_eval_counts_accuracy_stability_and_the_mean_of_orders():
    tool = load("template_eval")
    records = [
        # right both ways
        {"style": "s", "category": "a", "gold_index": 0, "forward": _side([0.8, 0.2]), "reversed": _side([0.7, 0.3])},
        # right as written only; the mean of orders is right (0.9 + 0.4 > 0.1 + 0.6)
        {"style": "s", "category": "a", "gold_index": 0, "forward": _side([0.9, 0.1]), "reversed": _side([0.4, 0.6])},
        # wrong both ways, but contextual calibration puts it right: option 1 is what the empty state says anyway
        {"style": "s", "category": "b", "gold_index": 0,
         "forward": _side([0.4, 0.6], [0.1, 0.9]), "reversed": _side([0.45, 0.55], [0.1, 0.9])},
    ]
    summary = tool.summarise(records, ["s"], {"s": 40})["s"]
    assert summary["n"] == 3
    assert summary["forward"] == pytest.approx(2 / 3) and summary["reversed"] == pytest.approx(1 / 3)
    assert summary["stable"] == pytest.approx(2 / 3)  # the first and the third keep their choice
    assert summary["mean_of_orders"] == pytest.approx(2 / 3)
    assert summary["calibrated_mean"] == pytest.approx(1.0)
    assert summary["after_head_tokens"] == pytest.approx(60.0)
    assert summary["per_category"] == {"a": 1.0, "b": 0.0}
    assert "reverse_stop_rule" not in summary  # records from before the first direction was kept


def test_template_eval_reports_the_served_readout_with_its_stop_rule():
    """debias "reverse": the mean of both orders' log-probabilities, and the first direction alone where its
    margin passes the stop rule's allowance (0.5)."""
    tool = load("template_eval")
    records = [
        # the first direction (the listing) settles on option 0 (log 0.9 - log 0.1 > 0.5), though both reads pick 1
        {"style": "s", "category": "a", "gold_index": 0, "first_listed": True,
         "forward": _side([0.9, 0.1]), "reversed": _side([0.001, 0.999])},
        # the first direction is the reverse listing and does not settle (log 0.55 - log 0.45 < 0.5): both read
        {"style": "s", "category": "a", "gold_index": 1, "first_listed": False,
         "forward": _side([0.2, 0.8]), "reversed": _side([0.55, 0.45])},
    ]
    summary = tool.summarise(records, ["s"], {"s": 40})["s"]
    assert summary["reverse_both_reads"] == pytest.approx(1 / 2)
    assert summary["reverse_stop_rule"] == pytest.approx(1.0)
    assert summary["reverse_one_read_share"] == pytest.approx(1 / 2)


def test_second_look_eval_counts_flips_and_served_time():
    tool = load("second_look_eval")
    records = [
        {"gold_index": 0, "first_pass": {"choice": 1, "ms": 100.0},
         "looks": {"8": {"choice": 0, "ran": True, "ms": 400.0, "reasoning_tokens": 8}}},   # wrong -> right
        {"gold_index": 0, "first_pass": {"choice": 0, "ms": 100.0},
         "looks": {"8": {"choice": 1, "ran": True, "ms": 300.0, "reasoning_tokens": 4}}},   # right -> wrong
        {"gold_index": 2, "first_pass": {"choice": 2, "ms": 100.0},
         "looks": {"8": {"choice": 2, "ran": False, "ms": 100.0, "reasoning_tokens": 0}}},  # clear: no look
    ]
    summary = tool.summarise(records, [8])
    assert summary["first_pass"]["accuracy"] == pytest.approx(2 / 3)
    look = summary["8"]
    assert look["accuracy"] == pytest.approx(2 / 3) and look["looked_again"] == 2
    assert look["wrong_to_right"] == 1 and look["right_to_wrong"] == 1
    assert look["p50_ms"] == 300.0 and look["p50_ms_looked_again"] == 350.0
    assert look["mean_reasoning_tokens"] == 6.0


@pytest.mark.parametrize("script, args", [
    ("template_eval.py", ["--styles", "v2,v3"]),
    ("second_look_eval.py", ["--budgets", "4", "--below-margin", "1.0"]),
])
def test_each_tool_runs_end_to_end_on_the_embedded_model(tmp_path, model_path, script, args):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / script), str(model_path), "--limit", "2",
                             "--threads", "2", "--json", str(out), *args],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert len(report["records"]) == (4 if script == "template_eval.py" else 2)
    if script == "second_look_eval.py":
        assert report["summary"]["4"]["looked_again"] == 2  # below margin 1.0: every answer looks again
        assert all(r["looks"]["4"]["reasoning_tokens"] <= 4 for r in report["records"])


def test_bad_flags_are_a_usage_error_not_a_traceback(model_path):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "second_look_eval.py"), str(model_path),
                             "--budgets", "x"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "--budgets" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, str(REPO / "tools" / "template_eval.py"), str(model_path),
                             "--styles", "v9"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "unknown style" in result.stderr and "Traceback" not in result.stderr


def test_order_study_picks_the_smallest_allowance_whose_early_stop_keeps_to_the_change_budget():
    """reverse_stop_rules stops after the first read where its margin exceeds the allowance and counts the choices
    that then differ from the pair's; the chosen allowance is the smallest whose changed share, plus one standard
    error of it, is at most 2% of the rows."""
    study = load("order_study")
    # 400 rows of three options, the first direction as listed. 396 are settled by any read (lead 2.0, both
    # reads agree); in 4 the first read leads by 0.12, 0.22, 0.42 and 0.62 while the pair picks the other option.
    leads = {396: 0.12, 397: 0.22, 398: 0.42, 399: 0.62}
    records, first_listed = [], {}
    for i in range(400):
        lead = leads.get(i, 2.0)
        given = [lead, 0.0, -5.0]
        back = [0.0, lead + 1.0, -5.0] if i in leads else given
        records.append({"id": f"r{i}", "group": "g", "answer": 0, "given": given, "reversed": back,
                        "given_ms": 1.0, "reversed_ms": 1.0})
        first_listed[f"r{i}"] = True
    rules = {r["delta"]: r for r in study.reverse_stop_rules(records, first_listed, {"g": list(range(400))})}
    assert [rules[d]["changed_rows"] for d in (0.0, 0.15, 0.25, 0.45, 0.65)] == [4, 3, 2, 1, 0]
    assert rules[0.25]["one_read_share"] == 0.995 and rules[0.65]["one_read_share"] == 0.99
    # 4 of 400 (1%, standard error 0.5%) keeps to the budget; so does every larger allowance.
    assert study.within_budget(4, 400) and study.smallest_within_budget(list(rules.values()), 400) == 0.0
    # 2 of 120 (1.7%) is within 2% only without its standard error (1.2%); 1 of 120 keeps to it.
    assert not study.within_budget(2, 120) and study.within_budget(1, 120)
    # The same counts out of fewer rows: on 100, 2 changed (2% + 1.4%) is over and 1 (1% + 1%) at the budget;
    # on 60, 1 changed (1.7% + 1.7%) is over too.
    assert study.smallest_within_budget(list(rules.values()), 100) == 0.45
    assert study.smallest_within_budget(list(rules.values()), 60) == 0.65


def test_the_served_stop_allowance_is_the_one_the_recorded_order_study_chose():
    """STOP_MARGIN_PER_READ is the dev study's shared_delta (the larger of the two passes' picks), recomputed from
    its recorded reads by the tool as it is now: changing the constant, the rule or the records alone fails."""
    import math as _math

    from semif.serving.engine.passes.orders import STOP_MARGIN_PER_READ

    study = load("order_study")
    out = REPO / "results" / "order-study-qwen-dev120.jsonl"
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    rows = {json.loads(line)["id"]: json.loads(line) for line in (REPO / "data" / "decisions-dev.jsonl").read_text().splitlines()}
    first_listed = {r["id"]: study._first_is_listed(rows[r["id"]]) for r in records}
    summary = study.summarise(records, first_listed=first_listed)
    assert summary["shared_delta"] == max(summary["reverse_chosen_delta"], summary["chosen_delta"])
    assert _math.isclose(summary["shared_delta"], STOP_MARGIN_PER_READ)
    recorded = json.loads(Path(str(out) + ".summary.json").read_text())
    assert recorded["shared_delta"] == summary["shared_delta"]


def test_time_per_token_recovers_each_sides_cost_per_token_and_per_request(tmp_path, capsys):
    """Synthetic first-sight requests on an exact line per side: the fit gives back its slope and intercept, new
    and recurring option sets apart; the first request of a state is what it reads (not the reversed one)."""
    tool = load("time_per_token")
    cases = []
    for k in range(12):
        new = k % 3 == 0
        adapter_tokens, callo_tokens = 120 + 7 * k, 100 + 5 * k
        cases.append({"option_set_new": new,
                      "adapter": {"forward": {"ms": 130 + 15.0 * adapter_tokens, "evaluated_tokens": adapter_tokens},
                                  "reversed": {"ms": 5.0, "evaluated_tokens": 0}},
                      "callo": {"forward": {"ms": 60 + 14.5 * callo_tokens, "evaluated_tokens": callo_tokens},
                                "reversed": {"ms": 900.0, "evaluated_tokens": 40}}})
    path = tmp_path / "run.cases.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    rows = {(r["side"], r["option_set"]): r for r in tool.summarise(cases)}
    assert set(rows) == {(s, n) for s in ("adapter", "callo") for n in ("new", "recurring")}
    for novelty in ("new", "recurring"):
        assert rows[("adapter", novelty)]["ms_per_token"] == 15.0 and rows[("adapter", novelty)]["ms_besides_tokens"] == 130
        assert rows[("callo", novelty)]["ms_per_token"] == 14.5 and rows[("callo", novelty)]["ms_besides_tokens"] == 60
    assert rows[("adapter", "new")]["n"] == 4 and rows[("adapter", "recurring")]["n"] == 8
    assert tool.main([str(path)]) == 0
    assert "ms/tok" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such file"):
        tool.main([str(tmp_path / "missing.cases.jsonl")])
