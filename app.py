#!/usr/bin/env python3
"""The SemIf CDK app. The only place that knows environments.

    make deploy ENV=dev                                      # one environment from its own account (deploy/)
    cdk synth -c env=dev -c adapter-image-cpu=sha256:…       # the stacks of one environment (default: dev)
    cdk synth -c pipeline=true -c adapter-images-dir=<dir>   # the CDK Pipelines stack that deploys every environment

Synth is offline: account and region come from config/environments.json, nothing is looked up.
The adapter image is built by CodeBuild before the stack that runs it, never during synth or a stack
operation: by ``deploy/`` in the environment's own account (its ``SemIf-<env>-Image`` stack), or by the
pipeline in the pipeline account. Synth takes the digest (``-c adapter-image-<variant>``) and the DLC digest
the build started from (``-c dlc-image-<variant>``, when config/environments.json pins none). cdk-nag's
AwsSolutions checks run on every synth; an unacknowledged finding fails it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aws_cdk import Annotations, App, Environment, RemovalPolicy, Tags, Validations, aws_logs as logs
from cdk_nag import AwsSolutionsChecks
from constructs import Construct

from config import AppSettings, ConfigError, EnvironmentSettings, baseline_stage, load_settings
from config.pricing import monthly_cost_table
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute, InstancePool
from constructs_lib.image_build import default_build_specs, image_repository_name, image_variants, read_image_digests
from constructs_lib.image_sources import PLACEHOLDER_DIGEST, dlc_image_uri
from constructs_lib.model_bucket import model_bucket_name
from constructs_lib.model_check import manifest_key
from constructs_lib.serving_endpoint import model_role_name, target_concurrency
from stacks.decision_stack import DEFAULT_CPU_BATCH_INSTANCE_TYPE, DecisionStack
from stacks.image_stack import ImageStack
from stacks.pipeline_stack import (PIPELINE_CHECK_ROLE_NAME, PipelineStack, PipelineStageSpec, StageStacks,
                                   stage_stack_synthesizer)
from stacks.release_checks import (MODEL_KEY_OUTPUT, BaselinePlace, LoadPlan, ReleaseCheckAccess, baseline_key,
                                   gate_and_load_checks, promote_check)
from stacks.shared_stack import SharedStack, pipeline_check_role_name
from stacks.text_stack import TextStack

ROOT = Path(__file__).resolve().parent
# Images one environment's own repository keeps when no pipeline config says (pipeline.image_keep_last).
DEFAULT_KEEP_LAST_IMAGES = 30
# dev and staging are disposable; prod keeps its data on update and delete, but not after a failed first create.
REMOVAL_BY_TIER = {"dev": RemovalPolicy.DESTROY, "staging": RemovalPolicy.DESTROY,
                   "prod": RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE}


@dataclass
class EnvironmentStacks:
    shared: SharedStack
    decision: DecisionStack
    text: Optional[TextStack]
    image: Optional[ImageStack] = None


def _compute(endpoint, *, variant: str, inference_ami_version: Optional[str], admitted_per_instance: int) -> EndpointCompute:
    return EndpointCompute(
        instance_type=endpoint.instance_type,
        instance_pools=[InstancePool(p.instance_type, p.priority) for p in endpoint.instance_pools or ()],
        provision_timeout_s=endpoint.variant_instance_provision_timeout_s,
        min_instances=endpoint.min_instances,
        max_instances=endpoint.max_instances,
        autoscaling_enabled=endpoint.autoscaling_enabled,
        target_concurrency=target_concurrency(admitted_per_instance=admitted_per_instance,
                                              fraction=endpoint.scale_at_concurrency_fraction),
        model_download_timeout_s=endpoint.model_download_timeout_s,
        startup_health_check_timeout_s=endpoint.startup_health_check_timeout_s,
        inference_ami_version=inference_ami_version if variant == "gpu" else None,
    )


def decision_compute(env: EnvironmentSettings) -> EndpointCompute:
    # One request runs, SEMIF_MAX_QUEUE wait; the next gets 503.
    return _compute(env.decision, variant=env.variant, inference_ami_version=env.inference_ami_version,
                    admitted_per_instance=1 + env.decision.adapter.max_queue)


def text_compute(env: EnvironmentSettings) -> EndpointCompute:
    # llama-server runs `parallel` slots.
    return _compute(env.text, variant=env.variant, inference_ami_version=env.inference_ami_version,
                    admitted_per_instance=int(env.text.llama_cpp.get("parallel", 1)))


def _thresholds(alarms, **extra) -> EndpointAlarmThresholds:
    return EndpointAlarmThresholds(
        invocation_5xx_per_5min=alarms.invocation_5xx_per_5min, model_latency_p95_ms=alarms.model_latency_p95_ms,
        cpu_utilization_pct=alarms.cpu_utilization_pct, memory_utilization_pct=alarms.memory_utilization_pct,
        disk_utilization_pct=alarms.disk_utilization_pct, gpu_utilization_pct=alarms.gpu_utilization_pct,
        gpu_memory_utilization_pct=alarms.gpu_memory_utilization_pct, **extra)


def image_repository_arn(settings: AppSettings) -> str:
    """The pipeline's central repository, which every stage pulls from."""
    pipeline = settings.pipeline
    return f"arn:aws:ecr:{pipeline.region}:{pipeline.account}:repository/{image_repository_name()}"


