"""tools/bench_callo.py's bookkeeping: the requests both sides get, who goes first, and the figures it reports
(accuracy, order stability, wins per group, the paired latency ratio, callo's token counts), computed from
recorded replies. No servers run here: the benchmark itself needs callo and llama-server (make bench-callo)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_callo.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("bench_callo_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


ROW = {"id": "r1", "state": "The VPN drops.", "question": "Which team?", "answer": "network",
       "options": [{"id": "hardware", "description": "Laptops"}, {"id": "network", "description": "VPN, Wi-Fi"},
                   {"id": "hr", "description": None}]}


def reply(choice, ms=100.0, *, answer="network", evaluated=None, error=None):
    probabilities = {} if choice is None else {choice: 0.7, **({answer: 0.3} if answer != choice else {})}
    return {"ms": ms, "choice": choice, "probabilities": probabilities, "prompt_tokens": None,
            "evaluated_tokens": evaluated, "cached_tokens": None, "generated_tokens": None, "error": error, "nll": None}


def case(adapter_fwd, adapter_rev, callo_fwd, callo_rev, *, category="routing", answer="network", ms=(100.0, 100.0),
         new=True):
    return {"id": "x", "category": category, "decision_id": category, "answer": answer, "option_set_new": new,
            "adapter": {"forward": reply(adapter_fwd, ms[0]), "reversed": reply(adapter_rev, ms[0])},
            "callo": {"forward": reply(callo_fwd, ms[1]), "reversed": reply(callo_rev, ms[1])}}


def test_both_directions_send_the_same_question_with_the_options_reversed(tool):
    forward, backward = tool.systemone_body(ROW, False), tool.systemone_body(ROW, True)
    q_fwd, q_rev = forward["questions"]["decision"], backward["questions"]["decision"]
    assert q_fwd["type"] == q_rev["type"] == "choice"
    assert forward["state"] == backward["state"] == ROW["state"]
    assert q_fwd["instructions"] == q_rev["instructions"] == ROW["question"]
    assert list(q_fwd["criteria"]) == ["hardware", "network", "hr"]
    assert list(q_rev["criteria"]) == ["hr", "network", "hardware"]
    assert q_rev["criteria"] == q_fwd["criteria"] == {"hardware": "Laptops", "network": "VPN, Wi-Fi", "hr": None}


def test_the_adapters_body_marks_the_rows_abstain_option_and_callos_never_does(tool):
    row = {**ROW, "options": ROW["options"] + [{"id": "needs_more_info", "description": "Says too little"}],
           "abstain_option": "needs_more_info"}
    for reverse in (False, True):
        bodies = tool.side_bodies(row, reverse, abstain_marks=True)
        adapter, callo = bodies["adapter"]["questions"]["decision"], bodies["callo"]["questions"]["decision"]
        assert adapter.pop("x_abstain_option") == "needs_more_info"
        assert "x_abstain_option" not in callo
        assert bodies["adapter"] == bodies["callo"] == tool.systemone_body(row, reverse)  # otherwise the same request
    # A row without an abstain option: no mark, the same body for both sides.
    plain = tool.side_bodies(ROW, False, abstain_marks=True)
    assert plain["adapter"] == plain["callo"] and "x_abstain_option" not in plain["adapter"]["questions"]["decision"]
    # --no-abstain-marks: the flag turns the marks off; both sides get the very same body.
    assert tool.parse_args([]).abstain_marks is True
    off = tool.parse_args(["--no-abstain-marks"]).abstain_marks
    bodies = tool.side_bodies(row, False, abstain_marks=off)
    assert bodies["adapter"] == bodies["callo"] and "x_abstain_option" not in bodies["adapter"]["questions"]["decision"]


def test_the_adapters_marked_body_is_what_its_system_one_contract_takes_as_the_abstain_option(tool):
    from semif.serving.contracts import systemone
    from semif.serving.contracts.base import Limits

    row = {**ROW, "abstain_option": "hr"}
    for reverse, index in ((False, 2), (True, 0)):
        job = systemone.parse(tool.side_bodies(row, reverse, abstain_marks=True)["adapter"], Limits(255, 400))
        assert job.questions[0].abstain == index
        assert systemone.parse(tool.side_bodies(row, reverse, abstain_marks=True)["callo"], Limits(255, 400)).questions[0].abstain is None


def test_the_report_records_whether_abstain_marks_were_sent(tool, capsys):
    cases = [case("network", "network", "network", "network"), case("hr", "hr", "hr", "hr")]
    cases[0].update(abstain_option="hr", abstain_marked=True)
    cases[1].update(abstain_option=None, abstain_marked=False)
    assert tool.abstain_marks_record(cases, True) == {"sent": True, "rows_with_abstain_option": 1, "marked_cases": 1}
    cases[0]["abstain_marked"] = False
    off = tool.abstain_marks_record(cases, False)
    assert off == {"sent": False, "rows_with_abstain_option": 1, "marked_cases": 0}
    summary = {side: tool.side_summary(cases, side) for side in ("adapter", "callo")}
    report = {"meta": {"model_file": "m.gguf", "threads": 2, "cases": 2, "data": "d.jsonl", "host": {"commit": "abc"},
                       "date": "2026-12-03", "abstain_marks": off},
              "summary": summary, "ratios": {"p50_forward": 1.0, "p50_all": 1.0, "median_per_request": 1.0},
              "per_category": tool.group_summary(cases, "category"), "per_decision": tool.group_summary(cases, "decision_id")}
    tool.print_report(report)
    assert "abstain marks: not sent (--no-abstain-marks)" in capsys.readouterr().out


def test_each_side_goes_first_equally_often_in_each_direction(tool):
    firsts = Counter((turn, tool.side_order(index, turn)[0]) for index in range(10) for turn in (0, 1))
    assert firsts == {(0, "adapter"): 5, (0, "callo"): 5, (1, "adapter"): 5, (1, "callo"): 5}
    assert all(tool.side_order(i, 0)[0] != tool.side_order(i, 1)[0] for i in range(10))
    assert all(sorted(tool.side_order(i, t)) == ["adapter", "callo"] for i in range(4) for t in (0, 1))


def test_accuracy_counts_the_first_direction_and_stability_needs_the_same_choice_both_ways(tool):
    cases = [case("network", "network", "network", "hardware"),   # both right; callo flips when reversed
             case("hr", "hr", "network", "network"),              # adapter wrong but stable
             case("network", None, "hardware", "network")]        # adapter's reversed request failed
    cases[2]["adapter"]["reversed"]["error"] = "HTTP 500: boom"
    adapter, callo = tool.side_summary(cases, "adapter"), tool.side_summary(cases, "callo")
    assert (adapter["correct"], adapter["correct_reversed"], adapter["order_stable"]) == (2, 1, 2)
    assert (callo["correct"], callo["correct_reversed"], callo["order_stable"]) == (2, 2, 1)
    assert adapter["errors"] == 1 and callo["errors"] == 0
    assert adapter["accuracy"] == pytest.approx(2 / 3)


def test_groups_count_where_only_one_side_is_right(tool):
    cases = [case("network", "network", "hr", "hr", category="a"),
             case("network", "network", "network", "network", category="a"),
             case("hr", "hr", "network", "network", category="b"),
             case("hr", "hr", "hardware", "hardware", category="b")]
    groups = tool.group_summary(cases, "category")
    assert (groups["a"]["adapter_only_right"], groups["a"]["callo_only_right"]) == (1, 0)
    assert (groups["b"]["adapter_only_right"], groups["b"]["callo_only_right"]) == (0, 1)
    assert groups["a"]["adapter"]["correct"] == 2 and groups["b"]["callo"]["correct"] == 1


def test_the_paired_ratio_is_the_median_of_per_request_ratios_and_skips_failures(tool):
    cases = [case("network", "network", "network", "network", ms=(300.0, 100.0)),
             case("network", "network", "network", "network", ms=(50.0, 100.0))]
    cases[0]["callo"]["reversed"]["error"] = "timeout"  # this pair is left out
    # ratios kept: 3.0, 0.5, 0.5 -> median 0.5 (with the failed pair it would be 1.75)
    assert tool.paired_ratio(cases) == pytest.approx(0.5)


def test_callo_token_counts_come_from_the_question_entry_of_its_timings_header(tool):
    header = json.dumps([{"q": "decision", "kind": "plain", "tokens": 187, "prompt_n": 120, "cache_n": 67},
                         {"q": "other", "tokens": 1, "prompt_n": 1, "cache_n": 0}])
    assert tool.callo_token_counts(header) == (187, 120, 67)
    assert tool.callo_token_counts(None) == (None, None, None)
    assert tool.callo_token_counts('[{"truncated": 1}]') == (None, None, None)
    assert tool.callo_token_counts("not json") == (None, None, None)


def test_llama_server_counters_are_read_from_its_prometheus_text(tool):
    text = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234
llamacpp:tokens_predicted_total 17
llamacpp:prompt_seconds_total 4.5e+01
"""
    counters = tool.llama_server_counters(text)
    assert counters == {"llamacpp:prompt_tokens_total": 1234.0, "llamacpp:tokens_predicted_total": 17.0,
                        "llamacpp:prompt_seconds_total": 45.0}


