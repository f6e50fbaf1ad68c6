"""The `SEMIF_*` settings, each defined once: name, type, default, limits and scope.

This is the contract between the CDK app and the container. ``Settings.from_env`` reads the environment through
it, the CDK config (``config/__init__.py``) validates and renders ``decision.adapter`` against it, and
docs/reference/configuration.md documents it in one table that a test compares with it.

Standard library only: the CDK app imports this module on a machine without llama.cpp, Starlette or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

# Who sets a variable, and so where it may come from.
OPERATOR = "operator"  # per environment: config/environments.json, decision.adapter.<key>
CONTRACT = "contract"  # the image, SageMaker or the CDK construct sets it; never per environment
SECRET = "secret"  # never in the Model's environment: by reference, decision.adapter.secrets.<key>
SCOPES = (OPERATOR, CONTRACT, SECRET)

# The variable that carries a secret's reference: SEMIF_API_KEY -> SEMIF_API_KEY_SECRET_ARN.
SECRET_REFERENCE_SUFFIX = "_SECRET_ARN"
# The model directory SageMaker mounts the model data in; relative file settings resolve under it.
DEFAULT_MODEL_DIR = "/opt/ml/model"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# What SageMaker sets in a Batch Transform job's container (docs: "Custom Inference Code with Batch Transform").
SAGEMAKER_BATCH = "SAGEMAKER_BATCH"


class SettingsError(ValueError):
    """A setting is invalid; the message names the variable."""


@dataclass(frozen=True)
class Setting:
    """One `SEMIF_*` variable. ``type`` is int, float, bool, str, choice or path (a file; relative to the model
    directory). ``default`` is the value when the variable is unset or empty (None: unset); ``default_doc`` says
    what the container computes when the default depends on the host or on another setting."""

    name: str
    type: str
    scope: str
    default: Any = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    maximum_reason: str = ""
    choices: tuple[str, ...] = ()
    # choice: how a value is normalised before it is checked (SEMIF_LOG_LEVEL=info is INFO).
    upper: bool = False
    # str: surrounding whitespace dropped. Secrets and names are taken exactly as given.
    strip: bool = False
    default_doc: Optional[str] = None

    @property
    def key(self) -> str:
        """The key in config/environments.json: ``SEMIF_MAX_QUEUE`` -> ``max_queue``."""
        return self.name[len("SEMIF_"):].lower()

    @property
    def reference_name(self) -> str:
        """A secret's by-reference variable (the Secrets Manager ARN the container resolves at startup)."""
        return self.name + SECRET_REFERENCE_SUFFIX

    def parse(self, env: Mapping[str, str], default: Any = None) -> Any:
        """The value ``env`` gives this setting; ``default`` replaces a computed default (None: ``self.default``)."""
        default = self.default if default is None else default
        raw = env.get(self.name)
        if self.type == "choice":
            normalised = (raw or "").strip()
            normalised = normalised.upper() if self.upper else normalised.lower()
            if not normalised:
                return default
            if normalised not in self.choices:
                raise SettingsError(f"{self.name}={normalised!r} must be one of {', '.join(self.choices)}")
            return normalised
        if self.type in ("str", "path"):
            if raw is None or raw == "" or (self.strip and raw.strip() == ""):
                return default
            return raw.strip() if self.strip else raw
        if raw is None or raw.strip() == "":
            return default
        if self.type == "bool":
            lowered = raw.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise SettingsError(f"{self.name}={raw!r} is not a boolean (use 1/0, true/false)")
        if self.type == "int":
            try:
                value = int(raw)
            except ValueError:
                raise SettingsError(f"{self.name}={raw!r} is not an integer") from None
            if self.minimum is not None and value < self.minimum:
                raise SettingsError(f"{self.name}={value} must be >= {self.minimum}")
        elif self.type == "float":
            try:
                value = float(raw)
            except ValueError:
                raise SettingsError(f"{self.name}={raw!r} is not a number") from None
            if self.minimum is not None and not value >= self.minimum:  # NaN fails too
                raise SettingsError(f"{self.name}={raw} must be >= {self.minimum}")
        else:
            raise TypeError(f"{self.name}: unknown setting type {self.type!r}")  # a bug in this module
        if self.maximum is not None and value > self.maximum:
            reason = f" ({self.maximum_reason})" if self.maximum_reason else ""
            raise SettingsError(f"{self.name}={value} must be <= {self.maximum}{reason}")
        return value

    def render(self, value: Any) -> str:
        """``value`` as the environment carries it, so that ``parse`` reads back the same value."""
        if self.type == "bool":
            return "1" if value else "0"
        if self.type == "float":
            value = float(value)
            return str(int(value)) if value.is_integer() else repr(value)
        return str(value)

    def describe_default(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        return f"`{self.render(self.default)}`"

    def describe_allowed(self) -> str:
        if self.type == "choice":
            return ", ".join(f"`{c}`" for c in self.choices)
        if self.type == "bool":
            return "`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`"
        if self.type in ("int", "float"):
            parts = []
            if self.minimum is not None:
                parts.append(f"≥ {self.minimum}")
            if self.maximum is not None:
                parts.append(f"≤ {self.maximum}")
            return ", ".join(parts) or "any"
        if self.type == "path":
            return "a file; relative: under `SEMIF_MODEL_DIR`"
        return "any"


def _op(name: str, type_: str, default: Any = None, **limits: Any) -> Setting:
    return Setting(name, type_, OPERATOR, default, **limits)


SETTINGS: tuple[Setting, ...] = (
    # Set by the image (Dockerfile ENV), SageMaker's layout or the CDK construct.
    Setting("SEMIF_MODEL_PATH", "str", CONTRACT, strip=True,
            default_doc="first `*.gguf` under `SEMIF_MODEL_DIR`, else the embedded SmolLM2-135M"),
    Setting("SEMIF_MODEL_DIR", "str", CONTRACT, DEFAULT_MODEL_DIR, strip=True),
    Setting("SEMIF_HOST", "str", CONTRACT, "0.0.0.0", strip=True),
    Setting("SEMIF_PORT", "int", CONTRACT, 8080, minimum=0),
    Setting("SEMIF_IMAGE_DIGEST", "str", CONTRACT),
    Setting("SEMIF_BUILD_INFO", "str", CONTRACT, "/opt/semif/BUILD_INFO.json", strip=True),
    Setting("SEMIF_REQUIRE_GPU", "bool", CONTRACT, False, default_doc="`0` (`1` on GPU variants, set by CDK)"),
    Setting("SEMIF_API_KEY_SECRET_ARN", "str", CONTRACT, strip=True),
    Setting("SEMIF_LOG_HASH_KEY_SECRET_ARN", "str", CONTRACT, strip=True),
    Setting("SEMIF_BATCH_TRANSFORM", "bool", CONTRACT, False,
            default_doc="`0` (`1` in a Batch Transform job: SageMaker sets `SAGEMAKER_BATCH=true`, CDK sets it too)"),
    # Secrets: the environment of a SageMaker Model is no place for them.
    Setting("SEMIF_API_KEY", "str", SECRET),
    Setting("SEMIF_LOG_HASH_KEY", "str", SECRET),
    # Per environment.
    _op("SEMIF_N_CTX", "int", minimum=64, default_doc="the model's training context, capped at `8192`"),
    _op("SEMIF_N_BATCH", "int", 512, minimum=1),
    _op("SEMIF_N_THREADS", "int", minimum=1, default_doc="number of CPUs"),
    _op("SEMIF_N_GPU_LAYERS", "int", -1, minimum=-1),
    _op("SEMIF_SCORING", "choice", "label", choices=("label", "sequence")),
    _op("SEMIF_PREFIX_CACHE", "bool", True),
    _op("SEMIF_PREFIX_CACHE_MB", "float", 256.0, minimum=0.0),
    _op("SEMIF_FLASH_ATTN", "bool", True),
    _op("SEMIF_LABEL_MEMO", "bool", True),
    _op("SEMIF_MAX_QUEUE", "int", 8, minimum=0),
    _op("SEMIF_QUEUE_TIMEOUT_S", "float", 30.0, minimum=0.001),
    _op("SEMIF_READ_TIMEOUT_S", "float", 30.0, minimum=0.1),
    _op("SEMIF_RETRY_AFTER_S", "int", 1, minimum=0),
    _op("SEMIF_MAX_OPTIONS", "int", 255, minimum=2, maximum=255),
    _op("SEMIF_MAX_QUESTIONS", "int", 400, minimum=1),
    _op("SEMIF_MAX_BODY_BYTES", "int", 1 << 20, minimum=1024),
    _op("SEMIF_MAX_RESPONSE_BYTES", "int", 4_000_000, minimum=1024),
    _op("SEMIF_BODY_BUDGET_BYTES", "int", minimum=1, default_doc="4 × `SEMIF_MAX_BODY_BYTES`"),
    _op("SEMIF_MAX_JSON_VALUES", "int", 131072, minimum=16),
    _op("SEMIF_MAX_STATE_CHARS", "int", 2 << 20, minimum=1024),
    _op("SEMIF_MAX_REQUEST_TOKENS", "int", 65536, minimum=64),
    _op("SEMIF_REQUEST_DEADLINE_S", "float", 50.0, minimum=0.001),
    _op("SEMIF_CHAT_DEADLINE_S", "float", 50.0, minimum=0.001),
    _op("SEMIF_MODEL_ALIAS", "str", default_doc="GGUF file stem"),
    _op("SEMIF_CALIBRATION_PATH", "path", strip=True),
    _op("SEMIF_LOG_LEVEL", "choice", "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), upper=True),
    _op("SEMIF_BATCH_DEADLINE_S", "float", 3300.0, minimum=0.001),
    _op("SEMIF_BATCH_MAX_REQUEST_TOKENS", "int", 0, minimum=0),
    _op("SEMIF_MAX_JSONL_RECORDS", "int", 10000, minimum=1),
    _op("SEMIF_LAYOUT", "choice", "state_first", choices=("state_first", "options_first")),
    _op("SEMIF_INJECTION_CHECK", "bool", False),
    _op("SEMIF_DEBIAS", "choice", "reverse", choices=("none", "reverse", "content_free", "rotations")),
    _op("SEMIF_CONTENT_FREE_ENTRIES", "int", 1024, minimum=1),
    _op("SEMIF_BATCHING", "bool", False),
    _op("SEMIF_N_SEQ", "int", 4, minimum=2, maximum=256, maximum_reason="llama.cpp's most parallel sequences"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
SECRET_REFERENCES: dict[str, Setting] = {s.reference_name: s for s in SETTINGS if s.scope == SECRET}



def read_environment(env: Mapping[str, str], *, n_threads_default: int = 1) -> dict[str, Any]:
    """Every setting but the model path, keyed by ``Setting.key``, with the checks that span settings. Reads no
    file and calls nothing: the container adds the model and calibration files and the secrets, the CDK config
    runs it on what it renders."""
    values = {s.key: s.parse(env) for s in SETTINGS
              if s.key not in ("model_path", "n_threads", "body_budget_bytes", "n_seq")
              and s.scope != SECRET and s.name not in SECRET_REFERENCES}
    values["n_threads"] = BY_KEY["n_threads"].parse(env, default=n_threads_default)
    # SageMaker sets SAGEMAKER_BATCH=true in the container of a Batch Transform job, never on an endpoint.
    values["batch_transform"] = values["batch_transform"] or (env.get(SAGEMAKER_BATCH) or "").strip().lower() in _TRUE
    if values["require_gpu"] and values["n_gpu_layers"] == 0:
        raise SettingsError("SEMIF_REQUIRE_GPU=1 with SEMIF_N_GPU_LAYERS=0 would never use the GPU")
    max_body_bytes = values["max_body_bytes"]
    budget = BY_KEY["body_budget_bytes"].parse(env, default=4 * max_body_bytes)
    if budget < max_body_bytes:
        raise SettingsError(f"SEMIF_BODY_BUDGET_BYTES={budget} must be >= SEMIF_MAX_BODY_BYTES "
                            f"({max_body_bytes}), or no body of the largest allowed size could ever be read")
    values["body_budget_bytes"] = budget
    # n_seq is read only when batching is on.
    values["n_seq"] = BY_KEY["n_seq"].parse(env) if values["batching"] else BY_KEY["n_seq"].default
    return values

