"""The text path of one environment: the llama.cpp DLC serving chat completions."""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Sequence

from aws_cdk import Duration, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms, aws_logs as logs, aws_s3 as s3, aws_sns as sns
from constructs import Construct

from constructs_lib.chat_endpoint import ChatEndpoint
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.image_sources import DlcImage
from constructs_lib.model_check import ModelCheck
from constructs_lib.trust import named_role_principal
from stacks.outputs import publish


class TextStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        env_name: str,
        variant: Literal["cpu", "gpu"],
        image_digest: Optional[str],
        model_bucket_name: str,
        model_key: kms.IKey,
        model_prefix: str,
        endpoint_name: str,
        compute: EndpointCompute,
        llama_cpp: Mapping[str, Any],
        alarm_topic: sns.ITopic,
        alarm_thresholds: EndpointAlarmThresholds,
        log_retention: logs.RetentionDays,
        client_role_arns: Sequence[str],
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
        **kwargs,
    ) -> None:
        super().__init__(scope, id_, **kwargs)
        # By name, not by cross-stack reference: the IAM resources stay plain strings.
        model_bucket = s3.Bucket.from_bucket_name(self, "ModelBucket", model_bucket_name)
        self.endpoint = ChatEndpoint(
            self, "Chat", endpoint_name=endpoint_name, image=DlcImage(variant=variant, digest=image_digest),
            model_bucket=model_bucket, model_key=model_key, model_prefix=model_prefix, llama_cpp=llama_cpp,
            compute=compute, alarm_topic=alarm_topic, alarm_thresholds=alarm_thresholds,
            log_retention=log_retention, removal_policy=removal_policy,
        )
        # The DLC serves the same GGUF from the same prefix: checked here too, so this stack stands on its own.
        self.model_check = ModelCheck(self, "ModelCheck", model_bucket=model_bucket, model_key=model_key,
                                      model_prefix=model_prefix, log_retention=log_retention,
                                      removal_policy=removal_policy)
        self.model_check.guard(self.endpoint.cfn_model)
        # The named app roles assume this role to mint short-lived bearer tokens for the OpenAI-compatible route.
        if not client_role_arns:
            raise ValueError("client_role_arns: name at least one role that may call the chat endpoint")
        # By account and aws:PrincipalArn, not by role principal: the app roles may not exist yet, and may be
        # re-created.
        self.client_role = iam.Role(self, "ChatClientRole", assumed_by=named_role_principal(*client_role_arns),
                                    max_session_duration=Duration.hours(1),
                                    description=f"Calls {endpoint_name} (InvokeEndpoint and bearer tokens) only")
        self.endpoint.grant_invoke(self.client_role)
        self.endpoint_name_output = publish(self, env_name=env_name, key="text/endpoint-name", value=endpoint_name,
                                            description="Chat-completions endpoint name (llama.cpp DLC)")
        publish(self, env_name=env_name, key="text/endpoint-arn", value=self.endpoint.endpoint_arn,
                description="Chat-completions endpoint ARN")
        publish(self, env_name=env_name, key="text/client-role-arn", value=self.client_role.role_arn,
                description="Role to assume for chat completions through the OpenAI-compatible route")
