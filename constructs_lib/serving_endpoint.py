"""A llama.cpp model served by a SageMaker real-time endpoint: the part both paths share.

Owns the execution role (least privilege), the Model, the EndpointConfig, the Endpoint with a
fixed name, autoscaling, the endpoint's log group and the alarms every endpoint gets.
Model and EndpointConfig names are left to CloudFormation: a new image digest or setting makes
a new EndpointConfig, and CloudFormation updates the endpoint in place. The update keeps the
variant's current instance count (RetainAllVariantProperties) and shifts traffic blue/green
(canary when the fleet has two or more instances), rolling back on one-minute error and latency alarms.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Mapping, Optional

import jsii
from aws_cdk import (
    ArnFormat,
    Duration,
    RemovalPolicy,
    Stack,
    Token,
    aws_applicationautoscaling as appscaling,
    aws_cloudwatch as cloudwatch,
    aws_iam as iam,
    aws_kms as kms,
    aws_logs as logs,
    aws_s3 as s3,
    aws_sagemaker as sagemaker,
    aws_sns as sns,
)
from constructs import Construct

from config import settings_contract  # the SEMIF_* definition (the container package's)

from constructs_lib.adapter_metrics import AdapterLogMetrics, adapter_log_metrics
from constructs_lib.endpoint_alarms import (INSTANCE_ALARMS, ROLLBACK_ALARMS, EndpointAlarmThresholds, alarm_name,
                                           notify, sagemaker_endpoint_alarms)
from constructs_lib.endpoint_compute import EndpointCompute
from constructs_lib.image_sources import ContainerImageSource
from constructs_lib.log_groups import encrypted_log_group
from constructs_lib.model_bucket import TARBALL_SUFFIX, check_model_prefix, grant_model_read
from constructs_lib.nag import acknowledge_wildcard_resource
from constructs_lib.trust import sagemaker_principal

VARIANT_NAME = "AllTraffic"
# Blue/green: how long the canary (or the whole new fleet, for one-instance endpoints) serves before the rest of
# the traffic moves, and how long the old fleet stays up for a rollback afterwards.
CANARY_BAKE_S = 600
TERMINATION_WAIT_S = 600
# A GPU fleet may wait for capacity (VariantInstanceProvisionTimeoutInSeconds, at most 1 h, shared by all its
# pools), then download the model and start: a blue/green update gets three hours in all.
MAX_DEPLOYMENT_S = 3 * 3600
# How the endpoint spreads requests over its instances (ProductionVariantRoutingConfig.RoutingStrategy,
# https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariantRoutingConfig.html; CloudFormation:
# https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-properties-sagemaker-endpointconfig-routingconfig.html).
# Without a RoutingConfig SageMaker routes at RANDOM. LEAST_OUTSTANDING_REQUESTS sends a request to "the specific
# instances that have more capacity to process them": an adapter instance admits 1 running + SEMIF_MAX_QUEUE waiting
# requests and answers 503 beyond, so random routing can fill one instance's queue while another is idle.
LEAST_OUTSTANDING_REQUESTS = "LEAST_OUTSTANDING_REQUESTS"
ROUTING_STRATEGIES = (LEAST_OUTSTANDING_REQUESTS, "RANDOM")


# IAM role names: at most 64 characters, unique in the account across every region
# (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_iam-quotas.html).
ROLE_NAME_MAX = 64
# SageMaker endpoint names: 1 to 63 letters, digits and inner hyphens
# (EndpointName, https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateEndpoint.html).
ENDPOINT_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


def check_names(endpoint_name: str, role_name: Optional[str]) -> None:
    """Refuse, at synth, the names SageMaker or IAM would refuse minutes into a deploy. The environments file checks
    its own names; this covers an app that builds the constructs itself."""
    if not Token.is_unresolved(endpoint_name) and not ENDPOINT_NAME.match(endpoint_name):
        raise ValueError(f"endpoint_name: {endpoint_name!r} is not a SageMaker endpoint name (1 to 63 letters, digits "
                         "and '-', starting and ending with a letter or digit)")
    if role_name is not None and not Token.is_unresolved(role_name) and not 1 <= len(role_name) <= ROLE_NAME_MAX:
        raise ValueError(f"role_name: {role_name!r} has {len(role_name)} characters; IAM allows 1 to {ROLE_NAME_MAX} "
                         "(model_role_name shortens a long one)")


def endpoint_log_group_name(endpoint_name: str) -> str:
    return f"/aws/sagemaker/Endpoints/{endpoint_name}"


def grant_secret_references(role: iam.IRole, environment: Mapping[str, str]) -> None:
    """Read exactly the secrets the adapter's environment names by reference (``SEMIF_*_SECRET_ARN``), nothing else.
    A secret encrypted with a customer managed key also needs kms:Decrypt for the role in that key's policy (the
    aws/secretsmanager key needs nothing more)."""
    arns = sorted(arn for name, arn in environment.items() if name in settings_contract.SECRET_REFERENCES)
    if arns:
        role.add_to_principal_policy(iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=arns))


def model_role_name(env_name: str, endpoint_name: str, kind: str) -> str:
    """The fixed name of a role that runs ``endpoint_name``'s model in environment ``env_name``: ``kind`` is
    ``endpoint`` (the execution role) or ``transform`` (Batch Transform). Fixed, so that the image repository of
    another account can name it before it exists; the environment's name keeps two environments of one account apart
    (an endpoint name is unique only per region). Past 64 characters the name is cut and ends in a hash of the whole."""
    name = f"semif-{env_name}-{endpoint_name}-{kind}"
    if len(name) <= ROLE_NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:ROLE_NAME_MAX - len(digest) - 1]}-{digest}"


@jsii.implements(iam.IGrantable)
class ServingEndpoint(Construct):
    def __init__(
        self,
        scope: Construct,
        id_: str,
        *,
        endpoint_name: str,
        image: ContainerImageSource,
        model_bucket: s3.IBucket,
        model_key: kms.IKey,
        model_prefix: str,
        environment: Mapping[str, str],
        compute: EndpointCompute,
        alarm_topic: sns.ITopic,
        alarm_thresholds: EndpointAlarmThresholds,
        log_retention: logs.RetentionDays,
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
        adapter_low_margin_threshold: Optional[float] = None,
        role_name: Optional[str] = None,
        routing_strategy: Optional[str] = None,
    ) -> None:
        """``adapter_low_margin_threshold`` marks an endpoint that runs the SemIf adapter: its JSON log lines
        become metrics, and its 503s (queue full) are alarmed on apart from other 5xx. ``role_name``: a fixed name
        for the execution role (model_role_name), for a repository policy that names it. ``routing_strategy``:
        the variant's RoutingConfig (one of ROUTING_STRATEGIES); None leaves SageMaker's default (RANDOM)."""
        check_names(endpoint_name, role_name)
        if routing_strategy is not None and routing_strategy not in ROUTING_STRATEGIES:
            raise ValueError(f"routing_strategy: {routing_strategy!r} is not one of {', '.join(ROUTING_STRATEGIES)}")
        check_model_prefix(model_prefix)
        super().__init__(scope, id_)
        stack = Stack.of(self)
        self.endpoint_name = endpoint_name
        self.variant_name = VARIANT_NAME
        self.compute = compute
        self.model_prefix = model_prefix
        self.endpoint_arn = stack.format_arn(service="sagemaker", resource="endpoint",
                                             resource_name=endpoint_name.lower())

        # SageMaker writes container stdout here; creating it before the endpoint lets us own retention and
        # filters (SageMaker then finds it and does not create its own). With RETAIN_ON_UPDATE_OR_DELETE a failed
        # first deploy removes it on rollback, so the retry does not meet "already exists"; DESTROY (dev) removes
        # it with the stack, after the endpoint that writes to it.
        log_group_name = endpoint_log_group_name(endpoint_name)
        self.log_key = kms.Key(self, "LogKey", enable_key_rotation=True, removal_policy=removal_policy,
                               description=f"Log encryption for endpoint {endpoint_name}")
        self.log_group = encrypted_log_group(self, "Logs", log_group_name=log_group_name, key=self.log_key,
                                             retention=log_retention, removal_policy=removal_policy)

        self.role = iam.Role(self, "ExecutionRole", assumed_by=sagemaker_principal(stack),
                             role_name=role_name, description=f"Execution role of SageMaker endpoint {endpoint_name}")
        image_uri = grant_model_runtime(self, self.role, image=image, model_bucket=model_bucket, model_key=model_key,
                                        model_prefix=model_prefix)
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
            resources=[self.log_group.log_group_arn],
        ))
        # SageMaker's CreateModel documentation lists logs:CreateLogGroup among the execution role's permissions;
        # the group already exists (created above), so the call can only find it, and it may name no other group.
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["logs:CreateLogGroup"],
            resources=[stack.format_arn(service="logs", resource="log-group", resource_name=log_group_name,
                                        arn_format=ArnFormat.COLON_RESOURCE_NAME)],
        ))
        # PutMetricData has no resource-level permissions; the namespace condition narrows it.
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["cloudwatch:PutMetricData"], resources=["*"],
            conditions={"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/Endpoints"}},
        ))
        acknowledge_wildcard_resource(self.role, "*", "Only ecr:GetAuthorizationToken and cloudwatch:PutMetricData "
                                      "(namespace-conditioned) use '*': neither supports resource-level permissions.")

        self.volume_key: Optional[kms.Key] = None
        if compute.supports_volume_kms_key:
            self.volume_key = kms.Key(self, "VolumeKey", enable_key_rotation=True, removal_policy=removal_policy,
                                      description=f"ML storage volume encryption for endpoint {endpoint_name}")
            iam.Grant.add_to_principal(grantee=self.role, resource_arns=[self.volume_key.key_arn],
                                       actions=["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"])
            # Grants only for the AWS service attaching the volume, never for an arbitrary grantee.
            self.role.add_to_policy(iam.PolicyStatement(
                actions=["kms:CreateGrant"], resources=[self.volume_key.key_arn],
                conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}}))

        self.cfn_model = isolated_model(self, role=self.role, image_uri=image_uri, bucket_name=model_bucket.bucket_name,
                                        model_prefix=model_prefix, environment=environment)

        variant = sagemaker.CfnEndpointConfig.ProductionVariantProperty(
            variant_name=VARIANT_NAME,
            model_name=self.cfn_model.attr_model_name,
            initial_instance_count=compute.min_instances,
            initial_variant_weight=1,
            instance_type=compute.instance_type,
            instance_pools=[
                sagemaker.CfnEndpointConfig.InstancePoolProperty(instance_type=p.instance_type, priority=p.priority)
                for p in compute.pools_by_priority
            ] or None,
            variant_instance_provision_timeout_in_seconds=compute.provision_timeout_s,
            model_data_download_timeout_in_seconds=compute.model_download_timeout_s,
            container_startup_health_check_timeout_in_seconds=compute.startup_health_check_timeout_s,
            # GPU hosts: an AMI whose NVIDIA driver runs the image's CUDA (SageMaker's default may not).
            inference_ami_version=compute.inference_ami_version,
            routing_config=(sagemaker.CfnEndpointConfig.RoutingConfigProperty(routing_strategy=routing_strategy)
                            if routing_strategy else None),
        )
        self.cfn_endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "EndpointConfig",
            production_variants=[variant],
            kms_key_id=self.volume_key.key_arn if self.volume_key else None,
        )
        self.alarm_topic = alarm_topic
        self.adapter_metrics: Optional[AdapterLogMetrics] = None
        if adapter_low_margin_threshold is not None:
            self.adapter_metrics = adapter_log_metrics(self, log_group=self.log_group, endpoint_name=endpoint_name,
                                                       low_margin_threshold=adapter_low_margin_threshold)
        self.alarms: dict[str, cloudwatch.Alarm] = sagemaker_endpoint_alarms(
            self, endpoint_name=endpoint_name, variant_name=VARIANT_NAME, topic=alarm_topic,
            thresholds=alarm_thresholds, compute=compute,
            overload_503=self.adapter_metrics.overload_503 if self.adapter_metrics else None,
        )
        if self.adapter_metrics is not None:
            self.alarms["overload_503"] = notify(cloudwatch.Alarm(
                self, "Overload503Alarm", alarm_name=alarm_name(endpoint_name, "overload-503"),
                metric=self.adapter_metrics.overload_503,
                alarm_description=f"{endpoint_name}: adapter answered 503 (queue full) — add instances or raise "
                                  "SEMIF_MAX_QUEUE",
                threshold=alarm_thresholds.overload_503_per_5min, evaluation_periods=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ), alarm_topic)

        # Plain names, known at synth, not the alarms' Ref tokens.
        self.rollback_alarm_names: list[str] = [self.alarms[k].node.default_child.alarm_name for k in ROLLBACK_ALARMS]
        # SageMaker reads the rollback alarms with the execution role. ARNs from the fixed names: the alarms'
        # own ARN attributes would tie the role's policy, which the Model waits for, to resources created later.
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["cloudwatch:DescribeAlarms"],
            resources=[stack.format_arn(service="cloudwatch", resource="alarm", resource_name=name,
                                        arn_format=ArnFormat.COLON_RESOURCE_NAME)
                       for name in self.rollback_alarm_names]))

        self.cfn_endpoint = sagemaker.CfnEndpoint(
            self,
            "Endpoint",
            endpoint_name=endpoint_name,
            endpoint_config_name=self.cfn_endpoint_config.attr_endpoint_config_name,
            # An image, model or setting change keeps the instance count autoscaling reached (prod does not drop
            # to min_instances under load); data capture, if ever added, follows the new config.
            retain_all_variant_properties=True,
            exclude_retained_variant_properties=[
                sagemaker.CfnEndpoint.VariantPropertyProperty(variant_property_type="DataCaptureConfig")],
            deployment_config=self._deployment_config(compute),
        )
        self.cfn_endpoint.node.add_dependency(self.log_group)
        for name in ROLLBACK_ALARMS:
            self.cfn_endpoint.node.add_dependency(self.alarms[name])
        # CloudFormation finishes creating an endpoint once it is InService: its instance alarms start then, not
        # while the instances provision.
        for name in INSTANCE_ALARMS:
            if name in self.alarms:
                self.alarms[name].node.add_dependency(self.cfn_endpoint)
        # Plain names (the bake step lists exactly these), not the alarms' Ref tokens.
        self.alarm_names: list[str] = sorted(a.node.default_child.alarm_name for a in self.alarms.values())

        self.scalable_target: Optional[appscaling.ScalableTarget] = None
        if compute.autoscaling_enabled:
            self._autoscaling(stack, compute)

    def _deployment_config(self, compute: EndpointCompute) -> sagemaker.CfnEndpoint.DeploymentConfigProperty:
        """Blue/green with auto-rollback. A canary needs at most half the new fleet, so one-instance endpoints
        move all at once and bake before the old fleet goes."""
        if compute.min_instances >= 2:
            routing = sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
                type="CANARY", wait_interval_in_seconds=CANARY_BAKE_S,
                canary_size=sagemaker.CfnEndpoint.CapacitySizeProperty(type="INSTANCE_COUNT", value=1))
        else:
            routing = sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
                type="ALL_AT_ONCE", wait_interval_in_seconds=CANARY_BAKE_S)
        return sagemaker.CfnEndpoint.DeploymentConfigProperty(
            blue_green_update_policy=sagemaker.CfnEndpoint.BlueGreenUpdatePolicyProperty(
                traffic_routing_configuration=routing, termination_wait_in_seconds=TERMINATION_WAIT_S,
                maximum_execution_timeout_in_seconds=MAX_DEPLOYMENT_S),
            auto_rollback_configuration=sagemaker.CfnEndpoint.AutoRollbackConfigProperty(alarms=[
                sagemaker.CfnEndpoint.AlarmProperty(alarm_name=name) for name in self.rollback_alarm_names]),
        )

    def _autoscaling(self, stack: Stack, compute: EndpointCompute) -> None:
        endpoint_name = self.endpoint_name
        self.scalable_target = appscaling.ScalableTarget(
            self,
            "Scaling",
            service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
            resource_id=f"endpoint/{endpoint_name}/variant/{VARIANT_NAME}",
            scalable_dimension="sagemaker:variant:DesiredInstanceCount",
            min_capacity=compute.min_instances,
            max_capacity=compute.max_instances,
            # Imported only so that CDK creates no role of its own; RoleARN is dropped below.
            role=iam.Role.from_role_arn(
                self, "ScalingRole",
                f"arn:{stack.partition}:iam::{stack.account}:role/aws-service-role/"
                "sagemaker.application-autoscaling.amazonaws.com/"
                "AWSServiceRoleForApplicationAutoScaling_SageMakerEndpoint",
                mutable=False),
        )
        # No RoleARN: Application Auto Scaling then uses its service-linked role for SageMaker and creates it when
        # the account has none (RegisterScalableTarget). Naming the role fails on an account that never had it
        # ("Unable to assume IAM role"), and AWS::IAM::ServiceLinkedRole fails in the second stack that declares it.
        self.scalable_target.node.default_child.add_property_deletion_override("RoleARN")
        self.scalable_target.node.add_dependency(self.cfn_endpoint)
        # Requests in flight (running + queued), reported every 10 s: it rises as soon as the queue does, where
        # InvocationsPerInstance (per minute, blind to request cost) reacts after the queue already answers 503.
        self.scalable_target.scale_to_track_metric(
            "ConcurrentRequests",
            # A fixed name: the same template whether the stack is deployed by hand or by the pipeline.
            policy_name=f"{endpoint_name}-concurrency",
            target_value=compute.target_concurrency,
            predefined_metric=appscaling.PredefinedMetric.SAGEMAKER_VARIANT_CONCURRENT_REQUESTS_PER_MODEL_HIGH_RESOLUTION,
            scale_in_cooldown=Duration.minutes(10),
            scale_out_cooldown=Duration.minutes(2),
        )

    @property
    def grant_principal(self) -> iam.IPrincipal:
        return self.role

    def metric(self, metric_name: str, *, statistic: str = "Sum",
               period: Duration = Duration.minutes(5)) -> cloudwatch.Metric:
        return cloudwatch.Metric(namespace="AWS/SageMaker", metric_name=metric_name, statistic=statistic,
                                 period=period,
                                 dimensions_map={"EndpointName": self.endpoint_name, "VariantName": VARIANT_NAME})

    def grant_invoke(self, grantee: iam.IGrantable) -> iam.Grant:
        """``sagemaker:InvokeEndpoint`` (and its streaming form) on this endpoint only."""
        return iam.Grant.add_to_principal(
            grantee=grantee, actions=["sagemaker:InvokeEndpoint", "sagemaker:InvokeEndpointWithResponseStream"],
            resource_arns=[self.endpoint_arn])


def target_concurrency(*, admitted_per_instance: int, fraction: float) -> float:
    """The ConcurrentRequestsPerModel target: ``fraction`` of what one instance admits before it refuses.

    Decision endpoints admit 1 running + SEMIF_MAX_QUEUE waiting requests; a 503 comes when that is full, so the
    target sits well below it. Rounded to a tenth (the metric is an average over instances).
    """
    return max(1.0, math.floor(admitted_per_instance * fraction * 10) / 10)


def grant_model_runtime(scope: Construct, role: iam.Role, *, image: ContainerImageSource, model_bucket: s3.IBucket,
                        model_key: kms.IKey, model_prefix: str) -> str:
    """What running the model needs, for an endpoint's role and Batch Transform's alike: read the model's own
    prefix (and decrypt it), pull the image. Returns the image URI."""
    object_pattern = grant_model_read(role, bucket=model_bucket, key=model_key, model_prefix=model_prefix)
    if object_pattern.endswith("*"):
        acknowledge_wildcard_resource(role, model_bucket.arn_for_objects(object_pattern),
                                      "Reads the objects under this model's own prefix (GGUF and manifest), "
                                      "whose file names the stack does not know.")
    return image.bind(scope, role)


def isolated_model(scope: Construct, *, role: iam.Role, image_uri: str, bucket_name: str, model_prefix: str,
                   environment: Mapping[str, str], model_data_url_key: Optional[str] = None) -> sagemaker.CfnModel:
    """A network-isolated SageMaker Model of one image and one model prefix, created after its role's policy
    (SageMaker checks the role's access when it creates the model). The endpoint and Batch Transform share it.

    ``model_data_url_key``: the ``model.tar.gz`` to name as ModelDataUrl instead of a ModelDataSource, for Batch
    Transform, which refuses a Model whose container uses ModelDataSource."""
    model_data = (_model_data(bucket_name, model_prefix) if model_data_url_key is None
                  else {"model_data_url": f"s3://{bucket_name}/{model_data_url_key}"})
    model = sagemaker.CfnModel(
        scope,
        "Model",
        execution_role_arn=role.role_arn,
        enable_network_isolation=True,
        primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
            image=image_uri,
            mode="SingleModel",
            environment=dict(environment),
            **model_data,
        ),
    )
    model.node.add_dependency(role.node.find_child("DefaultPolicy"))
    return model


def _model_data(bucket_name: str, model_prefix: str) -> dict:
    check_model_prefix(model_prefix)  # an S3Prefix S3Uri must end in '/'
    uri = f"s3://{bucket_name}/{model_prefix}"
    if model_prefix.endswith(TARBALL_SUFFIX):
        source = sagemaker.CfnModel.S3DataSourceProperty(s3_uri=uri, s3_data_type="S3Object",
                                                         compression_type="Gzip")
    else:
        source = sagemaker.CfnModel.S3DataSourceProperty(s3_uri=uri, s3_data_type="S3Prefix",
                                                         compression_type="None")
    return {"model_data_source": sagemaker.CfnModel.ModelDataSourceProperty(s3_data_source=source)}
