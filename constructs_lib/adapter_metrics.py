"""Metrics counted from the adapter's JSON log lines (one object per line on stdout).

SageMaker's Invocation5XXErrors mixes every 5xx; the adapter's own lines say which failure it
was: ``status`` (503 = queue full, overload), ``error_code`` on 4xx, and on decisions ``action``
(accept / review / abstain), ``margin`` and ``label_mass`` (the lowest share of the next-token
distribution that fell on the option labels; low means the model wanted to write something else).
Each becomes a metric in ``SemIf/<endpoint_name>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, aws_cloudwatch as cloudwatch, aws_logs as logs
from constructs import Construct

OVERLOAD_503_PATTERN = "{ $.status = 503 }"
CLIENT_ERROR_PATTERN = "{ $.status >= 400 && $.status < 500 }"
DECISION_ACTIONS = ("accept", "review", "abstain")
# Below this label mass a decision counts as "low label mass": most of the model's next-token probability
# went to tokens other than the option labels (docs/explanation/scoring.md, "Label mass").
DEFAULT_LOW_LABEL_MASS_THRESHOLD = 0.5


def adapter_namespace(endpoint_name: str) -> str:
    return f"SemIf/{endpoint_name}"


@dataclass
class AdapterLogMetrics:
    namespace: str
    overload_503: cloudwatch.Metric
    client_errors: cloudwatch.Metric
    low_margin: cloudwatch.Metric
    low_label_mass: cloudwatch.Metric
    decisions_by_action: dict[str, cloudwatch.Metric]
    client_errors_by_code: cloudwatch.MathExpression


def adapter_log_metrics(scope: Construct, *, log_group: logs.ILogGroup, endpoint_name: str,
                        low_margin_threshold: float, period: Duration = Duration.minutes(5),
                        low_label_mass_threshold: float = DEFAULT_LOW_LABEL_MASS_THRESHOLD) -> AdapterLogMetrics:
    namespace = adapter_namespace(endpoint_name)

    def count(id_: str, metric_name: str, pattern: str, dimensions: dict[str, str] | None = None) -> None:
        logs.MetricFilter(scope, id_, log_group=log_group, filter_pattern=logs.FilterPattern.literal(pattern),
                          metric_namespace=namespace, metric_name=metric_name, metric_value="1",
                          dimensions=dimensions, unit=cloudwatch.Unit.COUNT)

    def metric(metric_name: str) -> cloudwatch.Metric:
        return cloudwatch.Metric(namespace=namespace, metric_name=metric_name, statistic="Sum", period=period)

    count("Overload503Filter", "Overload503", OVERLOAD_503_PATTERN)
    count("ClientErrorsFilter", "ClientErrors", CLIENT_ERROR_PATTERN)
    count("ClientErrorsByCodeFilter", "ClientErrorsByCode", CLIENT_ERROR_PATTERN, {"ErrorCode": "$.error_code"})
    count("LowMarginFilter", "LowMarginDecisions", f"{{ $.margin < {low_margin_threshold:g} }}")
    count("LowLabelMassFilter", "LowLabelMassDecisions", f"{{ $.label_mass < {low_label_mass_threshold:g} }}")
    decisions: dict[str, cloudwatch.Metric] = {}
    for action in DECISION_ACTIONS:
        metric_name = f"Decisions{action.capitalize()}"
        count(f"{metric_name}Filter", metric_name, f'{{ $.action = "{action}" }}')
        decisions[action] = metric(metric_name)
    by_code = cloudwatch.MathExpression(
        expression=f"SEARCH('{{{namespace},ErrorCode}} MetricName=\"ClientErrorsByCode\"', 'Sum', {int(period.to_seconds())})",
        label="4xx by error_code", period=period,
    )
    return AdapterLogMetrics(
        namespace=namespace,
        overload_503=metric("Overload503"),
        client_errors=metric("ClientErrors"),
        low_margin=metric("LowMarginDecisions"),
        low_label_mass=metric("LowLabelMassDecisions"),
        decisions_by_action=decisions,
        client_errors_by_code=by_code,
    )
