"""semif-eval check: saved thresholds applied to answers people have since labeled. The answers are seeded
synthetic records in the shapes the adapter writes; their probabilities are inputs here, not model outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from semif.tools.evaluate import CaseOutcome, score_decisions
from semif.tools.outcome_check import main as check_main

OPTIONS = ["network", "hardware", "billing"]
SEMIF_EVAL = Path(sys.executable).with_name("semif-eval")


def answers(n: int, *, seed: int, overconfidence: float = 0.0) -> list[dict]:
    """SemIf results with a `label` drawn from the served distribution, its top option's probability
    lowered by ``overconfidence`` first (the model claims more than it delivers: drift)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        top_p = rng.uniform(0.4, 1.0)
        served = np.array([top_p, (1 - top_p) * 0.6, (1 - top_p) * 0.4])
        rng.shuffle(served)
        top = int(np.argmax(served))
        truth = served.copy()
        truth[top] = max(served[top] - overconfidence, 0.0)
        others = [i for i in range(3) if i != top]
        truth[others] += (1.0 - truth.sum()) / 2
        label = OPTIONS[rng.choice(3, p=truth / truth.sum())]
        out.append({"id": "route", "option_ids": OPTIONS, "probabilities": served.tolist(), "choice": OPTIONS[top],
                    "label": label})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = check_main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


POLICY = '{"min_probability": 0.8}'


def test_labels_drawn_from_the_served_probabilities_pass_the_check(tmp_path, capsys):
    labels = write_jsonl(tmp_path / "labels.jsonl", answers(400, seed=3))
    code, out, _ = run(capsys, labels, "--thresholds", POLICY, "--budget", "0.15")
    assert code == 0
    assert "verdict: holds" in out


def test_labels_from_an_overconfident_model_fail_the_check(tmp_path, capsys):
    labels = write_jsonl(tmp_path / "labels.jsonl", answers(400, seed=3, overconfidence=0.3))
    code, out, _ = run(capsys, labels, "--thresholds", POLICY, "--budget", "0.15")
    assert code == 1
    assert "verdict: drifted" in out


def _fixed(accepted: int, wrong: int, rejected: int = 20) -> list[dict]:
    """`accepted` answers at p = 0.9 (`wrong` of them labeled otherwise) and `rejected` at p = 0.5."""
    records = [{"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.06, 0.04],
                "label": "hardware" if i < wrong else "network"} for i in range(accepted)]
    records += [{"id": "route", "option_ids": OPTIONS, "probabilities": [0.5, 0.3, 0.2], "label": "billing"}] * rejected
    return records


@pytest.mark.parametrize("wrong, code, verdict", [(16, 0, "holds"), (17, 1, "drifted")])
def test_the_check_fails_only_beyond_the_budget_plus_two_standard_errors(tmp_path, capsys, wrong, code, verdict):
    # budget 0.1 over 100 accepted: SE = sqrt(0.1 · 0.9 / 100) = 0.03, so the limit is 0.16: 16 wrong hold, 17 do not.
    labels = write_jsonl(tmp_path / "labels.jsonl", _fixed(100, wrong))
    got, out, _ = run(capsys, labels, "--thresholds", POLICY, "--budget", "0.1", "--json")
    result = json.loads(out)
    assert got == code and result["verdict"] == verdict
    assert (result["n"], result["accepted"], result["wrong"]) == (120, 100, wrong)
    assert result["coverage"] == pytest.approx(100 / 120)
    assert result["se"] == pytest.approx(0.03) and result["limit"] == pytest.approx(0.16)
    assert result["error_accepted"] == pytest.approx(wrong / 100) and result["budget"] == pytest.approx(0.1)


def _report(tmp_path: Path, records: list[dict], shape: str = "semif-eval") -> Path:
    """The report semif-eval (or semif-batch report) writes, scored from these answers with semif-eval's own scoring."""
    rows = [{"id": str(i), "category": "route", "answer": r["label"], "options": [{"id": o} for o in OPTIONS]}
            for i, r in enumerate(records)]
    outcomes = [CaseOutcome(latency_ms=1.0, probabilities=r["probabilities"]) for r in records]
    run_report = score_decisions(rows, outcomes, folds=2, seed=0, min_per_decision=5, priors=None, policy=None,
                                 targets=(0.8, 0.9))
    path = tmp_path / f"{shape}-report.json"
    path.write_text(json.dumps({"runs": {"label": run_report}} if shape == "semif-eval" else {"evaluation": run_report}))
    return path


def test_a_cut_point_semif_eval_chose_holds_on_new_calibrated_labels_and_fails_on_drifted_ones(tmp_path, capsys):
    report = _report(tmp_path, answers(400, seed=11))
    entry = next(e for e in json.loads(report.read_text())["runs"]["label"]["recommended_thresholds"] if e["target_accuracy"] == 0.9)
    calibrated = write_jsonl(tmp_path / "calibrated.jsonl", answers(400, seed=12))
    drifted = write_jsonl(tmp_path / "drifted.jsonl", answers(400, seed=12, overconfidence=0.3))
    code, out, _ = run(capsys, calibrated, "--thresholds", report, "--target-accuracy", "0.9", "--json")
    result = json.loads(out)
    assert code == 0 and result["verdict"] == "holds"
    assert result["policy"]["min_probability"] == entry["min_probability"]
    assert result["budget"] == pytest.approx(0.1) and result["recorded"]["basis"] == "out-of-bag"
    code, out, _ = run(capsys, drifted, "--thresholds", report, "--target-accuracy", "0.9")
    assert code == 1 and "verdict: drifted" in out
    # semif-batch report's report.json holds the same run under `evaluation`.
    batch_report = _report(tmp_path, answers(400, seed=11), shape="semif-batch")
    code, out, _ = run(capsys, drifted, "--thresholds", batch_report, "--target-accuracy", "0.9", "--json")
    assert code == 1 and json.loads(out)["source"] == "semif-batch report"