def image_pull_roles(env: EnvironmentSettings) -> tuple[str, str]:
    """The roles that pull the adapter image in ``env``: the decision endpoint's execution role and the Batch Transform
    role, by the fixed names its decision stack gives them."""
    return tuple(f"arn:aws:iam::{env.account}:role/{model_role_name(env.name, env.decision.endpoint_name, kind)}"
                 for kind in ("endpoint", "transform"))


def environment_repository_arn(env: EnvironmentSettings) -> str:
    """One environment's own repository (its ImageStack), when it is deployed from its own account."""
    return f"arn:aws:ecr:{env.region}:{env.account}:repository/{image_repository_name(env.name)}"


def pipeline_check_principal(settings: AppSettings, env: EnvironmentSettings) -> Optional[str]:
    """The pipeline role the environment's check role trusts: none without a pipeline, or for an environment that
    is not one of its stages (IAM refuses a trust policy naming an account that does not exist)."""
    if settings.pipeline is None or env.name not in settings.pipeline.stages:
        return None
    return f"arn:aws:iam::{settings.pipeline.account}:role/{PIPELINE_CHECK_ROLE_NAME}"


def add_environment(scope: Construct, env: EnvironmentSettings, *, settings: AppSettings, aws_env: Optional[Environment],
                    adapter_image_digest: str, dlc_digest: str, image_repository: str,
                    batch_image_digest: Optional[str] = None, image_lookup: Optional[str] = None,
                    synthesizer=None) -> EnvironmentStacks:
    """Add one environment's stacks to ``scope`` (the app, or a pipeline stage): the same stacks on both paths, but
    for where the adapter image comes from (``image_repository``, an ECR repository ARN) and the DLC digest of the
    chat endpoint (``dlc_digest``)."""
    prefix = f"semif-{env.name}"
    synth = (lambda: synthesizer()) if synthesizer else (lambda: None)
    retention = logs.RetentionDays(_retention_name(env.log_retention_days))
    removal = REMOVAL_BY_TIER[env.tier]
    bucket_name = model_bucket_name(settings.project, env.name, env.account, env.region)
    endpoint_names = (env.decision.endpoint_name,) + ((env.text.endpoint_name,) if env.text else ())
    access = release_check_access(env, settings)
    shared = SharedStack(scope, f"SemIf-{env.name}-Shared", stack_name=f"{prefix}-shared", env=aws_env, synthesizer=synth(),
                         env_name=env.name, model_bucket_name=bucket_name, model_prefix=env.model_prefix,
                         alarm_email=env.alarm_email, removal_policy=removal,
                         pipeline_check_principal_arn=pipeline_check_principal(settings, env), endpoint_names=endpoint_names,
                         check_reads=access.reads if access else (), check_writes=access.writes if access else (),
                         check_lists=access.lists if access else (),
                         check_describes_endpoint_configs=access is not None and env.release_checks is not None,
                         description=f"SemIf {env.name}: model bucket, alarm topic and the pipeline's check role")
    alarms = env.decision.alarms
    decision = DecisionStack(
        scope, f"SemIf-{env.name}-Decision", stack_name=f"{prefix}-decision", env=aws_env, synthesizer=synth(),
        description=f"SemIf {env.name}: decision endpoint on the promoted adapter image",
        env_name=env.name, image_repository_arn=image_repository, image_digest=adapter_image_digest,
        model_bucket_name=bucket_name, model_key=shared.models.key, model_prefix=env.model_prefix,
        endpoint_name=env.decision.endpoint_name, compute=decision_compute(env),
        adapter_environment=env.decision.adapter.to_environment(), alarm_topic=shared.alarm_topic,
        alarm_thresholds=_thresholds(alarms, overload_503_per_5min=alarms.overload_503_per_5min),
        low_margin_threshold=alarms.low_margin_threshold, log_retention=retention, removal_policy=removal,
        placeholder_lookup=image_lookup,
        # Batch Transform runs the CPU image on a CPU instance (stacks/decision_stack.py says why).
        batch_image_digest=batch_image_digest,
        batch_instance_type=None if env.variant == "cpu" else DEFAULT_CPU_BATCH_INSTANCE_TYPE,
    )
    text = None
    if env.text is not None:
        text = TextStack(
            scope, f"SemIf-{env.name}-Text", stack_name=f"{prefix}-text", env=aws_env, synthesizer=synth(),
            description=f"SemIf {env.name}: llama.cpp DLC chat-completions endpoint",
            env_name=env.name, variant=env.variant, image_digest=dlc_digest,
            model_bucket_name=bucket_name, model_key=shared.models.key, model_prefix=env.model_prefix,
            endpoint_name=env.text.endpoint_name, compute=text_compute(env), llama_cpp=env.text.llama_cpp,
            alarm_topic=shared.alarm_topic, alarm_thresholds=_thresholds(env.text.alarms), log_retention=retention,
            client_role_arns=env.text.client_role_arns, removal_policy=removal,
        )
        # One endpoint provisions at a time: GPU quota and capacity go to the decision endpoint first.
        text.add_stack_dependency(decision)
    for stack in (shared, decision, text):
        if stack is not None:
            Tags.of(stack).add("project", "semif")
            Tags.of(stack).add("environment", env.name)
    return EnvironmentStacks(shared=shared, decision=decision, text=text)


