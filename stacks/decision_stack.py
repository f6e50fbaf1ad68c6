"""The decision service of one environment: adapter image build and the decision endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from aws_cdk import Stack, aws_iam as iam, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from constructs_lib.batch_transform import BatchTransform
from constructs_lib.decision_endpoint import DecisionEndpoint
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.image_build import ImageBuild
from stacks.outputs import publish


def smoke_test_role_name(env_name: str) -> str:
    return f"semif-{env_name}-smoke-test"


class DecisionStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        env_name: str,
        container_dir: Path,
        base_image: str,
        keep_last_images: int,
        model_bucket_name: str,
        model_key: kms.IKey,
        model_prefix: str,
        endpoint_name: str,
        compute: EndpointCompute,
        adapter_environment: Mapping[str, str],
        alarm_topic: sns.ITopic,
        alarm_thresholds: EndpointAlarmThresholds,
        low_margin_threshold: float,
        log_retention: logs.RetentionDays,
        smoke_test_account: Optional[str] = None,
        **kwargs,
    ) -> None:
        super().__init__(scope, id_, **kwargs)
        # By name, not by cross-stack reference: the IAM resources stay plain strings.
        model_bucket = s3.Bucket.from_bucket_name(self, "ModelBucket", model_bucket_name)
        self.image_build = ImageBuild(self, "AdapterImage", context_dir=container_dir, base_image=base_image,
                                      keep_last_images=keep_last_images, log_retention=log_retention)
        self.endpoint = DecisionEndpoint(
            self, "Decision", endpoint_name=endpoint_name, image=self.image_build.image, model_bucket=model_bucket,
            model_key=model_key, model_prefix=model_prefix, adapter_environment=adapter_environment,
            compute=compute, alarm_topic=alarm_topic, alarm_thresholds=alarm_thresholds,
            low_margin_threshold=low_margin_threshold, log_retention=log_retention,
        )

        # Batch Transform: a Model of the same image and model, run by a role of its own (docs/batch.md).
        self.batch = BatchTransform(self, "Batch", image=self.image_build.image, model_bucket=model_bucket,
                                    model_key=model_key, model_prefix=model_prefix,
                                    environment={**adapter_environment, "SEMIF_IMAGE_DIGEST": self.image_build.image_digest})

        if smoke_test_account:
            # The pipeline's post-deploy smoke step assumes this role (possibly from another account).
            self.smoke_test_role = iam.Role(self, "SmokeTestRole", role_name=smoke_test_role_name(env_name),
                                            assumed_by=iam.AccountPrincipal(smoke_test_account),
                                            description="Lets the pipeline's smoke step call the decision endpoint")
            self.endpoint.grant_invoke(self.smoke_test_role)
            self.smoke_test_role.add_to_policy(iam.PolicyStatement(actions=["sagemaker:DescribeEndpoint"],
                                                                   resources=[self.endpoint.endpoint_arn]))

        self.endpoint_name_output = publish(self, env_name=env_name, key="decision/endpoint-name",
                                            value=endpoint_name, description="Decision endpoint name")
        publish(self, env_name=env_name, key="decision/endpoint-arn", value=self.endpoint.endpoint_arn,
                description="Decision endpoint ARN")
        publish(self, env_name=env_name, key="decision/repository-uri",
                value=self.image_build.repository.repository_uri, description="Adapter image repository")
        publish(self, env_name=env_name, key="decision/image-digest", value=self.image_build.image_digest,
                description="Digest of the adapter image the endpoint serves")
        publish(self, env_name=env_name, key="decision/batch-model-name", value=self.batch.model_name,
                description="SageMaker Model for Batch Transform jobs (semif-batch run)")
        publish(self, env_name=env_name, key="decision/batch-role-arn", value=self.batch.role.role_arn,
                description="Execution role of Batch Transform jobs: reads batch/*/in/, writes batch/*/out/")
        publish(self, env_name=env_name, key="decision/batch-instance-type", value=compute.instance_types[0],
                description="Default instance type of Batch Transform jobs (the endpoint's first)")
