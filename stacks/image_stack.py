"""One environment's adapter image, when the environment is deployed from its own account (``make deploy``).

The repository and the CodeBuild project that fills it; no build runs during the stack operation. ``deploy/``
deploys this stack, starts the build with the resolved DLC digest and waits, then deploys the decision stack
pinned to the digest the build pushed (docs/explanation/image.md). The pipeline keeps its central repository
(``stacks.pipeline_stack``) and never deploys this stack.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from constructs import Construct

from constructs_lib.image_build import AdapterImageRepository, ImageBuildSpec
from constructs_lib.nag import acknowledge, acknowledge_wildcard_resource

CONTAINER_DIR = Path(__file__).resolve().parents[1] / "container"
# The names deploy/ reads back from DescribeStacks.
OUTPUT_PROJECT = "ImageProjectName"
OUTPUT_REPOSITORY_URI = "ImageRepositoryUri"
OUTPUT_SOURCE_HASH = "ImageSourceHash"
OUTPUT_VARIANT = "ImageVariant"


class ImageStack(Stack):
    def __init__(self, scope: Construct, id_: str, *, env_name: str, build: ImageBuildSpec, keep_last_images: int,
                 removal_policy: RemovalPolicy, source_dir: Path = CONTAINER_DIR, **kwargs) -> None:
        super().__init__(scope, id_, **kwargs)
        self.images = AdapterImageRepository(self, "AdapterImages", keep_last_images=keep_last_images,
                                             environments=[env_name], env_name=env_name, removal_policy=removal_policy)
        self.project = self.images.build_project(build, source_dir=source_dir)
        self.repository = self.images.repository
        CfnOutput(self, OUTPUT_PROJECT, value=self.project.project_name,
                  description="CodeBuild project that builds the adapter image (deploy/ starts it)")
        CfnOutput(self, OUTPUT_REPOSITORY_URI, value=self.repository.repository_uri,
                  description="This environment's adapter image repository")
        # The tag of an image names its inputs: this hash of container/ with the base image and the variant.
        CfnOutput(self, OUTPUT_SOURCE_HASH, value=self.images.source.asset_hash,
                  description="Hash of the container/ sources the project builds")
        CfnOutput(self, OUTPUT_VARIANT, value=build.variant, description="Image variant (cpu or gpu)")

        acknowledge(self.project, "AwsSolutions-CB3", "docker build of the adapter image needs the Docker daemon: "
                    "privileged mode runs the project's own buildspec on repository code only, never a user's input.")
        acknowledge_wildcard_resource(self.project.role, "*", "build-image.sh calls ecr:GetAuthorizationToken "
                                      "(docker login), which supports no resource-level permissions.")
        for action, reason in (
            ("s3:GetBucket*", "CodeBuild reads its source, the container/ asset, from the CDK bootstrap bucket "
                              "(Bucket.grant_read, scoped to that bucket)."),
            ("s3:GetObject*", "CodeBuild reads its source, the container/ asset, from the CDK bootstrap bucket."),
            ("s3:List*", "CodeBuild reads its source, the container/ asset, from the CDK bootstrap bucket."),
            ("kms:GenerateDataKey*", "The project encrypts its logs and artifacts with the repository key only."),
            ("kms:ReEncrypt*", "The project encrypts its logs and artifacts with the repository key only."),
        ):
            acknowledge(self.project.role, f"AwsSolutions-IAM5[Action::{action}]", reason)
        name = self.project.project_name
        acknowledge_wildcard_resource(
            self.project.role,
            f"arn:{self.partition}:logs:{self.region}:{self.account}:log-group:/aws/codebuild/{name}:*",
            "The project writes streams in its own log group.")
        acknowledge_wildcard_resource(
            self.project.role, f"arn:{self.partition}:codebuild:{self.region}:{self.account}:report-group/{name}-*",
            "The project may publish its own test reports (CodeBuild's default grant).")
