"""Typed per-environment settings for the CDK app (read by ``app.py`` only).

``environments.json`` holds one entry per environment. Every key is checked: an unknown key, a
missing key or a value of the wrong type stops synth with a message naming the key's path, so a
typo in the file never silently falls back to a default.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

CONFIG_PATH = Path(__file__).with_name("environments.json")


class ConfigError(ValueError):
    """The environments file is invalid, or names no such environment."""


@dataclass(frozen=True)
class InstancePoolSettings:
    instance_type: str
    priority: int


@dataclass(frozen=True)
class EndpointComputeSettings:
    """What every SageMaker endpoint variant needs, decision or text."""

    endpoint_name: str
    instance_type: Optional[str]
    instance_pools: Optional[tuple[InstancePoolSettings, ...]]
    variant_instance_provision_timeout_s: Optional[int]
    min_instances: int
    max_instances: int
    target_invocations_per_instance: int
    model_download_timeout_s: int
    startup_health_check_timeout_s: int


@dataclass(frozen=True)
class AdapterSettings:
    """The adapter's tunables; ``to_environment`` renders them as the SEMIF_* contract."""

    n_ctx: int
    n_batch: int
    n_threads: int
    n_gpu_layers: int
    scoring: Literal["label", "sequence"]
    prefix_cache: bool
    max_queue: int
    queue_timeout_s: int
    retry_after_s: int
    max_options: int
    max_questions: int
    max_body_bytes: int
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"]

    def to_environment(self) -> dict[str, str]:
        """SEMIF_* variables as documented in docs/configuration.md (SEMIF_IMAGE_DIGEST is added by CDK)."""
        rendered: dict[str, str] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool):
                value = "1" if value else "0"
            rendered[f"SEMIF_{field.name.upper()}"] = str(value)
        return rendered


@dataclass(frozen=True)
class DecisionSettings(EndpointComputeSettings):
    adapter: AdapterSettings


@dataclass(frozen=True)
class TextSettings(EndpointComputeSettings):
    # Checked against the llama-server flag allow-list by the chat endpoint construct at synth.
    llama_cpp: Mapping[str, Any]


@dataclass(frozen=True)
class AlarmSettings:
    overload_503_per_5min: int
    invocation_5xx_per_5min: int
    model_latency_p95_ms: int
    low_margin_threshold: float


@dataclass(frozen=True)
class EnvironmentSettings:
    name: str
    account: str
    region: str
    variant: Literal["cpu", "gpu"]
    model_prefix: str
    image_lifecycle_keep_last: int
    log_retention_days: int
    alarm_email: Optional[str]
    decision: DecisionSettings
    alarms: AlarmSettings
    text: Optional[TextSettings]


@dataclass(frozen=True)
class PipelineSettings:
    account: str
    region: str
    connection_arn: str
    repository: str
    branch: str
    stages: tuple[str, ...]
    approval_before: tuple[str, ...]


@dataclass(frozen=True)
class AppSettings:
    project: str
    environments: Mapping[str, EnvironmentSettings]
    pipeline: PipelineSettings

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
    for stage in (*pipeline.stages, *pipeline.approval_before):
        if stage not in environments:
            raise ConfigError(f"pipeline: stage '{stage}' is not a defined environment")
    app_settings = AppSettings(project=settings.project, environments=environments, pipeline=pipeline)
    for env in environments.values():
        _check_environment(env)
    return app_settings


@dataclass(frozen=True)
class _TopLevel:
    project: str
    pipeline: PipelineSettings


_ACCOUNT = re.compile(r"^\d{12}$")
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")
_ENDPOINT_NAME = re.compile(r"^[a-z0-9](-*[a-z0-9]){0,62}$")
_MODEL_PREFIX = re.compile(r"^models/[A-Za-z0-9._-]+/[A-Za-z0-9._-]+/$|^models/[A-Za-z0-9._/-]+\.tar\.gz$")


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
    for label, endpoint in (("decision", env.decision), ("text", env.text)):
        if endpoint is None:
            continue
        if not _ENDPOINT_NAME.match(endpoint.endpoint_name):
            raise ConfigError(
                f"{where}.{label}.endpoint_name: '{endpoint.endpoint_name}' must be lowercase letters, digits and '-'"
            )
        if not 1 <= endpoint.min_instances <= endpoint.max_instances:
            raise ConfigError(f"{where}.{label}: need 1 <= min_instances <= max_instances")


def _fail(where: str, message: str) -> Any:
    raise ConfigError(f"{where or '<root>'}: {message}")


def _build(cls: type, body: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``body``, rejecting unknown and missing keys."""
    if not isinstance(body, dict):
        return _fail(where, f"expected an object for {cls.__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        _fail(where, f"unknown key(s) {', '.join(unknown)}")
    missing = sorted(names - set(body))
    if missing:
        _fail(where, f"missing key(s) {', '.join(missing)}")
    values = {name: _coerce(hints[name], body[name], f"{where}.{name}".lstrip(".")) for name in names}
    return cls(**values)


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