def test_both_orders_averages_the_two_requests_probabilities_per_option(tool):
    replies = {"forward": {"probabilities": {"hardware": 0.55, "network": 0.45}, "error": None},
               "reversed": {"probabilities": {"network": 0.8, "hardware": 0.2}, "error": None}}
    assert tool.both_orders_choice(replies) == "network"  # 0.625 against 0.375, although forward chose hardware
    replies["reversed"]["error"] = "HTTP 500"
    assert tool.both_orders_choice(replies) is None


def test_thinking_gives_callo_a_budget_on_every_request_and_the_adapter_a_second_look_below_the_margin(tool):
    thinking = tool.Thinking(64, below_margin=0.25, deadline_ms=5000)
    body = tool.systemone_body(ROW, False)
    callo, adapter = thinking.body("callo", body), thinking.body("adapter", body)
    assert callo["think_budget"] == 64 and "second_look" not in callo
    assert adapter["second_look"] == {"below_margin": 0.25, "max_tokens": 64, "deadline_ms": 5000}
    assert "think_budget" not in adapter
    # What the adapter's own System One contract reads from it (its second_look fields are strict).
    from semif.serving.contracts.systemone import SystemOneRequest
    look = SystemOneRequest.model_validate(adapter).second_look.config()
    assert (look.max_tokens, look.deadline_s) == (64, 5.0)
    assert look.below_margin == 0.25
    assert callo["questions"] == adapter["questions"] == body["questions"]
    assert "think_budget" not in body and "second_look" not in body  # the shared body is not changed


