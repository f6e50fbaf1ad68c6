"""The SemIf decision endpoint: the adapter image on SageMaker, with its failure-class metrics."""

from __future__ import annotations

from typing import Mapping, Optional

from aws_cdk import RemovalPolicy, aws_iam as iam, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from config import settings_contract  # the SEMIF_* definition (the container package's), not the environments file
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.endpoint_dashboard import endpoint_dashboard
from constructs_lib.image_sources import BuiltImage, ContainerImageSource
from constructs_lib.serving_endpoint import LEAST_OUTSTANDING_REQUESTS, ServingEndpoint, grant_secret_references

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
        role_name: Optional[str] = None,
        routing_strategy: Optional[str] = LEAST_OUTSTANDING_REQUESTS,
    ) -> None:
        """``routing_strategy``: how SageMaker spreads requests over the instances. Least outstanding requests by
        default: each instance admits 1 running + SEMIF_MAX_QUEUE waiting requests and answers 503 beyond, so random
        routing can refuse on a busy instance while another is idle. "RANDOM", or None (SageMaker's default, which is
        random), change it."""
        bad = sorted(k for k in adapter_environment if not k.startswith("SEMIF_") or k in RESERVED_VARIABLES)
        if bad:
            raise ValueError(f"adapter_environment: {', '.join(bad)} not allowed (SEMIF_* only; "
                             "SEMIF_IMAGE_DIGEST is set from the image, SEMIF_REQUIRE_GPU from the instance types)")
        # SageMaker: "Don't include any sensitive data in your environment variables" (ContainerDefinition.Environment,
        # https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ContainerDefinition.html). A secret comes as
        # the ARN of a Secrets Manager secret, which the adapter reads at startup with the execution role.
        secrets = sorted(k for k in adapter_environment if k in settings_contract.BY_NAME
                         and settings_contract.BY_NAME[k].scope == settings_contract.SECRET)
        if secrets:
            raise ValueError(f"adapter_environment: {', '.join(secrets)} is a secret; pass its Secrets Manager ARN as "
                             f"{settings_contract.BY_NAME[secrets[0]].reference_name} instead")
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
            adapter_low_margin_threshold=low_margin_threshold, role_name=role_name, routing_strategy=routing_strategy,
        )
        self.environment = environment  # the adapter's SEMIF_* as the Model gets them (Batch Transform reuses them)
        grant_secret_references(self.role, environment)
        self.dashboard = endpoint_dashboard(self, dashboard_name=endpoint_name, endpoint_metric=self.metric,
                                            alarms=list(self.alarms.values()), adapter=self.adapter_metrics)
