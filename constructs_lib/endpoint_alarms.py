"""Alarms for SageMaker endpoints. Each goes to the SNS topic, on ALARM and on OK, except the one-minute
rollback alarms, which only a blue/green update acts on.

Every alarm has a fixed name (``<endpoint>-<kind>``), so the endpoint's blue/green auto-rollback
and the pipeline's bake step can name them. No alarm treats missing data as breaching: CloudWatch puts
such an alarm in ALARM when its whole evaluation range is missing, which is every alarm of an endpoint
still provisioning. An endpoint that stops reporting instance metrics is dead: its CPU alarm goes to
INSUFFICIENT_DATA, and that notifies the topic too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from aws_cdk import Duration, aws_cloudwatch as cloudwatch, aws_cloudwatch_actions as cw_actions, aws_sns as sns
from constructs import Construct

from constructs_lib.endpoint_compute import EndpointCompute

PERIOD = Duration.minutes(5)
# Blue/green rolls back only on an alarm that trips while the new fleet bakes; SageMaker publishes invocation
# metrics every minute, so the rollback alarms judge one-minute periods, 2 of 3 breaching.
ROLLBACK_PERIOD = Duration.minutes(1)
ROLLBACK_EVALUATION_PERIODS = 3
ROLLBACK_DATAPOINTS = 2
# A one-minute p95 of a handful of requests is one slow request: below this many requests in a minute the rollback
# latency alarm reads 0 (not breaching), so a good release is not rolled back at low traffic.
ROLLBACK_LATENCY_MIN_REQUESTS = 20
# Instance metrics (CPU, memory, GPU, disk) live here; invocation metrics in AWS/SageMaker.
INSTANCE_NAMESPACE = "/aws/sagemaker/Endpoints"


@dataclass(frozen=True, kw_only=True)
class EndpointAlarmThresholds:
    invocation_5xx_per_5min: int
    model_latency_p95_ms: int
    overload_503_per_5min: int = 0  # decision endpoints only: counted from the adapter's log lines
    cpu_utilization_pct: int = 90
    memory_utilization_pct: int = 90
    disk_utilization_pct: int = 80
    gpu_utilization_pct: int = 95
    gpu_memory_utilization_pct: int = 90


def alarm_name(endpoint_name: str, kind: str) -> str:
    return f"{endpoint_name}-{kind}"


def notify(alarm: cloudwatch.Alarm, topic: sns.ITopic) -> cloudwatch.Alarm:
    action = cw_actions.SnsAction(topic)
    alarm.add_alarm_action(action)
    alarm.add_ok_action(action)
    return alarm


def sagemaker_endpoint_alarms(scope: Construct, *, endpoint_name: str, variant_name: str, topic: sns.ITopic,
                              thresholds: EndpointAlarmThresholds, compute: EndpointCompute,
                              overload_503: Optional[cloudwatch.IMetric] = None) -> dict[str, cloudwatch.Alarm]:
    """``overload_503`` (the adapter's own count) is subtracted from Invocation5XXErrors: a 503 is designed-in
    back-pressure with its own alarm, not a server error."""
    dimensions = {"EndpointName": endpoint_name, "VariantName": variant_name}

    def metric(name: str, statistic: str, namespace: str = "AWS/SageMaker", period: Duration = PERIOD
               ) -> cloudwatch.Metric:
        return cloudwatch.Metric(namespace=namespace, metric_name=name, dimensions_map=dimensions,
                                 statistic=statistic, period=period)

    def alarm(id_: str, kind: str, description: str, metric_: cloudwatch.IMetric, threshold: float, *,
              periods: int = 1, missing: cloudwatch.TreatMissingData = cloudwatch.TreatMissingData.NOT_BREACHING,
              operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD) -> cloudwatch.Alarm:
        return notify(cloudwatch.Alarm(
            scope, id_, alarm_name=alarm_name(endpoint_name, kind), metric=metric_,
            alarm_description=f"{endpoint_name}: {description}", threshold=threshold, evaluation_periods=periods,
            datapoints_to_alarm=periods, comparison_operator=operator, treat_missing_data=missing,
        ), topic)

    def server_errors_metric(period: Duration) -> cloudwatch.IMetric:
        errors_5xx = metric("Invocation5XXErrors", "Sum", period=period)
        if overload_503 is None:
            return errors_5xx
        return cloudwatch.MathExpression(
            expression="FILL(errors, 0) - FILL(overload, 0)",
            using_metrics={"errors": errors_5xx, "overload": overload_503.with_(period=period)},
            label="5xx other than 503 (queue full)", period=period)

    server_errors = server_errors_metric(PERIOD)
    what = "5xx other than the adapter's 503 back-pressure" if overload_503 is not None else "Invocation5XXErrors"
    at_least = cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD
    alarms = {
        # No traffic means no errors and no latency: missing data is fine here.
        "server_errors": alarm("Invocation5xxAlarm", "server-errors", f"{what} per 5 min",
                               server_errors, thresholds.invocation_5xx_per_5min, operator=at_least),
        # ModelLatency is reported in microseconds.
        "model_latency_p95": alarm("ModelLatencyP95Alarm", "latency-p95",
                                   f"ModelLatency p95 above {thresholds.model_latency_p95_ms} ms",
                                   metric("ModelLatency", "p95"), thresholds.model_latency_p95_ms * 1000, periods=3),
        # Instance metrics: evaluated on the datapoints there are ('missing'), so an alarm created before its first
        # datapoint waits in INSUFFICIENT_DATA instead of firing.
        "cpu_utilization": alarm("CpuUtilizationAlarm", "cpu-utilization",
                                 f"CPUUtilization above {thresholds.cpu_utilization_pct}% of every vCPU "
                                 "(INSUFFICIENT_DATA: no instance reporting)",
                                 metric("CPUUtilization", "Average", INSTANCE_NAMESPACE),
                                 thresholds.cpu_utilization_pct * compute.min_vcpus, periods=3,
                                 missing=cloudwatch.TreatMissingData.MISSING),
        "memory_utilization": alarm("MemoryUtilizationAlarm", "memory-utilization",
                                    f"MemoryUtilization above {thresholds.memory_utilization_pct}%",
                                    metric("MemoryUtilization", "Average", INSTANCE_NAMESPACE),
                                    thresholds.memory_utilization_pct, periods=3,
                                    missing=cloudwatch.TreatMissingData.MISSING),
        "disk_utilization": alarm("DiskUtilizationAlarm", "disk-utilization",
                                  f"DiskUtilization above {thresholds.disk_utilization_pct}%",
                                  metric("DiskUtilization", "Maximum", INSTANCE_NAMESPACE),
                                  thresholds.disk_utilization_pct),
    }
    if compute.has_gpu:
        alarms["gpu_utilization"] = alarm(
            "GpuUtilizationAlarm", "gpu-utilization",
            f"GPUUtilization above {thresholds.gpu_utilization_pct}% of every GPU",
            metric("GPUUtilization", "Average", INSTANCE_NAMESPACE),
            thresholds.gpu_utilization_pct * compute.min_gpus, periods=3, missing=cloudwatch.TreatMissingData.MISSING)
        alarms["gpu_memory_utilization"] = alarm(
            "GpuMemoryUtilizationAlarm", "gpu-memory-utilization",
            f"GPUMemoryUtilization above {thresholds.gpu_memory_utilization_pct}% of every GPU",
            metric("GPUMemoryUtilization", "Maximum", INSTANCE_NAMESPACE),
            thresholds.gpu_memory_utilization_pct * compute.min_gpus, periods=3,
            missing=cloudwatch.TreatMissingData.MISSING)
    if compute.autoscaling_enabled and compute.max_instances > compute.min_instances:
        # Each instance reports CPUUtilization once a minute: samples per 5 min / 5 = instances in service. During a
        # blue/green update both fleets report under the variant, so the count alone reaches max_instances on an
        # ordinary deploy of a fleet half that size; the alarm also needs the scaling metric (requests in flight per
        # instance, averaged over the instances that report it) at or above the scaling target: a fleet that would
        # scale out and cannot. An ordinary deploy runs below the target; one that does not is a fleet starved
        # while autoscaling is blocked for the update, and pages rightly.
        at_max = cloudwatch.MathExpression(
            expression=f"IF(samples / 5 >= {compute.max_instances} AND FILL(load, 0) >= {compute.target_concurrency}, "
                       "samples / 5, 0)",
            using_metrics={"samples": metric("CPUUtilization", "SampleCount", INSTANCE_NAMESPACE),
                           "load": metric("ConcurrentRequestsPerModel", "Average")},
            label="instances in service, while requests in flight per instance are at the scaling target",
            period=PERIOD)
        alarms["scaling_at_max"] = alarm(
            "ScalingAtMaxAlarm", "scaling-at-max",
            f"{compute.max_instances} instances (max_instances) and requests in flight at the scaling target "
            f"({compute.target_concurrency} per instance) for 30 min: raise max_instances or the quota",
            at_max, compute.max_instances, periods=6, operator=at_least)
    # A dead endpoint reports no CPUUtilization at all: one notification for it, from the CPU alarm.
    alarms["cpu_utilization"].add_insufficient_data_action(cw_actions.SnsAction(topic))

    # The alarms a blue/green update rolls back on: the same signals on one-minute periods, so they can trip
    # inside the bake. They notify no one (the five-minute alarms above page).
    def rollback_alarm(id_: str, kind: str, description: str, metric_: cloudwatch.IMetric, threshold: float,
                       operator: cloudwatch.ComparisonOperator) -> cloudwatch.Alarm:
        return cloudwatch.Alarm(
            scope, id_, alarm_name=alarm_name(endpoint_name, kind), metric=metric_,
            alarm_description=f"{endpoint_name}: {description} (blue/green auto-rollback; notifies no one)",
            threshold=threshold, evaluation_periods=ROLLBACK_EVALUATION_PERIODS,
            datapoints_to_alarm=ROLLBACK_DATAPOINTS, comparison_operator=operator,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING)

    alarms["rollback_server_errors"] = rollback_alarm(
        "RollbackServerErrorsAlarm", "rollback-server-errors", f"{what} per minute",
        server_errors_metric(ROLLBACK_PERIOD), thresholds.invocation_5xx_per_5min, at_least)
    # ModelLatency's SampleCount is the minute's requests.
    rollback_latency = cloudwatch.MathExpression(
        expression=f"IF(requests >= {ROLLBACK_LATENCY_MIN_REQUESTS}, latency, 0)",
        using_metrics={"latency": metric("ModelLatency", "p95", period=ROLLBACK_PERIOD),
                       "requests": metric("ModelLatency", "SampleCount", period=ROLLBACK_PERIOD)},
        label=f"ModelLatency p95 of minutes with {ROLLBACK_LATENCY_MIN_REQUESTS}+ requests", period=ROLLBACK_PERIOD)
    alarms["rollback_latency_p95"] = rollback_alarm(
        "RollbackLatencyP95Alarm", "rollback-latency-p95",
        f"ModelLatency p95 above {thresholds.model_latency_p95_ms} ms per minute of at least "
        f"{ROLLBACK_LATENCY_MIN_REQUESTS} requests", rollback_latency, thresholds.model_latency_p95_ms * 1000,
        cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD)
    return alarms


# The alarms a blue/green update watches for its auto-rollback (keys of sagemaker_endpoint_alarms' result).
ROLLBACK_ALARMS = ("rollback_server_errors", "rollback_latency_p95")


# Alarms on metrics an instance reports: they can only be evaluated once the endpoint has instances.
INSTANCE_ALARMS = ("cpu_utilization", "memory_utilization", "disk_utilization", "gpu_utilization",
                   "gpu_memory_utilization", "scaling_at_max")