def test_forward_only_leaves_the_figures_that_need_both_orders_empty(tool):
    cases = [case("network", None, "hr", None), case("hr", None, "network", None)]
    for c in cases:
        for side in ("adapter", "callo"):
            del c[side]["reversed"]
    cases[0]["adapter"]["forward"]["looked_again"] = True
    cases[1]["adapter"]["forward"]["looked_again"] = False
    adapter, callo = tool.side_summary(cases, "adapter"), tool.side_summary(cases, "callo")
    assert (adapter["correct"], adapter["accuracy"]) == (1, 0.5)
    assert adapter["order_stable"] is None and adapter["correct_both_orders"] is None
    assert adapter["looked_again"] == 1 and callo["looked_again"] is None
    assert adapter["requests"] == 2
    assert list(adapter["tokens"]) == ["forward"]
    assert tool.group_summary(cases, "category")["routing"]["adapter"]["order_stable"] is None
    assert tool.paired_ratio(cases) == pytest.approx(1.0)


FITS = Path(__file__).resolve().parents[1] / "tools" / "callo_fits.py"


def test_callo_fits_write_the_same_request_with_the_answer_as_its_label(tool):
    spec = importlib.util.spec_from_file_location("callo_fits_tool", FITS)
    fits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fits)
    row = {**ROW, "category": "routing", "decision_id": "team"}
    record = fits.callo_record(row)
    question = record["questions"]["decision"]
    assert question.pop("label") == "network"
    assert {k: v for k, v in record.items() if k != "_meta"} == tool.systemone_body(row, False)
    assert record["_meta"] == {"id": "r1", "group_id": "team", "source": "routing"}
    assert fits.callo_record(ROW)["_meta"] == {"id": "r1", "group_id": "r1", "source": "all"}


def test_the_report_prints_without_the_reversed_requests_and_with_a_side_that_always_failed(tool, capsys):
    cases = [case("network", None, None, None), case("hr", None, None, None)]
    for c in cases:
        for side in ("adapter", "callo"):
            del c[side]["reversed"]
        c["callo"]["forward"]["error"] = "HTTP 422: no thinking mode"
        c["adapter"]["forward"]["looked_again"] = True
    summary = {side: tool.side_summary(cases, side) for side in ("adapter", "callo")}
    assert summary["callo"]["latency_ms"]["forward"]["p50"] is None and summary["callo"]["errors"] == 2
    a, c = summary["adapter"]["latency_ms"], summary["callo"]["latency_ms"]
    ratios = {"p50_forward": tool.ratio_of(a["forward"]["p50"], c["forward"]["p50"]),
              "p50_all": tool.ratio_of(a["all"]["p50"], c["all"]["p50"]), "median_per_request": tool.paired_ratio(cases)}
    assert ratios == {"p50_forward": None, "p50_all": None, "median_per_request": None}
    report = {"meta": {"model_file": "m.gguf", "threads": 2, "cases": 2, "data": "d.jsonl", "host": {"commit": "abc"},
                       "date": "2026-12-03", "thinking": {"budget": 64, "below_margin": 0.2, "deadline_ms": 20000}},
              "summary": summary, "ratios": ratios, "per_category": tool.group_summary(cases, "category"),
              "per_decision": tool.group_summary(cases, "decision_id")}
    tool.print_report(report)
    out = capsys.readouterr().out
    assert "p50 (first sight of each state) -" in out
    assert "looked again on 2/2 requests" in out


