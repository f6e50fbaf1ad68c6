"""The SemIf decision endpoint: the adapter image on SageMaker, with its failure-class metrics."""

from __future__ import annotations

from typing import Mapping

from aws_cdk import RemovalPolicy, aws_cloudwatch as cloudwatch, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from constructs_lib.adapter_metrics import adapter_log_metrics
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds, notify
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.endpoint_dashboard import endpoint_dashboard
from constructs_lib.image_sources import BuiltImage, ContainerImageSource
from constructs_lib.serving_endpoint import ServingEndpoint

RESERVED_VARIABLES = frozenset({"SEMIF_IMAGE_DIGEST"})


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
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN,
    ) -> None:
        bad = sorted(k for k in adapter_environment if not k.startswith("SEMIF_") or k in RESERVED_VARIABLES)
        if bad:
            raise ValueError(f"adapter_environment: {', '.join(bad)} not allowed (SEMIF_* only; "
                             "SEMIF_IMAGE_DIGEST is set from the image)")
        environment = dict(adapter_environment)
        if isinstance(image, BuiltImage):
            environment["SEMIF_IMAGE_DIGEST"] = image.digest
        super().__init__(
            scope, id_, endpoint_name=endpoint_name, image=image, model_bucket=model_bucket, model_key=model_key,
            model_prefix=model_prefix, environment=environment, compute=compute, alarm_topic=alarm_topic,
            alarm_thresholds=alarm_thresholds, log_retention=log_retention, removal_policy=removal_policy,
        )
        self.adapter_metrics = adapter_log_metrics(self, log_group=self.log_group, endpoint_name=endpoint_name,
                                                   low_margin_threshold=low_margin_threshold)
        self.alarms["overload_503"] = notify(cloudwatch.Alarm(
            self, "Overload503Alarm", metric=self.adapter_metrics.overload_503,
            alarm_description=f"{endpoint_name}: adapter answered 503 (queue full) — add instances or raise "
                              "SEMIF_MAX_QUEUE",
            threshold=alarm_thresholds.overload_503_per_5min, evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        ), alarm_topic)
        self.dashboard = endpoint_dashboard(self, dashboard_name=endpoint_name, endpoint_metric=self.metric,
                                            alarms=list(self.alarms.values()), adapter=self.adapter_metrics)
