"""Build the adapter image from the llama.cpp DLC with CodeBuild, during `cdk deploy`.

The build context is ``container/`` shipped as an S3 asset. Its tag is a hash of every build
input (the asset hash covers Dockerfile, buildspec and adapter sources; the base image URI is
added), so the build runs again only when one of them changes. The custom resource returns the
pushed image's digest; the endpoint pins ``repository@digest``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from aws_cdk import (
    CustomResource,
    IgnoreMode,
    Duration,
    RemovalPolicy,
    Stack,
    aws_codebuild as codebuild,
    aws_ecr as ecr,
    aws_iam as iam,
    aws_kms as kms,
    aws_lambda as lambda_,
    aws_logs as logs,
    aws_s3_assets as s3_assets,
    aws_stepfunctions as sfn,
    custom_resources as cr,
)
from constructs import Construct

from constructs_lib.image_sources import BuiltImage, DLC_REPOSITORY, dlc_registry_account
from constructs_lib.nag import acknowledge, acknowledge_wildcard_resource

HANDLER_DIR = Path(__file__).resolve().parent.parent / "lambda" / "image_build"

# Used only when the context has no .dockerignore: tests, caches and local artefacts are not
# build inputs and must not trigger a rebuild.
CONTEXT_EXCLUDES = [
    "tests", "tests/**", "**/__pycache__", "**/*.pyc", ".pytest_cache", "**/.pytest_cache",
    ".hypothesis", "**/*.egg-info", ".venv", "build", "dist", "reports", "**/*.gguf", ".make",
]


def build_context_excludes(context_dir: Path) -> tuple[list[str], IgnoreMode]:
    """What the asset leaves out: the Docker context's own exclusions, keeping Dockerfile and buildspec.

    So the asset hash (and with it the image tag) covers exactly what `docker build` sees, plus the
    two files that say how to build it.
    """
    dockerignore = context_dir / ".dockerignore"
    if not dockerignore.is_file():
        return list(CONTEXT_EXCLUDES), IgnoreMode.GLOB
    patterns = [line.strip() for line in dockerignore.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    return patterns + ["!Dockerfile", "!buildspec.yml", "!.dockerignore"], IgnoreMode.DOCKER


def image_input_hash(asset_hash: str, base_image: str) -> str:
    """The image tag: changes exactly when the build context or the base image changes."""
    return hashlib.sha256(f"{asset_hash}\n{base_image}".encode()).hexdigest()[:40]


class ImageBuild(Construct):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        context_dir: Path | str,
        base_image: str,
        keep_last_images: int,
        log_retention: logs.RetentionDays,
        build_timeout: Duration = Duration.minutes(60),
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN,
    ) -> None:
        super().__init__(scope, id_)
        stack = Stack.of(self)
        self.base_image = base_image
        self.key = kms.Key(self, "Key", description="SemIf adapter image repository and build encryption",
                           enable_key_rotation=True, removal_policy=removal_policy)
        self.repository = ecr.Repository(
            self,
            "Repository",
            image_scan_on_push=True,
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            encryption=ecr.RepositoryEncryption.KMS,
            encryption_key=self.key,
            lifecycle_rules=[ecr.LifecycleRule(description=f"keep the last {keep_last_images} images",
                                               max_image_count=keep_last_images)],
            removal_policy=removal_policy,
        )
        excludes, ignore_mode = build_context_excludes(Path(context_dir))
        self.context_asset = s3_assets.Asset(self, "Context", path=str(context_dir), exclude=excludes,
                                             ignore_mode=ignore_mode)
        self.image_tag = image_input_hash(self.context_asset.asset_hash, base_image)

        self.build_log_group = logs.LogGroup(self, "BuildLogs", retention=log_retention, removal_policy=removal_policy)
        self.project_role = iam.Role(self, "ProjectRole", assumed_by=iam.ServicePrincipal("codebuild.amazonaws.com"),
                                     description="Builds and pushes the SemIf adapter image")
        self.project = codebuild.Project(
            self,
            "Project",
            description="Builds the SemIf adapter image on the llama.cpp DLC and pushes it to ECR",
            source=codebuild.Source.s3(bucket=self.context_asset.bucket, path=self.context_asset.s3_object_key),
            build_spec=codebuild.BuildSpec.from_source_filename("buildspec.yml"),
            environment=codebuild.BuildEnvironment(
                build_image=codebuild.LinuxBuildImage.STANDARD_7_0,
                compute_type=codebuild.ComputeType.MEDIUM,
                privileged=True,  # docker build needs the Docker daemon
                environment_variables={
                    "BASE_IMAGE": codebuild.BuildEnvironmentVariable(value=base_image),
                    "REPOSITORY_URI": codebuild.BuildEnvironmentVariable(value=self.repository.repository_uri),
                    "IMAGE_TAG": codebuild.BuildEnvironmentVariable(value=self.image_tag),
                },
            ),
            encryption_key=self.key,
            timeout=build_timeout,
            logging=codebuild.LoggingOptions(cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=self.build_log_group)),
            # CodeBuild's automatic grants use wildcards (s3:GetObject*, report groups, its default
            # log group); the statements below name each resource instead.
            role=self.project_role.without_policy_updates(),
        )
        self._grant_project(stack)

        self.provider = self._provider(log_retention)
        self.build = CustomResource(
            self,
            "Build",
            service_token=self.provider.service_token,
            resource_type="Custom::SemIfImageBuild",
            properties={
                "ProjectName": self.project.project_name,
                "RepositoryName": self.repository.repository_name,
                "RepositoryUri": self.repository.repository_uri,
                "BaseImage": base_image,
                "ImageTag": self.image_tag,
                "SourceLocation": f"{self.context_asset.s3_bucket_name}/{self.context_asset.s3_object_key}",
            },
        )
        self.image_digest = self.build.get_att_string("ImageDigest")
        self.image = BuiltImage(repository=self.repository, digest=self.image_digest)

    def _grant_project(self, stack: Stack) -> None:
        role = self.project_role
        asset = self.context_asset
        role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject", "s3:GetObjectVersion"],
                                               resources=[asset.bucket.arn_for_objects(asset.s3_object_key)]))
        role.add_to_policy(iam.PolicyStatement(actions=["s3:GetBucketAcl", "s3:GetBucketLocation"],
                                               resources=[asset.bucket.bucket_arn]))
        role.add_to_policy(iam.PolicyStatement(actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                                               resources=[self.build_log_group.log_group_arn]))
        role.add_to_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
            resources=[self.key.key_arn]))
        role.add_to_policy(iam.PolicyStatement(
            actions=["ecr:BatchCheckLayerAvailability", "ecr:GetDownloadUrlForLayer", "ecr:BatchGetImage",
                     "ecr:InitiateLayerUpload", "ecr:UploadLayerPart", "ecr:CompleteLayerUpload", "ecr:PutImage",
                     "ecr:DescribeImages"],
            resources=[self.repository.repository_arn]))
        dlc_account = dlc_registry_account(stack.region)
        role.add_to_policy(iam.PolicyStatement(
            actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
            resources=[f"arn:{stack.partition}:ecr:{stack.region}:{dlc_account}:repository/{DLC_REPOSITORY}"]))
        role.add_to_policy(iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]))
        acknowledge_wildcard_resource(role, "*", "ecr:GetAuthorizationToken (docker login to our repository and "
                                                 "the DLC registry) supports no resource-level permissions.")

    def _provider(self, log_retention: logs.RetentionDays) -> cr.Provider:
        role = iam.Role(self, "HandlerRole", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                        description="Starts and polls the SemIf image build")
        role.add_to_policy(iam.PolicyStatement(actions=["codebuild:StartBuild", "codebuild:BatchGetBuilds"],
                                               resources=[self.project.project_arn]))
        role.add_to_policy(iam.PolicyStatement(actions=["ecr:DescribeImages"],
                                               resources=[self.repository.repository_arn]))
        handler_logs = logs.LogGroup(self, "HandlerLogs", retention=log_retention,
                                     removal_policy=RemovalPolicy.DESTROY)
        handler_logs.grant_write(role)
        common = dict(
            runtime=lambda_.Runtime.PYTHON_3_14,
            code=lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"]),
            role=role,
            log_group=handler_logs,
            timeout=Duration.minutes(1),
            memory_size=256,
        )
        on_event = lambda_.Function(self, "OnEvent", handler="handler.on_event",
                                    description="Starts the SemIf image build", **common)
        is_complete = lambda_.Function(self, "IsComplete", handler="handler.is_complete",
                                       description="Polls the SemIf image build and reads the digest", **common)
        provider_logs = logs.LogGroup(self, "ProviderLogs", retention=log_retention,
                                      removal_policy=RemovalPolicy.DESTROY)
        # Own roles instead of the framework's AWSLambdaBasicExecutionRole: logs to one group only.
        framework_roles = []
        for name in ("FrameworkOnEventRole", "FrameworkCompleteRole"):
            framework_role = iam.Role(self, name, assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                                      description="CDK Provider framework function of the SemIf image build")
            provider_logs.grant_write(framework_role)
            framework_roles.append(framework_role)
        provider = cr.Provider(
            self,
            "Provider",
            on_event_handler=on_event,
            is_complete_handler=is_complete,
            query_interval=Duration.seconds(30),
            total_timeout=Duration.hours(2),
            log_group=provider_logs,
            framework_on_event_role=framework_roles[0],
            framework_complete_and_timeout_role=framework_roles[1],
            disable_waiter_state_machine_logging=False,
            waiter_state_machine_log_options=cr.LogOptions(
                destination=logs.LogGroup(self, "WaiterLogs", retention=log_retention,
                                          removal_policy=RemovalPolicy.DESTROY),
                level=sfn.LogLevel.ALL,
            ),
        )
        # The framework may invoke any version of the two handlers: CDK grants '<arn>:*' for that.
        for fn in (on_event, is_complete):
            for holder in framework_roles:
                acknowledge_wildcard_resource(holder, f"{fn.function_arn}:*",
                                              "CDK Provider framework invokes its handler's versions ('<arn>:*').")
        waiter = provider.node.find_child("waiter-state-machine")
        acknowledge_wildcard_resource(waiter, "*", "Step Functions log delivery (logs:CreateLogDelivery and "
                                      "friends, added by CDK) supports no resource-level permissions.")
        for child in ("framework-isComplete", "framework-onTimeout"):
            framework_fn = provider.node.find_child(child)
            acknowledge_wildcard_resource(waiter, f"{framework_fn.function_arn}:*",
                                          "CDK Provider waiter state machine invokes the framework function's "
                                          "versions ('<arn>:*').")
        acknowledge(waiter, "AwsSolutions-SF2", "CDK Provider waiter state machine only sequences is_complete "
                    "polls of one CodeBuild build; X-Ray tracing is not configurable and would add nothing.")
        return provider
