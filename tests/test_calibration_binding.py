"""A calibration file is bound to what it was fitted on: the model and prompt template (checked at startup)
and, fit by fit, the kind of logits (scoring, layout, debiasing). A fit is applied only to answers of its
kind; any other answer keeps its raw probabilities, says which calibration (none) applied and why, and the
file's default policy does not accept it. Real model, shipped engine defaults, the real `serve` process
where startup is what is tested."""

from __future__ import annotations

import json

import pytest

from semif.serving.config import DEFAULT_DEBIAS
from semif.serving.engine.plan import served_debias
from semif.serving.postprocess.calibration import Calibration, CalibrationError, FitKind, build_file, softmax
from serving import SAMPLE_DECISIONS, make_settings

DECISION = {"id": "route", "state": "My laptop screen cracked when it fell off the desk.", "question": "Which team?",
            "options": [{"id": "hardware"}, {"id": "network"}, {"id": "hr"}]}
TEAMS = [{"value": "hardware"}, {"value": "network"}, {"value": "hr"}]
# The kinds the server answers at its defaults (SEMIF_DEBIAS's default debiasing), in each layout, and a
# debiasing a request can ask for instead.
STATE_FIRST = FitKind("label", "state_first", served_debias(DEFAULT_DEBIAS, scoring="label", layout="state_first", native=False))
OPTIONS_FIRST = FitKind("label", "options_first", served_debias(DEFAULT_DEBIAS, scoring="label", layout="options_first",
                                                                native=False))
OTHER_DEBIAS = "content_free" if STATE_FIRST.debias != "content_free" else "reverse"


def fitted_file(info: dict, fits: dict[FitKind, float], *, policy=None, **bound) -> dict:
    """A file bound to ``info`` (an engine's), one global temperature per kind; ``bound`` overrides a binding."""
    binding = dict(model_sha256=info["sha256"], template_version=info["template_version"],
                   template_sha256=info["template_sha256"])
    binding.update(bound)
    return build_file(**binding, model_file=info["file"], fit={}, policy=policy,
                      fits=[(kind, {"global": {"temperature": t, "n": 10}, "per_decision": {}}) for kind, t in fits.items()])


@pytest.fixture(scope="module")
def shipped_engine(model_path):
    """The embedded model with every engine setting as shipped (flash attention, label memo, snapshots)."""
    from semif.serving.engine.context import Engine

    engine = Engine(model_path, n_ctx=4096, n_threads=2)
    yield engine
    engine.close()


def client_with(engine, payload: dict, tmp_path):
    """An in-process app with the file loaded the way `serve` loads it (model and template checked)."""
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(payload))
    calibration = Calibration.load(path, served=engine.info)
    app = create_app(make_settings(engine.model_path), engine)
    app.state.service.decision_postprocessor.configure(calibration)
    return TestClient(app, raise_server_exceptions=False), calibration


# ---- the file and the server -----------------------------------------------------------------------


def test_a_format_1_file_is_refused_and_told_to_refit():
    """Format 1 (what this repository shipped before) named no layout or template sha256: it cannot be checked."""
    payload = {"format": "semif-calibration", "format_version": 1, "model_sha256": "b" * 64, "model_file": "m.gguf",
               "template_version": "semif-prompt-v1", "scorings": {"label": {"global": {"temperature": 5.4, "n": 29}}}}
    with pytest.raises(CalibrationError, match="format_version 1 does not say which prompt template, layout or debiasing") as refused:
        Calibration.from_dict(payload)
    assert "refit it with semif-calibrate" in str(refused.value)


def test_the_shipped_file_is_bound_to_the_embedded_model_and_the_served_template(shipped_engine):
    calibration = Calibration.load(SAMPLE_DECISIONS.parent / "calibration-smollm2-135m.json", served=shipped_engine.info)
    assert STATE_FIRST in calibration.fits and calibration.template_version == "semif-prompt-v3"