def test_a_profile_that_kept_no_option_count_is_not_passed_on(tmp_path):
    spec = importlib.util.spec_from_file_location("callo_fits_tool", FITS)
    fits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fits)
    profile = tmp_path / "bias.json"
    assert fits.profile_entries(profile) == 0  # not written
    profile.write_text(json.dumps({"format": 1, "entries": {}}))
    assert fits.profile_entries(profile) == 0  # written, nothing kept
    profile.write_text(json.dumps({"format": 1, "entries": {"4": {"offsets": [0.1, 0, 0, -0.1]}, "2": {}}}))
    assert fits.profile_entries(profile) == 2
    profile.write_text("{not json")
    assert fits.profile_entries(profile) == 0


def test_second_looks_are_counted_in_both_directions(tool):
    cases = [case("network", "network", "network", "network")]
    cases[0]["adapter"]["forward"]["looked_again"] = False
    cases[0]["adapter"]["reversed"]["looked_again"] = True
    summary = tool.side_summary(cases, "adapter")
    assert (summary["looked_again"], summary["requests"]) == (1, 2)


def test_an_option_set_is_new_the_first_time_the_run_asks_it_whatever_its_listing(tool):
    other_question = {**ROW, "question": "Which queue?"}
    relisted = {**ROW, "options": ROW["options"][::-1]}
    redescribed = {**ROW, "options": [{**ROW["options"][0], "description": "Desktops"}, *ROW["options"][1:]]}
    assert tool.first_sightings([ROW, relisted, other_question, ROW, redescribed, other_question]) == [
        True, False, True, False, True, False]


def test_latency_is_split_by_option_set_novelty_on_the_first_sight_of_each_state(tool):
    cases = [case("network", "network", "hr", "hr", ms=(300.0, 100.0), new=True),
             case("network", "network", "hr", "hr", ms=(500.0, 100.0), new=True),
             case("network", "network", "hr", "hr", ms=(50.0, 100.0), new=False)]
    adapter = tool.side_summary(cases, "adapter")["latency_ms"]
    assert adapter["forward_new"] == {"p50": 400.0, "p95": pytest.approx(490.0), "n": 2}
    assert adapter["forward_recurring"]["p50"] == 50.0 and adapter["forward_recurring"]["n"] == 1
    assert tool.side_summary(cases, "callo")["latency_ms"]["forward_new"]["p50"] == 100.0


def test_a_resumed_run_keeps_the_cases_written_and_drops_a_torn_last_line(tool, tmp_path):
    rows = [{**ROW, "id": f"r{i}"} for i in range(4)]
    path = tmp_path / "run.cases.jsonl"
    assert tool.resumed_cases(path, rows) == []
    path.write_text(json.dumps({"id": "r0", "k": 1}) + "\n" + json.dumps({"id": "r1", "k": 2}) + "\n" + '{"id": "r2", "k')
    kept = tool.resumed_cases(path, rows)
    assert [c["id"] for c in kept] == ["r0", "r1"]
    assert path.read_text().splitlines() == [json.dumps(c) for c in kept]  # appending goes on after a whole line


def test_a_resumed_run_refuses_cases_from_other_rows_or_a_torn_middle_line(tool, tmp_path):
    rows = [{**ROW, "id": f"r{i}"} for i in range(3)]
    path = tmp_path / "run.cases.jsonl"
    path.write_text(json.dumps({"id": "r1"}) + "\n")
    with pytest.raises(SystemExit, match="not the first 1"):
        tool.resumed_cases(path, rows)
    path.write_text("{torn\n" + json.dumps({"id": "r0"}) + "\n")
    with pytest.raises(SystemExit, match=":1: not JSON"):
        tool.resumed_cases(path, rows)
