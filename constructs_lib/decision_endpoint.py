"""The SemIf decision endpoint: the adapter image on SageMaker, with its failure-class metrics."""

from __future__ import annotations

from typing import Mapping

from aws_cdk import RemovalPolicy, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.endpoint_dashboard import endpoint_dashboard
from constructs_lib.image_sources import BuiltImage, ContainerImageSource
from constructs_lib.serving_endpoint import ServingEndpoint

RESERVED_VARIABLES = frozenset({"SEMIF_IMAGE_DIGEST", "SEMIF_REQUIRE_GPU"})


class DecisionEndpoint(ServingEndpoint):
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
        adapter_environment: Mapping[str, str],
        compute: EndpointCompute,
        alarm_topic: sns.ITopic,
        alarm_thresholds: EndpointAlarmThresholds,
        low_margin_threshold: float,
        log_retention: logs.RetentionDays,
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
    ) -> None:
        bad = sorted(k for k in adapter_environment if not k.startswith("SEMIF_") or k in RESERVED_VARIABLES)
        if bad:
            raise ValueError(f"adapter_environment: {', '.join(bad)} not allowed (SEMIF_* only; "
                             "SEMIF_IMAGE_DIGEST is set from the image, SEMIF_REQUIRE_GPU from the instance types)")
        environment = dict(adapter_environment)
        if isinstance(image, BuiltImage):
            environment["SEMIF_IMAGE_DIGEST"] = image.digest
        if compute.has_gpu:
            # A GPU instance whose CUDA backend fails to come up must not serve from its CPU: the adapter exits
            # non-zero, and SageMaker replaces the instance instead of reporting it healthy.
            environment["SEMIF_REQUIRE_GPU"] = "1"
        super().__init__(
            scope, id_, endpoint_name=endpoint_name, image=image, model_bucket=model_bucket, model_key=model_key,
            model_prefix=model_prefix, environment=environment, compute=compute, alarm_topic=alarm_topic,
            alarm_thresholds=alarm_thresholds, log_retention=log_retention, removal_policy=removal_policy,
            adapter_low_margin_threshold=low_margin_threshold,
        )
        self.environment = environment  # the adapter's SEMIF_* as the Model gets them (Batch Transform reuses them)
        self.dashboard = endpoint_dashboard(self, dashboard_name=endpoint_name, endpoint_metric=self.metric,
                                            alarms=list(self.alarms.values()), adapter=self.adapter_metrics)
