"""Container image sources for SageMaker models.

Each source has one method, ``bind(scope, grantable) -> image URI``, which also grants the
execution role what it needs to pull that image and nothing more. The endpoint construct takes
any of them, so "the AWS llama.cpp DLC" and "our adapter built from it" are interchangeable.
"""

from __future__ import annotations

import re
from typing import Literal, Optional, Protocol

from aws_cdk import CfnRule, CfnRuleAssertion, Fn, Stack, aws_ecr as ecr, aws_iam as iam
from constructs import Construct

Variant = Literal["cpu", "gpu"]
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# Lets a synth run without a real image (tests, reviews); a template carrying it refuses to deploy (below).
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64

# The AWS Deep Learning Containers registry account differs per region (see
# https://github.com/aws/deep-learning-containers/blob/master/available_images.md).
# Only regions listed here can synthesize; add one by copying the account from that page.
DLC_REGISTRY_ACCOUNTS: dict[str, str] = {
    "us-east-1": "763104351884",
    "us-east-2": "763104351884",
    "us-west-1": "763104351884",
    "us-west-2": "763104351884",
    "ca-central-1": "763104351884",
    "eu-central-1": "763104351884",
    "eu-west-1": "763104351884",
    "eu-west-2": "763104351884",
    "eu-west-3": "763104351884",
    "eu-north-1": "763104351884",
    "eu-south-1": "692866216735",
    "ap-northeast-1": "763104351884",
    "ap-northeast-2": "763104351884",
    "ap-southeast-1": "763104351884",
    "ap-southeast-2": "763104351884",
    "ap-south-1": "763104351884",
    "sa-east-1": "763104351884",
    "ap-east-1": "871362719292",
    "me-south-1": "217643126080",
    "af-south-1": "626614931356",
}
DLC_REPOSITORY = "llama-cpp"
DLC_TAGS: dict[Variant, str] = {
    "cpu": "server-sagemaker-cpu-v1",
    "gpu": "server-sagemaker-cuda-v1",
}


def dlc_registry_account(region: str) -> str:
    try:
        return DLC_REGISTRY_ACCOUNTS[region]
    except KeyError:
        raise ValueError(
            f"no AWS Deep Learning Container registry account known for region '{region}'; "
            "add it to DLC_REGISTRY_ACCOUNTS in constructs_lib/image_sources.py"
        ) from None


def dlc_image_uri(region: str, variant: Variant, digest: Optional[str] = None) -> str:
    """The llama.cpp SageMaker DLC image for ``variant`` in ``region``: by digest when given, else by its moving tag.

    Deployments always pass the digest pinned in config: a tag moves when AWS republishes it, and nothing would
    rebuild or redeploy on that change.
    """
    if variant not in DLC_TAGS:
        raise ValueError(f"unknown image variant '{variant}'; expected one of {', '.join(DLC_TAGS)}")
    account = dlc_registry_account(region)
    repository = f"{account}.dkr.ecr.{region}.amazonaws.com/{DLC_REPOSITORY}"
    if digest is None:
        return f"{repository}:{DLC_TAGS[variant]}"
    if not _DIGEST.match(digest):
        raise ValueError(f"DLC digest must look like 'sha256:<64 hex>', got '{digest}'")
    return f"{repository}@{digest}"


def dlc_digest_lookup(region: str, variant: Variant) -> str:
    """The command that prints the digest the DLC's tag points to now (any credentials that may pull it)."""
    return (f"aws ecr batch-get-image --region {region} --registry-id {dlc_registry_account(region)} "
            f"--repository-name {DLC_REPOSITORY} --image-ids imageTag={DLC_TAGS[variant]} "
            "--query 'images[0].imageId.imageDigest' --output text")


