"""CDK Pipelines: build the adapter images, synth, then one stage per environment with checks around it.

    Source → Build [Image-cpu, Image-gpu → Synth] → UpdatePipeline → Assets
           → dev [shared → check model → decision → text → smoke]
           → staging (GPU) [same]
           → prod [approval, bake on staging, shared → check model → decision → text → smoke]

Each variant's image is built once, before any deploy, and every stage of that variant deploys the same
digest (build once, promote the digest). The pipeline knows environments only as the stage specs
``app.py`` hands it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from aws_cdk import (CfnOutput, DefaultStackSynthesizer, Duration, Environment, Stack, Stage, aws_codebuild as codebuild,
                     aws_iam as iam, pipelines)
from constructs import Construct

from constructs_lib.image_build import AdapterImageRepository, default_build_specs
from constructs_lib.nag import acknowledge, acknowledge_wildcard_resource, checkov_skip

# The role every check step (model check, smoke tests, bake) runs as; each environment's check role trusts it by name.
PIPELINE_CHECK_ROLE_NAME = "semif-pipeline-checks"
ADAPTER_IMAGES_DIR = "adapter-images"

# A request every SemIf build must answer; the smoke step checks the answer's shape, not just the status.
SMOKE_REQUEST = {"decision": {
    "id": "smoke",
    "state": "Customer writes: I was charged twice for my subscription this month.",
    "question": "Which team should handle this ticket?",
    "options": [{"id": "billing"}, {"id": "technical"}, {"id": "sales"}],
}}
SMOKE_CHAT_REQUEST = {"messages": [{"role": "user", "content": "Reply with the single word: ready"}],
                      "max_tokens": 8, "temperature": 0}
# Checks the decision answer: a choice among the options and probabilities that sum to 1.
CHECK_DECISION = (
    "import json,sys; r=json.load(open('response.json')); ids=r['option_ids']; p=r['probabilities']; "
    "assert ids==['billing','technical','sales'], ids; assert r['choice'] in ids, r['choice']; "
    "assert len(p)==3 and abs(sum(p)-1)<1e-3, p; print('decision ok:', r['choice'], p)"
)
CHECK_CHAT = (
    "import json; r=json.load(open('chat.json')); text=r['choices'][0]['message']['content']; "
    "assert isinstance(text,str) and text.strip(), r; print('chat ok:', text[:80])"
)


def stage_stack_synthesizer() -> DefaultStackSynthesizer:
    """Bootstrap roles with a literal ``aws`` partition, for stacks deployed by the pipeline.

    CDK Pipelines copies the CloudFormation execution role ARN into each deploy action's
    configuration; as ``Fn::Join`` with ``AWS::Partition`` cfn-lint rejects it (E3703). SemIf
    targets the ``aws`` partition only (see docs/deploy.md).
    """
    role = "arn:aws:iam::${AWS::AccountId}:role/cdk-${Qualifier}-%s-${AWS::AccountId}-${AWS::Region}"
    return DefaultStackSynthesizer(cloud_formation_execution_role=role % "cfn-exec-role",
                                   deploy_role_arn=role % "deploy-role")


@dataclass
class StageStacks:
    """What the pipeline needs from an environment's stacks."""

    decision: Stack
    endpoint_name_output: CfnOutput


@dataclass(frozen=True)
class PipelineStageSpec:
    """One environment as the pipeline sees it."""

    name: str
    account: str
    region: str
    needs_approval: bool
    check_role_arn: str
    model_bucket: str
    manifest_key: str
    chat_endpoint: Optional[str]
    # Adds the environment's stacks to the stage.
    build: Callable[[Stage], StageStacks]


class EnvironmentStage(Stage):
    def __init__(self, scope: Construct, id_: str, *, spec: PipelineStageSpec, **kwargs) -> None:
        super().__init__(scope, id_, env=Environment(account=spec.account, region=spec.region), **kwargs)
        self.stacks = spec.build(self)


