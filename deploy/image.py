"""The adapter image of one environment: the DLC digest behind it, and a CodeBuild build started and waited for.

Nothing here runs inside a CloudFormation operation: a stack waits at most an hour for a custom resource
(``ServiceTimeout``), and no CUDA build of llama.cpp has been timed under that (docs/explanation/image.md).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

from botocore.exceptions import ClientError

from constructs_lib.image_sources import DLC_REPOSITORY, DLC_TAGS, PLACEHOLDER_DIGEST, dlc_registry_account, dlc_image_uri

from stacks.pipeline_steps import DOCKER_MANIFEST  # the one manifest type SageMaker's CreateModel accepts

from . import DeployError
# How many of the project's latest builds are searched for one already building the same tag.
RECENT_BUILDS = 10


@dataclass(frozen=True)
class ImageProject:
    """What the environment's image stack outputs (``stacks.image_stack``)."""

    project_name: str
    repository_uri: str
    source_hash: str
    variant: str

    @property
    def repository_name(self) -> str:
        return self.repository_uri.split("/", 1)[1]


@dataclass(frozen=True)
class AdapterImage:
    digest: str
    tag: str
    base_image: str
    skipped: bool  # the tag was already in the repository: nothing was built
    build_id: Optional[str] = None
    log_url: Optional[str] = None


def resolve_dlc_digest(ecr, *, region: str, variant: str, pinned: Optional[str]) -> tuple[str, bool]:
    """``(digest, looked_up)``: the digest pinned in config, or the one the DLC's tag points to now.

    BatchGetImage is the registry's pull call, which the DLC repositories allow to any AWS principal
    (https://docs.aws.amazon.com/AmazonECR/latest/APIReference/API_BatchGetImage.html;
    https://github.com/aws/deep-learning-containers/blob/master/available_images.md: "docker login" with your own
    credentials)."""
    if pinned and pinned != PLACEHOLDER_DIGEST:
        return pinned, False
    account, tag = dlc_registry_account(region), DLC_TAGS[variant]
    try:
        response = ecr.batch_get_image(registryId=account, repositoryName=DLC_REPOSITORY,
                                       imageIds=[{"imageTag": tag}], acceptedMediaTypes=[DOCKER_MANIFEST])
    except ClientError as exc:
        raise DeployError(f"could not look up {dlc_image_uri(region, variant)}: {exc}") from None
    images = response.get("images") or []
    if not images:
        failures = "; ".join(f"{f.get('failureCode')}: {f.get('failureReason')}" for f in response.get("failures", []))
        raise DeployError(f"{dlc_image_uri(region, variant)} was not found ({failures or 'no image'}); pin a digest "
                          f"in config/environments.json dlc_images.{variant}")
    return images[0]["imageId"]["imageDigest"], True


def image_tag(project: ImageProject, base_image: str) -> str:
    """The input hash: the container/ sources (the CDK asset hash), the base image by digest and the variant."""
    return hashlib.sha256(f"{project.source_hash}\n{base_image}\n{project.variant}\n".encode()).hexdigest()[:40]


def _stored(ecr, project: ImageProject, tag: str) -> Optional[dict]:
    try:
        details = ecr.describe_images(repositoryName=project.repository_name, imageIds=[{"imageTag": tag}])
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ImageNotFoundException":
            return None
        raise DeployError(f"could not read {project.repository_uri}: {exc}") from None
    (detail,) = details["imageDetails"]
    return detail


def _log_url(build: dict) -> Optional[str]:
    return (build.get("logs") or {}).get("deepLink")


def _running_build(codebuild, project: ImageProject, tag: str) -> Optional[str]:
    """A build of the same tag still in progress (an earlier `make deploy` that stopped waiting): wait on it."""
    ids = codebuild.list_builds_for_project(projectName=project.project_name, sortOrder="DESCENDING").get("ids", [])
    if not ids:
        return None
    for build in codebuild.batch_get_builds(ids=ids[:RECENT_BUILDS])["builds"]:
        variables = {v["name"]: v["value"] for v in build.get("environment", {}).get("environmentVariables", [])}
        if build["buildStatus"] == "IN_PROGRESS" and variables.get("IMAGE_TAG") == tag:
            return build["id"]
    return None


def ensure_image(codebuild, ecr, project: ImageProject, *, region: str, dlc_digest: str, timeout_s: float,
                 poll_s: float = 15.0, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> AdapterImage:
    """The adapter image for ``project``'s sources on ``dlc_digest``: found by its input-hash tag, or built now.

    Raises DeployError when the build fails (naming its log), or is still running after ``timeout_s`` (the build
    goes on; the next run waits for it instead of starting another)."""
    base_image = dlc_image_uri(region, project.variant, dlc_digest)
    tag = image_tag(project, base_image)
    stored = _stored(ecr, project, tag)
    if stored is not None and stored.get("imageManifestMediaType") == DOCKER_MANIFEST:
        say(f"{project.repository_uri}:{tag} is already built from these sources: nothing to build")
        return AdapterImage(digest=stored["imageDigest"], tag=tag, base_image=base_image, skipped=True)

    build_id = _running_build(codebuild, project, tag)
    if build_id is not None:
        say(f"a build of {tag} is already running ({build_id}): waiting for it")
    else:
        try:
            build = codebuild.start_build(projectName=project.project_name, environmentVariablesOverride=[
                {"name": "BASE_IMAGE", "value": base_image, "type": "PLAINTEXT"},
                {"name": "IMAGE_TAG", "value": tag, "type": "PLAINTEXT"},
            ])["build"]
        except ClientError as exc:
            raise DeployError(f"could not start CodeBuild project {project.project_name}: {exc}") from None
        build_id = build["id"]
        say(f"building {project.repository_uri}:{tag} from {base_image} ({build_id}; log: {_log_url(build) or 'starting'})")

    started, phase = clock(), None
    while True:
        (build,) = codebuild.batch_get_builds(ids=[build_id])["builds"]
        status = build["buildStatus"]
        if status != "IN_PROGRESS":
            break
        if build.get("currentPhase") != phase:
            phase = build.get("currentPhase")
            say(f"  {phase.lower() if phase else 'queued'} ({clock() - started:.0f} s)")
        if clock() - started >= timeout_s:
            raise DeployError(
                f"the image build {build_id} is still running after {timeout_s / 60:.0f} min; it goes on, and the next "
                f"`make deploy` waits for it (log: {_log_url(build)})")
        sleep(poll_s)
    if status != "SUCCEEDED":
        failed = next((p for p in build.get("phases", []) if p.get("phaseStatus") not in (None, "SUCCEEDED")), {})
        context = "; ".join(c.get("message", "") for c in failed.get("contexts", []) if c.get("message"))
        raise DeployError(f"the image build {build_id} ended {status}"
                          f"{' in ' + failed['phaseType'] if failed.get('phaseType') else ''}"
                          f"{': ' + context if context else ''}; log: {_log_url(build)}")
    exported = {v["name"]: v["value"] for v in build.get("exportedEnvironmentVariables", [])}
    digest = exported.get("IMAGE_DIGEST", "")
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise DeployError(f"the image build {build_id} succeeded but exported no IMAGE_DIGEST (got {digest!r}); "
                          f"log: {_log_url(build)}")
    say(f"built {project.repository_uri}@{digest} in {clock() - started:.0f} s")
    return AdapterImage(digest=digest, tag=tag, base_image=base_image, skipped=False, build_id=build_id,
                        log_url=_log_url(build))