def adapter_digest_lookup(repository_arn: str, env_name: str) -> str:
    """The command that prints the adapter digest the pipeline last deployed to ``env_name`` (its pre-deploy step
    tags each one ``deployed-<env>-…``)."""
    _, _, _, region, account, resource = repository_arn.split(":", 5)
    return (f"aws ecr describe-images --region {region} --registry-id {account} --repository-name "
            f"{resource.removeprefix('repository/')} --filter tagStatus=TAGGED --query \"reverse(sort_by("
            f"imageDetails[?contains(join(',', imageTags), 'deployed-{env_name}-')], &imagePushedAt))[0].imageDigest\" "
            "--output text")


def refuse_placeholder_digest(scope: Construct, id_: str, digest: Optional[str], *, what: str, lookup: str) -> None:
    """A template whose image is the all-zero placeholder synthesizes, but CloudFormation refuses to create or update
    the stack (a rule evaluated before any resource, on every deploy path), naming the command that finds the digest.
    """
    stack = Stack.of(scope)
    if digest != PLACEHOLDER_DIGEST or stack.node.try_find_child(id_) is not None:
        return
    CfnRule(stack, id_, assertions=[CfnRuleAssertion(
        assert_=Fn.condition_not(Fn.condition_equals(digest, PLACEHOLDER_DIGEST)),
        assert_description=f"{what} is the all-zero placeholder digest, which no endpoint can run: deploy a real "
                           f"digest, as printed by {lookup}")])


class ContainerImageSource(Protocol):
    def bind(self, scope: Construct, grantable: iam.IGrantable) -> str:
        """Grant ``grantable`` pull access and return the image URI for the SageMaker model."""
        ...


def _grant_pull(grantable: iam.IGrantable, repository_arn: str) -> None:
    iam.Grant.add_to_principal(
        grantee=grantable,
        actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
        resource_arns=[repository_arn],
    )
    # GetAuthorizationToken has no resource-level permissions: '*' is the only valid resource.
    iam.Grant.add_to_principal(grantee=grantable, actions=["ecr:GetAuthorizationToken"], resource_arns=["*"])


class DlcImage:
    """The AWS llama.cpp DLC itself (text path). Optionally pinned by digest."""

    def __init__(self, *, variant: Variant, digest: Optional[str] = None) -> None:
        if digest is not None and not _DIGEST.match(digest):
            raise ValueError(f"DLC digest must look like 'sha256:<64 hex>', got '{digest}'")
        self.variant = variant
        self.digest = digest

    def bind(self, scope: Construct, grantable: iam.IGrantable) -> str:
        region = Stack.of(scope).region
        account = dlc_registry_account(region)
        _grant_pull(grantable, f"arn:{Stack.of(scope).partition}:ecr:{region}:{account}:repository/{DLC_REPOSITORY}")
        refuse_placeholder_digest(scope, "DlcImagePinned", self.digest,
                                  what=f"config dlc_images.{self.variant} (config/environments.json)",
                                  lookup=dlc_digest_lookup(region, self.variant))
        return dlc_image_uri(region, self.variant, self.digest)


class BuiltImage:
    """An image in our own ECR repository (possibly another account's, the pipeline's), pinned by digest.

    ``placeholder_lookup``: the command that finds a real digest, named when the digest is the placeholder."""

    def __init__(self, *, repository: ecr.IRepository, digest: str, placeholder_lookup: str = "") -> None:
        if not digest.startswith("${Token") and not _DIGEST.match(digest):
            raise ValueError(f"image digest must look like 'sha256:<64 hex>', got '{digest}'")
        self.repository = repository
        self.digest = digest
        self.placeholder_lookup = placeholder_lookup

    def bind(self, scope: Construct, grantable: iam.IGrantable) -> str:
        _grant_pull(grantable, self.repository.repository_arn)
        refuse_placeholder_digest(scope, "AdapterImagePinned", self.digest, what="the adapter image",
                                  lookup=self.placeholder_lookup or "aws ecr describe-images on the image repository")
        return f"{self.repository.repository_uri}@{self.digest}"
