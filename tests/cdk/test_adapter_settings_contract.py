"""One settings contract between CDK and the container: config/environments.json -> AdapterSettings ->
to_environment() -> the Model's environment -> Settings.from_env, all against semif.serving.settings_contract."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aws_cdk import App, Stack, aws_iam as iam, aws_logs as logs
from aws_cdk.assertions import Template

from config import CONFIG_PATH, REQUIRED_ADAPTER_KEYS, ConfigError, load_settings
from constructs_lib.decision_endpoint import DecisionEndpoint
from constructs_lib.image_sources import BuiltImage
from semif.serving.config import Settings
from semif.serving.settings_contract import CONTRACT, OPERATOR, SECRET, SETTINGS, Setting
from test_endpoint_constructs import DIGEST, ENV, THRESHOLDS, _deps, compute

REPO = Path(__file__).resolve().parents[2]
OPERATOR_SETTINGS = [s for s in SETTINGS if s.scope == OPERATOR]
API_KEY_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:semif/api-key-AbCdEf"


@pytest.fixture(scope="module")
def raw_config():
    return json.loads(CONFIG_PATH.read_text())


def _load_with_adapter(tmp_path, raw_config, **adapter):
    """The shipped config, with the dev decision adapter block given these keys."""
    raw = copy.deepcopy(raw_config)
    raw["environments"]["dev"]["decision"]["adapter"].update(adapter)
    path = tmp_path / "environments.json"
    path.write_text(json.dumps(raw))
    return load_settings(path).environment("dev").decision.adapter


def _non_default(setting: Setting, base: dict):
    """A valid value other than both the container's default and the shipped config's, from the definition."""
    current = base.get(setting.key, setting.default)
    if setting.type == "bool":
        return not current
    if setting.type == "choice":
        return next(c for c in setting.choices if c != current)
    if setting.type in ("int", "float"):
        if setting.key == "body_budget_bytes":  # must hold one body of the largest size (a cross-setting rule)
            return 8 * base["max_body_bytes"]
        step = 1 if setting.type == "int" else 0.5
        start = current if current is not None else setting.minimum
        value = start + step
        return start - step if setting.maximum is not None and value > setting.maximum else value
    if setting.type == "path":
        return "calibration/fit.json"
    return f"value-of-{setting.key}"


@pytest.mark.parametrize("setting", OPERATOR_SETTINGS, ids=lambda s: s.key)
def test_every_operator_setting_round_trips_from_config_into_the_container(setting, tmp_path, raw_config):
    base = raw_config["environments"]["dev"]["decision"]["adapter"]
    value = _non_default(setting, base)
    given = {setting.key: value, **({"batching": True} if setting.key == "n_seq" else {})}
    adapter = _load_with_adapter(tmp_path, raw_config, **given)
    assert getattr(adapter, setting.key) == value

    model_dir = tmp_path / "model"
    (model_dir / "calibration").mkdir(parents=True)
    (model_dir / "model.gguf").write_bytes(b"GGUF")
    (model_dir / "calibration" / "fit.json").write_text("{}")
    environment = adapter.to_environment()
    assert set(environment) == {f"SEMIF_{k.upper()}" for k in {*base, *given}}
    settings = Settings.from_env({**environment, "SEMIF_MODEL_DIR": str(model_dir)})
    assert getattr(settings, setting.key) == (model_dir / value if setting.type == "path" else value)


def test_the_shipped_environments_render_what_the_container_reads_back(raw_config, tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for name, body in raw_config["environments"].items():
        adapter = load_settings().environment(name).decision.adapter
        settings = Settings.from_env({**adapter.to_environment(), "SEMIF_MODEL_DIR": str(tmp_path)})
        for key, value in body["decision"]["adapter"].items():
            assert getattr(settings, key) == value, f"{name}: {key}"


def test_required_adapter_keys_are_operator_settings():
    assert set(REQUIRED_ADAPTER_KEYS) <= {s.key for s in OPERATOR_SETTINGS}


@pytest.mark.parametrize("key, value, message", [
    ("image_digest", "sha256:" + "0" * 64,
     "decision.adapter.image_digest: SEMIF_IMAGE_DIGEST is set by the image, SageMaker or the endpoint construct"),
    ("port", 9000, "decision.adapter.port: SEMIF_PORT is set by the image, SageMaker or the endpoint construct"),
    ("api_key", "hunter2", "decision.adapter.api_key: SEMIF_API_KEY is a secret: it must not be in the Model's "
                           r"environment; give its Secrets Manager ARN by reference in "
                           r"environments.dev.decision.adapter.secrets.api_key"),
    ("log_hash_key", "k", "decision.adapter.log_hash_key: SEMIF_LOG_HASH_KEY is a secret"),
    ("max_queu", 3, r"decision.adapter: unknown key\(s\) max_queu"),
])
def test_contract_secret_and_unknown_keys_fail_the_load_naming_the_key(key, value, message, tmp_path, raw_config):
    with pytest.raises(ConfigError, match=message):
        _load_with_adapter(tmp_path, raw_config, **{key: value})


def test_every_contract_and_secret_setting_is_refused_under_adapter(tmp_path, raw_config):
    for setting in (s for s in SETTINGS if s.scope in (CONTRACT, SECRET)):
        with pytest.raises(ConfigError, match=f"decision.adapter.{setting.key}: {setting.name} is "):
            _load_with_adapter(tmp_path, raw_config, **{setting.key: "x"})


@pytest.mark.parametrize("adapter, message", [
    ({"max_options": 256}, r"decision.adapter.max_options: SEMIF_MAX_OPTIONS=256 must be <= 255"),
    ({"read_timeout_s": 0.05}, r"decision.adapter.read_timeout_s: SEMIF_READ_TIMEOUT_S=0.05 must be >= 0.1"),
    ({"layout": "sideways"}, r"decision.adapter.layout: 'sideways' is not one of state_first, options_first"),
    ({"flash_attn": 1}, r"decision.adapter.flash_attn: expected true/false"),
    ({"model_alias": ""}, r"decision.adapter.model_alias: '' would reach the container as None"),
    ({"calibration_path": "/opt/ml/model/fit.json"}, r"decision.adapter.calibration_path: '/opt/ml/model/fit.json' "
                                                     "must be a relative path"),
    ({"body_budget_bytes": 2048}, r"decision.adapter: SEMIF_BODY_BUDGET_BYTES=2048 must be >= SEMIF_MAX_BODY_BYTES"),
    ({"secrets": {"api_key": "semif/api-key"}}, r"decision.adapter.secrets.api_key: 'semif/api-key' is not the full "
                                                "ARN of a Secrets Manager secret"),
    ({"secrets": {"token": API_KEY_ARN}}, r"decision.adapter.secrets: unknown key\(s\) token"),
])
def test_values_the_container_would_refuse_fail_the_load(adapter, message, tmp_path, raw_config):
    with pytest.raises(ConfigError, match=message):
        _load_with_adapter(tmp_path, raw_config, **adapter)


def test_a_secret_reaches_the_environment_only_as_its_reference(tmp_path, raw_config):
    adapter = _load_with_adapter(tmp_path, raw_config, secrets={"api_key": API_KEY_ARN})
    environment = adapter.to_environment()
    assert environment["SEMIF_API_KEY_SECRET_ARN"] == API_KEY_ARN
    assert "SEMIF_API_KEY" not in environment and "SEMIF_LOG_HASH_KEY_SECRET_ARN" not in environment


# ---- the synthesized template ----

@pytest.fixture(scope="module")
def decision_template(tmp_path_factory, raw_config):
    adapter = _load_with_adapter(tmp_path_factory.mktemp("config"), raw_config, max_queue=3, request_deadline_s=42.5,
                                 layout="options_first", calibration_path="calibration/fit.json",
                                 secrets={"api_key": API_KEY_ARN})
    app = App()
    stack = Stack(app, "Contract", env=ENV)
    bucket, key, topic, repo = _deps(stack)
    endpoint = DecisionEndpoint(
        stack, "Decision", endpoint_name="contract-decision", image=BuiltImage(repository=repo, digest=DIGEST),
        model_bucket=bucket, model_key=key, model_prefix="models/m/1/", adapter_environment=adapter.to_environment(),
        compute=compute(instance_type="ml.c6i.xlarge"), alarm_topic=topic, alarm_thresholds=THRESHOLDS,
        low_margin_threshold=0.15, log_retention=logs.RetentionDays.ONE_MONTH,
    )
    return adapter, Template.from_stack(stack), endpoint


def test_the_decision_model_carries_the_rendered_environment(decision_template):
    adapter, template, _ = decision_template
    (model,) = template.find_resources("AWS::SageMaker::Model").values()
    environment = model["Properties"]["PrimaryContainer"]["Environment"]
    assert environment == {**adapter.to_environment(), "SEMIF_IMAGE_DIGEST": DIGEST}
    assert environment["SEMIF_REQUEST_DEADLINE_S"] == "42.5" and environment["SEMIF_LAYOUT"] == "options_first"
    assert environment["SEMIF_API_KEY_SECRET_ARN"] == API_KEY_ARN and "SEMIF_API_KEY" not in environment


def test_the_execution_role_may_read_exactly_the_referenced_secret(decision_template):
    _, template, _ = decision_template
    statements = [s for p in template.find_resources("AWS::IAM::Policy").values()
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    reads = [s for s in statements if "secretsmanager" in json.dumps(s["Action"])]
    assert reads == [{"Action": "secretsmanager:GetSecretValue", "Effect": "Allow", "Resource": API_KEY_ARN}]


def test_the_construct_refuses_a_secret_in_the_environment():
    app = App()
    stack = Stack(app, "Leak", env=ENV)
    bucket, key, topic, repo = _deps(stack)
    with pytest.raises(ValueError, match="SEMIF_LOG_HASH_KEY is a secret; pass its Secrets Manager ARN as "
                                         "SEMIF_LOG_HASH_KEY_SECRET_ARN"):
        DecisionEndpoint(
            stack, "Decision", endpoint_name="leak-decision", image=BuiltImage(repository=repo, digest=DIGEST),
            model_bucket=bucket, model_key=key, model_prefix="models/m/1/",
            adapter_environment={"SEMIF_LOG_HASH_KEY": "k"}, compute=compute(instance_type="ml.c6i.xlarge"),
            alarm_topic=topic, alarm_thresholds=THRESHOLDS, low_margin_threshold=0.15,
            log_retention=logs.RetentionDays.ONE_MONTH,
        )


def test_the_config_loads_without_the_container_package_or_its_heavy_dependencies():
    """The deploy machine installs requirements.txt only: no semif package, no llama.cpp, Starlette or numpy."""
    script = ("import sys\n"
              "for name in ('llama_cpp', 'starlette', 'numpy', 'pydantic', 'jinja2', 'uvicorn'):\n"
              "    sys.modules[name] = None\n"
              "import config\n"
              "settings = config.load_settings()\n"
              "print(sorted(settings.environment('dev').decision.adapter.to_environment())[0])\n"
              "print(config.settings_contract.__file__)\n")
    # -S: no site-packages, so neither the installed (editable) package nor anything else outside the repository.
    done = subprocess.run([sys.executable, "-S", "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 0, done.stderr
    first, module = done.stdout.split()
    assert first == "SEMIF_LOG_LEVEL"
    assert Path(module) == REPO / "container" / "semif" / "serving" / "settings_contract.py"


def test_the_config_uses_the_checkouts_contract_even_when_another_semif_is_importable_first(tmp_path):
    """A `semif` installed from another version (the light client, say) must not become the contract the CDK app
    validates and renders against: the image is built from this checkout's container/."""
    foreign = tmp_path / "site" / "semif" / "serving"
    foreign.mkdir(parents=True)
    (foreign.parent / "__init__.py").write_text("")
    (foreign / "__init__.py").write_text("")
    (foreign / "settings_contract.py").write_text("raise ImportError('the foreign settings contract was imported')\n")
    script = ("import config, semif\n"
              "print(semif.__file__)\n"
              "print(config.settings_contract.__file__)\n"
              "print(sorted(config.load_settings().environment('dev').decision.adapter.to_environment())[0])\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}"}, timeout=60)
    assert done.returncode == 0, done.stderr
    foreign_semif, module, first = done.stdout.split()
    assert Path(foreign_semif) == foreign.parent / "__init__.py"  # the foreign package is the importable one
    assert Path(module) == REPO / "container" / "semif" / "serving" / "settings_contract.py"
    assert first == "SEMIF_LOG_LEVEL"
