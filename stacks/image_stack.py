"""One environment's adapter image, when the environment is deployed from its own account (``make deploy``).

The repository and the CodeBuild project that fills it; no build runs during the stack operation. ``deploy/``
deploys this stack, starts the build with the resolved DLC digest and waits, then deploys the decision stack
pinned to the digest the build pushed (docs/explanation/image.md). The pipeline keeps its central repository
(``stacks.pipeline_stack``) and never deploys this stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from aws_cdk import CfnOutput, RemovalPolicy, Stack, aws_logs as logs
from constructs import Construct

from constructs_lib.image_build import AdapterImageRepository, ImageBuildSpec
from constructs_lib.nag import acknowledge, acknowledge_wildcard_resource

CONTAINER_DIR = Path(__file__).resolve().parents[1] / "container"
# The names deploy/ reads back from DescribeStacks.
OUTPUT_REPOSITORY_URI = "ImageRepositoryUri"
OUTPUT_SOURCE_HASH = "ImageSourceHash"


def output_project(variant: str) -> str:
    """The output naming the project that builds ``variant`` (``ImageProjectCpu``, ``ImageProjectGpu``)."""
    return f"ImageProject{variant.capitalize()}"


class ImageStack(Stack):
    def __init__(self, scope: Construct, id_: str, *, env_name: str, builds: Sequence[ImageBuildSpec],
                 keep_last_images: int, removal_policy: RemovalPolicy,
                 log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH,
                 source_dir: Path = CONTAINER_DIR, **kwargs) -> None:
        """``builds``: one project per variant the environment runs, the endpoint's and Batch Transform's (CPU)."""
        super().__init__(scope, id_, **kwargs)
        self.images = AdapterImageRepository(self, "AdapterImages", keep_last_images=keep_last_images,
                                             environments=[env_name], env_name=env_name, removal_policy=removal_policy)
        self.projects = {build.variant: self.images.build_project(build, source_dir=source_dir,
                                                                  log_retention=log_retention,
                                                                  removal_policy=removal_policy)
                         for build in builds}
        self.repository = self.images.repository
        for variant, project in self.projects.items():
            CfnOutput(self, output_project(variant), value=project.project_name,
                      description=f"CodeBuild project that builds the {variant} adapter image (deploy/ starts it)")
        CfnOutput(self, OUTPUT_REPOSITORY_URI, value=self.repository.repository_uri,
                  description="This environment's adapter image repository")
        # The tag of an image names its inputs: this hash of container/ with the base image and the variant.
        CfnOutput(self, OUTPUT_SOURCE_HASH, value=self.images.source.asset_hash,
                  description="Hash of the container/ sources the projects build")
        for project in self.projects.values():
            self._acknowledge(project)

    def _acknowledge(self, project) -> None:
        acknowledge(project, "AwsSolutions-CB3", "docker build of the adapter image needs the Docker daemon: "
                    "privileged mode runs the project's own buildspec on repository code only, never a user's input.")
        acknowledge_wildcard_resource(project.role, "*", "build-image.sh calls ecr:GetAuthorizationToken "
                                      "(docker login), which supports no resource-level permissions.")
        for action, reason in (
            ("s3:GetBucket*", "CodeBuild reads its source, the container/ asset, from the CDK bootstrap bucket "
                              "(Bucket.grant_read, scoped to that bucket)."),
            ("s3:GetObject*", "CodeBuild reads its source, the container/ asset, from the CDK bootstrap bucket."),
            ("s3:List*", "CodeBuild reads its source, the container/ asset, from the CDK bootstrap bucket."),
            ("kms:GenerateDataKey*", "The project encrypts its logs and artifacts with the repository key only."),
            ("kms:ReEncrypt*", "The project encrypts its logs and artifacts with the repository key only."),
        ):
            acknowledge(project.role, f"AwsSolutions-IAM5[Action::{action}]", reason)
        name = project.project_name
        acknowledge_wildcard_resource(
            project.role,
            f"arn:{self.partition}:logs:{self.region}:{self.account}:log-group:/aws/codebuild/{name}:*",
            "The project writes streams in its own log group.")
        acknowledge_wildcard_resource(
            project.role, f"arn:{self.partition}:codebuild:{self.region}:{self.account}:report-group/{name}-*",
            "The project may publish its own test reports (CodeBuild's default grant).")
