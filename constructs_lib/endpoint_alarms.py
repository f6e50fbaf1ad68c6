"""Alarms for SageMaker endpoints. Each goes to the SNS topic, on ALARM and on OK."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, aws_cloudwatch as cloudwatch, aws_cloudwatch_actions as cw_actions, aws_sns as sns
from constructs import Construct

PERIOD = Duration.minutes(5)


@dataclass(frozen=True)
class EndpointAlarmThresholds:
    invocation_5xx_per_5min: int
    model_latency_p95_ms: int
    overload_503_per_5min: int = 0  # decision endpoints only: counted from the adapter's log lines


def notify(alarm: cloudwatch.Alarm, topic: sns.ITopic) -> cloudwatch.Alarm:
    action = cw_actions.SnsAction(topic)
    alarm.add_alarm_action(action)
    alarm.add_ok_action(action)
    return alarm


def sagemaker_endpoint_alarms(scope: Construct, *, endpoint_name: str, variant_name: str, topic: sns.ITopic,
                              thresholds: EndpointAlarmThresholds) -> dict[str, cloudwatch.Alarm]:
    dimensions = {"EndpointName": endpoint_name, "VariantName": variant_name}
    errors_5xx = cloudwatch.Metric(namespace="AWS/SageMaker", metric_name="Invocation5XXErrors",
                                   dimensions_map=dimensions, statistic="Sum", period=PERIOD)
    # ModelLatency is reported in microseconds.
    latency_p95 = cloudwatch.Metric(namespace="AWS/SageMaker", metric_name="ModelLatency",
                                    dimensions_map=dimensions, statistic="p95", period=PERIOD)
    return {
        "invocation_5xx": notify(cloudwatch.Alarm(
            scope, "Invocation5xxAlarm", metric=errors_5xx,
            alarm_description=f"{endpoint_name}: SageMaker Invocation5XXErrors (all 5xx, incl. container errors)",
            threshold=thresholds.invocation_5xx_per_5min, evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        ), topic),
        "model_latency_p95": notify(cloudwatch.Alarm(
            scope, "ModelLatencyP95Alarm", metric=latency_p95,
            alarm_description=f"{endpoint_name}: ModelLatency p95 above {thresholds.model_latency_p95_ms} ms",
            threshold=thresholds.model_latency_p95_ms * 1000, evaluation_periods=3, datapoints_to_alarm=3,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        ), topic),
    }
