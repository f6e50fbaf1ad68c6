#!/usr/bin/env python3
"""The SemIf CDK app. The only place that knows environments.

    cdk synth -c env=dev          # the stacks of one environment (default: dev)
    cdk deploy -c env=prod --all
    cdk synth -c pipeline=true    # the CDK Pipelines stack that deploys every environment

Synth is offline: account and region come from config/environments.json, nothing is looked up.
cdk-nag's AwsSolutions checks run on every synth; an unacknowledged finding fails it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aws_cdk import App, CfnOutput, Environment, Tags, Validations, aws_logs as logs
from cdk_nag import AwsSolutionsChecks
from constructs import Construct

from config import ConfigError, EnvironmentSettings, load_settings
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute, InstancePool
from constructs_lib.image_sources import dlc_image_uri
from constructs_lib.model_bucket import model_bucket_name
from stacks.decision_stack import DecisionStack, smoke_test_role_name
from stacks.pipeline_stack import PipelineStack, PipelineStageSpec, stage_stack_synthesizer
from stacks.shared_stack import SharedStack
from stacks.text_stack import TextStack

ROOT = Path(__file__).resolve().parent
CONTAINER_DIR = ROOT / "container"


@dataclass
class EnvironmentStacks:
    shared: SharedStack
    decision: DecisionStack
    text: Optional[TextStack]


def _compute(endpoint) -> EndpointCompute:
    return EndpointCompute(
        instance_type=endpoint.instance_type,
        instance_pools=[InstancePool(p.instance_type, p.priority) for p in endpoint.instance_pools or ()],
        provision_timeout_s=endpoint.variant_instance_provision_timeout_s,
        min_instances=endpoint.min_instances,
        max_instances=endpoint.max_instances,
        target_invocations_per_instance=endpoint.target_invocations_per_instance,
        model_download_timeout_s=endpoint.model_download_timeout_s,
        startup_health_check_timeout_s=endpoint.startup_health_check_timeout_s,
    )


def add_environment(scope: Construct, env: EnvironmentSettings, *, project: str, aws_env: Optional[Environment],
                    smoke_test_account: Optional[str] = None, synthesizer=None) -> EnvironmentStacks:
    """Add one environment's stacks to ``scope`` (the app, or a pipeline stage)."""
    prefix = f"semif-{env.name}"
    synth = (lambda: synthesizer()) if synthesizer else (lambda: None)
    retention = logs.RetentionDays(_retention_name(env.log_retention_days))
    bucket_name = model_bucket_name(project, env.name, env.account, env.region)
    shared = SharedStack(scope, f"SemIf-{env.name}-Shared", stack_name=f"{prefix}-shared", env=aws_env, synthesizer=synth(),
                         env_name=env.name, model_bucket_name=bucket_name, model_prefix=env.model_prefix, alarm_email=env.alarm_email,
                         description=f"SemIf {env.name}: model bucket and alarm topic")
    thresholds = EndpointAlarmThresholds(
        invocation_5xx_per_5min=env.alarms.invocation_5xx_per_5min,
        model_latency_p95_ms=env.alarms.model_latency_p95_ms,
        overload_503_per_5min=env.alarms.overload_503_per_5min,
    )
    decision = DecisionStack(
        scope, f"SemIf-{env.name}-Decision", stack_name=f"{prefix}-decision", env=aws_env, synthesizer=synth(),
        description=f"SemIf {env.name}: adapter image build and decision endpoint",
        env_name=env.name, container_dir=CONTAINER_DIR, base_image=dlc_image_uri(env.region, env.variant),
        keep_last_images=env.image_lifecycle_keep_last, model_bucket_name=bucket_name,
        model_key=shared.models.key, model_prefix=env.model_prefix, endpoint_name=env.decision.endpoint_name,
        compute=_compute(env.decision), adapter_environment=env.decision.adapter.to_environment(),
        alarm_topic=shared.alarm_topic, alarm_thresholds=thresholds,
        low_margin_threshold=env.alarms.low_margin_threshold, log_retention=retention,
        smoke_test_account=smoke_test_account,
    )
    text = None
    if env.text is not None:
        text = TextStack(
            scope, f"SemIf-{env.name}-Text", stack_name=f"{prefix}-text", env=aws_env, synthesizer=synth(),
            description=f"SemIf {env.name}: llama.cpp DLC chat-completions endpoint",
            env_name=env.name, variant=env.variant, image_digest=None, model_bucket_name=bucket_name,
            model_key=shared.models.key, model_prefix=env.model_prefix, endpoint_name=env.text.endpoint_name,
            compute=_compute(env.text), llama_cpp=env.text.llama_cpp, alarm_topic=shared.alarm_topic,
            alarm_thresholds=thresholds, log_retention=retention,
        )
    for stack in (shared, decision, text):
        if stack is not None:
            Tags.of(stack).add("project", "semif")
            Tags.of(stack).add("environment", env.name)
    return EnvironmentStacks(shared=shared, decision=decision, text=text)


def _retention_name(days: int) -> str:
    names = {1: "ONE_DAY", 3: "THREE_DAYS", 5: "FIVE_DAYS", 7: "ONE_WEEK", 14: "TWO_WEEKS", 30: "ONE_MONTH",
             60: "TWO_MONTHS", 90: "THREE_MONTHS", 120: "FOUR_MONTHS", 150: "FIVE_MONTHS", 180: "SIX_MONTHS",
             365: "ONE_YEAR", 400: "THIRTEEN_MONTHS", 545: "EIGHTEEN_MONTHS", 731: "TWO_YEARS",
             1827: "FIVE_YEARS", 3653: "TEN_YEARS"}
    if days not in names:
        raise ConfigError(f"log_retention_days: {days} is not a CloudWatch retention; use one of {sorted(names)}")
    return names[days]


def build_app(app: Optional[App] = None, *, config_path: Optional[Path] = None) -> App:
    app = app or App()
    settings = load_settings(config_path) if config_path else load_settings()
    if str(app.node.try_get_context("pipeline") or "").lower() in ("1", "true", "yes"):
        pipeline = settings.pipeline
        specs = []
        for name in pipeline.stages:
            env = settings.environment(name)

            def build(stage, env=env) -> CfnOutput:
                stacks = add_environment(stage, env, project=settings.project, aws_env=None,
                                         smoke_test_account=pipeline.account, synthesizer=stage_stack_synthesizer)
                return stacks.decision.endpoint_name_output

            specs.append(PipelineStageSpec(name=name, account=env.account, region=env.region,
                                           needs_approval=name in pipeline.approval_before,
                                           smoke_test_role_name=smoke_test_role_name(name), build=build))
        PipelineStack(app, "SemIf-Pipeline", stack_name="semif-pipeline",
                      env=Environment(account=pipeline.account, region=pipeline.region),
                      description="SemIf delivery pipeline", connection_arn=pipeline.connection_arn,
                      repository=pipeline.repository, branch=pipeline.branch, stages=specs)
    else:
        env = settings.environment(str(app.node.try_get_context("env") or "dev"))
        add_environment(app, env, project=settings.project, aws_env=Environment(account=env.account, region=env.region))
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app


if __name__ == "__main__":
    try:
        application = build_app()
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None
    application.synth()
