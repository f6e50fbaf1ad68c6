"""What the pipeline's release-check steps hand the tools: limits the tools accept exactly when the config does, the
tools installed with the package's own pins, and a remote evaluation that never needs llama.cpp."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from config import CONFIG_PATH, ConfigError, GateSettings, LoadLimitSettings, LoadSettings, load_settings
from semif.tools.gate import GateError, GateLimits, parse_limits as parse_gate_limits
from semif.tools.loadcheck import LoadCheckError, LoadLimits, LoadPlan, parse_limits as parse_load_limits
from stacks.pipeline_steps import TOOLS_REQUIREMENTS

REPO = Path(__file__).resolve().parents[1]


def _dataclass_tree(cls) -> dict:
    hints = typing.get_type_hints(cls)
    tree = {}
    for field in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[field.name]) if a is not type(None)] or [hints[field.name]]
        tree[field.name] = _dataclass_tree(inner[0]) if dataclasses.is_dataclass(inner[0]) else None
    return tree


def _model_tree(model) -> dict:
    tree = {}
    for name, field in model.model_fields.items():
        inner = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
        tree[name] = _model_tree(inner[0]) if isinstance(inner[0], type) and hasattr(inner[0], "model_fields") else None
    return tree


def test_the_config_names_every_limit_the_tools_take_and_no_other():
    assert _dataclass_tree(GateSettings) == _model_tree(GateLimits)
    assert _dataclass_tree(LoadLimitSettings) == _model_tree(LoadLimits)
    plan = {f.name for f in dataclasses.fields(LoadSettings)} - {"limits"}
    assert plan <= set(LoadPlan.model_fields)


def test_the_shipped_limits_are_what_the_tools_read():
    checks = load_settings().environment("staging").release_checks
    gate = parse_gate_limits(json.loads(checks.gate.to_json()))
    assert gate.model_dump() == json.loads(checks.gate.to_json())
    assert gate.absolute.min_accuracy == checks.gate.absolute.min_accuracy and gate.policy is not None
    load = parse_load_limits(json.loads(checks.load.limits.to_json()))
    assert load.model_dump() == json.loads(checks.load.limits.to_json())
    plan = LoadPlan(clients=checks.load.clients, duration_s=checks.load.duration_s, max_attempts=checks.load.max_attempts,
                    max_elapsed_s=checks.load.max_elapsed_s, request_timeout_s=checks.load.request_timeout_s)
    assert plan.bound_s == checks.load.bound_s


GATE_NUMBERS = ["policy.min_probability", "policy.min_margin", "absolute.min_valid_share", "absolute.min_accuracy",
                "absolute.max_ece", "absolute.min_policy_coverage", "change.max_changed_share",
                "change.max_accuracy_drop", "change.max_ece_rise", "change.max_policy_coverage_drop",
                "change.min_shared_share"]
LOAD_NUMBERS = ["min_successes", "min_throughput_rps", "max_p50_ms", "max_p95_ms", "max_p99_ms", "max_503_share",
                "max_attempts_per_success", "max_failed_share"]
PROBES = [-1, -0.01, 0, 0.5, 1, 1.01, 2, 5000]


def _accepted_by_config(tmp_path, section: str, path: str, value) -> bool:
    raw = json.loads(CONFIG_PATH.read_text())
    node = raw["environments"]["staging"]["release_checks"][section]
    if section == "load":
        node = node["limits"]
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    (tmp_path / "environments.json").write_text(json.dumps(raw))
    try:
        load_settings(tmp_path / "environments.json")
    except ConfigError:
        return False
    return True


def _accepted_by_tool(parse, error, limits: dict, path: str, value) -> bool:
    limits = copy.deepcopy(limits)
    node = limits
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    try:
        parse(limits)
    except error:
        return False
    return True


@pytest.mark.parametrize("path", GATE_NUMBERS)
def test_a_gate_limit_the_config_accepts_is_one_semif_eval_accepts(tmp_path, path):
    shipped = json.loads(load_settings().environment("staging").release_checks.gate.to_json())
    for value in PROBES:
        assert _accepted_by_config(tmp_path, "gate", path, value) == _accepted_by_tool(
            parse_gate_limits, GateError, shipped, path, value), (path, value)


@pytest.mark.parametrize("path", LOAD_NUMBERS)
def test_a_load_limit_the_config_accepts_is_one_semif_loadcheck_accepts(tmp_path, path):
    shipped = json.loads(load_settings().environment("staging").release_checks.load.limits.to_json())
    for value in PROBES:
        if path == "min_successes" and not float(value).is_integer():
            continue  # an integer field: both refuse a fraction (the config by type, pydantic by parsing)
        assert _accepted_by_config(tmp_path, "load", path, value) == _accepted_by_tool(
            parse_load_limits, LoadCheckError, shipped, path, value), (path, value)


def _tools_requirements(requires: list[str], monkeypatch) -> list[str]:
    import contextlib
    import importlib.metadata
    import io

    monkeypatch.setattr(importlib.metadata, "requires", lambda name: requires if name == "semif" else None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(TOOLS_REQUIREMENTS, {})
    return out.getvalue().split()


def test_the_steps_install_the_tools_with_the_packages_pins_and_without_llama_cpp(monkeypatch):
    project = tomllib.loads((REPO / "container/pyproject.toml").read_text())["project"]
    # The metadata `pip install --no-deps ./container` writes: the dependencies, then each extra's with its marker.
    requires = list(project["dependencies"]) + [f'{r}; extra == "{extra}"'
                                                for extra, reqs in project["optional-dependencies"].items() for r in reqs]
    installed = _tools_requirements(requires, monkeypatch)
    assert not [r for r in installed if r.lower().replace("_", "-").startswith("llama-cpp-python")]
    assert set(installed) == {r for r in project["dependencies"] if not r.startswith("llama-cpp-python")} | set(
        project["optional-dependencies"]["tools"])
    for needed in ("httpx", "boto3", "rich", "matplotlib", "pydantic", "numpy", "jinja2"):
        assert any(r.startswith(needed + "=") or r.startswith(needed + "<") or r.startswith(needed + ">")
                   for r in installed), needed
    # Another extra's requirement stays out; a spelling of llama-cpp-python's name does too.
    assert _tools_requirements(['pytest==9; extra == "dev"', "llama_cpp_python>=0.3", "rich==15.0.0"],
                               monkeypatch) == ["rich==15.0.0"]


def test_the_filter_runs_as_the_step_runs_it_on_the_installed_package():
    proc = subprocess.run([sys.executable, "-c", TOOLS_REQUIREMENTS], capture_output=True, text=True, check=True)
    lines = proc.stdout.split()
    assert lines and not [r for r in lines if "llama" in r.lower()]
    assert any(r.startswith("boto3==") for r in lines)


BLOCK_LLAMA_CPP = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError("llama_cpp is not installed in the pipeline's step")
sys.meta_path.insert(0, Blocked())
"""


def test_a_remote_evaluation_and_load_check_need_no_llama_cpp():
    """The pipeline's step installs semif without llama-cpp-python: the endpoint paths of semif-eval, semif-gate and
    semif-loadcheck must import and parse their arguments without it."""
    script = BLOCK_LLAMA_CPP + """
import contextlib, io
from semif.tools import endpoint_record, evaluate, gate, loadcheck, storage
for main in (evaluate.main, loadcheck.main, gate.main):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
assert "llama_cpp" not in sys.modules, "imported llama_cpp"
try:
    import llama_cpp  # the blocker is live: this test would see an import
except ImportError:
    print("blocked")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("blocked")