def release_check_access(env: EnvironmentSettings, settings: AppSettings) -> Optional[ReleaseCheckAccess]:
    """What the environment's check role needs for its release checks (none without them); the same in a hand
    deploy and in the pipeline, so neither removes what the other granted."""
    if settings.pipeline is None:
        return None
    grants = []
    if env.release_checks is not None:
        grants.append(ReleaseCheckAccess.for_stage(data_key=env.release_checks.data_key, stage=env.name))
    if any(baseline_stage(settings.pipeline, settings.environments, name) == env.name
           for name in settings.pipeline.stages if settings.environments[name].release_checks is not None):
        grants.append(ReleaseCheckAccess.for_baseline(baseline_stage=env.name))
    return sum(grants[1:], grants[0]) if grants else None


def baseline_place(settings: AppSettings, gated: EnvironmentSettings) -> BaselinePlace:
    """Where ``gated``'s baseline lives: in the bucket of the stage it is compared with (prod), which is kept."""
    name = baseline_stage(settings.pipeline, settings.environments, gated.name)
    kept = settings.environments[name]
    return BaselinePlace(bucket=model_bucket_name(settings.project, name, kept.account, kept.region),
                         key=baseline_key(name), role_arn=f"arn:aws:iam::{kept.account}:role/{pipeline_check_role_name(name)}",
                         region=kept.region, endpoint_name=kept.decision.endpoint_name)


def release_checks(env: EnvironmentSettings, settings: AppSettings) -> list:
    """The stage checks of ``env`` in the pipeline: its gate and load check, or, on a prod stage, the promotion of
    each earlier stage's gated report that compares with it."""
    checks = []
    if env.release_checks is not None:
        rc = env.release_checks
        load = rc.load
        checks += gate_and_load_checks(
            model_bucket=model_bucket_name(settings.project, env.name, env.account, env.region), data_key=rc.data_key,
            endpoint_name=env.decision.endpoint_name, stage=env.name, baseline=baseline_place(settings, env),
            gate_limits_json=rc.gate.to_json(),
            load=LoadPlan(clients=load.clients, duration_s=load.duration_s, max_attempts=load.max_attempts,
                          max_elapsed_s=load.max_elapsed_s, request_timeout_s=load.request_timeout_s,
                          limits_json=load.limits.to_json()))
    for name in settings.pipeline.stages:
        gated = settings.environments[name]
        if gated.release_checks is not None and baseline_stage(settings.pipeline, settings.environments, name) == env.name:
            checks.append(promote_check(
                model_bucket=model_bucket_name(settings.project, name, gated.account, gated.region), stage=name,
                baseline=baseline_place(settings, gated), role_arn=f"arn:aws:iam::{gated.account}:role/{pipeline_check_role_name(name)}",
                region=gated.region))
    return checks


