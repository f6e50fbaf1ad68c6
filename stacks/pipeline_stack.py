"""CDK Pipelines: synth (tests + `cdk synth`), one stage per environment, approval, smoke test.

The pipeline knows environments only as the stage builders ``app.py`` hands it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

from aws_cdk import CfnOutput, DefaultStackSynthesizer, Environment, Stack, Stage, aws_codebuild as codebuild, aws_iam as iam, pipelines
from constructs import Construct

from constructs_lib.nag import acknowledge, acknowledge_wildcard_resource

# A request every SemIf build must answer 200 to; the smoke step prints the answer.
SMOKE_REQUEST = {"decision": {
    "id": "smoke",
    "state": "Customer writes: I was charged twice for my subscription this month.",
    "question": "Which team should handle this ticket?",
    "options": [{"id": "billing"}, {"id": "technical"}, {"id": "sales"}],
}}


def stage_stack_synthesizer() -> DefaultStackSynthesizer:
    """Bootstrap roles with a literal ``aws`` partition, for stacks deployed by the pipeline.

    CDK Pipelines copies the CloudFormation execution role ARN into each deploy action's
    configuration; as ``Fn::Join`` with ``AWS::Partition`` cfn-lint rejects it (E3703). SemIf
    targets the ``aws`` partition only (see docs/deploy.md).
    """
    role = "arn:aws:iam::${AWS::AccountId}:role/cdk-${Qualifier}-%s-${AWS::AccountId}-${AWS::Region}"
    return DefaultStackSynthesizer(cloud_formation_execution_role=role % "cfn-exec-role",
                                   deploy_role_arn=role % "deploy-role")


@dataclass(frozen=True)
class PipelineStageSpec:
    """One environment as the pipeline sees it."""

    name: str
    account: str
    region: str
    needs_approval: bool
    smoke_test_role_name: str
    # Adds the environment's stacks to the stage; returns the output carrying the endpoint name.
    build: Callable[[Stage], CfnOutput]


class EnvironmentStage(Stage):
    def __init__(self, scope: Construct, id_: str, *, spec: PipelineStageSpec, **kwargs) -> None:
        super().__init__(scope, id_, env=Environment(account=spec.account, region=spec.region), **kwargs)
        self.endpoint_name_output = spec.build(self)


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
        **kwargs,
    ) -> None:
        super().__init__(scope, id_, **kwargs)
        source = pipelines.CodePipelineSource.connection(repository, branch, connection_arn=connection_arn)
        self.pipeline = pipelines.CodePipeline(
            self,
            "Pipeline",
            pipeline_name="semif",
            cross_account_keys=True,
            enable_key_rotation=True,
            synth=pipelines.ShellStep(
                "Synth",
                input=source,
                install_commands=[
                    "npm ci",
                    "python3 -m venv .venv",
                    # The CDK app and its tests only: the adapter (llama.cpp) is not needed to synthesize.
                    "grep -E '^(pytest|moto|cfn-lint|hypothesis)' requirements-dev.txt > cdk-test-requirements.txt",
                    ".venv/bin/pip install -r requirements.txt -r cdk-test-requirements.txt",
                ],
                commands=[
                    ".venv/bin/python -m pytest tests/cdk tests/lambda -q",
                    "npx cdk synth -c pipeline=true",
                ],
                primary_output_directory="cdk.out",
            ),
        )
        self.stages: dict[str, EnvironmentStage] = {}
        for spec in stages:
            stage = EnvironmentStage(self, spec.name, spec=spec)
            self.stages[spec.name] = stage
            pre = [pipelines.ManualApprovalStep(f"Approve-{spec.name}",
                                                comment=f"Promote to {spec.name}?")] if spec.needs_approval else []
            self.pipeline.add_stage(stage, pre=pre, post=[self._smoke_step(spec, stage)])
        self.pipeline.build_pipeline()
        self._acknowledge_framework_findings()

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
        acknowledge_wildcard_resource(scope, f"{bucket.bucket_arn}/*",
                                      "Pipeline actions read and write artifacts under their own bucket.")
        for project in (c for c in self.node.find_all() if isinstance(c, codebuild.CfnProject) and Stack.of(c) is self):
            name = project.ref
            acknowledge_wildcard_resource(
                scope, f"arn:{self.partition}:logs:{self.region}:{self.account}:log-group:/aws/codebuild/{name}:*",
                "A CodeBuild project of the pipeline writes streams in its own log group.")
            acknowledge_wildcard_resource(
                scope, f"arn:{self.partition}:codebuild:{self.region}:{self.account}:report-group/{name}-*",
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

    def _smoke_step(self, spec: PipelineStageSpec, stage: EnvironmentStage) -> pipelines.CodeBuildStep:
        role_arn = f"arn:{self.partition}:iam::{spec.account}:role/{spec.smoke_test_role_name}"
        body = json.dumps(SMOKE_REQUEST)
        return pipelines.CodeBuildStep(
            f"Smoke-{spec.name}",
            env_from_cfn_outputs={"ENDPOINT_NAME": stage.endpoint_name_output},
            env={"SMOKE_ROLE_ARN": role_arn, "AWS_DEFAULT_REGION": spec.region},
            role_policy_statements=[iam.PolicyStatement(actions=["sts:AssumeRole"], resources=[role_arn])],
            commands=[
                'creds=$(aws sts assume-role --role-arn "$SMOKE_ROLE_ARN" --role-session-name semif-smoke '
                "--query Credentials --output json)",
                'export AWS_ACCESS_KEY_ID=$(echo "$creds" | jq -r .AccessKeyId) '
                'AWS_SECRET_ACCESS_KEY=$(echo "$creds" | jq -r .SecretAccessKey) '
                'AWS_SESSION_TOKEN=$(echo "$creds" | jq -r .SessionToken)',
                'test "$(aws sagemaker describe-endpoint --endpoint-name "$ENDPOINT_NAME" '
                '--query EndpointStatus --output text)" = InService',
                f"echo '{body}' > request.json",
                'aws sagemaker-runtime invoke-endpoint --endpoint-name "$ENDPOINT_NAME" '
                "--content-type application/json --body fileb://request.json response.json",
                "cat response.json",
            ],
        )