def test_the_contract_shapes_and_a_calibration_files_policy_give_the_same_figures(tmp_path, capsys):
    records = answers(120, seed=5)
    semif = write_jsonl(tmp_path / "semif.jsonl", records)
    # One SemIf response holding two results, labeled by decision id; System One answers; OpenAI Decisions answers.
    paired = [{"request_id": "r", "results": [dict(a, id="first"), dict(b, id="second")],
               "label": {"first": a["label"], "second": b["label"]}} for a, b in zip(records[::2], records[1::2])]
    system_one = [{"answers": {"route": {"choice": r["choice"], "probabilities": dict(zip(OPTIONS, r["probabilities"]))}},
                   "label": r["label"]} for r in records]
    openai = [{"answers": [{"type": "choice", "name": "route", "choice": r["choice"],
                            "probabilities": [{"label": o, "probability": p} for o, p in zip(OPTIONS, r["probabilities"])]}],
               "label": r["label"]} for r in records]
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"format": "semif-calibration", "format_version": 2, "policy": json.loads(POLICY)}))
    figures = []
    for labels, thresholds in ((semif, POLICY), (write_jsonl(tmp_path / "paired.jsonl", paired), POLICY),
                               (write_jsonl(tmp_path / "s1.jsonl", system_one), POLICY),
                               (write_jsonl(tmp_path / "oai.jsonl", openai), POLICY), (semif, calibration)):
        code, out, _ = run(capsys, labels, "--thresholds", thresholds, "--budget", "0.15", "--json")
        result = json.loads(out)
        figures.append((code, result["n"], result["accepted"], result["wrong"]))
    assert figures[0][1] == 120 and figures[0][2] > 0
    assert len(set(figures)) == 1, figures


@pytest.mark.parametrize("lines, argv, expected", [
    ([{"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.06, 0.04], "label": "network"},
      {"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.06, 0.04]}], [], ["labels.jsonl:2", "label"]),
    ([{"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.06, 0.04], "label": "printer"}], [],
     ["labels.jsonl:1", "label 'printer' is not one of the options", "[field: label]"]),
    ([{"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.1], "label": "network"}], [],
     ["labels.jsonl:1", "[field: probabilities]"]),
    ([{"id": "route", "option_ids": OPTIONS, "label": "network"}], [], ["labels.jsonl:1", "[field: probabilities]"]),
    ([{"error": {"code": "invalid_request", "message": "decision.question: Field required"}, "id": "bad", "label": "x"}], [],
     ["labels.jsonl:1", "invalid_request", "[field: error]"]),
    (["{not json"], [], ["labels.jsonl:1", "not JSON"]),
    ([{"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.06, 0.04], "label": "network"}], ["--budget", "1.5"],
     ["--budget", "not between 0 and 1"]),
])
def test_bad_labeled_input_exits_2_naming_the_line_and_the_field(tmp_path, capsys, lines, argv, expected):
    labels = write_jsonl(tmp_path / "labels.jsonl", lines)
    code, _, err = run(capsys, labels, "--thresholds", POLICY, *(argv or ["--budget", "0.1"]))
    assert code == 2
    for text in expected:
        assert text in err


@pytest.mark.parametrize("thresholds, argv, expected", [
    (POLICY, [], ["[field: --budget]"]),
    ('{"min_probability": 0.8, "max_wrong": 3}', ["--budget", "0.1"], ["max_wrong", "[field: policy.max_wrong]"]),
    ("missing.json", ["--budget", "0.1"], ["missing.json: no such file"]),
])
def test_a_thresholds_file_the_check_cannot_use_exits_2_naming_it(tmp_path, capsys, thresholds, argv, expected):
    labels = write_jsonl(tmp_path / "labels.jsonl", answers(5, seed=1))
    code, _, err = run(capsys, labels, "--thresholds", thresholds if thresholds.startswith("{") else tmp_path / thresholds, *argv)
    assert code == 2
    for text in expected:
        assert text in err


def test_a_report_whose_thresholds_were_refused_exits_2(tmp_path, capsys):
    report = _report(tmp_path, answers(30, seed=2))
    code, _, err = run(capsys, write_jsonl(tmp_path / "labels.jsonl", answers(5, seed=1)), "--thresholds", report,
                       "--target-accuracy", "0.9")
    assert code == 2 and "30 labeled decisions; a cut-point needs at least 50" in err


def test_semif_eval_check_from_the_console_exits_2_on_bad_input_without_a_traceback(tmp_path):
    labels = write_jsonl(tmp_path / "labels.jsonl", [{"id": "route", "option_ids": OPTIONS, "probabilities": [0.9, 0.06, 0.04]}])
    missing_label = subprocess.run([str(SEMIF_EVAL), "check", str(labels), "--thresholds", POLICY, "--budget", "0.1"],
                                   capture_output=True, text=True, timeout=120)
    unknown_option = subprocess.run([str(SEMIF_EVAL), "check", str(labels), "--thresholds", POLICY, "--max-wrong", "3"],
                                    capture_output=True, text=True, timeout=120)
    assert missing_label.returncode == 2 and "labels.jsonl:1: missing field label" in missing_label.stderr
    assert unknown_option.returncode == 2 and "unrecognized arguments: --max-wrong" in unknown_option.stderr
    assert "Traceback" not in missing_label.stderr + unknown_option.stderr
