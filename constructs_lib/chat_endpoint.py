"""The text path: the llama.cpp DLC's own SageMaker image serving chat completions.

No child image. The DLC entrypoint turns every ``SM_LLAMA_CPP_FOO_BAR=v`` into ``--foo-bar v``
(``true`` → bare flag, ``false`` → dropped), so a typed dict of llama-server options becomes
the environment here, and an unknown option fails synth rather than the container's start.
"""

from __future__ import annotations

from typing import Any, Mapping

from aws_cdk import RemovalPolicy, aws_iam as iam, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.endpoint_dashboard import endpoint_dashboard
from constructs_lib.image_sources import ContainerImageSource
from constructs_lib.nag import acknowledge_wildcard_resource
from constructs_lib.serving_endpoint import ServingEndpoint

# llama-server options accepted in config, with their value types. The DLC sets no defaults
# for threads, context or batch sizes, so those are required.
LLAMA_SERVER_OPTIONS: dict[str, type] = {
    "ctx_size": int, "n_gpu_layers": int, "threads": int, "threads_batch": int, "batch_size": int,
    "ubatch_size": int, "parallel": int, "n_predict": int, "flash_attn": str, "cont_batching": bool,
    "jinja": bool, "alias": str, "cache_type_k": str, "cache_type_v": str, "mlock": bool, "no_mmap": bool,
    "metrics": bool, "chat_template": str, "reasoning_format": str, "temp": float, "seed": int,
    "timeout": int, "model": str,
}
REQUIRED_LLAMA_SERVER_OPTIONS = ("ctx_size", "n_gpu_layers", "threads", "batch_size", "parallel")


def llama_cpp_environment(options: Mapping[str, Any]) -> dict[str, str]:
    """``{"ctx_size": 4096}`` → ``{"SM_LLAMA_CPP_CTX_SIZE": "4096"}``; raises on unknown or mistyped keys."""
    unknown = sorted(set(options) - set(LLAMA_SERVER_OPTIONS))
    if unknown:
        raise ValueError(f"llama_cpp: unknown llama-server option(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(LLAMA_SERVER_OPTIONS))}")
    missing = [k for k in REQUIRED_LLAMA_SERVER_OPTIONS if k not in options]
    if missing:
        raise ValueError(f"llama_cpp: missing required option(s) {', '.join(missing)} (the DLC has no defaults)")
    environment: dict[str, str] = {}
    for key, value in options.items():
        expected = LLAMA_SERVER_OPTIONS[key]
        ok = isinstance(value, bool) if expected is bool else (
            isinstance(value, expected) and not isinstance(value, bool)
            or expected is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"llama_cpp.{key}: expected {expected.__name__}, got {value!r}")
        if value is False:
            continue  # the DLC drops false flags; leaving them out says the same thing
        environment[f"SM_LLAMA_CPP_{key.upper()}"] = "true" if value is True else str(value)
    return environment


class ChatEndpoint(ServingEndpoint):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        endpoint_name: str,
        image: ContainerImageSource,
        model_bucket: s3.IBucket,
        model_key: kms.IKey,
        model_prefix: str,
        llama_cpp: Mapping[str, Any],
        compute: EndpointCompute,
        alarm_topic: sns.ITopic,
        alarm_thresholds: EndpointAlarmThresholds,
        log_retention: logs.RetentionDays,
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
    ) -> None:
        super().__init__(
            scope, id_, endpoint_name=endpoint_name, image=image, model_bucket=model_bucket, model_key=model_key,
            model_prefix=model_prefix, environment=llama_cpp_environment(llama_cpp), compute=compute,
            alarm_topic=alarm_topic, alarm_thresholds=alarm_thresholds, log_retention=log_retention,
            removal_policy=removal_policy,
        )
        self.dashboard = endpoint_dashboard(self, dashboard_name=endpoint_name, endpoint_metric=self.metric,
                                            alarms=list(self.alarms.values()))

    def grant_invoke(self, grantee: iam.IGrantable) -> iam.Grant:
        """InvokeEndpoint (and streaming) on this endpoint, plus bearer tokens for the OpenAI-compatible route.

        ``sagemaker:CallWithBearerToken`` takes no resource ARN (SageMaker requires '*'); the token
        carries the caller's credentials, so InvokeEndpoint on this ARN still bounds what it can call.
        """
        grant = super().grant_invoke(grantee)
        iam.Grant.add_to_principal(grantee=grantee, actions=["sagemaker:CallWithBearerToken"], resource_arns=["*"])
        if isinstance(grantee, Construct):
            acknowledge_wildcard_resource(grantee, "*", "sagemaker:CallWithBearerToken supports no resource-level "
                                          f"permissions; sagemaker:InvokeEndpoint is limited to {self.endpoint_name}.")
        return grant
