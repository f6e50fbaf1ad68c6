"""The decision service of one environment: the decision endpoint on the promoted adapter image."""

from __future__ import annotations

from typing import Mapping, Optional

from aws_cdk import CfnOutput, RemovalPolicy, Stack, aws_ecr as ecr, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from config import settings_contract  # the SEMIF_* definition (the container package's)

from constructs_lib.batch_transform import BatchTransform
from constructs_lib.decision_endpoint import DecisionEndpoint
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.image_sources import BuiltImage, adapter_digest_lookup
from constructs_lib.model_check import ModelCheck
from constructs_lib.serving_endpoint import model_role_name
from stacks.outputs import publish


# The Batch Transform instance type of a GPU environment: its batch Model runs the CPU image.
DEFAULT_CPU_BATCH_INSTANCE_TYPE = "ml.c6i.xlarge"


def batch_environment(endpoint_environment: Mapping[str, str], *, image_digest: str) -> dict[str, str]:
    """The endpoint's adapter settings for the CPU batch Model: no GPU layers and no GPU required, its own image
    digest, and no API key (Batch Transform's requests carry no bearer token)."""
    api_key = settings_contract.BY_KEY["api_key"].reference_name
    environment = {k: v for k, v in endpoint_environment.items() if k not in ("SEMIF_REQUIRE_GPU", api_key)}
    environment["SEMIF_N_GPU_LAYERS"] = "0"
    environment["SEMIF_IMAGE_DIGEST"] = image_digest
    return environment


class DecisionStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        env_name: str,
        image_repository_arn: str,
        image_digest: str,
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
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
        placeholder_lookup: Optional[str] = None,
        batch_image_digest: Optional[str] = None,
        batch_instance_type: Optional[str] = None,
        **kwargs,
    ) -> None:
        super().__init__(scope, id_, **kwargs)
        # By name, not by cross-stack reference: the IAM resources stay plain strings.
        model_bucket = s3.Bucket.from_bucket_name(self, "ModelBucket", model_bucket_name)
        # The image was built before this stack: by the pipeline in its account, or by `make deploy` in this
        # environment's own repository (docs/explanation/image.md).
        repository = ecr.Repository.from_repository_arn(self, "AdapterRepository", image_repository_arn)
        lookup = placeholder_lookup or adapter_digest_lookup(image_repository_arn, env_name)
        self.image = BuiltImage(repository=repository, digest=image_digest, placeholder_lookup=lookup)
        self.endpoint = DecisionEndpoint(
            self, "Decision", endpoint_name=endpoint_name, image=self.image, model_bucket=model_bucket,
            model_key=model_key, model_prefix=model_prefix, adapter_environment=adapter_environment,
            compute=compute, alarm_topic=alarm_topic, alarm_thresholds=alarm_thresholds,
            low_margin_threshold=low_margin_threshold, log_retention=log_retention, removal_policy=removal_policy,
            role_name=model_role_name(env_name, endpoint_name, "endpoint"),
        )
        # No Model (so no instance) before the model it serves is in the bucket, on every deploy path.
        self.model_check = ModelCheck(self, "ModelCheck", model_bucket=model_bucket, model_key=model_key,
                                      model_prefix=model_prefix, log_retention=log_retention,
                                      removal_policy=removal_policy, transform_tarball=True)
        self.model_check.guard(self.endpoint.cfn_model)

        # Batch Transform: a Model of the same model and settings, run by a role of its own
        # (docs/how-to/batch-transform.md); the model check guards it like the endpoint's Model. It runs the CPU
        # image on a CPU instance on every environment: Batch Transform's GPU hosts offer NVIDIA drivers 470 and 535
        # only (TransformAmiVersion, https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TransformResources.html),
        # which cannot run the CUDA 13 adapter that the endpoints' gpu-4-1 hosts (driver 580) run.
        batch_digest = batch_image_digest or image_digest
        self.batch_image = self.image if batch_digest == image_digest else BuiltImage(
            repository=repository, digest=batch_digest, placeholder_lookup=lookup)
        self.batch = BatchTransform(self, "Batch", image=self.batch_image, model_bucket=model_bucket,
                                    model_key=model_key, model_prefix=model_prefix,
                                    environment=batch_environment(self.endpoint.environment, image_digest=batch_digest),
                                    role_name=model_role_name(env_name, endpoint_name, "transform"))
        self.model_check.guard(self.batch.cfn_model)

        # The config the endpoint must run once this stack's update is done (the pipeline's smoke test compares it
        # with DescribeEndpoint). It changes with every image: an output, never an export.
        self.endpoint_config_output = CfnOutput(
            self, "DecisionEndpointConfigName", value=self.endpoint.cfn_endpoint_config.attr_endpoint_config_name,
            description="Endpoint config the decision endpoint runs after this stack's last update")
        self.endpoint_name_output = publish(self, env_name=env_name, key="decision/endpoint-name",
                                            value=endpoint_name, description="Decision endpoint name")
        publish(self, env_name=env_name, key="decision/endpoint-arn", value=self.endpoint.endpoint_arn,
                description="Decision endpoint ARN")
        publish(self, env_name=env_name, key="decision/repository-uri", value=repository.repository_uri,
                description="Adapter image repository the endpoint pulls from")
        # Changes with every image: SSM only, never an export another stack could import.
        publish(self, env_name=env_name, key="decision/image-digest", value=image_digest, stable=False,
                description="Digest of the adapter image the endpoint serves")
        # A new Model with every image: SSM only.
        publish(self, env_name=env_name, key="decision/batch-model-name", value=self.batch.model_name, stable=False,
                description="SageMaker Model for Batch Transform jobs (semif-batch run)")
        publish(self, env_name=env_name, key="decision/batch-role-arn", value=self.batch.role.role_arn,
                description="Execution role of Batch Transform jobs: reads batch/*/in/, writes batch/*/out/")
        publish(self, env_name=env_name, key="decision/batch-instance-type",
                value=batch_instance_type or compute.instance_types[0],
                description="Default instance type of Batch Transform jobs (a CPU type: the endpoint's first on a CPU "
                            "environment)")
