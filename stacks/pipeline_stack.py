"""CDK Pipelines: build the adapter images, synth, then one stage per environment with checks around it.

    Source → Build [Image-cpu, Image-gpu → Synth] → UpdatePipeline → Assets
           → dev     [PreDeploy → shared → CheckModel → decision → text → Smoke]
           → staging [PreDeploy → shared → CheckModel → decision → Smoke → Gate → LoadCheck
                      → Bake(staging)]                                                            (GPU)
           → prod    [Approve → PreDeploy → shared → CheckModel → decision → text → Smoke → PromoteBaseline]

Each variant's image is built once, before any deploy, and every stage of that variant deploys the same
digest (build once, promote the digest). Gate, LoadCheck and PromoteBaseline are stage checks
(``stacks/release_checks.py``). The pipeline knows environments only as the stage specs ``app.py`` hands it.
What each step runs is in ``stacks/pipeline_steps.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from aws_cdk import (CfnOutput, DefaultStackSynthesizer, Duration, Environment, Stack, Stage, aws_codebuild as codebuild,
                     aws_codepipeline as codepipeline, aws_iam as iam, pipelines)
from constructs import Construct

from constructs_lib.image_build import IMAGE_REPOSITORY_NAME, AdapterImageRepository, default_build_specs, deployed_tag_prefix
from constructs_lib.nag import acknowledge, acknowledge_wildcard_resource, checkov_skip
from stacks.pipeline_steps import (CHECK_DECISION, assume_role, bake_commands,  # noqa: F401 (re-exported)
                                   model_check_commands, pre_deploy_commands, smoke_commands)

# The role every check step (model check, smoke tests, bake) runs as; each environment's check role trusts it by name.
PIPELINE_CHECK_ROLE_NAME = "semif-pipeline-checks"
# The role of the pre-deploy steps: it tags images in the pipeline account, and may assume each environment's CDK
# deploy role (which the pipeline's deploy actions already use) to delete a stack a failed first create left.
PIPELINE_PRE_DEPLOY_ROLE_NAME = "semif-pipeline-pre-deploy"
ADAPTER_IMAGES_DIR = "adapter-images"
# Where a GPU stage's pre-deploy step finds the CPU image's image.json (its Batch Transform image).
BATCH_IMAGE_DIR = "batch-image"
# Every CodeBuild project of the pipeline runs on this image with these runtimes, not the image's defaults (which
# move when a version reaches end of life): Node 22 for the CDK CLI (README; the CDK supports Node 22 and 24 since
# Node 20's end of life), Python 3.12 for the app and its tests. aws/codebuild/standard:8.0 offers nodejs 22 and 24,
# python 3.10 to 3.14; standard:7.0 stops at nodejs 20
# (https://docs.aws.amazon.com/codebuild/latest/userguide/available-runtimes.html).
CODEBUILD_IMAGE = codebuild.LinuxBuildImage.STANDARD_8_0
CODEBUILD_RUNTIME_VERSIONS = {"nodejs": "22", "python": "3.12"}
PACKAGE_JSON = Path(__file__).resolve().parents[1] / "package.json"


def toolchain_versions(package_json: Path = PACKAGE_JSON) -> tuple[str, str]:
    """The CDK CLI and cdk-assets versions ``package.json`` pins: self-mutation and asset publishing install exactly
    these (unpinned, CDK Pipelines installs ``aws-cdk@2`` and ``cdk-assets@latest`` at every run)."""
    pins = json.loads(package_json.read_text())["devDependencies"]
    for name in ("aws-cdk", "cdk-assets"):
        if not re.fullmatch(r"\d+\.\d+\.\d+", pins.get(name, "")):
            raise ValueError(f"{package_json}: devDependencies.{name} must be an exact version, got {pins.get(name)!r}")
    return pins["aws-cdk"], pins["cdk-assets"]


def stage_stack_synthesizer() -> DefaultStackSynthesizer:
    """Bootstrap roles with a literal ``aws`` partition, for stacks deployed by the pipeline.

    CDK Pipelines copies the CloudFormation execution role ARN into each deploy action's
    configuration; as ``Fn::Join`` with ``AWS::Partition`` cfn-lint rejects it (E3703). SemIf
    targets the ``aws`` partition only (see docs/how-to/deploy-first-environment.md).
    """
    role = "arn:aws:iam::${AWS::AccountId}:role/cdk-${Qualifier}-%s-${AWS::AccountId}-${AWS::Region}"
    return DefaultStackSynthesizer(cloud_formation_execution_role=role % "cfn-exec-role",
                                   deploy_role_arn=role % "deploy-role")


def deploy_role_arn(account: str, region: str, qualifier: str = DefaultStackSynthesizer.DEFAULT_QUALIFIER) -> str:
    """An environment's CDK bootstrap deploy role, which `cdk bootstrap --trust <pipeline account>` lets in."""
    return f"arn:aws:iam::{account}:role/cdk-{qualifier}-deploy-role-{account}-{region}"


