#!/usr/bin/env python3
"""A SemIf decision endpoint inside your own CDK app.

The stack imports your model bucket and its KMS key, pins the adapter image in your ECR repository by digest,
runs the decision endpoint on it, and grants your service's role invoke on that endpoint alone. cdk-nag's
AwsSolutions checks run on every synth; an unacknowledged finding fails it.

    npx cdk synth        # in this folder, in the virtualenv cdk.json's python is; values: cdk.json (README.md)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

# Where the SemIf repository is checked out (a git submodule, say): constructs_lib/ and config/ are imported from it.
SEMIF_HOME = Path(os.environ.get("SEMIF_HOME", Path(__file__).resolve().parents[2]))
if not all((SEMIF_HOME / package / "__init__.py").is_file() for package in ("constructs_lib", "config")):
    raise SystemExit(f"error: SEMIF_HOME: {SEMIF_HOME} is not a SemIf checkout (no constructs_lib/ and config/); "
                     "set SEMIF_HOME to the folder you cloned SemIf into")
sys.path.insert(0, str(SEMIF_HOME))

from aws_cdk import (App, CfnOutput, Environment, Stack, Validations, aws_ecr as ecr, aws_iam as iam,  # noqa: E402
                     aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns)
from cdk_nag import AwsSolutionsChecks  # noqa: E402
from constructs import Construct  # noqa: E402

from config import AdapterSettings  # noqa: E402
from constructs_lib.decision_endpoint import DecisionEndpoint  # noqa: E402
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds  # noqa: E402
from constructs_lib.endpoint_compute import EndpointCompute  # noqa: E402
from constructs_lib.image_sources import BuiltImage  # noqa: E402
from constructs_lib.model_check import ModelCheck  # noqa: E402
from constructs_lib.serving_endpoint import target_concurrency  # noqa: E402
from constructs_lib.trust import ecs_tasks_principal  # noqa: E402

# The context keys this app reads (cdk.json, or -c key=value).
CONTEXT_KEYS = ("endpoint-name", "model-bucket", "model-key-arn", "model-prefix", "adapter-repository",
                "adapter-image-digest", "alarm-topic-arn")
# The adapter's SEMIF_* settings (docs/reference/configuration.md). One request runs and max_queue wait; the next
# gets a 503, so autoscaling targets half of those 1 + max_queue.
ADAPTER = AdapterSettings(n_ctx=8192, n_batch=512, n_threads=4, n_gpu_layers=0, scoring="label", prefix_cache=True,
                          max_queue=8, queue_timeout_s=30, retry_after_s=1, max_options=255, max_questions=400,
                          max_body_bytes=1048576, log_level="INFO")


class DecisionServiceStack(Stack):
    def __init__(self, scope: Construct, id_: str, *, endpoint_name: str, model_bucket: str, model_key_arn: str,
                 model_prefix: str, adapter_repository: str, adapter_image_digest: str, alarm_topic_arn: str,
                 **kwargs) -> None:
        super().__init__(scope, id_, **kwargs)
        # Your bucket and key, holding the model `semif-package-model upload` put under model_prefix.
        bucket = s3.Bucket.from_bucket_name(self, "ModelBucket", model_bucket)
        key = kms.Key.from_key_arn(self, "ModelKey", model_key_arn)
        # By digest, never by tag: a moved tag would change what a running endpoint serves.
        repository = ecr.Repository.from_repository_name(self, "AdapterRepository", adapter_repository)
        image = BuiltImage(repository=repository, digest=adapter_image_digest)
        retention = logs.RetentionDays.ONE_MONTH

        self.endpoint = DecisionEndpoint(
            self, "Decision", endpoint_name=endpoint_name, image=image, model_bucket=bucket, model_key=key,
            model_prefix=model_prefix, adapter_environment=ADAPTER.to_environment(),
            compute=EndpointCompute(
                instance_type="ml.c6i.xlarge", min_instances=1, max_instances=2,
                target_concurrency=target_concurrency(admitted_per_instance=1 + ADAPTER.max_queue, fraction=0.5),
                model_download_timeout_s=1200, startup_health_check_timeout_s=900),
            alarm_topic=sns.Topic.from_topic_arn(self, "AlarmTopic", alarm_topic_arn),
            alarm_thresholds=EndpointAlarmThresholds(invocation_5xx_per_5min=5, model_latency_p95_ms=20000,
                                                     overload_503_per_5min=10),
            low_margin_threshold=0.1, log_retention=retention,
        )
        # No SageMaker Model, so no instance, before the model is in the bucket.
        check = ModelCheck(self, "ModelCheck", model_bucket=bucket, model_key=key, model_prefix=model_prefix,
                           log_retention=retention)
        check.guard(self.endpoint.cfn_model)

        # The role your service runs as (an ECS task role here); iam.Role.from_role_arn takes one you already have.
        # Only ECS tasks of this account and region may assume it (trust.ecs_tasks_principal).
        self.caller_role = iam.Role(self, "CallerRole", assumed_by=ecs_tasks_principal(self),
                                    description=f"Calls the {endpoint_name} decision endpoint")
        self.endpoint.grant_invoke(self.caller_role)

        CfnOutput(self, "EndpointName", value=endpoint_name, description="Decision endpoint name")
        CfnOutput(self, "EndpointArn", value=self.endpoint.endpoint_arn, description="Decision endpoint ARN")
        CfnOutput(self, "CallerRoleArn", value=self.caller_role.role_arn,
                  description="Role allowed to invoke the decision endpoint")


def build_app(app: Optional[App] = None) -> App:
    app = app or App()
    values = {key: app.node.try_get_context(key) for key in CONTEXT_KEYS}
    missing = [key for key, value in values.items() if not value]
    if missing:
        raise ValueError(f"context: set {', '.join(missing)} in cdk.json or with -c key=value")
    # The account and region of the credentials `cdk` runs with. The model bucket and the image must be in that
    # region, and a stack without one would synthesize region-agnostic ARNs.
    region = os.environ.get("CDK_DEFAULT_REGION")
    if not region:
        raise ValueError("CDK_DEFAULT_REGION is not set: give the credentials `cdk` runs with a region "
                         "(AWS_REGION, or region in the profile's ~/.aws/config), the region of your model bucket")
    DecisionServiceStack(
        app, "DecisionService", **{key.replace("-", "_"): str(value) for key, value in values.items()},
        env=Environment(account=os.environ.get("CDK_DEFAULT_ACCOUNT"), region=region),
    )
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app


if __name__ == "__main__":
    try:
        application = build_app()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    application.synth()
