"""Calibration: metrics against hand-computed values, temperature and Platt fitting on synthetic logits with
known parameters, cross-validation, the calibration file, and the adapter applying it (or refusing it)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from semif.serving.config import DEFAULT_DEBIAS
from semif.serving.postprocess.calibration import (
    Calibration,
    CalibrationError,
    Case,
    FitKind,
    accuracy_coverage,
    apply_contextual,
    apply_platt,
    brier,
    build_file,
    contextual_log_prior,
    cross_validate,
    ece,
    fit_platt,
    fit_temperature,
    fit_temperatures,
    kfold_indices,
    nll,
    reliability_bins,
    softmax,
)

# ---- metrics, by hand -----------------------------------------------------------------------------


def test_nll_is_the_mean_negative_log_of_the_right_answers_probability():
    probabilities = [[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]]
    answers = [0, 1, 1]
    assert nll(probabilities, answers) == pytest.approx((math.log(2) + math.log(4 / 3) + math.log(10)) / 3)


def test_brier_sums_squared_errors_over_options_and_averages_over_cases():
    # case 1: (0.5-1)² + 0.5² = 0.5;  case 2: 0.2² + (0.7-1)² + 0.1² = 0.14
    assert brier([[0.5, 0.5], [0.2, 0.7, 0.1]], [0, 1]) == pytest.approx((0.5 + 0.14) / 2)


def test_ece_weights_each_bins_gap_by_its_share_of_cases():
    # 15 bins of width 1/15. Confidences 0.95 and 0.97 share bin 14 (accuracy 1/2, confidence 0.96);
    # 0.55 is alone in bin 8 (accuracy 1); 0.41 alone in bin 6 (accuracy 0).
    confidences = [0.95, 0.97, 0.55, 0.41]
    correct = [True, False, True, False]
    expected = 2 / 4 * abs(0.5 - 0.96) + 1 / 4 * abs(1 - 0.55) + 1 / 4 * abs(0 - 0.41)
    assert ece(confidences, correct) == pytest.approx(expected)
    bins = reliability_bins(confidences, correct)
    assert len(bins) == 15
    assert [b["count"] for b in bins if b["count"]] == [1, 1, 2]
    assert bins[14]["confidence"] == pytest.approx(0.96)


def test_bins_are_right_closed_and_confidence_one_lands_in_the_last_bin():
    bins = reliability_bins([1.0, 1 / 15 + 1e-9, 0.5], [True, True, True])
    assert bins[14]["count"] == 1 and bins[1]["count"] == 1 and bins[7]["count"] == 1


def test_a_perfectly_calibrated_bin_has_zero_ece():
    assert ece([0.6] * 5, [True, True, True, False, False]) == pytest.approx(0.0)


def test_accuracy_coverage_lists_each_threshold_once_with_ties_together():
    curve = accuracy_coverage([0.9, 0.8, 0.8, 0.3], [True, False, True, False])
    assert curve == [
        {"threshold": 0.9, "coverage": 0.25, "accuracy": 1.0, "accepted": 1},
        {"threshold": 0.8, "coverage": 0.75, "accuracy": 2 / 3, "accepted": 3},
        {"threshold": 0.3, "coverage": 1.0, "accuracy": 0.5, "accepted": 4},
    ]


# ---- temperature fitting --------------------------------------------------------------------------


def synthetic(n: int, temperature: float, n_options: int = 4, seed: int = 1) -> tuple[list[list[float]], list[int]]:
    """Logits z whose true distribution is softmax(z / temperature); answers sampled from it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3.0, size=(n, n_options))
    answers = [int(rng.choice(n_options, p=softmax(z, temperature))) for z in logits]
    return logits.tolist(), answers


@pytest.mark.parametrize("true_temperature", [0.5, 1.0, 2.5])
def test_fit_recovers_a_known_temperature(true_temperature):
    logits, answers = synthetic(4000, true_temperature)
    fitted = fit_temperature(logits, answers)
    assert fitted == pytest.approx(true_temperature, rel=0.1)


def test_the_fitted_temperature_minimises_the_nll():
    logits, answers = synthetic(500, 1.7, seed=3)
    fitted = fit_temperature(logits, answers)

    def loss(t):
        return nll([softmax(z, t) for z in logits], answers)

    assert loss(fitted) <= loss(fitted * 1.05) and loss(fitted) <= loss(fitted / 1.05)


