"""Per-environment shared pieces: the model bucket, the alarm topic, and the role the pipeline's checks use.

Deployed before the endpoint stacks, which find these by name: a model must be in the bucket before an
endpoint is created, and the pipeline checks that with the role defined here.
"""

from __future__ import annotations

from typing import Optional, Sequence

from aws_cdk import ArnFormat, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms, aws_sns as sns, aws_sns_subscriptions as subs
from constructs import Construct

from constructs_lib.model_bucket import ModelBucket
from constructs_lib.model_check import MANIFEST_NAME, model_object_listing, model_object_patterns  # noqa: F401 (MANIFEST_NAME: re-exported)
from constructs_lib.nag import acknowledge_wildcard_resource, checkov_skip
from constructs_lib.trust import named_role_principal
from stacks.outputs import publish

_COLON_RESOURCE_NAME = ArnFormat.COLON_RESOURCE_NAME


def pipeline_check_role_name(env_name: str) -> str:
    return f"semif-{env_name}-pipeline-check"


def alarm_topic_name(env_name: str) -> str:
    return f"semif-{env_name}-alarms"


class SharedStack(Stack):
    def __init__(self, scope: Construct, id_: str, *, env_name: str, model_bucket_name: str, model_prefix: str,
                 alarm_email: Optional[str] = None, removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
                 pipeline_check_principal_arn: Optional[str] = None, endpoint_names: tuple[str, ...] = (),
                 check_reads: Sequence[str] = (), check_writes: Sequence[str] = (), check_lists: Sequence[str] = (),
                 check_describes_endpoint_configs: bool = False, **kwargs) -> None:
        """What the pipeline's stage checks (``stacks.pipeline_stack.StageCheck``) may do as this environment's check
        role, in the model bucket: ``check_reads`` / ``check_writes``, keys (``eval/decisions.jsonl``) or prefixes
        ending in '/' (``reports/staging/``) they read or write, with the model key; ``check_lists``, the exact key
        prefixes they may list (``s3:prefix``). ``check_describes_endpoint_configs``: they may read the endpoint
        configs (the instance types an evaluation records)."""
        super().__init__(scope, id_, **kwargs)
        self.models = ModelBucket(self, "Models", bucket_name=model_bucket_name, removal_policy=removal_policy,
                                  auto_delete_objects=removal_policy == RemovalPolicy.DESTROY)

        provider = self.node.try_find_child("Custom::S3AutoDeleteObjectsCustomResourceProvider")
        if provider is not None:
            handler = provider.node.find_child("Handler")
            for check_id, reason in (
                ("CKV_AWS_115", "CDK's S3 auto-delete handler runs only when the stack deletes a disposable "
                                "(dev/staging) bucket; reserved concurrency would guard nothing."),
                ("CKV_AWS_116", "CDK's S3 auto-delete handler is invoked synchronously by CloudFormation, which "
                                "reports its failure; there is no asynchronous event to dead-letter."),
                ("CKV_AWS_117", "CDK's S3 auto-delete handler calls only the S3 API; a VPC would add NAT cost and "
                                "no isolation to a function that touches no private network."),
            ):
                checkov_skip(handler, check_id, reason)
        self.alarm_key = kms.Key(self, "AlarmTopicKey", enable_key_rotation=True, removal_policy=removal_policy,
                                 description="SemIf alarm topic encryption")
        # CloudWatch alarms publish to the encrypted topic as the CloudWatch service, for this account's alarms only
        # (the confused-deputy guard).
        self.alarm_key.add_to_resource_policy(iam.PolicyStatement(
            principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            actions=["kms:Decrypt", "kms:GenerateDataKey"], resources=["*"],
            conditions={"StringEquals": {"aws:SourceAccount": self.account}}))
        self.alarm_topic = sns.Topic(self, "AlarmTopic", topic_name=alarm_topic_name(env_name),
                                     display_name=f"SemIf {env_name} alarms", master_key=self.alarm_key,
                                     enforce_ssl=True)
        # enforce_ssl writes a topic policy, which replaces SNS's default one: without this statement CloudWatch
        # may not publish, and every alarm action fails silently. This account's alarms only.
        self.alarm_topic.add_to_resource_policy(iam.PolicyStatement(
            sid="CloudWatchAlarmsPublish",
            principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            actions=["sns:Publish"], resources=[self.alarm_topic.topic_arn],
            conditions={"StringEquals": {"aws:SourceAccount": self.account},
                        "ArnLike": {"aws:SourceArn": self.format_arn(
                            service="cloudwatch", resource="alarm", resource_name="*",
                            arn_format=_COLON_RESOURCE_NAME)}}))
        if alarm_email:
            self.alarm_topic.add_subscription(subs.EmailSubscription(alarm_email))

        self.pipeline_check_role: Optional[iam.Role] = None
        if pipeline_check_principal_arn:
            self.pipeline_check_role = self._pipeline_check_role(env_name, model_prefix, pipeline_check_principal_arn,
                                                                 endpoint_names)
            self._grant_check_access(self.pipeline_check_role, reads=check_reads, writes=check_writes,
                                     lists=check_lists)
            if check_describes_endpoint_configs:
                self._grant_endpoint_config_reads(self.pipeline_check_role)

        publish(self, env_name=env_name, key="model-bucket/name", value=self.models.bucket.bucket_name,
                description="S3 bucket holding models under models/<name>/<version>/")
        publish(self, env_name=env_name, key="model-prefix", value=model_prefix, stable=False,
                description="Model prefix the endpoints serve")
        publish(self, env_name=env_name, key="alarm-topic-arn", value=self.alarm_topic.topic_arn,
                description="SNS topic receiving the endpoints' alarms")
        # The key the release checks name when they write reports (S3 applies the AWS managed key otherwise).
        self.model_key_arn_output = publish(self, env_name=env_name, key="model-bucket/key-arn",
                                            value=self.models.key.key_arn,
                                            description="KMS key of the model bucket (SSE-KMS for objects written to it)")

    def _grant_check_access(self, role: iam.Role, *, reads: Sequence[str], writes: Sequence[str],
                            lists: Sequence[str]) -> None:
        """Read the objects of ``reads`` and write those of ``writes`` (keys, or prefixes ending in '/'), with the
        model key; list exactly the key prefixes of ``lists``."""
        for location in (*reads, *writes, *lists):
            if not location or location.startswith("/") or "*" in location:
                raise ValueError(f"check location {location!r}: a key, or a key prefix ending in '/', of the model "
                                 "bucket (no leading '/', no wildcard)")
        pattern = lambda location: f"{location}*" if location.endswith("/") else location  # noqa: E731
        if reads:
            role.add_to_policy(iam.PolicyStatement(
                actions=["s3:GetObject"], resources=[self.models.bucket.arn_for_objects(pattern(p)) for p in reads]))
        if lists:
            role.add_to_policy(iam.PolicyStatement(
                actions=["s3:ListBucket"], resources=[self.models.bucket.bucket_arn],
                conditions={"StringEquals": {"s3:prefix": list(lists)}}))
        if writes:
            role.add_to_policy(iam.PolicyStatement(
                actions=["s3:PutObject"], resources=[self.models.bucket.arn_for_objects(pattern(p)) for p in writes]))
            role.add_to_policy(iam.PolicyStatement(actions=["kms:GenerateDataKey"],
                                                   resources=[self.models.key.key_arn]))
        for location in sorted({p for p in (*reads, *writes) if p.endswith("/")}):
            acknowledge_wildcard_resource(role, self.models.bucket.arn_for_objects(f"{location}*"),
                                          f"The pipeline's stage checks read or write the objects under {location}, "
                                          "one folder per pipeline execution, whose id each run brings.")

    def _grant_endpoint_config_reads(self, role: iam.Role) -> None:
        """DescribeEndpointConfig on this account's and region's endpoint configs: CloudFormation names an endpoint
        config itself (a new name on every replacement), so no narrower ARN names it before it exists."""
        configs = self.format_arn(service="sagemaker", resource="endpoint-config", resource_name="*")
        role.add_to_policy(iam.PolicyStatement(actions=["sagemaker:DescribeEndpointConfig"], resources=[configs]))
        acknowledge_wildcard_resource(
            role, configs, "Read-only: the release checks record the instance types of the endpoint's current config, "
            "whose name CloudFormation generates on every replacement; InvokeEndpoint stays on the named endpoints.")

    def _pipeline_check_role(self, env_name: str, model_prefix: str, principal_arn: str,
                             endpoint_names: tuple[str, ...]) -> iam.Role:
        """The pipeline's pre-deploy model check, post-deploy smoke tests and bake step run as this role.

        It trusts one named role of the pipeline account, and reads only what those checks read.
        """
        role = iam.Role(self, "PipelineCheckRole", role_name=pipeline_check_role_name(env_name),
                        assumed_by=named_role_principal(principal_arn),
                        description="The pipeline's model check, smoke tests and bake check for this environment")
        # The pipeline's CheckModel step runs the model check custom resource's own check: the same objects.
        # The decision stack's check, Batch Transform tarball included.
        patterns = model_object_patterns(model_prefix, transform_tarball=True)
        role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"],
                                               resources=[self.models.bucket.arn_for_objects(p) for p in patterns]))
        role.add_to_policy(model_object_listing(self.models.bucket, model_prefix, transform_tarball=True))
        role.add_to_policy(iam.PolicyStatement(actions=["kms:Decrypt"], resources=[self.models.key.key_arn]))
        for pattern in patterns:
            if pattern.endswith("*.gguf"):
                acknowledge_wildcard_resource(
                    role, self.models.bucket.arn_for_objects(pattern),
                    "The model check reads the GGUF the manifest names, directly in this model's prefix; its file "
                    "name is in the manifest, not known at synth.")
        endpoints = [self.format_arn(service="sagemaker", resource="endpoint", resource_name=name)
                     for name in endpoint_names]
        if endpoints:
            role.add_to_policy(iam.PolicyStatement(
                actions=["sagemaker:DescribeEndpoint", "sagemaker:InvokeEndpoint"], resources=endpoints))
        # Every alarm of this environment is named <endpoint>-<kind>: the bake step lists their states.
        role.add_to_policy(iam.PolicyStatement(actions=["cloudwatch:DescribeAlarms"], resources=[
            self.format_arn(service="cloudwatch", resource="alarm", resource_name=f"{name}-*",
                            arn_format=_COLON_RESOURCE_NAME) for name in endpoint_names] or [
            self.format_arn(service="cloudwatch", resource="alarm", resource_name=f"semif-{env_name}-*",
                            arn_format=_COLON_RESOURCE_NAME)]))
        for name in endpoint_names:
            acknowledge_wildcard_resource(
                role, self.format_arn(service="cloudwatch", resource="alarm", resource_name=f"{name}-*",
                                      arn_format=_COLON_RESOURCE_NAME),
                f"The bake step reads the state of {name}'s alarms, all named {name}-<kind>.")
        return role