def _retention_name(days: int) -> str:
    names = {1: "ONE_DAY", 3: "THREE_DAYS", 5: "FIVE_DAYS", 7: "ONE_WEEK", 14: "TWO_WEEKS", 30: "ONE_MONTH",
             60: "TWO_MONTHS", 90: "THREE_MONTHS", 120: "FOUR_MONTHS", 150: "FIVE_MONTHS", 180: "SIX_MONTHS",
             365: "ONE_YEAR", 400: "THIRTEEN_MONTHS", 545: "EIGHTEEN_MONTHS", 731: "TWO_YEARS",
             1827: "FIVE_YEARS", 3653: "TEN_YEARS"}
    if days not in names:
        raise ConfigError(f"log_retention_days: {days} is not a CloudWatch retention; use one of {sorted(names)}")
    return names[days]


def adapter_image_digests(app: App) -> dict[str, str]:
    """The promoted adapter digests: ``-c adapter-images-dir=<dir>`` (the pipeline's image steps' outputs) or
    ``-c adapter-image-<variant>=sha256:…`` (a hand deploy of a digest the pipeline built)."""
    digests: dict[str, str] = {}
    directory = app.node.try_get_context("adapter-images-dir")
    if directory:
        digests.update(read_image_digests(Path(directory)))
    for variant in ("cpu", "gpu"):
        value = app.node.try_get_context(f"adapter-image-{variant}")
        if value:
            digests[variant] = str(value)
    return digests


def _digest_for(digests: dict[str, str], variant: str) -> str:
    if variant not in digests:
        raise ConfigError(
            f"no adapter image digest for the '{variant}' variant: `make deploy ENV=<env>` builds it and passes "
            f"-c adapter-image-{variant}=sha256:… (docs/how-to/deploy-first-environment.md); pass "
            f"-c adapter-image-{variant}={PLACEHOLDER_DIGEST} for a synth that deploys no endpoint")
    return digests[variant]


def dlc_digests(app: App, settings: AppSettings) -> dict[str, str]:
    """The DLC digest per variant: the one config/environments.json pins, else ``-c dlc-image-<variant>`` (what
    ``deploy/`` looked up from the DLC's tag), else the all-zero placeholder (refused at deploy)."""
    resolved = {}
    for variant in ("cpu", "gpu"):
        pinned = settings.dlc_images.digest(variant)
        given = app.node.try_get_context(f"dlc-image-{variant}")
        if given is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", str(given)):
            raise ConfigError(f"-c dlc-image-{variant}: '{given}' is not a digest (sha256:<64 hex>)")
        if pinned != PLACEHOLDER_DIGEST:
            if given and str(given) != pinned:
                raise ConfigError(f"-c dlc-image-{variant}={given} differs from dlc_images.{variant}={pinned} in "
                                  "config/environments.json: the pinned digest wins; drop one of them")
            resolved[variant] = pinned
        else:
            resolved[variant] = str(given) if given else PLACEHOLDER_DIGEST
    return resolved


