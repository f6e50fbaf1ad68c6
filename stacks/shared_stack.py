"""Per-environment shared pieces: the model bucket and the alarm topic. Both outlive endpoints."""

from __future__ import annotations

from typing import Optional

from aws_cdk import Stack, aws_iam as iam, aws_kms as kms, aws_sns as sns, aws_sns_subscriptions as subs
from constructs import Construct

from constructs_lib.model_bucket import ModelBucket
from stacks.outputs import publish


class SharedStack(Stack):
    def __init__(self, scope: Construct, id_: str, *, env_name: str, model_bucket_name: str, model_prefix: str,
                 alarm_email: Optional[str] = None, **kwargs) -> None:
        super().__init__(scope, id_, **kwargs)
        self.models = ModelBucket(self, "Models", bucket_name=model_bucket_name)

        self.alarm_key = kms.Key(self, "AlarmTopicKey", enable_key_rotation=True,
                                 description="SemIf alarm topic encryption")
        # CloudWatch alarms publish to the encrypted topic as the CloudWatch service.
        self.alarm_key.grant(iam.ServicePrincipal("cloudwatch.amazonaws.com"), "kms:Decrypt", "kms:GenerateDataKey")
        self.alarm_topic = sns.Topic(self, "AlarmTopic", display_name=f"SemIf {env_name} alarms",
                                     master_key=self.alarm_key, enforce_ssl=True)
        if alarm_email:
            self.alarm_topic.add_subscription(subs.EmailSubscription(alarm_email))

        publish(self, env_name=env_name, key="model-bucket/name", value=self.models.bucket.bucket_name,
                description="S3 bucket holding models under models/<name>/<version>/")
        publish(self, env_name=env_name, key="model-prefix", value=model_prefix,
                description="Model prefix the endpoints serve")
        publish(self, env_name=env_name, key="alarm-topic-arn", value=self.alarm_topic.topic_arn,
                description="SNS topic receiving the endpoints' alarms")