def connection_use_action(connection_arn: str) -> str:
    """``UseConnection`` under the service prefix of the connection's ARN (``codeconnections`` since the rename,
    ``codestar-connections`` for older connections): IAM matches an action to a resource of its own prefix only."""
    parts = connection_arn.split(":")
    if len(parts) != 6 or parts[0] != "arn" or parts[2] not in ("codeconnections", "codestar-connections") \
            or not parts[5].startswith("connection/"):
        raise ValueError(f"connection_arn {connection_arn!r}: expected arn:aws:codeconnections:<region>:<account>:"
                         "connection/<id> (or a codestar-connections one)")
    return f"{parts[2]}:UseConnection"


@dataclass
class StageStacks:
    """What the pipeline needs from an environment's stacks."""

    decision: Stack
    endpoint_name_output: CfnOutput
    # Every stack of the stage, in deploy order.
    stacks: Sequence[Stack] = ()
    endpoint_names: Sequence[str] = ()
    # The alarms of the stage's endpoints, by name: what a bake of this stage watches.
    alarm_names: Sequence[str] = ()
    # Outputs of the stage's stacks a stage check may read, by name (``StageCheck.env_from_outputs``).
    outputs: Mapping[str, CfnOutput] = field(default_factory=dict)
    # The decision endpoint's config: the smoke test fails unless the endpoint runs this one.
    endpoint_config_output: Optional[CfnOutput] = None


@dataclass(frozen=True)
class StageCheck:
    """A check run after a stage's smoke test, in a checkout of the repository, as that environment's check role.

    A stage's checks run one after another, and all before the next stage begins (so before prod's approval when
    they check staging): a regression gate or a load check against the stage's endpoints, for example. What they
    may read and write (an eval prefix, a reports prefix) is granted to the check role by the shared stack.

    ``role_arn`` and ``region`` make a check act in another environment (prod's stage promoting staging's gated
    report, say); ``env_from_outputs`` maps environment variables to ``StageStacks.outputs`` of the stage it runs
    in, read when the step runs. An ``env`` value holding a CodePipeline variable (``#{codepipeline.…}``) is
    resolved per execution.
    """

    name: str
    commands: Sequence[str]
    install_commands: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    env_from_outputs: Mapping[str, str] = field(default_factory=dict)
    timeout: Duration = Duration.hours(1)
    role_arn: Optional[str] = None
    region: Optional[str] = None


@dataclass(frozen=True)
class PipelineStageSpec:
    """One environment as the pipeline sees it."""

    name: str
    account: str
    region: str
    variant: str
    needs_approval: bool
    check_role_arn: str
    model_bucket: str
    model_prefix: str
    manifest_key: str
    chat_endpoint: Optional[str]
    # Adds the environment's stacks to the stage.
    build: Callable[[Stage], StageStacks]
    checks: Sequence[StageCheck] = ()

    @property
    def deploy_role_arn(self) -> str:
        return deploy_role_arn(self.account, self.region)


class EnvironmentStage(Stage):
    def __init__(self, scope: Construct, id_: str, *, spec: PipelineStageSpec, **kwargs) -> None:
        super().__init__(scope, id_, env=Environment(account=spec.account, region=spec.region), **kwargs)
        self.stacks = spec.build(self)


class PipelineStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        connection_arn: str,
        repository: str,
        branch: str,
        stages: Sequence[PipelineStageSpec],
        bakes: Mapping[str, PipelineStageSpec],
        bake_minutes: int,
        image_keep_last: int,
        dlc_base_images: Mapping[str, str],
        pull_roles: Sequence[str],
        **kwargs,
    ) -> None:
        super().__init__(scope, id_, **kwargs)
        self.source = pipelines.CodePipelineSource.connection(repository, branch, connection_arn=connection_arn)
        self.images = AdapterImageRepository(self, "AdapterImages", keep_last_images=image_keep_last,
                                             pull_roles=pull_roles, environments=[s.name for s in stages])
        self.image_steps = {
            spec.variant: self.images.build_step(spec, source=self.source)
            for spec in default_build_specs(cpu_base_image=dlc_base_images.get("cpu", ""),
                                            gpu_base_image=dlc_base_images.get("gpu", ""))
            if spec.variant in dlc_base_images  # the variants the stages run, and no other
        }
        self.check_role = iam.Role(
            self, "CheckRole", role_name=PIPELINE_CHECK_ROLE_NAME,
            assumed_by=iam.ServicePrincipal("codebuild.amazonaws.com"),
            description="Runs the pipeline's model checks, smoke tests and bake checks (assumes each environment's "
                        "semif-<env>-pipeline-check role)")
        self.check_role.add_to_policy(iam.PolicyStatement(
            actions=["sts:AssumeRole"], resources=sorted({s.check_role_arn for s in stages})))
        self.pre_deploy_role = iam.Role(
            self, "PreDeployRole", role_name=PIPELINE_PRE_DEPLOY_ROLE_NAME,
            assumed_by=iam.ServicePrincipal("codebuild.amazonaws.com"),
            description="Marks the image a stage deploys and deletes that stage's stacks left in ROLLBACK_COMPLETE")
        self.pre_deploy_role.add_to_policy(iam.PolicyStatement(
            actions=["sts:AssumeRole"], resources=sorted({s.deploy_role_arn for s in stages})))
        self.pre_deploy_role.add_to_policy(iam.PolicyStatement(
            actions=["ecr:DescribeImages", "ecr:BatchGetImage", "ecr:PutImage"],
            resources=[self.images.repository.repository_arn]))
        self.pre_deploy_role.add_to_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:GenerateDataKey"], resources=[self.images.key.key_arn]))
        cli_version, cdk_assets_version = toolchain_versions()
        self.pipeline = pipelines.CodePipeline(
            self,
            "Pipeline",
            pipeline_name="semif",
            pipeline_type=codepipeline.PipelineType.V2,
            cli_version=cli_version,
            cdk_assets_cli_version=cdk_assets_version,
            code_build_defaults=pipelines.CodeBuildOptions(
                build_environment=codebuild.BuildEnvironment(build_image=CODEBUILD_IMAGE),
                partial_build_spec=codebuild.BuildSpec.from_object(
                    {"phases": {"install": {"runtime-versions": dict(CODEBUILD_RUNTIME_VERSIONS)}}})),
            cross_account_keys=True,
            enable_key_rotation=True,
            synth=pipelines.ShellStep(
                "Synth",
                input=self.source,
                # The synth reads the digests the image steps just pushed: every stage deploys those.
                additional_inputs={f"{ADAPTER_IMAGES_DIR}/{variant}": step
                                   for variant, step in self.image_steps.items()},
                install_commands=[
                    "npm ci",
                    "python3 -m venv .venv",
                    # The CDK app and its tests only: the adapter (llama.cpp) is not needed to synthesize.
                    "grep -E '^(pytest|moto|cfn-lint|hypothesis)' requirements-dev.txt > cdk-test-requirements.txt",
                    ".venv/bin/pip install -r requirements.txt -r cdk-test-requirements.txt",
                    # checkov's pins conflict with the project's: its own virtualenv (tests/cdk/test_checkov.py).
                    "python3 -m venv .venv-checkov && .venv-checkov/bin/pip install -r requirements-checkov.txt",
                ],
                commands=[
                    ".venv/bin/python -m pytest tests/cdk -q",
                    f"npx cdk synth -c pipeline=true -c adapter-images-dir={ADAPTER_IMAGES_DIR}",
                ],
                primary_output_directory="cdk.out",
            ),
        )
        self.stages: dict[str, EnvironmentStage] = {}
        for spec in stages:
            stage = EnvironmentStage(self, spec.name, spec=spec)
            self.stages[spec.name] = stage
            waits: list[pipelines.Step] = []
            if spec.needs_approval:
                waits.append(pipelines.ManualApprovalStep(f"Approve-{spec.name}", comment=f"Promote to {spec.name}?"))
            pre_deploy = self._pre_deploy_step(spec, stage)
            for step in waits:
                pre_deploy.add_step_dependency(step)
            post = self._post_deploy_steps(spec, stage)
            for target in (t for t, baked in bakes.items() if baked.name == spec.name):
                # Last in the baked stage itself: CodePipeline runs one execution per stage at a time, so no newer
                # release enters this stage while it bakes (https://docs.aws.amazon.com/codepipeline/latest/userguide/
                # concepts-how-it-works.html); in the target's `pre`, a newer one could replace what it watches.
                bake = self._bake_step(target, spec, stage.stacks, bake_minutes)
                bake.add_step_dependency(post[-1])
                post.append(bake)
            self.pipeline.add_stage(
                stage, pre=[*waits, pre_deploy], post=post,
                # The shared stack (bucket, topic, check role) deploys first; the endpoints only once the
                # model they serve is in the bucket.
                stack_steps=[pipelines.StackSteps(stack=stage.stacks.decision, pre=[self._model_check_step(spec)])],
            )
        self.pipeline.build_pipeline()
        self._grant_connection_use(connection_arn)
        self._acknowledge_framework_findings()

    def _grant_connection_use(self, connection_arn: str) -> None:
        """The Source action's role may use the connection under the ARN's own service prefix.

        CDK grants ``codestar-connections:UseConnection`` only; IAM matches an action to a resource only under the
        same service prefix, and connections created since the CodeConnections rename have ``codeconnections``
        ARNs (https://docs.aws.amazon.com/dtconsole/latest/userguide/rename.html)."""
        source_stage = self.pipeline.pipeline.node.find_child("Source")
        roles = [c for c in source_stage.node.find_all() if isinstance(c, iam.Role)]
        if len(roles) != 1:
            raise RuntimeError(f"expected one Source action role, found {len(roles)}")
        roles[0].add_to_policy(iam.PolicyStatement(actions=[connection_use_action(connection_arn)],
                                                   resources=[connection_arn]))

    def _check_step(self, id_: str, *, role_arn: str, region: str, commands: list[str],
                    env: Optional[Mapping[str, str]] = None, **kwargs) -> pipelines.CodeBuildStep:
        """A step that acts as an environment's check role (``commands`` start by assuming it)."""
        return pipelines.CodeBuildStep(
            id_, role=self.check_role, env={"CHECK_ROLE_ARN": role_arn, "AWS_DEFAULT_REGION": region, **(env or {})},
            commands=commands, **kwargs)

    def _pre_deploy_step(self, spec: PipelineStageSpec, stage: EnvironmentStage) -> pipelines.CodeBuildStep:
        """Marks the digest this stage deploys (so the repository keeps it) and clears stacks a failed first create
        left in ROLLBACK_COMPLETE (so the deploy can create them again)."""
        stack_names = [s.stack_name for s in reversed(stage.stacks.stacks or [stage.stacks.decision])]
        return pipelines.CodeBuildStep(
            f"PreDeploy-{spec.name}", input=self.image_steps[spec.variant], role=self.pre_deploy_role,
            # A GPU stage's Batch Transform runs the CPU image: it is marked as deployed there too.
            additional_inputs={BATCH_IMAGE_DIR: self.image_steps["cpu"]} if spec.variant != "cpu" else None,
            env={"STAGE_NAME": spec.name, "IMAGE_REPOSITORY": IMAGE_REPOSITORY_NAME, "IMAGE_REGION": self.region,
                 "DEPLOYED_TAG_PREFIX": deployed_tag_prefix(spec.name), "DEPLOY_ROLE_ARN": spec.deploy_role_arn,
                 "AWS_DEFAULT_REGION": spec.region, "STACKS": " ".join(stack_names)},
            commands=pre_deploy_commands())

    def _model_check_step(self, spec: PipelineStageSpec) -> pipelines.CodeBuildStep:
        return self._check_step(
            f"CheckModel-{spec.name}", role_arn=spec.check_role_arn, region=spec.region, input=self.source,
            env={"MODEL_BUCKET": spec.model_bucket, "MODEL_PREFIX": spec.model_prefix,
                 "MANIFEST_KEY": spec.manifest_key},
            # The handler's only dependency, at the project's pin.
            install_commands=['python3 -m pip install --quiet "$(grep -E \'^boto3==\' requirements.txt)"'],
            commands=model_check_commands())

    def _post_deploy_steps(self, spec: PipelineStageSpec, stage: EnvironmentStage) -> list[pipelines.Step]:
        """The smoke test, then the stage's checks, each after the one before."""
        env = {"CHAT_ENDPOINT_NAME": spec.chat_endpoint} if spec.chat_endpoint else {}
        config = stage.stacks.endpoint_config_output
        smoke = self._check_step(
            f"Smoke-{spec.name}", role_arn=spec.check_role_arn, region=spec.region, env=env,
            input=self.image_steps[spec.variant],  # image.json: the digest the answer must name
            commands=smoke_commands(chat=bool(spec.chat_endpoint), endpoint_config=config is not None),
            env_from_cfn_outputs={"ENDPOINT_NAME": stage.stacks.endpoint_name_output,
                                  **({"ENDPOINT_CONFIG_NAME": config} if config is not None else {})})
        steps: list[pipelines.Step] = [smoke]
        for check in spec.checks:
            unknown = sorted(set(check.env_from_outputs.values()) - set(stage.stacks.outputs))
            if unknown:
                raise ValueError(f"stage check {check.name}: stage {spec.name} has no output {', '.join(unknown)} "
                                 f"(it has {', '.join(sorted(stage.stacks.outputs)) or 'none'})")
            step = self._check_step(
                f"{check.name}-{spec.name}", role_arn=check.role_arn or spec.check_role_arn,
                region=check.region or spec.region, input=self.source,
                env={"ENDPOINT_NAMES": " ".join(stage.stacks.endpoint_names), **check.env},
                env_from_cfn_outputs={var: stage.stacks.outputs[name] for var, name in check.env_from_outputs.items()}
                or None,
                install_commands=list(check.install_commands),
                commands=assume_role("CHECK_ROLE_ARN") + list(check.commands), timeout=check.timeout)
            step.add_step_dependency(steps[-1])
            steps.append(step)
        return steps

    def _bake_step(self, target: str, baked: PipelineStageSpec, baked_stacks: StageStacks,
                   minutes: int) -> pipelines.CodeBuildStep:
        """At the end of ``baked``'s stage (GPU staging, running the digest ``target`` deploys next): its endpoints
        must serve ``minutes`` InService with none of its alarms in ALARM."""
        return self._check_step(
            f"Bake-{baked.name}-before-{target}", role_arn=baked.check_role_arn, region=baked.region,
            env={"BAKE_SECONDS": str(minutes * 60), "ENDPOINT_NAMES": " ".join(baked_stacks.endpoint_names),
                 "ALARM_NAMES": " ".join(baked_stacks.alarm_names)},
            timeout=Duration.minutes(minutes + 15),
            commands=bake_commands())


    def _acknowledge_framework_findings(self) -> None:
        """CDK Pipelines writes these policies itself; each finding is named with why it stays."""
        scope = self.pipeline
        bucket = self.pipeline.pipeline.artifact_bucket
        acknowledge(scope, "AwsSolutions-S1", "CDK Pipelines' own artifact bucket holds only transient build "
                    "artifacts, KMS-encrypted with the pipeline key; access logs would need a second bucket "
                    "with no consumer.")
        for action in ("s3:GetObject*", "s3:GetBucket*", "s3:List*", "s3:DeleteObject*", "s3:Abort*",
                       "kms:ReEncrypt*", "kms:GenerateDataKey*"):
            acknowledge(scope, f"AwsSolutions-IAM5[Action::{action}]",
                        f"CDK Pipelines grants {action} on its own artifact bucket and artifact key only.")
            for role in (self.check_role, self.pre_deploy_role):
                acknowledge(role, f"AwsSolutions-IAM5[Action::{action}]",
                            f"CDK Pipelines grants a step's role {action} on its artifact bucket and key only.")
        checkov_skip(bucket, "CKV_AWS_18", "CDK Pipelines' own artifact bucket holds only transient build artifacts, "
                     "KMS-encrypted; access logs would need a second bucket with no consumer.")
        checkov_skip(bucket, "CKV_AWS_21", "CDK Pipelines writes every artifact under a new key per execution; "
                     "versions would only keep garbage.")
        assets = scope.node.try_find_child("Assets")  # only when a stage has file assets
        if assets is not None:
            checkov_skip(assets.node.find_child("FileRole").node.find_child("DefaultPolicy"),
                         "CKV_AWS_111", "CDK Pipelines' asset-publishing role: its write actions target the bootstrap "
                         "asset buckets and the per-asset CodeBuild projects, which CDK names at synth.")
            acknowledge_wildcard_resource(
                assets.node.find_child("FileRole"), "*",
                "CDK Pipelines' asset-publishing role starts the per-asset CodeBuild projects it creates at synth.")
        acknowledge_wildcard_resource(scope, f"{bucket.bucket_arn}/*",
                                      "Pipeline actions read and write artifacts under their own bucket.")
        for role in (self.check_role, self.pre_deploy_role):
            acknowledge_wildcard_resource(role, f"{bucket.bucket_arn}/*",
                                          "The pipeline's steps read their input artifacts from its bucket.")
        for project in (c for c in self.node.find_all() if isinstance(c, codebuild.CfnProject) and Stack.of(c) is self):
            name = project.ref
            for holder in (scope, self.check_role, self.pre_deploy_role):
                acknowledge_wildcard_resource(
                    holder, f"arn:{self.partition}:logs:{self.region}:{self.account}:log-group:/aws/codebuild/{name}:*",
                    "A CodeBuild project of the pipeline writes streams in its own log group.")
                acknowledge_wildcard_resource(
                    holder, f"arn:{self.partition}:codebuild:{self.region}:{self.account}:report-group/{name}-*",
                    "A CodeBuild project of the pipeline may publish its own test reports.")
        acknowledge_wildcard_resource(
            scope, f"arn:{self.partition}:logs:{self.region}:{self.account}:log-group:/aws/codebuild/*",
            "Asset publishing projects are created by CDK Pipelines per asset; one role serves them all.")
        acknowledge_wildcard_resource(
            scope, f"arn:{self.partition}:codebuild:{self.region}:{self.account}:report-group/*",
            "Asset publishing projects are created by CDK Pipelines per asset; one role serves them all.")
        acknowledge_wildcard_resource(
            scope, f"arn:*:iam::{self.account}:role/*",
            "Self-mutation assumes the CDK bootstrap roles (cdk-*), whose names include the qualifier.")
        self_mutation = scope.node.find_child("UpdatePipeline").node.find_child("SelfMutation")
        acknowledge_wildcard_resource(
            self_mutation, "*", "Self-mutation runs `cdk deploy` of this stack: cloudformation:DescribeStacks and "
            "s3:ListBucket on '*' are what the CDK CLI needs to find the stack and the bootstrap bucket.")
        for step in self.image_steps.values():
            acknowledge_wildcard_resource(
                step.project.role, "*", "The image step calls ecr:GetAuthorizationToken (docker login), which "
                "supports no resource-level permissions.")
