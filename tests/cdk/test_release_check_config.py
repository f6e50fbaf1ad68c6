"""The release checks' settings in config/environments.json: typed and range-checked like the rest, so a bad limit
stops synth with the key's path instead of failing the pipeline's gate step after a deploy."""

from __future__ import annotations

import copy
import json

import pytest

from config import CONFIG_PATH, ConfigError, load_settings


@pytest.fixture
def raw():
    return json.loads(CONFIG_PATH.read_text())


def _load(tmp_path, raw):
    path = tmp_path / "environments.json"
    path.write_text(json.dumps(raw))
    return load_settings(path)


def _set(raw, path: str, value):
    node = raw["environments"]["staging"]["release_checks"]
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return raw


def test_the_shipped_config_gates_staging_against_prod_and_nothing_else():
    settings = load_settings()
    staging = settings.environment("staging").release_checks
    assert staging is not None and staging.data_key == "eval/decisions.jsonl"
    assert settings.environment("dev").release_checks is None and settings.environment("prod").release_checks is None
    # Every limit the requirement names has a value: accuracy, ECE, coverage, absolute and as change.
    gate = staging.gate
    assert None not in (gate.absolute.min_accuracy, gate.absolute.max_ece, gate.absolute.min_policy_coverage,
                        gate.change.max_accuracy_drop, gate.change.max_ece_rise, gate.change.max_policy_coverage_drop,
                        gate.change.max_changed_share)
    assert gate.policy is not None
    assert 60 <= staging.load.duration_s <= 600 and staging.load.bound_s < 900  # minutes, not hours


@pytest.mark.parametrize("path,value,message", [
    ("gate.absolute.min_accuracy", 1.5, r"release_checks.gate.absolute.min_accuracy: 1.5 is a share; use 0 to 1"),
    ("gate.change.max_changed_share", -0.1, r"release_checks.gate.change.max_changed_share: -0.1 is a share"),
    ("gate.policy.min_margin", 2, r"release_checks.gate.policy.min_margin: 2 is a share"),
    ("gate.policy", None, r"release_checks.gate.absolute.min_policy_coverage: a coverage limit needs gate.policy"),
    ("gate.scoring", "logits", r"release_checks.gate.scoring: 'logits' is not one of label, sequence"),
    ("gate.absolute.max_ece", "0.1", r"release_checks.gate.absolute.max_ece: expected a number"),
    ("gate.change.max_ece_drop", 0.1, r"release_checks.gate.change: unknown key\(s\) max_ece_drop"),
    ("data_key", "reports/decisions.jsonl", r"release_checks.data_key: 'reports/decisions.jsonl' must be a .jsonl key "
                                            r"under eval/"),
    ("data_key", "eval/decisions.json", r"must be a .jsonl key under eval/"),
    ("load.clients", 0, r"release_checks.load.clients: 0 is outside 1-256"),
    ("load.duration_s", 3600, r"release_checks.load.duration_s: 3600 is outside 10-900 s"),
    ("load.duration_s", 60.5, r"release_checks.load.duration_s: expected an integer"),
    ("load.max_attempts", 0, r"release_checks.load.max_attempts: 0 is outside 1-20"),
    ("load.request_timeout_s", 0, r"release_checks.load.request_timeout_s: must be above 0"),
    ("load.limits.max_503_share", 5, r"release_checks.load.limits.max_503_share: 5 is a share"),
    ("load.limits.max_attempts_per_success", 0.5, r"release_checks.load.limits.max_attempts_per_success: at least 1"),
    ("load.limits.max_p95_ms", 0, r"release_checks.load.limits.max_p95_ms: must be above 0"),
    ("load.limits.min_successes", -1, r"release_checks.load.limits.min_successes: must be 0 or more"),
])
def test_a_bad_release_check_setting_fails_synth_naming_its_key(tmp_path, raw, path, value, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, _set(raw, path, value))


def test_a_missing_limit_is_refused_rather_than_defaulted(tmp_path, raw):
    del raw["environments"]["staging"]["release_checks"]["gate"]["change"]["max_accuracy_drop"]
    with pytest.raises(ConfigError, match=r"release_checks.gate.change: missing key\(s\) max_accuracy_drop"):
        _load(tmp_path, raw)


def test_null_switches_a_limit_off(tmp_path, raw):
    settings = _load(tmp_path, _set(raw, "gate.absolute.max_ece", None))
    limits = json.loads(settings.environment("staging").release_checks.gate.to_json())
    assert limits["absolute"]["max_ece"] is None


def test_prod_runs_no_release_checks_of_its_own(tmp_path, raw):
    raw["environments"]["prod"]["release_checks"] = copy.deepcopy(raw["environments"]["staging"]["release_checks"])
    with pytest.raises(ConfigError, match="environments.prod.release_checks: prod is what the gate compares with"):
        _load(tmp_path, raw)


def test_release_checks_need_a_later_prod_stage_of_their_variant_to_compare_with(tmp_path, raw):
    raw["environments"]["dev"]["release_checks"] = copy.deepcopy(raw["environments"]["staging"]["release_checks"])
    raw["environments"]["prod"]["variant"] = "gpu"
    # dev runs the cpu image; prod runs gpu: dev's gate would have no release to compare with.
    with pytest.raises(ConfigError, match="environments.dev.release_checks: no later prod stage runs the cpu image"):
        _load(tmp_path, raw)
    raw = json.loads(CONFIG_PATH.read_text())
    raw["pipeline"].update(stages=["dev", "staging"], approval_before=[], bake_before={})
    with pytest.raises(ConfigError, match="environments.staging.release_checks: no later prod stage runs the gpu image"):
        _load(tmp_path, raw)