def build_app(app: Optional[App] = None, *, config_path: Optional[Path] = None) -> App:
    app = app or App()
    settings = load_settings(config_path) if config_path else load_settings()
    digests = adapter_image_digests(app)
    dlc = dlc_digests(app, settings)
    if str(app.node.try_get_context("pipeline") or "").lower() in ("1", "true", "yes"):
        pipeline = settings.pipeline
        if pipeline is None:
            raise ConfigError('pipeline: null in config/environments.json: there is no pipeline to synthesize; '
                              'deploy each environment with `make deploy ENV=<env>`')
        specs = []
        for name in pipeline.stages:
            env = settings.environment(name)

            def build(stage, env=env) -> StageStacks:
                stacks = add_environment(stage, env, settings=settings, aws_env=None,
                                         adapter_image_digest=_digest_for(digests, env.variant),
                                         batch_image_digest=_digest_for(digests, "cpu"),
                                         dlc_digest=dlc[env.variant], image_repository=image_repository_arn(settings),
                                         synthesizer=stage_stack_synthesizer)
                endpoints = [stacks.decision.endpoint] + ([stacks.text.endpoint] if stacks.text else [])
                return StageStacks(decision=stacks.decision, endpoint_name_output=stacks.decision.endpoint_name_output,
                                   stacks=[s for s in (stacks.shared, stacks.decision, stacks.text) if s is not None],
                                   endpoint_names=[e.endpoint_name for e in endpoints],
                                   alarm_names=[name for e in endpoints for name in e.alarm_names],
                                   outputs={MODEL_KEY_OUTPUT: stacks.shared.model_key_arn_output},
                                   endpoint_config_output=stacks.decision.endpoint_config_output)

            # The manifest `semif-package-model upload` writes: in the prefix, or beside the .tar.gz.
            manifest = manifest_key(env.model_prefix)
            specs.append(PipelineStageSpec(
                name=name, account=env.account, region=env.region, variant=env.variant,
                needs_approval=name in pipeline.approval_before,
                check_role_arn=f"arn:aws:iam::{env.account}:role/{pipeline_check_role_name(name)}",
                model_bucket=model_bucket_name(settings.project, name, env.account, env.region),
                model_prefix=env.model_prefix, manifest_key=manifest,
                chat_endpoint=env.text.endpoint_name if env.text else None, build=build,
                checks=release_checks(env, settings)))
        by_name = {s.name: s for s in specs}
        PipelineStack(app, "SemIf-Pipeline", stack_name="semif-pipeline",
                      env=Environment(account=pipeline.account, region=pipeline.region),
                      description="SemIf delivery pipeline", connection_arn=pipeline.connection_arn,
                      repository=pipeline.repository, branch=pipeline.branch, stages=specs,
                      bakes={target: by_name[baked] for target, baked in pipeline.bake_before.items()},
                      bake_minutes=pipeline.bake_minutes, image_keep_last=pipeline.image_keep_last,
                      # The variants the stages run, and CPU, which every stage's Batch Transform runs: an all-CPU
                      # pipeline builds no CUDA image.
                      dlc_base_images={v: dlc_image_uri(pipeline.region, v, dlc[v]) for v in
                                       sorted({v for n in pipeline.stages for v in image_variants(settings.environment(n).variant)})},
                      pull_roles=sorted(arn for name in pipeline.stages
                                        for arn in image_pull_roles(settings.environment(name))))
    else:
        env = settings.environment(str(app.node.try_get_context("env") or "dev"))
        aws_env = Environment(account=env.account, region=env.region)
        # The environment's own repository and build project: `make deploy` builds the image there first.
        # Its variant, and CPU for its Batch Transform: a CPU environment builds one image, a GPU one two.
        builds = [spec for spec in default_build_specs(cpu_base_image=dlc_image_uri(env.region, "cpu", dlc["cpu"]),
                                                       gpu_base_image=dlc_image_uri(env.region, "gpu", dlc["gpu"]))
                  if spec.variant in image_variants(env.variant)]
        image = ImageStack(app, f"SemIf-{env.name}-Image", stack_name=f"semif-{env.name}-image", env=aws_env,
                           description=f"SemIf {env.name}: adapter image repository and its CodeBuild project",
                           env_name=env.name, builds=builds,
                           keep_last_images=settings.pipeline.image_keep_last if settings.pipeline else DEFAULT_KEEP_LAST_IMAGES,
                           removal_policy=REMOVAL_BY_TIER[env.tier],
                           log_retention=logs.RetentionDays(_retention_name(env.log_retention_days)))
        stacks = add_environment(app, env, settings=settings, aws_env=aws_env,
                                 adapter_image_digest=_digest_for(digests, env.variant), dlc_digest=dlc[env.variant],
                                 batch_image_digest=_digest_for(digests, "cpu"),
                                 image_repository=environment_repository_arn(env),
                                 image_lookup=f"`make deploy ENV={env.name}`, which builds the image and deploys its digest")
        stacks.image = image
        stacks.decision.add_stack_dependency(image)
        Tags.of(image).add("project", "semif")
        Tags.of(image).add("environment", env.name)
        if PLACEHOLDER_DIGEST in (digests[env.variant], digests["cpu"]):
            Annotations.of(stacks.decision).add_warning_v2(
                "semif:placeholder-image", "adapter image digest is the all-zero placeholder: CloudFormation will "
                "refuse to deploy this decision stack")
    for variant in ("cpu", "gpu"):
        if dlc[variant] == PLACEHOLDER_DIGEST:
            Annotations.of(app).add_warning_v2(
                f"semif:dlc-{variant}-unresolved", f"the {variant} DLC digest is the all-zero placeholder: the image "
                f"build and CloudFormation will refuse it; `make deploy` looks it up (-c dlc-image-{variant}=sha256:…)")
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app


if __name__ == "__main__":
    try:
        application = build_app()
        print(monthly_cost_table(load_settings()), file=sys.stderr)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None
    application.synth()