def test_separable_data_is_clamped_instead_of_diverging():
    assert fit_temperature([[5.0, 0.0], [0.0, 5.0]], [0, 1]) == pytest.approx(0.01)
    assert fit_temperature([[5.0, 0.0], [0.0, 5.0]], [1, 0]) == pytest.approx(1000.0)


def test_per_decision_temperatures_need_enough_cases_and_fall_back_to_global():
    hot, hot_answers = synthetic(300, 3.0, seed=5)
    cold, cold_answers = synthetic(4, 0.5, seed=6)
    cases = [Case("hot", y, z) for z, y in zip(hot, hot_answers)] + [Case("cold", y, z) for z, y in zip(cold, cold_answers)]
    fitted = fit_temperatures(cases, min_per_decision=5)
    assert set(fitted["per_decision"]) == {"hot"}
    assert fitted["per_decision"]["hot"]["temperature"] == pytest.approx(3.0, rel=0.25)
    assert fitted["global"]["n"] == 304


def test_kfold_covers_every_case_exactly_once():
    folds = kfold_indices(29, 5, seed=0)
    assert len(folds) == 5
    assert sorted(i for fold in folds for i in fold) == list(range(29))


def test_cross_validation_fits_on_other_folds_and_improves_overconfident_logits():
    logits, answers = synthetic(600, 3.0, seed=8)  # the raw logits are 3x overconfident
    cases = [Case("d", y, z) for z, y in zip(logits, answers)]
    report = cross_validate(cases, k=5, seed=0)
    raw, scaled = report["methods"]["raw"], report["methods"]["temperature"]
    assert scaled["nll"] < raw["nll"]
    assert scaled["ece"] < raw["ece"]
    assert raw["accuracy"] == scaled["accuracy"]  # a temperature never changes the argmax
    assert np.allclose(report["probabilities"]["raw"][0], softmax(logits[0]))


# ---- Platt scaling --------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def top_log_odds(logits) -> float:
    """log(p / (1 − p)) of the top softmax probability, from the probabilities themselves."""
    p = max(softmax(logits))
    return math.log(p / (1 - p))


