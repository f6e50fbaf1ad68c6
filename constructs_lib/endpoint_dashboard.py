"""One CloudWatch dashboard per endpoint.

Failure classes sit apart from throughput and latency, so a single success rate cannot hide
overload (503), bad requests (4xx by error code) or weak answers (low margin, abstain).
"""

from __future__ import annotations

from typing import Optional, Sequence

from aws_cdk import Duration, aws_cloudwatch as cloudwatch
from constructs import Construct

from constructs_lib.adapter_metrics import AdapterLogMetrics


def endpoint_dashboard(scope: Construct, *, dashboard_name: str, endpoint_metric, alarms: Sequence[cloudwatch.Alarm],
                       adapter: Optional[AdapterLogMetrics] = None) -> cloudwatch.Dashboard:
    """``endpoint_metric(name, statistic=...)`` returns an AWS/SageMaker metric for this endpoint."""
    dashboard = cloudwatch.Dashboard(scope, "Dashboard", dashboard_name=dashboard_name,
                                     default_interval=Duration.hours(3))
    dashboard.add_widgets(
        cloudwatch.GraphWidget(title="Invocations", width=8, left=[endpoint_metric("Invocations")]),
        cloudwatch.GraphWidget(title="Model latency (µs)", width=8, left=[
            endpoint_metric("ModelLatency", statistic=s) for s in ("p50", "p95", "p99")
        ]),
        cloudwatch.GraphWidget(title="SageMaker 4xx / 5xx (all causes)", width=8, left=[
            endpoint_metric("Invocation4XXErrors"), endpoint_metric("Invocation5XXErrors"),
        ]),
    )
    if adapter is not None:
        dashboard.add_widgets(
            cloudwatch.GraphWidget(title="503 overload (queue full)", width=6, left=[adapter.overload_503]),
            cloudwatch.GraphWidget(title="4xx by error_code", width=6, left=[adapter.client_errors_by_code]),
            cloudwatch.GraphWidget(title="Decisions by action", width=6, stacked=True,
                                   left=list(adapter.decisions_by_action.values())),
            # Low label mass beside low margin: both say the model is unsure (docs/explanation/scoring.md, "Label mass").
            cloudwatch.GraphWidget(title="Low-margin decisions", width=6, left=[adapter.low_margin, adapter.low_label_mass]),
        )
    dashboard.add_widgets(cloudwatch.AlarmStatusWidget(title="Alarms", width=24, alarms=list(alarms)))
    return dashboard
