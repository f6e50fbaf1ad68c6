"""The adapter image: built by CodeBuild from the llama.cpp DLC, before the stack that runs it, and pinned by digest.

A CloudFormation custom resource waits at most one hour, and the CUDA build of llama.cpp can take
longer; so the image is never built during a stack operation (docs/explanation/image.md). Two callers
run the same ``container/build-image.sh`` in a CodeBuild project of this module:

- the pipeline: a step per variant its stages use, pushing ``<central repository>:<input hash>`` in the
  pipeline account; every environment of the variant deploys exactly that digest;
- one environment deployed from one account (``make deploy``): ``AdapterImageRepository.build_project``
  in the environment's own account, started and waited for by ``deploy/`` before the stacks that run it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from aws_cdk import (
    Duration,
    RemovalPolicy,
    Stack,
    aws_codebuild as codebuild,
    aws_ecr as ecr,
    aws_iam as iam,
    aws_kms as kms,
    aws_logs as logs,
    aws_s3_assets as s3_assets,
    pipelines,
)
from constructs import Construct

from constructs_lib.image_sources import DLC_REPOSITORY, dlc_registry_account
from constructs_lib.log_groups import encrypted_log_group
from constructs_lib.nag import checkov_skip

IMAGE_REPOSITORY_NAME = "semif/adapter"
CACHE_REPOSITORY_NAME = "semif/adapter-build-cache"
# build-image.sh pushes each image as candidate-<tag> and checks its manifest type before it tags <tag>: the one tag
# pattern the repository leaves mutable.
CANDIDATE_TAG_PATTERN = "candidate-*"
IMAGE_OUTPUT_DIR = "image-out"
IMAGE_OUTPUT_FILE = "image.json"
# CodeBuild allows up to 2160 minutes (36 h); a cold CUDA build of llama-cpp-python for four architectures takes well under 2 h on
# 72 vCPUs. The layer cache makes an adapter-only change a matter of minutes.
BUILD_TIMEOUT = Duration.hours(3)


@dataclass(frozen=True)
class ImageBuildSpec:
    """One variant's build: where the base comes from and what machine compiles it."""

    variant: str  # "cpu" | "gpu"
    base_image: str  # the DLC, pinned by digest
    compute_type: codebuild.ComputeType
    # Memory one compiler job needs: nvcc compiling ggml-cuda for several architectures peaks near 4 GB per job.
    gb_per_job: int

    @property
    def llama_cpp_variant(self) -> str:
        return "cuda" if self.variant == "gpu" else "cpu"


def default_build_specs(*, cpu_base_image: str, gpu_base_image: str) -> list[ImageBuildSpec]:
    # cpu: 8 vCPUs / 15 GB compile llama.cpp for one CPU target in minutes.
    # gpu: 72 vCPUs / 145 GB (BUILD_GENERAL1_2XLARGE): RAM for about 36 nvcc jobs at 4 GB each.
    return [
        ImageBuildSpec("cpu", cpu_base_image, codebuild.ComputeType.LARGE, gb_per_job=2),
        ImageBuildSpec("gpu", gpu_base_image, codebuild.ComputeType.X2_LARGE, gb_per_job=4),
    ]


def deployed_tag_prefix(env_name: str) -> str:
    """Tags ``<prefix><hex digest>`` mark the images an environment was deployed with (the pipeline's pre-deploy
    step adds them); the repository's lifecycle keeps the last of those per environment."""
    return f"deployed-{env_name}-"


def image_project_name(variant: str, env_name: Optional[str] = None) -> str:
    """The pipeline's project per variant, or one environment's own (``env_name``)."""
    return f"semif-adapter-image-{variant}" if env_name is None else f"semif-{env_name}-adapter-image-{variant}"


def image_variants(variant: str) -> list[str]:
    """The images an environment of ``variant`` runs: its endpoint's, and CPU, which its Batch Transform runs."""
    return sorted({variant, "cpu"})


def image_repository_name(env_name: Optional[str] = None) -> str:
    """The pipeline's central repository, or one environment's own (``env_name``): several environments of one
    account each keep their own."""
    return IMAGE_REPOSITORY_NAME if env_name is None else f"semif/{env_name}/adapter"


