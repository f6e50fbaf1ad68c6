"""The deploy-time model check: a custom resource that fails the deploy unless the model is in S3.

Its runtime is ``lambda/model_check/``. A stack makes its SageMaker Model depend on ``ModelCheck``, so
CloudFormation runs the check before it creates the Model (and so before the endpoint provisions instances).
Every deploy path gets it: the pipeline, and a hand ``cdk deploy``. The check re-runs when the model prefix or
manifest key changes (both are resource properties).
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from aws_cdk import CustomResource, Duration, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms, aws_lambda as lambda_, aws_logs as logs, aws_s3 as s3
from constructs import Construct

from constructs_lib.model_bucket import check_model_key, check_model_prefix
from constructs_lib.nag import acknowledge_wildcard_resource, checkov_skip

HANDLER_DIR = Path(__file__).resolve().parent.parent / "lambda" / "model_check"
MANIFEST_NAME = "model-manifest.json"
RESOURCE_TYPE = "Custom::SemIfModelCheck"


def manifest_key(model_prefix: str) -> str:
    """Where `semif-package-model upload` puts the manifest: in the prefix, or beside the ``.tar.gz``."""
    if model_prefix.endswith(".tar.gz"):
        directory = posixpath.dirname(model_prefix)
        return f"{directory}/{MANIFEST_NAME}" if directory else MANIFEST_NAME
    return f"{model_prefix}{MANIFEST_NAME}"


def transform_tarball_key(model_prefix: str) -> str:
    """The ``model.tar.gz`` Batch Transform reads (it takes ModelDataUrl only, never an uncompressed prefix): for
    ``models/<name>/<version>/``, ``models/<name>/<version>.tar.gz`` beside it, which `semif-package-model upload`
    writes (inside the prefix the endpoint would download it too); a ``.tar.gz`` model prefix is its own."""
    if model_prefix.endswith(".tar.gz"):
        return model_prefix
    return model_prefix.rstrip("/") + ".tar.gz"


def model_object_patterns(model_prefix: str, *, transform_tarball: bool = False) -> list[str]:
    """The objects the check reads: the manifest, and the GGUF (any ``*.gguf`` in the prefix: its name is in the
    manifest, not known at synth) or the one tarball; with ``transform_tarball``, Batch Transform's tarball too."""
    if model_prefix.endswith(".tar.gz"):
        return [manifest_key(model_prefix), model_prefix]
    patterns = [manifest_key(model_prefix), f"{model_prefix}*.gguf"]
    return patterns + [transform_tarball_key(model_prefix)] if transform_tarball else patterns


def model_object_listing(model_bucket: s3.IBucket, model_prefix: str, *,
                         transform_tarball: bool = False) -> iam.PolicyStatement:
    """``s3:ListBucket`` for listings of the objects the check reads, and of nothing else in the bucket."""
    patterns = model_object_patterns(model_prefix, transform_tarball=transform_tarball)
    return iam.PolicyStatement(actions=["s3:ListBucket"], resources=[model_bucket.bucket_arn],
                               conditions={"StringLike": {"s3:prefix": patterns}})


class ModelCheck(Construct):
    def __init__(self, scope: Construct, id_: str, *, model_bucket: s3.IBucket, model_key: kms.IKey,
                 model_prefix: str, log_retention: logs.RetentionDays,
                 removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
                 transform_tarball: bool = False) -> None:
        """``transform_tarball``: the stack also runs Batch Transform on this model, so its tarball is checked."""
        super().__init__(scope, id_)
        check_model_prefix(model_prefix)  # the same rule as the endpoint's and its grant's
        check_model_key(model_key)
        stack = Stack.of(self)
        self.model_prefix = model_prefix
        self.manifest_key = manifest_key(model_prefix)
        self.log_group = logs.LogGroup(self, "Logs", retention=log_retention, removal_policy=removal_policy)
        checkov_skip(self.log_group, "CKV_AWS_158", "The model check logs only the bucket, the model prefix and the "
                     "outcome (no model bytes, no decision state); a customer key's policy would need this generated "
                     "log group's ARN, or a fixed name that a retained prod group blocks on re-create.")
        # Its own role, not AWSLambdaBasicExecutionRole: one log group, the model's objects, the model key.
        self.role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                             description=f"Checks the model at {model_prefix} before the endpoint deploys")
        self.role.add_to_policy(iam.PolicyStatement(actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                                                    resources=[self.log_group.log_group_arn]))
        patterns = model_object_patterns(model_prefix, transform_tarball=transform_tarball)
        # HeadObject is authorised by s3:GetObject.
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["s3:GetObject"], resources=[model_bucket.arn_for_objects(p) for p in patterns]))
        # S3 answers a missing key with 403 to a reader that may not list it; listing exactly these keys lets the
        # check tell "not uploaded" from "access denied" (an IAM or KMS mistake).
        self.role.add_to_policy(model_object_listing(model_bucket, model_prefix, transform_tarball=transform_tarball))
        for pattern in patterns:
            if pattern.endswith("*.gguf"):
                acknowledge_wildcard_resource(
                    self.role, model_bucket.arn_for_objects(pattern),
                    "The check reads the GGUF the manifest names; its file name is in the manifest, not known at "
                    "synth, and it lies directly in this model's prefix.")
        # Reading the SSE-KMS manifest (and HeadObject's checksum) decrypts with the model key, through S3 only.
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["kms:Decrypt"], resources=[model_key.key_arn],
            conditions={"StringEquals": {"kms:ViaService": f"s3.{stack.region}.amazonaws.com"}}))

        self.function = lambda_.Function(
            self, "Function",
            runtime=lambda_.Runtime.PYTHON_3_14,
            handler="handler.on_event",
            code=lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"]),
            role=self.role,
            log_group=self.log_group,
            timeout=Duration.seconds(60),
            memory_size=256,
            description="SemIf: fails the deploy unless the endpoint's model manifest and GGUF are in S3",
        )
        # The function must be able to log before CloudFormation invokes it.
        self.function.node.add_dependency(self.role.node.find_child("DefaultPolicy"))
        for check_id, reason in (
            ("CKV_AWS_115", "The model check runs once per deploy; reserved concurrency would take from the "
                            "account's unreserved pool, which a fresh account (limit 10) cannot give."),
            ("CKV_AWS_116", "CloudFormation invokes the model check synchronously and reports its failure in the "
                            "deploy; there is no asynchronous event to dead-letter."),
            ("CKV_AWS_117", "The model check calls only the S3 API (HeadObject, GetObject); a VPC would add NAT "
                            "or endpoint cost and no isolation."),
        ):
            checkov_skip(self.function, check_id, reason)

        self.resource = CustomResource(
            self, "Resource", service_token=self.function.function_arn, resource_type=RESOURCE_TYPE,
            properties={"Bucket": model_bucket.bucket_name, "ModelPrefix": model_prefix,
                        "ManifestKey": self.manifest_key,
                        **({"TransformTarball": "true"} if transform_tarball else {})},
            # The check creates nothing: there is nothing to keep, and Delete is a no-op.
            removal_policy=RemovalPolicy.DESTROY,
            # Should the function die without answering (it answers on every path it controls), the deploy fails
            # after minutes instead of CloudFormation's default hour.
            service_timeout=Duration.minutes(5),
        )

    def guard(self, *resources) -> None:
        """CloudFormation creates (and updates) ``resources`` only after the check passed."""
        for resource in resources:
            resource.node.add_dependency(self.resource)
