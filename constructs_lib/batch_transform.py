"""What a SageMaker Batch Transform job on the decision model needs: a Model (the endpoint's digest-pinned
image, model and adapter environment) whose execution role is the transform role.

CreateTransformJob refuses a Model whose container uses ModelDataSource, which the endpoint's Model uses for an
uncompressed model prefix; this Model names a ``model.tar.gz`` as ModelDataUrl instead: the tarball
`semif-package-model upload` writes beside the prefix (``<version>.tar.gz``), or the model itself when the prefix
is a ``.tar.gz``. The decision stack's model check fails the deploy unless that tarball is there as its manifest
records it.

CreateTransformJob takes no role: a job runs with its Model's execution role. A Model of its own keeps
the batch grants off the endpoint's role, and the role holds exactly what a job does: run the model
(its data, its image, its log group and metrics namespace), read ``batch/<job>/in/``, write
``batch/<job>/out/`` in the model bucket, and use the bucket's key. `semif-batch run` creates jobs
on this Model (docs/how-to/batch-transform.md).
"""

from __future__ import annotations

from typing import Mapping, Optional

from aws_cdk import ArnFormat, Stack, aws_iam as iam, aws_kms as kms, aws_s3 as s3
from constructs import Construct

from constructs_lib.image_sources import ContainerImageSource
from constructs_lib.model_bucket import BATCH_ROOT
from constructs_lib.model_check import transform_tarball_key
from constructs_lib.nag import acknowledge_wildcard_resource
from constructs_lib.serving_endpoint import grant_model_runtime, grant_secret_references, isolated_model
from constructs_lib.trust import sagemaker_principal

TRANSFORM_LOG_GROUP = "/aws/sagemaker/TransformJobs"
INPUT_PATTERN = f"{BATCH_ROOT}*/in/*"
OUTPUT_PATTERN = f"{BATCH_ROOT}*/out/*"


class BatchTransform(Construct):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        image: ContainerImageSource,
        model_bucket: s3.IBucket,
        model_key: kms.IKey,
        model_prefix: str,
        environment: Mapping[str, str],
        role_name: Optional[str] = None,
    ) -> None:
        """``role_name``: a fixed name for the transform role (model_role_name), for a repository policy that names
        it."""
        super().__init__(scope, id_)
        stack = Stack.of(self)
        self.role = iam.Role(self, "TransformRole", assumed_by=sagemaker_principal(stack),
                             role_name=role_name,
                             description="Execution role of the decision model's Batch Transform jobs")

        # Run the model: the same grants as the endpoint's role.
        image_uri = grant_model_runtime(self, self.role, image=image, model_bucket=model_bucket, model_key=model_key,
                                        model_prefix=model_prefix)
        self.model_data_key = transform_tarball_key(model_prefix)
        if self.model_data_key != model_prefix:
            self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"],
                                                        resources=[model_bucket.arn_for_objects(self.model_data_key)]))
        log_group = stack.format_arn(service="logs", resource="log-group", resource_name=TRANSFORM_LOG_GROUP,
                                     arn_format=ArnFormat.COLON_RESOURCE_NAME)
        log_streams = stack.format_arn(service="logs", resource="log-group", resource_name=f"{TRANSFORM_LOG_GROUP}:*",
                                       arn_format=ArnFormat.COLON_RESOURCE_NAME)
        # CreateLogGroup names the group's own ARN (and, as some callers see it, the group with ':*'); the
        # streams' actions are on ':*' below it.
        self.role.add_to_policy(iam.PolicyStatement(actions=["logs:CreateLogGroup"],
                                                    resources=[log_group, log_streams]))
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
            resources=[log_streams],
        ))
        acknowledge_wildcard_resource(self.role, log_streams, "SageMaker names one log stream per transform "
                                      "instance and container at run time, inside the TransformJobs log group only.")
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["cloudwatch:PutMetricData"], resources=["*"],
            conditions={"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/TransformJobs"}},
        ))
        acknowledge_wildcard_resource(self.role, "*", "Only ecr:GetAuthorizationToken and cloudwatch:PutMetricData "
                                      "(namespace-conditioned) use '*': neither supports resource-level permissions.")

        # Batch data: read the inputs, write the answers, nothing else in the bucket.
        self.input_objects = model_bucket.arn_for_objects(INPUT_PATTERN)
        self.output_objects = model_bucket.arn_for_objects(OUTPUT_PATTERN)
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[self.input_objects]))
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["s3:ListBucket"], resources=[model_bucket.bucket_arn],
            conditions={"StringLike": {"s3:prefix": [INPUT_PATTERN]}},
        ))
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                                                    resources=[self.output_objects]))
        acknowledge_wildcard_resource(self.role, self.input_objects, "Transform jobs read the objects under "
                                      "batch/<job>/in/; job names are chosen per run by semif-batch.")
        acknowledge_wildcard_resource(self.role, self.output_objects, "Transform jobs write <object>.out under "
                                      "batch/<job>/out/; job names are chosen per run by semif-batch.")
        # Writing SSE-KMS objects needs a data key from the bucket's key (reading already has kms:Decrypt).
        iam.Grant.add_to_principal(grantee=self.role, actions=["kms:GenerateDataKey"], resource_arns=[model_key.key_arn])

        # JSON Lines on /invocations run under the batch limits only in a transform job's container; SageMaker's
        # SAGEMAKER_BATCH=true says so too, this keeps it explicit in the Model (SEMIF_BATCH_TRANSFORM).
        environment = {**environment, "SEMIF_BATCH_TRANSFORM": "1"}
        grant_secret_references(self.role, environment)  # the log hash key, when it is set by reference
        self.cfn_model = isolated_model(self, role=self.role, image_uri=image_uri, bucket_name=model_bucket.bucket_name,
                                        model_prefix=model_prefix, environment=environment,
                                        model_data_url_key=self.model_data_key)
        self.model_name = self.cfn_model.attr_model_name