def _assume(role_arn_var: str) -> list[str]:
    return [
        f'creds=$(aws sts assume-role --role-arn "${role_arn_var}" --role-session-name semif-pipeline '
        "--query Credentials --output json)",
        'export AWS_ACCESS_KEY_ID=$(echo "$creds" | jq -r .AccessKeyId) '
        'AWS_SECRET_ACCESS_KEY=$(echo "$creds" | jq -r .SecretAccessKey) '
        'AWS_SESSION_TOKEN=$(echo "$creds" | jq -r .SessionToken)',
    ]


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
        pull_accounts: Sequence[str],
        **kwargs,
    ) -> None:
        super().__init__(scope, id_, **kwargs)
        source = pipelines.CodePipelineSource.connection(repository, branch, connection_arn=connection_arn)
        self.images = AdapterImageRepository(self, "AdapterImages", keep_last_images=image_keep_last,
                                             pull_accounts=pull_accounts)
        self.image_steps = {
            spec.variant: self.images.build_step(spec, source=source)
            for spec in default_build_specs(cpu_base_image=dlc_base_images["cpu"],
                                            gpu_base_image=dlc_base_images["gpu"])
        }
        self.check_role = iam.Role(
            self, "CheckRole", role_name=PIPELINE_CHECK_ROLE_NAME,
            assumed_by=iam.ServicePrincipal("codebuild.amazonaws.com"),
            description="Runs the pipeline's model checks, smoke tests and bake checks (assumes each environment's "
                        "semif-<env>-pipeline-check role)")
        self.check_role.add_to_policy(iam.PolicyStatement(
            actions=["sts:AssumeRole"], resources=sorted({s.check_role_arn for s in stages})))
        self.pipeline = pipelines.CodePipeline(
            self,
            "Pipeline",
            pipeline_name="semif",
            cross_account_keys=True,
            enable_key_rotation=True,
            synth=pipelines.ShellStep(
                "Synth",
                input=source,
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
            pre: list[pipelines.Step] = []
            if spec.needs_approval:
                pre.append(pipelines.ManualApprovalStep(f"Approve-{spec.name}", comment=f"Promote to {spec.name}?"))
            if spec.name in bakes:
                pre.append(self._bake_step(spec.name, bakes[spec.name], bake_minutes))
            self.pipeline.add_stage(
                stage, pre=pre, post=[self._smoke_step(spec, stage)],
                # The shared stack (bucket, topic, check role) deploys first; the endpoints only once the
                # model they serve is in the bucket.
                stack_steps=[pipelines.StackSteps(stack=stage.stacks.decision, pre=[self._model_check_step(spec)])],
            )
        self.pipeline.build_pipeline()
        self._acknowledge_framework_findings()

    def _check_step(self, id_: str, *, role_arn: str, region: str, commands: list[str],
                    env: Optional[dict[str, str]] = None, **kwargs) -> pipelines.CodeBuildStep:
        return pipelines.CodeBuildStep(
            id_, role=self.check_role, env={"CHECK_ROLE_ARN": role_arn, "AWS_DEFAULT_REGION": region, **(env or {})},
            commands=_assume("CHECK_ROLE_ARN") + commands, **kwargs)

    def _model_check_step(self, spec: PipelineStageSpec) -> pipelines.CodeBuildStep:
        return self._check_step(
            f"CheckModel-{spec.name}", role_arn=spec.check_role_arn, region=spec.region,
            env={"MODEL_BUCKET": spec.model_bucket, "MANIFEST_KEY": spec.manifest_key},
            commands=[
                'aws s3api head-object --bucket "$MODEL_BUCKET" --key "$MANIFEST_KEY" > /dev/null '
                '|| { echo "no model at s3://$MODEL_BUCKET/$MANIFEST_KEY: upload it first (docs/deploy.md, step 3)"; '
                "exit 1; }",
                'echo "model manifest present: s3://$MODEL_BUCKET/$MANIFEST_KEY"',
            ])

    def _smoke_step(self, spec: PipelineStageSpec, stage: EnvironmentStage) -> pipelines.CodeBuildStep:
        commands = [
            'test "$(aws sagemaker describe-endpoint --endpoint-name "$ENDPOINT_NAME" '
            '--query EndpointStatus --output text)" = InService',
            f"echo '{json.dumps(SMOKE_REQUEST)}' > request.json",
            'aws sagemaker-runtime invoke-endpoint --endpoint-name "$ENDPOINT_NAME" '
            "--content-type application/json --body fileb://request.json response.json",
            f'python3 -c "{CHECK_DECISION}"',
        ]
        env = {}
        if spec.chat_endpoint:
            env["CHAT_ENDPOINT_NAME"] = spec.chat_endpoint
            commands += [
                f"echo '{json.dumps(SMOKE_CHAT_REQUEST)}' > chat-request.json",
                'aws sagemaker-runtime invoke-endpoint --endpoint-name "$CHAT_ENDPOINT_NAME" '
                "--content-type application/json --body fileb://chat-request.json chat.json",
                f'python3 -c "{CHECK_CHAT}"',
            ]
        return self._check_step(f"Smoke-{spec.name}", role_arn=spec.check_role_arn, region=spec.region, env=env,
                                 commands=commands,
                                 env_from_cfn_outputs={"ENDPOINT_NAME": stage.stacks.endpoint_name_output})

    def _bake_step(self, target: str, baked: PipelineStageSpec, minutes: int) -> pipelines.CodeBuildStep:
        """Before ``target`` deploys: ``baked`` (the GPU staging stage, running the same digest) must have served
        ``minutes`` with none of its alarms in ALARM."""
        return self._check_step(
            f"Bake-{baked.name}-before-{target}", role_arn=baked.check_role_arn, region=baked.region,
            env={"BAKE_SECONDS": str(minutes * 60), "ALARM_PREFIX": f"semif-{baked.name}-"},
            timeout=Duration.minutes(minutes + 15),
            commands=[
                'echo "baking ${ALARM_PREFIX}* for ${BAKE_SECONDS}s"',
                'end=$(( $(date +%s) + BAKE_SECONDS )); while :; do '
                'firing=$(aws cloudwatch describe-alarms --alarm-name-prefix "$ALARM_PREFIX" --state-value ALARM '
                "--query 'MetricAlarms[].AlarmName' --output text); "
                'if [ -n "$firing" ]; then echo "alarms firing: $firing"; exit 1; fi; '
                '[ "$(date +%s)" -ge "$end" ] && break; sleep 60; done',
                'echo "bake passed: no alarm fired"',
            ])

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
            acknowledge(self.check_role, f"AwsSolutions-IAM5[Action::{action}]",
                        f"CDK Pipelines grants the check steps' role {action} on its artifact bucket and key only.")
        checkov_skip(bucket, "CKV_AWS_18", "CDK Pipelines' own artifact bucket holds only transient build artifacts, "
                     "KMS-encrypted; access logs would need a second bucket with no consumer.")
        checkov_skip(bucket, "CKV_AWS_21", "CDK Pipelines writes every artifact under a new key per execution; "
                     "versions would only keep garbage.")
        checkov_skip(scope.node.find_child("Assets").node.find_child("FileRole").node.find_child("DefaultPolicy"),
                     "CKV_AWS_111", "CDK Pipelines' asset-publishing role: its write actions target the bootstrap "
                     "asset buckets and the per-asset CodeBuild projects, which CDK names at synth.")
        acknowledge_wildcard_resource(scope, f"{bucket.bucket_arn}/*",
                                      "Pipeline actions read and write artifacts under their own bucket.")
        acknowledge_wildcard_resource(self.check_role, f"{bucket.bucket_arn}/*",
                                      "The check steps read their input artifacts from the pipeline's bucket.")
        for project in (c for c in self.node.find_all() if isinstance(c, codebuild.CfnProject) and Stack.of(c) is self):
            name = project.ref
            for holder in (scope, self.check_role):
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
        acknowledge_wildcard_resource(
            scope.node.find_child("Assets").node.find_child("FileRole"), "*",
            "CDK Pipelines' asset-publishing role starts the per-asset CodeBuild projects it creates at synth.")
        acknowledge_wildcard_resource(
            scope, "*", "The image steps call ecr:GetAuthorizationToken (docker login), which supports no "
            "resource-level permissions.")
