"""The model store: an S3 bucket for GGUF files and their manifests, with its KMS key.

Layout: ``models/<name>/<version>/`` holds ``<file>.gguf`` and ``model-manifest.json``,
served uncompressed (SageMaker ``S3DataType: S3Prefix``, ``CompressionType: None``).
A ``models/….tar.gz`` object is accepted as well (``S3Object`` + ``Gzip``).
"""

from __future__ import annotations

from typing import Optional

from aws_cdk import Duration, RemovalPolicy, Token, aws_iam as iam, aws_kms as kms, aws_s3 as s3
from constructs import Construct

from constructs_lib.nag import checkov_skip

MODELS_ROOT = "models/"
# Batch Transform data: batch/<job>/in/ (records) and batch/<job>/out/ (answers); see constructs_lib/batch_transform.py.
BATCH_ROOT = "batch/"
# The one object a model prefix may name instead of a directory (S3Object + Gzip).
TARBALL_SUFFIX = ".tar.gz"


def check_model_prefix(model_prefix: str) -> None:
    """Refuse, at synth, a model prefix that is neither a directory (ends in '/') nor one ``.tar.gz`` object.

    SageMaker: "A valid key name prefix identified by S3Uri always ends with a forward slash (/)" (S3DataType
    S3Prefix, https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_S3ModelDataSource.html). Without the
    slash, the read grant ``<prefix>*`` would also match ``models/r/10/`` beside ``models/r/1``.
    """
    if Token.is_unresolved(model_prefix):
        return
    if model_prefix.startswith("/") or not (model_prefix.endswith("/") and model_prefix.strip("/")
                                            or model_prefix.endswith(TARBALL_SUFFIX)):
        raise ValueError(f"model_prefix: {model_prefix!r} is not a model location; end it with '/' (a directory, "
                         f"e.g. models/<name>/<version>/) or '{TARBALL_SUFFIX}' (one object), with no leading '/'")


def check_model_key(model_key: kms.IKey) -> None:
    """Refuse a KMS alias where the key's own ARN is needed: "When an alias is the value of a resource element, the
    policy applies to the alias resource, not to any KMS key that might be associated with it"
    (https://docs.aws.amazon.com/kms/latest/developerguide/alias-authorization.html), so a role granted
    kms:Decrypt on an alias ARN cannot decrypt the model. An ARN with tokens is checked for what it spells."""
    arn = model_key.key_arn
    if ":alias/" in arn or (not Token.is_unresolved(arn) and ":key/" not in arn):
        raise ValueError(f"model_key: {arn!r} is not a KMS key ARN (arn:<partition>:kms:<region>:<account>:key/<id>);"
                         " an alias ARN in an IAM policy grants the alias, not the key it points to")


def model_bucket_name(project: str, env_name: str, account: str, region: str) -> str:
    """Deterministic, so endpoint stacks and people name the bucket without a cross-stack lookup."""
    return f"{project}-{env_name}-models-{account}-{region}"


class ModelBucket(Construct):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        bucket_name: Optional[str] = None,
        noncurrent_version_expiration_days: int = 90,
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
        auto_delete_objects: bool = False,
        batch_expiration_days: int = 30,
    ) -> None:
        """``removal_policy``: RETAIN_ON_UPDATE_OR_DELETE (prod) keeps the data on update or delete, but a failed
        first deploy removes the (empty) buckets on rollback, so the retry does not meet "already exists" on the
        fixed bucket name. DESTROY with ``auto_delete_objects`` (dev, staging) lets `cdk destroy` remove models too."""
        super().__init__(scope, id_)
        self.key = kms.Key(
            self,
            "Key",
            description="SemIf model bucket encryption",
            enable_key_rotation=True,
            removal_policy=removal_policy,
        )
        self.access_log_bucket = s3.Bucket(
            self,
            "AccessLogs",
            # Server access logs can only be delivered to SSE-S3 buckets.
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_PREFERRED,
            lifecycle_rules=[
                s3.LifecycleRule(id="expire-access-logs", expiration=Duration.days(365),
                                 noncurrent_version_expiration=Duration.days(30)),
            ],
            removal_policy=removal_policy,
            auto_delete_objects=auto_delete_objects,
        )
        checkov_skip(self.access_log_bucket, "CKV_AWS_18", "This is the access-log destination of the model bucket; "
                     "logging its own access would need another bucket, and that one another.")
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            bucket_name=bucket_name,
            encryption=s3.BucketEncryption.KMS,
            encryption_key=self.key,
            bucket_key_enabled=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            server_access_logs_bucket=self.access_log_bucket,
            server_access_logs_prefix="model-bucket/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="expire-old-model-versions",
                    noncurrent_version_expiration=Duration.days(noncurrent_version_expiration_days),
                    abort_incomplete_multipart_upload_after=Duration.days(7),
                ),
                # Job inputs and answers are working copies: gone after batch_expiration_days, and their
                # old versions the next day (the bucket is versioned), so batch data never piles up.
                s3.LifecycleRule(
                    id="expire-batch-data",
                    prefix=BATCH_ROOT,
                    expiration=Duration.days(batch_expiration_days),
                    noncurrent_version_expiration=Duration.days(1),
                    abort_incomplete_multipart_upload_after=Duration.days(1),
                ),
            ],
            removal_policy=removal_policy,
            auto_delete_objects=auto_delete_objects,
        )

    def model_s3_uri(self, model_prefix: str) -> str:
        check_model_prefix(model_prefix)
        return f"s3://{self.bucket.bucket_name}/{model_prefix}"

    def grant_read_model(self, grantee: iam.IGrantable, model_prefix: str) -> None:
        """Read one model's objects (and nothing else in the bucket), decrypting with this key only."""
        grant_model_read(grantee, bucket=self.bucket, key=self.key, model_prefix=model_prefix)


def grant_model_read(grantee: iam.IGrantable, *, bucket: s3.IBucket, key: kms.IKey, model_prefix: str) -> str:
    """Returns the object pattern granted (the prefix + ``*``, or the one ``.tar.gz`` key). A prefix that is not a
    directory or a ``.tar.gz``, or a key given by its alias, raises ValueError (check_model_prefix, check_model_key)."""
    check_model_prefix(model_prefix)
    check_model_key(key)
    object_pattern = model_prefix if model_prefix.endswith(TARBALL_SUFFIX) else f"{model_prefix}*"
    iam.Grant.add_to_principal(
        grantee=grantee, actions=["s3:GetObject"], resource_arns=[bucket.arn_for_objects(object_pattern)]
    )
    grantee.grant_principal.add_to_principal_policy(
        iam.PolicyStatement(
            actions=["s3:ListBucket"],
            resources=[bucket.bucket_arn],
            conditions={"StringLike": {"s3:prefix": [object_pattern]}},
        )
    )
    iam.Grant.add_to_principal(grantee=grantee, actions=["kms:Decrypt"], resource_arns=[key.key_arn])
    return object_pattern