def offset_confidence(n: int, a: float, b: float, seed: int = 11) -> tuple[list[list[float]], list[int]]:
    """Two-option logits [s, 0], s > 0, whose top option is right with probability σ(a·s + b)."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0.2, 5.0, size=n)
    answers = [0 if rng.random() < sigmoid(a * s + b) else 1 for s in scores]
    return [[float(s), 0.0] for s in scores], answers


def test_platt_fit_recovers_a_known_slope_and_bias():
    logits, answers = offset_confidence(20000, 0.6, -0.8)
    fitted = fit_platt(logits, answers)
    assert fitted["a"] == pytest.approx(0.6, abs=0.06) and fitted["b"] == pytest.approx(-0.8, abs=0.12)
    assert fitted["n"] == 20000


def test_the_platt_fit_minimises_the_cross_entropy_against_platts_targets():
    logits, answers = synthetic(400, 2.0, seed=12)
    fitted = fit_platt(logits, answers)
    correct = [int(np.argmax(z)) == y for z, y in zip(logits, answers)]
    n_pos, n_neg = sum(correct), len(correct) - sum(correct)
    targets = [(n_pos + 1) / (n_pos + 2) if ok else 1 / (n_neg + 2) for ok in correct]
    scores = [top_log_odds(z) for z in logits]

    def loss(a, b):
        return -sum(t * math.log(sigmoid(a * s + b)) + (1 - t) * math.log(1 - sigmoid(a * s + b)) for s, t in zip(scores, targets))

    best = loss(fitted["a"], fitted["b"])
    for da, db in ((0.05, 0), (-0.05, 0), (0, 0.05), (0, -0.05)):
        assert best < loss(fitted["a"] + da, fitted["b"] + db)


def test_platt_sets_the_top_probability_and_keeps_the_order_of_the_options():
    logits = [0.3, 2.1, -1.0, 1.4, 0.0]
    probabilities = apply_platt(logits, 0.7, 0.4)
    assert probabilities[1] == pytest.approx(sigmoid(0.7 * top_log_odds(logits) + 0.4), abs=1e-9)
    assert probabilities.sum() == pytest.approx(1.0)
    assert list(np.argsort(probabilities)) == list(np.argsort(logits))
    # one temperature per answer: every pair's log-ratio is the same multiple of its logit gap
    ratios = [math.log(probabilities[i] / probabilities[j]) / (logits[i] - logits[j]) for i, j in ((1, 3), (0, 2), (4, 2))]
    assert ratios == pytest.approx([ratios[0]] * 3, rel=1e-6)
    # a top probability below the even share is clamped to it, never below the runner-up
    assert apply_platt(logits, 0.1, -8.0) == pytest.approx([0.2] * 5, abs=1e-6)


def test_cross_validation_fits_platt_on_the_other_folds_only():
    logits, answers = offset_confidence(200, 1.0, -1.5, seed=13)
    cases = [Case("d", y, z) for z, y in zip(logits, answers)]
    report = cross_validate(cases, k=4, seed=3)
    for fold in kfold_indices(len(cases), 4, seed=3):
        held = set(fold)
        fitted = fit_platt([c.logits for i, c in enumerate(cases) if i not in held],
                           [c.answer for i, c in enumerate(cases) if i not in held])
        for i in fold:
            assert report["probabilities"]["platt"][i] == pytest.approx(apply_platt(logits[i], fitted["a"], fitted["b"]).tolist())


def test_platt_wins_held_out_where_the_confidence_is_offset_and_then_it_is_applied():
    from semif.tools.calibrate import choose_applied

    # Right less often than the logits' spread says, by a fixed offset: no single temperature can express that.
    logits, answers = offset_confidence(2000, 1.0, -1.5, seed=14)
    report = cross_validate([Case("d", y, z) for z, y in zip(logits, answers)], k=5, seed=0)
    fitted = fit_platt(logits, answers)
    assert report["methods"]["platt"]["nll"] < report["methods"]["temperature"]["nll"]
    assert choose_applied(report["methods"], "auto", fitted) == "platt"
    assert choose_applied(report["methods"], "temperature", fitted) == "temperature"
    # a slope that ranks confidence backwards is never chosen, however its NLL compares
    assert choose_applied(report["methods"], "auto", {**fitted, "a": -fitted["a"]}) == "temperature"
    # Logits that are a known temperature off: temperature scaling is the right model and Platt does not win.
    logits, answers = synthetic(2000, 2.0, n_options=4, seed=15)
    report = cross_validate([Case("d", y, z) for z, y in zip(logits, answers)], k=5, seed=0)
    assert report["methods"]["temperature"]["nll"] <= report["methods"]["platt"]["nll"]
    assert choose_applied(report["methods"], "auto", fit_platt(logits, answers)) == "temperature"


def test_contextual_calibration_divides_by_the_content_free_prior():
    prior = contextual_log_prior([[2.0, 0.0], [2.0, 0.0]])
    p = softmax(apply_contextual([2.0, 0.0], prior))
    assert p == pytest.approx([0.5, 0.5])  # the content-free input itself becomes uniform


# ---- the calibration file and the adapter -----------------------------------------------------------


LABEL = FitKind("label", "state_first", "none")


def calibration_payload(model_sha256: str, *, temperature: float = 2.0, per_decision=None, policy=None,
                        template_version: str = "t", template_sha256: str = "d" * 64, kind: FitKind = LABEL) -> dict:
    entry = {"global": {"temperature": temperature, "n": 10}, "per_decision": per_decision or {}}
    return build_file(model_sha256=model_sha256, model_file="m.gguf", template_version=template_version,
                      template_sha256=template_sha256, fits=[(kind, entry)], fit={}, policy=policy)


SERVED = FitKind("label", "state_first", DEFAULT_DEBIAS)  # what the server answers at its defaults


def served_payload(engine, **options) -> dict:
    """A file bound to the served model and template, fitted on the kind it serves by default (what
    semif-calibrate writes for it)."""
    return calibration_payload(engine.sha256, template_version=engine.info["template_version"],
                               template_sha256=engine.info["template_sha256"], **{"kind": SERVED, **options})


def test_the_version_is_derived_from_the_fitted_content():
    a = calibration_payload("a" * 64)
    assert a["version"] == calibration_payload("a" * 64)["version"]
    assert a["version"] != calibration_payload("a" * 64, temperature=2.5)["version"]


def test_a_file_for_another_model_is_refused_with_both_hashes_in_the_message(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_payload("a" * 64)))
    with pytest.raises(CalibrationError) as caught:
        Calibration.load(path, model_sha256="b" * 64)
    assert "aaaaaaaaaaaa" in str(caught.value) and "bbbbbbbbbbbb" in str(caught.value)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.pop("format"), "not a SemIf calibration file"),
        (lambda p: p.update(format_version=99), "format_version"),
        (lambda p: p["fits"][0]["global"].update(temperature=0), "invalid temperature"),
        (lambda p: p.update(policy={"min_probability": 3}), "policy.min_probability"),
        (lambda p: p["fits"][0].update(applied="isotonic"), "applied is 'isotonic'"),
        (lambda p: p["fits"][0].update(applied="platt"), "platt: needs finite"),
        (lambda p: p["fits"][0].update(applied="platt", platt={"a": float("nan"), "b": 0.0}), "platt: needs finite"),
    ],
)
def test_malformed_files_are_refused(tmp_path, mutate, message):
    payload = calibration_payload("a" * 64)
    mutate(payload)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(CalibrationError, match=message):
        Calibration.load(path)


def test_per_decision_temperature_wins_over_global_and_scoring_without_fit_is_untouched():
    cal = Calibration.from_dict(calibration_payload("a" * 64, temperature=2.0, per_decision={"route": {"temperature": 0.5, "n": 6}}))
    probs, record = cal.calibrate([1.0, 0.0], kind=LABEL, decision_id="route", options_sha256=None)
    assert probs == pytest.approx(softmax([2.0, 0.0]).tolist())
    assert record == {"version": cal.version, "method": "temperature", "temperature": 0.5, "temperature_source": "decision",
                      "fit": {"scoring": "label", "layout": "state_first", "debias": "none"}}
    _, record = cal.calibrate([1.0, 0.0], kind=LABEL, decision_id="other", options_sha256=None)
    assert (record["temperature"], record["temperature_source"]) == (2.0, "global")
    probs, record = cal.calibrate([1.0, 0.0], kind=FitKind("sequence"), decision_id="route", options_sha256=None)
    assert probs is None and record["method"] == "none" and "sequence/state_first/none" in record["reason"]


def test_a_file_applies_platt_when_it_says_so_and_a_file_without_applied_keeps_its_temperature():
    platt = calibration_payload("a" * 64, temperature=2.0)
    platt["fits"][0].update(platt={"a": 0.5, "b": -0.2, "n": 10}, applied="platt")
    logits = [1.5, 0.2, -0.4]
    probs, record = Calibration.from_dict(platt).calibrate(logits, kind=LABEL, decision_id="route", options_sha256=None)
    assert probs[0] == pytest.approx(sigmoid(0.5 * top_log_odds(logits) - 0.2), abs=1e-9)
    assert record["method"] == "platt" and record["platt"] == {"a": 0.5, "b": -0.2}
    older = calibration_payload("a" * 64, temperature=2.0)  # written before Platt: no "applied", no "platt"
    probs, record = Calibration.from_dict(older).calibrate(logits, kind=LABEL, decision_id="route", options_sha256=None)
    assert probs == pytest.approx(softmax(logits, 2.0).tolist()) and record["method"] == "temperature"


@pytest.mark.parametrize("debias,applied", [("none", True), ("reverse", False), ("rotations", False)])
def test_a_contextual_prior_is_not_applied_to_reads_in_several_orders(debias, applied):
    """A prior is keyed on one listing's options_sha256: under reverse or rotations it would calibrate a
    listing and its reverse differently, so a file that carries one for those kinds is served without it."""
    kind = FitKind("label", "state_first", debias)
    payload = calibration_payload("a" * 64, temperature=1.0, kind=kind)
    payload["fits"][0].update(contextual={"route": {"options_sha256": "f" * 64, "log_prior": [-0.1, -2.4]}},
                              contextual_temperatures={"global": {"temperature": 1.0, "n": 10}, "per_decision": {}})
    probs, record = Calibration.from_dict(payload).calibrate([1.0, 0.0], kind=kind, decision_id="route",
                                                            options_sha256="f" * 64)
    assert (record["method"] == "contextual+temperature") is applied
    if not applied:
        assert probs == pytest.approx(softmax([1.0, 0.0]).tolist())


SINGLE = {"decision": {"id": "route", "state": "My laptop screen cracked.", "question": "Which team?",
                       "options": [{"id": "hardware"}, {"id": "network"}, {"id": "hr"}]}}


def test_the_adapter_applies_the_temperature_keeps_raw_logits_and_reports_the_calibration(engine, model_path):
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app
    from serving import make_settings

    cal = Calibration.from_dict(served_payload(engine, temperature=3.0, per_decision={"route": {"temperature": 0.5, "n": 6}},
                                               policy={"min_probability": 0.99, "fallback": "escalate"}))
    app = create_app(make_settings(model_path), engine)
    app.state.service.decision_postprocessor.configure(cal)
    with TestClient(app) as http:
        body = http.post("/invocations", json=SINGLE).json()
        other = http.post("/invocations", json={"decision": {**SINGLE["decision"], "id": "unknown"}}).json()
        overridden = http.post("/invocations", json={**SINGLE, "policy": {"min_probability": 0.0}}).json()
    assert body["probabilities"] == pytest.approx(softmax(body["option_logits"], 0.5).tolist(), abs=1e-12)
    assert body["calibration"] == {"version": cal.version, "method": "temperature", "temperature": 0.5, "temperature_source": "decision",
                                   "fit": {"scoring": "label", "layout": "state_first", "debias": DEFAULT_DEBIAS}}
    assert other["probabilities"] == pytest.approx(softmax(other["option_logits"], 3.0).tolist(), abs=1e-12)
    assert body["probabilities"] != pytest.approx(softmax(body["option_logits"]).tolist(), abs=1e-6)  # logits stay raw
    top = max(body["probabilities"])
    assert body["margin"] == pytest.approx(top - sorted(body["probabilities"])[-2])
    # the file's default policy applies unless the request brings its own
    assert body["action"] == ("accept" if top >= 0.99 else "abstain")
    assert overridden["action"] == "accept"


def test_the_adapter_applies_a_platt_fit_to_the_served_answer(engine, model_path):
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app
    from serving import make_settings

    payload = served_payload(engine, temperature=3.0)
    payload["fits"][0].update(platt={"a": 0.6, "b": 0.9, "n": 10}, applied="platt")
    app = create_app(make_settings(model_path), engine)
    app.state.service.decision_postprocessor.configure(Calibration.from_dict(payload))
    with TestClient(app) as http:
        body = http.post("/invocations", json=SINGLE).json()
    assert "option_logits" in body, body
    top = int(np.argmax(body["option_logits"]))
    assert body["probabilities"][top] == pytest.approx(sigmoid(0.6 * top_log_odds(body["option_logits"]) + 0.9), abs=1e-9)
    assert body["calibration"]["method"] == "platt"
    assert body["choice"] == SINGLE["decision"]["options"][top]["id"]


def test_serve_refuses_a_calibration_file_for_another_model_at_startup(start_serve, tmp_path):
    path = tmp_path / "other-model.json"
    path.write_text(json.dumps(calibration_payload("c" * 64)))
    proc = start_serve(wait=False, SEMIF_CALIBRATION_PATH=str(path))
    assert proc.proc.wait(timeout=60) == 5
    log = proc.log_text()
    assert "invalid SEMIF_CALIBRATION_PATH" in log and "cccccccccccc" in log and "fitted for model sha256" in log


def test_serve_loads_a_matching_calibration_file_and_reports_it(start_serve, tmp_path, engine):
    import httpx

    path = tmp_path / "cal.json"
    payload = served_payload(engine, temperature=4.0)
    path.write_text(json.dumps(payload))
    proc = start_serve(SEMIF_CALIBRATION_PATH=str(path))
    body = httpx.post(proc.base_url + "/invocations", json=SINGLE, timeout=60).json()
    assert body["calibration"]["version"] == payload["version"] and body["calibration"]["temperature"] == 4.0
    assert body["probabilities"] == pytest.approx(softmax(body["option_logits"], 4.0).tolist(), abs=1e-12)
    assert any(line.get("message") == "calibration loaded" for line in proc.log_lines())