@pytest.mark.parametrize("bound, message", [
    ({"template_sha256": "e" * 64}, "eeeeeeeeeeee"),
    ({"template_version": "semif-prompt-v1"}, "semif-prompt-v1"),
])
def test_serve_refuses_a_file_fitted_with_another_prompt_template_at_startup(start_serve, tmp_path, shipped_engine, bound, message):
    path = tmp_path / "other-template.json"
    path.write_text(json.dumps(fitted_file(shipped_engine.info, {STATE_FIRST: 2.0}, **bound)))
    proc = start_serve(wait=False, SEMIF_CALIBRATION_PATH=str(path))
    assert proc.proc.wait(timeout=120) == 5
    log = proc.log_text()
    assert "invalid SEMIF_CALIBRATION_PATH" in log and "was fitted with prompt template" in log and message in log
    assert shipped_engine.info["template_sha256"][:12] in log  # names what this server renders


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p["fits"][0].update(layout="sideways"), "fits[0].layout is 'sideways'"),
    (lambda p: p["fits"][0].pop("debias"), "fits[0].debias is None"),
    (lambda p: p["fits"].append(dict(p["fits"][0])), f"a second fit for {STATE_FIRST}"),
    (lambda p: p.pop("template_sha256"), "template_sha256 is missing"),
    (lambda p: p["fits"][0].update(contextual={"route": {"options_sha256": "x", "log_prior": [float("nan")]}}),
     "finite log_prior"),
])
def test_files_that_do_not_say_what_they_were_fitted_on_are_refused(shipped_engine, mutate, message):
    payload = fitted_file(shipped_engine.info, {STATE_FIRST: 2.0})
    mutate(payload)
    with pytest.raises(CalibrationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Calibration.from_dict(payload)


# ---- a fit applies to its own kind of logits only ------------------------------------------------------


def test_a_fit_is_applied_only_to_the_layout_scoring_and_debiasing_it_was_measured_on(shipped_engine, tmp_path):
    http, calibration = client_with(shipped_engine, fitted_file(shipped_engine.info, {STATE_FIRST: 3.0}), tmp_path)
    with http:
        answers = {name: http.post("/invocations", json={"decision": DECISION, **extra}).json() for name, extra in {
            "state_first": {}, "options_first": {"layout": "options_first"}, "other": {"debias": OTHER_DEBIAS},
            "none": {"debias": "none"}, "sequence": {"scoring": "sequence"}}.items()}
    fitted = answers.pop("state_first")
    assert fitted["probabilities"] == pytest.approx(softmax(fitted["option_logits"], 3.0).tolist(), abs=1e-12)
    assert fitted["calibration"]["fit"] == {"scoring": "label", "layout": "state_first", "debias": STATE_FIRST.debias}
    assert fitted["calibration"]["version"] == calibration.version and fitted["calibration"]["temperature"] == 3.0
    for name, kind in {"options_first": str(OPTIONS_FIRST), "other": f"label/state_first/{OTHER_DEBIAS}",
                       "none": "label/state_first/none", "sequence": "sequence/state_first/none"}.items():
        body = answers[name]
        assert body["probabilities"] == pytest.approx(softmax(body["option_logits"]).tolist(), abs=1e-12), name
        assert body["probabilities"] != pytest.approx(softmax(body["option_logits"], 3.0).tolist(), abs=1e-6), name
        record = body["calibration"]
        assert record["method"] == "none" and record["version"] == calibration.version and record["fit"] is None
        assert f"no fit for {kind}" in record["reason"] and str(STATE_FIRST) in record["reason"], name


def test_each_layout_gets_the_temperature_fitted_on_it(shipped_engine, tmp_path):
    http, _ = client_with(shipped_engine, fitted_file(shipped_engine.info, {STATE_FIRST: 3.0, OPTIONS_FIRST: 0.5}), tmp_path)
    with http:
        state_first = http.post("/invocations", json={"decision": DECISION}).json()
        options_first = http.post("/invocations", json={"decision": DECISION, "layout": "options_first"}).json()
    assert options_first["option_logits"] != pytest.approx(state_first["option_logits"], abs=1e-3)  # other logits
    assert state_first["probabilities"] == pytest.approx(softmax(state_first["option_logits"], 3.0).tolist(), abs=1e-12)
    assert options_first["probabilities"] == pytest.approx(softmax(options_first["option_logits"], 0.5).tolist(), abs=1e-12)
    assert options_first["calibration"]["fit"]["layout"] == "options_first" and options_first["calibration"]["temperature"] == 0.5


def test_the_files_policy_never_accepts_an_answer_it_has_no_fit_for_and_a_requests_policy_judges_it(shipped_engine, tmp_path):
    policy = {"min_probability": 0.0, "fallback": "escalate"}  # accepts every calibrated answer
    http, _ = client_with(shipped_engine, fitted_file(shipped_engine.info, {STATE_FIRST: 3.0}, policy=policy), tmp_path)
    with http:
        fitted = http.post("/invocations", json={"decision": DECISION}).json()
        unfitted = http.post("/invocations", json={"decision": DECISION, "layout": "options_first"}).json()
        own = http.post("/invocations", json={"decision": DECISION, "layout": "options_first", "policy": {"min_probability": 0.0}}).json()
    assert fitted["action"] == "accept"
    assert unfitted["action"] == "abstain" and unfitted["fallback"] == "escalate"
    assert "uncalibrated" in unfitted["action_reason"] and str(OPTIONS_FIRST) in unfitted["action_reason"]
    assert own["action"] == "accept" and own["calibration"]["method"] == "none"


def test_system_one_and_openai_answers_say_which_calibration_applied(shipped_engine, tmp_path):
    http, calibration = client_with(shipped_engine, fitted_file(shipped_engine.info, {STATE_FIRST: 3.0}), tmp_path)
    choice = {"type": "choice", "instructions": DECISION["question"], "criteria": {"hardware": None, "network": None, "hr": None}}
    with http:
        system_one = http.post("/v1/systemone", json={"state": DECISION["state"], "questions": {"team": choice}})
        openai = http.post("/v1/decisions", json={"model": "gpt-6-luna", "input": DECISION["state"], "questions": [
            {"type": "choice", "name": "team", "instructions": DECISION["question"], "choices": TEAMS}]})
        routed = http.post("/v1/decisions", json={"model": "gpt-6-luna", "input": DECISION["state"], "layout": "options_first",
                                                  "questions": [{"type": "choice", "name": "team", "instructions": DECISION["question"], "choices": TEAMS}]})
    assert system_one.status_code == openai.status_code == 200, (system_one.text, openai.text)
    system_one, openai = system_one.json(), openai.json()
    assert system_one["x_semif"]["calibration"]["team"]["fit"]["layout"] == "state_first"
    assert system_one["x_semif"]["calibration"]["team"]["version"] == calibration.version
    assert openai["x_semif"]["calibration"][0]["temperature"] == 3.0
    assert routed.status_code == 200 and routed.json()["x_semif"]["calibration"][0]["method"] == "none"


# ---- semif-calibrate writes what the server checks --------------------------------------------------


def test_semif_calibrate_fits_each_layout_against_a_server_and_that_server_accepts_the_file(start_serve, tmp_path, shipped_engine):
    import httpx

    from semif.tools.calibrate import main as calibrate_main

    server = start_serve()
    path = tmp_path / "fitted.json"
    assert calibrate_main([str(SAMPLE_DECISIONS), "--url", server.base_url, "--limit", "3", "--folds", "2", "--contextual", "off",
                           "--layout", "state_first,options_first", "--out", str(path)]) == 0
    calibration = Calibration.load(path, served=shipped_engine.info)  # the served template, without "+options-first"
    assert [str(kind) for kind in calibration.fits] == [str(STATE_FIRST), str(OPTIONS_FIRST)]
    assert set(calibration.raw["fit"]["cross_validation"]) == {str(STATE_FIRST), str(OPTIONS_FIRST)}
    server.stop()

    calibrated = start_serve(SEMIF_CALIBRATION_PATH=str(path))
    body = httpx.post(calibrated.base_url + "/invocations", json={"decision": DECISION, "layout": "options_first"}, timeout=60).json()
    temperature = calibration.fits[OPTIONS_FIRST]["global"]["temperature"]
    assert body["calibration"]["fit"]["layout"] == "options_first" and body["calibration"]["temperature"] == temperature
    assert body["probabilities"] == pytest.approx(softmax(body["option_logits"], temperature).tolist(), abs=1e-12)
    loaded = next(line for line in calibrated.log_lines() if line.get("message") == "calibration loaded")
    assert loaded["fits"] == [str(STATE_FIRST), str(OPTIONS_FIRST)]