def _role_account(role_arn: str) -> str:
    parts = role_arn.split(":")
    if len(parts) != 6 or parts[2] != "iam" or not parts[5].startswith("role/"):
        raise ValueError(f"pull_roles: {role_arn!r} is not an IAM role ARN")
    return parts[4]


def local_cache_supported(compute_type: codebuild.ComputeType) -> bool:
    """CodeBuild's local caching is not available on the 2XLARGE compute type
    (https://docs.aws.amazon.com/codebuild/latest/userguide/caching-local.html); there the registry cache
    (CACHE_REPOSITORY_URI) alone carries layers between builds."""
    return compute_type != codebuild.ComputeType.X2_LARGE


class AdapterImageRepository(Construct):
    """An image repository and the build cache beside it: the pipeline's central one every environment pulls from
    (``env_name=None``), or one environment's own."""

    def __init__(self, scope: Construct, id_: str, *, keep_last_images: int, pull_roles: Sequence[str] = (),
                 environments: Sequence[str] = (), env_name: Optional[str] = None,
                 removal_policy: RemovalPolicy = RemovalPolicy.RETAIN) -> None:
        """``keep_last_images``: per environment in ``environments`` (in promotion order, dev first), the images last
        deployed there; and of the images no environment was deployed with, the newest. An image an environment may
        still run (for a replacement instance, a scale-out, Batch Transform or a rollback) is never expired while it
        is among the last ``keep_last_images`` that environment was deployed with.

        ``pull_roles``: the ARNs of the roles of other accounts that pull its images (each environment's endpoint
        execution role and Batch Transform role, by their fixed names).

        ``removal_policy``: the pipeline's repository is retained (prod may run any of its digests); one
        environment's follows its tier, and a repository created by a failed first deploy never blocks the retry
        (RETAIN_ON_UPDATE_OR_DELETE, or DESTROY with the images removed)."""
        super().__init__(scope, id_)
        self.env_name = env_name
        self.source: Optional[s3_assets.Asset] = None  # container/, once build_project made it
        self.key = kms.Key(self, "Key", description="SemIf adapter image repositories", enable_key_rotation=True,
                           removal_policy=removal_policy)
        self.repository = ecr.Repository(
            self, "Repository", repository_name=image_repository_name(env_name), image_scan_on_push=True,
            # A tag is the hash of the build inputs: the same tag is always the same image. Only the candidate tag a
            # build pushes before checking the manifest type can move
            # (https://docs.aws.amazon.com/AmazonECR/latest/userguide/image-tag-mutability.html).
            image_tag_mutability=ecr.TagMutability.IMMUTABLE_WITH_EXCLUSION,
            image_tag_mutability_exclusion_filters=[ecr.ImageTagMutabilityExclusionFilter.wildcard(CANDIDATE_TAG_PATTERN)],
            encryption=ecr.RepositoryEncryption.KMS, encryption_key=self.key,
            # ECR expires an image by one rule at most: the highest-priority (lowest-numbered) rule whose tags select
            # it, so the closing 'any' rule cannot reach an image tagged as deployed. An image deployed to several
            # environments is governed by the last of them in promotion order (prod first): each of its deploys
            # followed one to every earlier environment, so once it drops out of that environment's last
            # ``keep_last_images`` it has dropped out of theirs too.
            lifecycle_rules=[
                *(ecr.LifecycleRule(rule_priority=priority,
                                    description=f"keep the last {keep_last_images} images deployed to {env}",
                                    tag_prefix_list=[deployed_tag_prefix(env)], max_image_count=keep_last_images)
                  for priority, env in enumerate(reversed(list(environments)), 1)),
                ecr.LifecycleRule(rule_priority=len(environments) + 1,
                                  description=f"keep the last {keep_last_images} images built",
                                  tag_status=ecr.TagStatus.ANY, max_image_count=keep_last_images),
            ],
            # Prod may still run any of these digests: deleting the pipeline stack must not take them.
            removal_policy=removal_policy, empty_on_delete=removal_policy == RemovalPolicy.DESTROY,
        )
        # BuildKit's registry cache overwrites one tag per variant, so it lives apart from the immutable images.
        self.cache_repository = ecr.Repository(
            self, "CacheRepository", repository_name=f"{image_repository_name(env_name)}-build-cache"
            if env_name else CACHE_REPOSITORY_NAME, image_scan_on_push=True,
            image_tag_mutability=ecr.TagMutability.MUTABLE,
            encryption=ecr.RepositoryEncryption.KMS, encryption_key=self.key,
            lifecycle_rules=[ecr.LifecycleRule(description="expire untagged cache layers after 14 days",
                                               tag_status=ecr.TagStatus.UNTAGGED, max_image_age=Duration.days(14))],
            removal_policy=RemovalPolicy.DESTROY, empty_on_delete=env_name is not None,
        )
        checkov_skip(self.repository, "CKV_AWS_51", "Every tag is immutable but candidate-*, the tag a build pushes to "
                     "check the manifest type before it makes the immutable tag; nothing deploys a candidate tag.")
        checkov_skip(self.cache_repository, "CKV_AWS_51", "BuildKit's registry cache rewrites one tag per variant "
                     "on every build; it holds cache layers, never an image any endpoint runs.")
        # SageMaker in each environment account pulls with the Model's execution role; that role's policy names this
        # repository, and this policy lets in exactly the named roles: their accounts as principals, and
        # aws:PrincipalArn, which needs no role to exist when the policy is written, for the roles
        # (https://docs.aws.amazon.com/AmazonECR/latest/userguide/repository-policy-examples.html,
        # https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-keys.html#condition-keys-principalarn).
        roles = sorted({arn for arn in pull_roles if _role_account(arn) != Stack.of(self).account})
        if roles:
            self.repository.add_to_resource_policy(iam.PolicyStatement(
                sid="EnvironmentAccountsPull",
                principals=[iam.AccountPrincipal(a) for a in sorted({_role_account(arn) for arn in roles})],
                actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
                conditions={"ArnEquals": {"aws:PrincipalArn": roles}}))

    def build_step(self, spec: ImageBuildSpec, *, source: pipelines.IFileSetProducer) -> pipelines.CodeBuildStep:
        """A pipeline step that builds ``spec``'s image from ``container/`` (or finds it built) and outputs
        ``image-out/image.json`` with its digest."""
        return pipelines.CodeBuildStep(
            f"Image-{spec.variant}",
            input=source,
            project_name=image_project_name(spec.variant),
            build_environment=codebuild.BuildEnvironment(
                build_image=codebuild.LinuxBuildImage.STANDARD_8_0, compute_type=spec.compute_type,
                privileged=True),  # docker build needs the Docker daemon
            # Same-host layer reuse on top of the registry cache: build-image.sh builds on the Docker daemon's own
            # BuildKit, whose layers this cache keeps.
            cache=codebuild.Cache.local(codebuild.LocalCacheMode.DOCKER_LAYER)
            if local_cache_supported(spec.compute_type) else None,
            timeout=BUILD_TIMEOUT,
            env={
                "BASE_IMAGE": spec.base_image,
                "REPOSITORY_URI": self.repository.repository_uri,
                "CACHE_REPOSITORY_URI": self.cache_repository.repository_uri,
                "LLAMA_CPP_VARIANT": spec.llama_cpp_variant,
                "GB_PER_BUILD_JOB": str(spec.gb_per_job),
                "IMAGE_OUTPUT": f"{IMAGE_OUTPUT_DIR}/{IMAGE_OUTPUT_FILE}",
            },
            commands=[
                f"mkdir -p {IMAGE_OUTPUT_DIR}",
                # The buildspec is the contract (and is tested); the step runs its phases in one shell.
                "bash container/build-image.sh",
            ],
            primary_output_directory=IMAGE_OUTPUT_DIR,
            role_policy_statements=self._build_statements(),
        )


    def _build_statements(self) -> list[iam.PolicyStatement]:
        """What build-image.sh does: log in, push the candidate image and the cache, check the candidate's manifest,
        tag it (PutImage), pull the DLC. No delete: nothing the build runs can remove an image an environment pulls."""
        stack = Stack.of(self)
        dlc_account = dlc_registry_account(stack.region)
        return [
            iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]),
            iam.PolicyStatement(
                actions=["ecr:BatchCheckLayerAvailability", "ecr:GetDownloadUrlForLayer", "ecr:BatchGetImage",
                         "ecr:InitiateLayerUpload", "ecr:UploadLayerPart", "ecr:CompleteLayerUpload",
                         "ecr:PutImage", "ecr:DescribeImages"],
                resources=[self.repository.repository_arn, self.cache_repository.repository_arn]),
            iam.PolicyStatement(
                actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
                resources=[f"arn:{stack.partition}:ecr:{stack.region}:{dlc_account}:repository/{DLC_REPOSITORY}"]),
            iam.PolicyStatement(actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                                resources=[self.key.key_arn]),
        ]

    def build_project(self, spec: ImageBuildSpec, *, source_dir: Path,
                      log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH,
                      removal_policy: RemovalPolicy = RemovalPolicy.DESTROY) -> codebuild.Project:
        """One environment's project for ``spec``: its source is ``source_dir`` (``container/``) as a CDK asset, its
        buildspec the asset's own ``buildspec.yml``. Nothing starts it during a stack operation: ``deploy/`` starts
        it with the resolved base image and the input-hash tag, and waits (docs/explanation/image.md)."""
        if self.env_name is None:
            raise ValueError("build_project is for one environment's repository (env_name)")
        if self.source is None:  # one asset of container/ for every variant's project
            self.source = s3_assets.Asset(self, f"Source-{spec.variant}", path=str(source_dir),
                                          exclude=list(SOURCE_EXCLUDES))
        project_name = image_project_name(spec.variant, self.env_name)
        # The build log, created by the stack (CodeBuild would create one that never expires and outlives a
        # teardown), encrypted with the repository key.
        build_log = encrypted_log_group(self, f"BuildLog-{spec.variant}", log_group_name=f"/aws/codebuild/{project_name}",
                                        key=self.key, retention=log_retention, removal_policy=removal_policy)
        project = codebuild.Project(
            self, f"Build-{spec.variant}", project_name=project_name,
            logging=codebuild.LoggingOptions(cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=build_log)),
            description=f"Builds the SemIf adapter image ({spec.variant}) for {self.env_name}",
            source=codebuild.Source.s3(bucket=self.source.bucket, path=self.source.s3_object_key),
            environment=codebuild.BuildEnvironment(build_image=codebuild.LinuxBuildImage.STANDARD_8_0,
                                                   compute_type=spec.compute_type,
                                                   privileged=True),  # docker build needs the Docker daemon
            environment_variables={name: codebuild.BuildEnvironmentVariable(value=value) for name, value in {
                "BASE_IMAGE": spec.base_image,
                "REPOSITORY_URI": self.repository.repository_uri,
                "CACHE_REPOSITORY_URI": self.cache_repository.repository_uri,
                "LLAMA_CPP_VARIANT": spec.llama_cpp_variant,
                "GB_PER_BUILD_JOB": str(spec.gb_per_job),
            }.items()},
            cache=codebuild.Cache.local(codebuild.LocalCacheMode.DOCKER_LAYER)
            if local_cache_supported(spec.compute_type) else None,
            timeout=BUILD_TIMEOUT, encryption_key=self.key,
        )
        for statement in self._build_statements():
            project.add_to_role_policy(statement)
        return project


# Not build inputs: byte-code and the editable install's metadata differ per machine.
SOURCE_EXCLUDES = ("**/__pycache__", "**/*.pyc", "*.egg-info", "**/*.egg-info")


def read_image_digests(directory: Path) -> dict[str, str]:
    """``{variant: digest}`` from the build steps' outputs laid out as ``<directory>/<variant>/image.json``."""
    digests = {}
    for variant_dir in sorted(p for p in Path(directory).iterdir() if p.is_dir()):
        detail = json.loads((variant_dir / IMAGE_OUTPUT_FILE).read_text())
        digests[variant_dir.name] = detail["imageDigest"]
    return digests
