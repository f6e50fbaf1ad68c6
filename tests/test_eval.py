"""semif-eval and semif-calibrate: scoring of hand-made outcomes, chat answer parsing, and short
end-to-end runs on the real model."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from serving import SAMPLE_DECISIONS, load_sample_decisions, start_cold
from semif.serving.config import DEFAULT_DEBIAS
from semif.serving.postprocess.calibration import Calibration, FitKind, accuracy_coverage, softmax
from semif.tools.client import SemIfClient
from semif.tools.evaluate import (
    CaseOutcome,
    ChatUnavailable,
    EvalConfig,
    InProcessTarget,
    RemoteTarget,
    parse_chat_answer,
    policy_report,
    recommend_thresholds,
    run_eval,
    score_decisions,
    threshold_line,
    write_plots,
)
from semif.tools.evaluate import main as eval_main
from semif.tools.thresholds import Guard, TooFewDecisions
from semif.serving.postprocess.policy import Policy
from semif.tools.sagemaker_transport import RetryingTransport

# The label memo is off here: a recomputed case is compared with a cold evaluation
# (a memo hit would repeat the first answer).
pytestmark = pytest.mark.usefixtures("memo_off")

IDS = ["hardware", "network", "software_licence", "hr"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("network", "network"),
        ("  Network.\n", "network"),
        ("`software_licence`", "software_licence"),
        ("**hr**", "hr"),
        ("Answer: hardware", "hardware"),
        ("The best option is network.", "network"),
        ("network or hardware", None),  # two ids: ambiguous
        ("B", None),
        ("", None),
        (None, None),
        ("software", None),  # a prefix of an id is not the id
    ],
)
def test_chat_answers_parse_to_one_option_id_or_invalid(text, expected):
    assert parse_chat_answer(text, IDS) == expected


def rows_and_outcomes():
    rows = [
        {"id": "1", "category": "a", "answer": "x", "options": [{"id": "x"}, {"id": "y"}]},
        {"id": "2", "category": "a", "answer": "y", "options": [{"id": "x"}, {"id": "y"}]},
        {"id": "3", "category": "b", "answer": "x", "options": [{"id": "x"}, {"id": "y"}]},
        {"id": "4", "category": "b", "answer": "y", "options": [{"id": "x"}, {"id": "y"}]},
    ]
    outcomes = [
        CaseOutcome(latency_ms=10, option_logits=None, probabilities=[0.9, 0.1], tokens=100),
        CaseOutcome(latency_ms=20, option_logits=None, probabilities=[0.6, 0.4], tokens=120),  # wrong: y → x
        CaseOutcome(latency_ms=30, option_logits=None, probabilities=[0.2, 0.8], tokens=80),  # wrong: x → y
        CaseOutcome(latency_ms=40, error="503 overloaded"),
    ]
    return rows, outcomes


def test_decision_scoring_matches_hand_computed_values():
    rows, outcomes = rows_and_outcomes()
    report = score_decisions(rows, outcomes, folds=2, seed=0, min_per_decision=5, priors=None, policy=None, targets=(0.9,))
    assert (report["cases"], report["valid"], report["invalid"]) == (4, 3, 1)
    assert report["errors"] == {"503 overloaded": 1}
    assert report["accuracy"] == 0.25  # invalid answers count as wrong
    assert report["per_category"]["a"]["accuracy"] == 0.5 and report["per_category"]["b"]["accuracy"] == 0.0
    assert {(c["answer"], c["predicted"]) for c in report["top_confusions"]} == {("y", "x"), ("x", "y")}
    assert report["latency"] == {"p50_ms": 20.0, "p95_ms": pytest.approx(29.0), "max_ms": 30, "n": 3}
    assert report["tokens_per_request"]["mean"] == 100.0
    probs = report["probabilities"]
    assert probs["accuracy"] == pytest.approx(1 / 3)
    assert probs["nll"] == pytest.approx((-np.log(0.9) - np.log(0.4) - np.log(0.2)) / 3)
    assert probs["brier"] == pytest.approx((0.02 + 0.72 + 1.28) / 3)
    # three valid answers are far too few to choose a cut-point on
    assert report["recommended_thresholds"] == []
    assert report["thresholds"]["status"] == "refused" and report["thresholds"]["n"] == 3
    assert "calibration_cv" not in report  # no logits, nothing to refit


def test_unreachable_target_accuracy_is_reported_as_such():
    [entry] = recommend_thresholds([0.9] * 25 + [0.8] * 25, [False] * 50, (0.5,))
    assert entry["target_accuracy"] == 0.5 and entry["reachable"] is False and "min_probability" not in entry


# ---- thresholds: chosen on all rows, reported out of bag ------------------------------------------------


def _scored(n: int, *, seed: int, right: float | None = None) -> tuple[list[float], list[bool]]:
    """n confidences in [0.4, 1); each right with probability `right`, or with its confidence (calibrated)."""
    rng = np.random.default_rng(seed)
    confidences = rng.uniform(0.4, 1.0, n)
    correct = rng.random(n) < (confidences if right is None else right)
    return confidences.tolist(), correct.tolist()


def test_thresholds_are_refused_below_50_labeled_decisions():
    with pytest.raises(TooFewDecisions, match="49 labeled decisions; a cut-point needs at least 50"):
        recommend_thresholds(*_scored(49, seed=1), (0.8,))
    assert recommend_thresholds(*_scored(50, seed=1), (0.8,))[0]["n"] == 50
    rows = [{"id": str(i), "category": "a", "answer": "x", "options": [{"id": "x"}, {"id": "y"}]} for i in range(49)]
    outcomes = [CaseOutcome(latency_ms=1, probabilities=[c, 1 - c]) for c in _scored(49, seed=1)[0]]
    report = score_decisions(rows, outcomes, folds=2, seed=0, min_per_decision=5, priors=None, policy=None, targets=(0.8,))
    assert report["recommended_thresholds"] == [] and report["thresholds"]["status"] == "refused"
    assert threshold_line(report).startswith("refused: 49 labeled decisions")


def _labeled_rows(path, n: int) -> None:
    path.write_text("\n".join(json.dumps({"id": str(i), "state": "s", "question": "q", "options": [{"id": "x"}, {"id": "y"}],
                                          "answer": "x"}) for i in range(n)))


def test_semif_eval_asked_for_thresholds_on_49_cases_exits_2_before_running_any(tmp_path, capsys):
    _labeled_rows(tmp_path / "small.jsonl", 49)
    # No adapter listens on port 9: a run that got as far as the cases would report their errors instead.
    code = eval_main([str(tmp_path / "small.jsonl"), "--url", "http://127.0.0.1:9", "--target-accuracy", "0.9",
                      "--max-attempts", "1", "--max-elapsed-s", "0.1", "--no-progress", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--target-accuracy" in err and "49 labeled decisions; a cut-point needs at least 50" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_thresholds_on_fewer_than_200_decisions_are_provisional_and_say_so():
    small = recommend_thresholds(*_scored(199, seed=2), (0.7, 0.8))
    firm = recommend_thresholds(*_scored(200, seed=2), (0.7, 0.8))
    assert [e["provisional"] for e in small] == [True, True]
    assert [e["provisional"] for e in firm] == [False, False]
    rows = [{"id": str(i), "category": "a", "answer": "x", "options": [{"id": "x"}, {"id": "y"}]} for i in range(199)]
    confidences, correct = _scored(199, seed=2)
    outcomes = [CaseOutcome(latency_ms=1, probabilities=[c, 1 - c] if ok else [1 - c, c]) for c, ok in zip(confidences, correct)]
    report = score_decisions(rows, outcomes, folds=2, seed=0, min_per_decision=5, priors=None, policy=None, targets=(0.7,))
    assert report["thresholds"]["status"] == "provisional" and report["thresholds"]["provisional"] is True
    assert "[provisional: 199 labeled decisions < 200" in threshold_line(report)


def test_out_of_bag_accuracy_shows_the_optimism_of_a_cut_point_chosen_on_its_own_rows():
    # Right 3 times in 4 whatever the confidence: a cut-point that "reaches" 90 % does so by luck of the draw.
    [entry] = recommend_thresholds(*_scored(300, seed=7, right=0.75), (0.9,))
    assert entry["reachable"] and entry["basis"] == "out-of-bag"
    assert entry["in_sample"]["accuracy"] >= 0.9
    assert entry["accuracy"] < entry["in_sample"]["accuracy"] - entry["accuracy_se"] / 2
    assert entry["accuracy"] < 0.9


def test_the_cut_point_is_the_all_rows_pick_and_the_figures_are_seeded():
    confidences, correct = _scored(300, seed=3)
    [first] = recommend_thresholds(confidences, correct, (0.85,), Guard(resamples=300, seed=5))
    [again] = recommend_thresholds(confidences, correct, (0.85,), Guard(resamples=300, seed=5))
    [other] = recommend_thresholds(confidences, correct, (0.85,), Guard(resamples=300, seed=6))
    assert first == again and first["accuracy"] != other["accuracy"]
    curve = accuracy_coverage(confidences, correct)
    lowest = max((p for p in curve if p["accuracy"] >= 0.85), key=lambda p: p["coverage"])
    assert first["min_probability"] == other["min_probability"] == lowest["threshold"]
    assert first["in_sample"] == {"accuracy": lowest["accuracy"], "coverage": lowest["coverage"], "accepted": lowest["accepted"]}


def test_policy_report_counts_actions_coverage_and_accuracy_of_accepted():
    report = policy_report([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]], [0, 1, 0], Policy(min_probability=0.7, fallback="escalate"))
    assert report["actions"] == {"accept": 2, "abstain": 1}
    assert report["coverage"] == pytest.approx(2 / 3)
    assert report["accuracy_accepted"] == 0.5


def test_chat_on_a_server_without_the_route_is_reported_unavailable():
    def handler(request):
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "POST /v1/chat/completions", "field": None}})
        return httpx.Response(500)

    client = SemIfClient("http://adapter", transport=RetryingTransport(httpx.MockTransport(handler)))
    row = load_sample_decisions()[0]
    with pytest.raises(ChatUnavailable):
        RemoteTarget(client, "url", "http://adapter").chat(row)


# ---- end to end on the real model ---------------------------------------------------------------------


def test_a_short_eval_run_on_the_real_model_reports_what_the_engine_computes(engine, tmp_path):
    from semif.serving.engine.prompt import Outcome, Question

    rows = load_sample_decisions()[:2]
    target = InProcessTarget(engine)
    config = EvalConfig(scorings=("label",), compare_chat=True, contextual=False, folds=2, policy=Policy(min_probability=0.5),
                        chat_max_tokens=4)
    report = run_eval(target, rows, config, data_path=str(SAMPLE_DECISIONS))
    run = report["runs"]["label"]
    assert run["cases"] == 2 and run["valid"] == 2
    for row, case in zip(rows, run["cases_detail"]):
        assert case["probabilities"] == pytest.approx(softmax(case["option_logits"]).tolist(), abs=1e-9)
        assert case["predicted"] == row["options"][int(np.argmax(case["probabilities"]))]["id"]
    correct = sum(c["predicted"] == c["answer"] for c in run["cases_detail"])
    assert run["accuracy"] == correct / 2
    assert set(run["calibration_cv"]["methods"]) == {"raw", "temperature", "platt"}  # platt: beside the temperature fit
    assert run["calibration_cv"]["methods"]["raw"]["nll"] == pytest.approx(run["probabilities"]["nll"])
    assert sum(run["policy"]["actions"].values()) == 2
    chat = report["chat"]
    assert chat["cases"] == 2 and 0 <= chat["valid"] <= 2
    for case in chat["cases_detail"]:
        assert case["choice"] == parse_chat_answer(case["text"], IDS)
    record = report["reproducibility"]
    assert record["model_sha256"] == engine.sha256 and record["template_version"] == engine.info["template_version"]
    assert len(record["option_set_sha256"]) == 1  # the routing cases share one option set
    assert record["host"]["cpus"] >= 1 and record["data_sha256"]
    # after chat generation used the context, a full evaluation still gives what the eval reported
    first = rows[0]
    question = Question(first["question"], tuple(Outcome(o["id"], o.get("description")) for o in first["options"]))
    start_cold(engine)
    recomputed = engine.score(first["state"], [question]).distributions[0]
    assert recomputed.evaluated_tokens == recomputed.tokens  # computed from scratch (memo off in this module)
    again = recomputed.option_logits
    assert again == pytest.approx(run["cases_detail"][0]["option_logits"], abs=1e-4)
    plots = write_plots(report, tmp_path)
    assert len(plots) == 3
    for path in plots:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_eval_and_calibrate_clis_write_their_files(model_path, engine, tmp_path):
    from semif.tools.calibrate import main as calibrate_main
    from semif.tools.evaluate import main as eval_main

    out = tmp_path / "eval"
    assert eval_main([str(SAMPLE_DECISIONS), "--model", str(model_path), "--limit", "2", "--no-contextual", "--folds", "2",
                      "--out", str(out), "--no-progress", "--n-threads", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["runs"]["label"]["cases"] == 2
    assert sorted(p.name for p in out.glob("*.png")) == ["accuracy-coverage.png", "latency.png", "reliability.png"]

    cal_path = tmp_path / "calibration.json"
    assert calibrate_main([str(SAMPLE_DECISIONS), "--model", str(model_path), "--limit", "2", "--folds", "2",
                           "--min-per-decision", "2", "--contextual", "on", "--out", str(cal_path), "--n-threads", "2"]) == 0
    calibration = Calibration.load(cal_path, served=engine.info)
    assert [str(kind) for kind in calibration.fits] == [f"label/state_first/{DEFAULT_DEBIAS}"]  # the server's default
    fitted = calibration.fits[FitKind("label", "state_first", DEFAULT_DEBIAS)]
    assert fitted["global"]["n"] == 2 and set(fitted["per_decision"]) == {"route"}
    # The default reads in several orders: a listing-keyed contextual prior would answer a listing and its reverse
    # differently, so its fit has none; a fit of single reads (debias none) carries it.
    assert "contextual" not in fitted
    assert calibrate_main([str(SAMPLE_DECISIONS), "--model", str(model_path), "--limit", "2", "--folds", "2",
                           "--min-per-decision", "2", "--contextual", "on", "--debias", "none", "--out", str(cal_path),
                           "--n-threads", "2"]) == 0
    calibration = Calibration.load(cal_path, served=engine.info)
    fitted = calibration.fits[FitKind("label", "state_first", "none")]
    # contextual calibration measured on the real model's content-free answers, stored for its option set
    rows = load_sample_decisions()
    from semif.serving.engine.prompt import options_sha256

    assert fitted["contextual"]["route"]["options_sha256"] == options_sha256([(o["id"], o.get("description")) for o in rows[0]["options"]])
    prior = np.exp(fitted["contextual"]["route"]["log_prior"])
    assert len(prior) == 4 and prior.sum() == pytest.approx(1.0)
    assert set(fitted["contextual_temperatures"]) == {"global", "per_decision"}
    assert calibration.raw["fit"]["cross_validation"]["label/state_first/none"]["k"] == 2


def test_labeled_rows_whose_strings_hold_line_separators_parse_as_one_row_each():
    """JSON Lines end at "\\n" only: U+2028, U+2029 and U+0085 are legal, unescaped, inside a JSON string."""
    from semif.tools.evaluate import parse_rows

    state = "First line\u2028second line\u2029third line\x85fourth"
    rows = [{"id": "a", "state": state, "question": "Which queue?", "options": [{"id": "billing"}, {"id": "shipping"}],
             "answer": "billing"},
            {"id": "b", "state": "Plain.", "question": "Which queue?", "options": [{"id": "billing"}, {"id": "shipping"}],
             "answer": "shipping"}]
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    parsed = parse_rows(text, "labeled.jsonl")
    assert [row["id"] for row in parsed] == ["a", "b"] and parsed[0]["state"] == state
