"""Decision and chat endpoint constructs, asserted on a purpose-built small app."""

from __future__ import annotations

import json
import re

import pytest
from aws_cdk import App, Environment, Stack, aws_ecr as ecr, aws_iam as iam, aws_kms as kms
from aws_cdk import aws_logs as logs, aws_s3 as s3, aws_sns as sns
from aws_cdk.assertions import Match, Template

from config import AdapterSettings
from constructs_lib.chat_endpoint import ChatEndpoint
from constructs_lib.decision_endpoint import DecisionEndpoint
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute, InstancePool
from constructs_lib.image_sources import BuiltImage, DlcImage

ENV = Environment(account="123456789012", region="us-east-1")
DIGEST = "sha256:" + "ab" * 32
GPU_POOLS = [("ml.g6e.xlarge", 1), ("ml.g6.xlarge", 2), ("ml.g5.xlarge", 3), ("ml.g4dn.xlarge", 4)]
ADAPTER = AdapterSettings(n_ctx=4096, n_batch=512, n_threads=8, n_gpu_layers=-1, scoring="label", prefix_cache=True,
                          max_queue=8, queue_timeout_s=30, retry_after_s=1, max_options=255, max_questions=400,
                          max_body_bytes=1048576, log_level="INFO")
THRESHOLDS = EndpointAlarmThresholds(invocation_5xx_per_5min=3, model_latency_p95_ms=4000, overload_503_per_5min=7)
CHAT_THRESHOLDS = EndpointAlarmThresholds(invocation_5xx_per_5min=2, model_latency_p95_ms=45000)
GPU_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"


def compute(**overrides) -> EndpointCompute:
    values = dict(min_instances=1, max_instances=3, target_concurrency=4.5, model_download_timeout_s=1200,
                  startup_health_check_timeout_s=900)
    values.update(overrides)
    return EndpointCompute(**values)


def _deps(stack: Stack):
    bucket = s3.Bucket.from_bucket_name(stack, "ModelBucket", "models-bucket")
    key = kms.Key.from_key_arn(stack, "ModelKey",
                               "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555")
    topic = sns.Topic(stack, "Topic")
    repo = ecr.Repository.from_repository_name(stack, "Repo", "semif-adapter")
    return bucket, key, topic, repo


def decision_stack(app: App, id_: str, *, compute_: EndpointCompute, model_prefix: str = "models/m/1/"):
    stack = Stack(app, id_, env=ENV)
    bucket, key, topic, repo = _deps(stack)
    endpoint = DecisionEndpoint(
        stack, "Decision", endpoint_name=f"{id_.lower()}-decision", image=BuiltImage(repository=repo, digest=DIGEST),
        model_bucket=bucket, model_key=key, model_prefix=model_prefix, adapter_environment=ADAPTER.to_environment(),
        compute=compute_, alarm_topic=topic, alarm_thresholds=THRESHOLDS, low_margin_threshold=0.15,
        log_retention=logs.RetentionDays.ONE_MONTH,
    )
    app_role = iam.Role(stack, "AppRole", assumed_by=iam.AccountPrincipal("123456789012"))
    endpoint.grant_invoke(app_role)
    return stack, endpoint


@pytest.fixture(scope="module")
def stacks():
    app = App()
    gpu, gpu_endpoint = decision_stack(app, "Gpu", compute_=compute(
        # Deliberately out of order: the construct emits them by priority.
        instance_pools=[InstancePool(instance_type=t, priority=p) for t, p in reversed(GPU_POOLS)],
        provision_timeout_s=1800,
        min_instances=2, max_instances=4, inference_ami_version=GPU_AMI))
    cpu, cpu_endpoint = decision_stack(app, "Cpu", compute_=compute(instance_type="ml.c6i.8xlarge"),
                                       model_prefix="models/m/2/model.tar.gz")
    chat = Stack(app, "Chat", env=ENV)
    bucket, key, topic, _ = _deps(chat)
    chat_endpoint = ChatEndpoint(
        chat, "Chat", endpoint_name="chat-endpoint", image=DlcImage(variant="gpu"), model_bucket=bucket,
        model_key=key, model_prefix="models/m/1/",
        llama_cpp={"ctx_size": 4096, "n_gpu_layers": 999, "threads": 4, "batch_size": 512, "parallel": 2,
                   "jinja": True, "mlock": False},
        compute=compute(instance_type="ml.g6.xlarge", target_concurrency=2.0, inference_ami_version=GPU_AMI),
        alarm_topic=topic, alarm_thresholds=CHAT_THRESHOLDS, log_retention=logs.RetentionDays.ONE_MONTH,
    )
    chat_role = iam.Role(chat, "AppRole", assumed_by=iam.AccountPrincipal("123456789012"))
    chat_endpoint.grant_invoke(chat_role)
    return {
        "gpu": Template.from_stack(gpu), "cpu": Template.from_stack(cpu), "chat": Template.from_stack(chat),
        "gpu_endpoint": gpu_endpoint, "chat_stack": chat, "cpu_endpoint": cpu_endpoint,
    }


def only(template: Template, type_: str) -> dict:
    resources = template.find_resources(type_)
    assert len(resources) == 1, f"expected one {type_}, found {len(resources)}"
    return next(iter(resources.values()))


def variant(template: Template) -> dict:
    (production_variant,) = only(template, "AWS::SageMaker::EndpointConfig")["Properties"]["ProductionVariants"]
    return production_variant


def test_gpu_variant_uses_instance_pools_in_priority_order(stacks):
    production_variant = variant(stacks["gpu"])
    assert production_variant["InstancePools"] == [
        {"InstanceType": "ml.g6e.xlarge", "Priority": 1},
        {"InstanceType": "ml.g6.xlarge", "Priority": 2},
        {"InstanceType": "ml.g5.xlarge", "Priority": 3},
        {"InstanceType": "ml.g4dn.xlarge", "Priority": 4},
    ]
    assert "InstanceType" not in production_variant
    assert production_variant["VariantInstanceProvisionTimeoutInSeconds"] == 1800


def _keys(template: Template, purpose: str) -> dict:
    return {k: r for k, r in template.find_resources("AWS::KMS::Key").items()
            if r["Properties"]["Description"].startswith(purpose)}


def test_gpu_variant_with_local_nvme_gets_no_volume_key(stacks):
    assert "KmsKeyId" not in only(stacks["gpu"], "AWS::SageMaker::EndpointConfig")["Properties"]
    assert _keys(stacks["gpu"], "ML storage volume encryption") == {}


def test_cpu_variant_uses_fixed_instance_type_and_a_volume_key(stacks):
    production_variant = variant(stacks["cpu"])
    assert production_variant["InstanceType"] == "ml.c6i.8xlarge"
    assert "InstancePools" not in production_variant
    assert "VariantInstanceProvisionTimeoutInSeconds" not in production_variant
    (key_id,) = _keys(stacks["cpu"], "ML storage volume encryption")
    assert stacks["cpu"].find_resources("AWS::KMS::Key")[key_id]["Properties"]["EnableKeyRotation"] is True
    config = only(stacks["cpu"], "AWS::SageMaker::EndpointConfig")["Properties"]
    assert config["KmsKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}


def test_variant_has_download_and_startup_timeouts_and_min_instances(stacks):
    production_variant = variant(stacks["gpu"])
    assert production_variant["ModelDataDownloadTimeoutInSeconds"] == 1200
    assert production_variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 900
    assert production_variant["InitialInstanceCount"] == 2
    assert production_variant["VariantName"] == "AllTraffic"


def test_model_pins_the_image_by_digest_and_passes_it_to_the_adapter(stacks):
    container = only(stacks["gpu"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
    image = json.dumps(container["Image"])
    assert image.endswith(f'/semif-adapter@{DIGEST}"]]}}') or f"semif-adapter@{DIGEST}" in image
    assert ":" + "latest" not in image
    assert container["Environment"]["SEMIF_IMAGE_DIGEST"] == DIGEST


def test_model_runs_with_network_isolation(stacks):
    for name in ("gpu", "cpu", "chat"):
        assert only(stacks[name], "AWS::SageMaker::Model")["Properties"]["EnableNetworkIsolation"] is True


def test_model_reads_an_uncompressed_prefix(stacks):
    container = only(stacks["gpu"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
    source = container["ModelDataSource"]["S3DataSource"]
    assert source["S3DataType"] == "S3Prefix"
    assert source["CompressionType"] == "None"
    assert source["S3Uri"] == "s3://models-bucket/models/m/1/"


def test_model_accepts_tar_gz_model_data(stacks):
    container = only(stacks["cpu"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
    assert container["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://models-bucket/models/m/2/model.tar.gz", "S3DataType": "S3Object", "CompressionType": "Gzip"}


def test_model_carries_the_adapter_environment(stacks):
    environment = only(stacks["gpu"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]["Environment"]
    assert {k: v for k, v in environment.items()
            if k not in ("SEMIF_IMAGE_DIGEST", "SEMIF_REQUIRE_GPU")} == ADAPTER.to_environment()
    assert environment["SEMIF_PREFIX_CACHE"] == "1"
    assert environment["SEMIF_MAX_QUEUE"] == "8"


def test_gpu_instances_make_the_adapter_refuse_to_serve_without_a_gpu(stacks):
    gpu = only(stacks["gpu"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]["Environment"]
    cpu = only(stacks["cpu"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]["Environment"]
    assert gpu["SEMIF_REQUIRE_GPU"] == "1"
    assert "SEMIF_REQUIRE_GPU" not in cpu


def test_the_rollback_latency_alarm_ignores_minutes_with_too_few_requests_for_a_p95(stacks):
    """A one-minute p95 of two requests is the slower one: without a minimum count, one slow request at low traffic
    would roll a good release back."""
    (alarm,) = [a["Properties"] for a in stacks["gpu"].find_resources("AWS::CloudWatch::Alarm").values()
                if a["Properties"]["AlarmName"] == "gpu-decision-rollback-latency-p95"]
    metrics = {m["Id"]: m for m in alarm["Metrics"]}
    (expression,) = [m for m in metrics.values() if "Expression" in m]
    assert expression["ReturnData"] is True
    match = re.fullmatch(r"IF\((\w+) >= (\d+), (\w+), 0\)", expression["Expression"])
    assert match and int(match.group(2)) >= 20
    count, latency = metrics[match.group(1)]["MetricStat"], metrics[match.group(3)]["MetricStat"]
    assert count["Metric"]["MetricName"] == latency["Metric"]["MetricName"] == "ModelLatency"
    assert (count["Stat"], latency["Stat"], count["Period"], latency["Period"]) == ("SampleCount", "p95", 60, 60)
    assert alarm["ComparisonOperator"] == "GreaterThanThreshold" and alarm["TreatMissingData"] == "notBreaching"


def test_gpu_variants_pin_a_host_ami_whose_driver_runs_cuda_13(stacks):
    assert variant(stacks["gpu"])["InferenceAmiVersion"] == GPU_AMI
    assert variant(stacks["chat"])["InferenceAmiVersion"] == GPU_AMI
    assert "InferenceAmiVersion" not in variant(stacks["cpu"])


def test_updates_keep_the_instance_count_and_shift_traffic_blue_green_with_rollback_on_alarms(stacks):
    endpoint = only(stacks["gpu"], "AWS::SageMaker::Endpoint")
    properties = endpoint["Properties"]
    assert properties["RetainAllVariantProperties"] is True
    assert properties["ExcludeRetainedVariantProperties"] == [{"VariantPropertyType": "DataCaptureConfig"}]
    policy = properties["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"] == {
        "Type": "CANARY", "CanarySize": {"Type": "INSTANCE_COUNT", "Value": 1}, "WaitIntervalInSeconds": 600}
    assert policy["TerminationWaitInSeconds"] == 600
    rollback = [a["AlarmName"] for a in properties["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]]
    assert rollback == ["gpu-decision-rollback-server-errors", "gpu-decision-rollback-latency-p95"]
    names = {a["Properties"]["AlarmName"]: k for k, a in stacks["gpu"].find_resources("AWS::CloudWatch::Alarm").items()}
    for name in rollback:
        assert names[name] in endpoint["DependsOn"]  # the alarms exist before the endpoint names them


def _alarm_window_s(alarm: dict) -> int:
    """How long an alarm must watch before it can go to ALARM: period x datapoints it needs (at the least), and
    period x evaluation periods it looks back over (at the most)."""
    periods = ([alarm["Period"]] if "Period" in alarm else
               [m["MetricStat"]["Period"] for m in alarm["Metrics"] if "MetricStat" in m]
               + [m["Period"] for m in alarm["Metrics"] if "Expression" in m and "Period" in m])
    assert periods, alarm["AlarmName"]
    return max(periods) * alarm["EvaluationPeriods"]


@pytest.mark.parametrize("name", ["gpu", "cpu", "chat"])
def test_every_rollback_alarm_can_trip_inside_the_bake_and_the_paging_alarms_stay(stacks, name):
    """SageMaker rolls a blue/green update back only on an alarm that goes to ALARM while the new fleet bakes."""
    template = stacks[name]
    deployment = only(template, "AWS::SageMaker::Endpoint")["Properties"]["DeploymentConfig"]
    bake_s = deployment["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]["WaitIntervalInSeconds"]
    by_name = {a["Properties"]["AlarmName"]: a["Properties"]
               for a in template.find_resources("AWS::CloudWatch::Alarm").values()}
    rollback = [a["AlarmName"] for a in deployment["AutoRollbackConfiguration"]["Alarms"]]
    assert len(rollback) == 2
    for alarm_name in rollback:
        alarm = by_name[alarm_name]
        assert _alarm_window_s(alarm) <= bake_s / 2, (alarm_name, _alarm_window_s(alarm), bake_s)
        assert alarm["DatapointsToAlarm"] < alarm["EvaluationPeriods"]  # 2 of 3: one noisy minute is not enough
        assert not alarm.get("AlarmActions") and not alarm.get("OKActions")  # the paging alarms page
    kinds = {n.rsplit("-rollback-", 1)[-1] for n in rollback}
    assert kinds == {"server-errors", "latency-p95"}
    endpoint = rollback[0].rsplit("-rollback-", 1)[0]
    for kind in kinds:
        paging = by_name[f"{endpoint}-{kind}"]
        assert _alarm_window_s(paging) >= 300 and paging["AlarmActions"]


def test_a_one_instance_endpoint_moves_all_at_once_and_bakes_before_the_old_fleet_goes(stacks):
    properties = only(stacks["cpu"], "AWS::SageMaker::Endpoint")["Properties"]
    routing = properties["DeploymentConfig"]["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
    assert routing == {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 600}
    assert properties["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]


def test_endpoint_has_a_fixed_name_and_model_and_config_names_are_left_to_cloudformation(stacks):
    endpoint = only(stacks["gpu"], "AWS::SageMaker::Endpoint")["Properties"]
    assert endpoint["EndpointName"] == "gpu-decision"
    config_id = next(iter(stacks["gpu"].find_resources("AWS::SageMaker::EndpointConfig")))
    assert endpoint["EndpointConfigName"] == {"Fn::GetAtt": [config_id, "EndpointConfigName"]}
    assert "ModelName" not in only(stacks["gpu"], "AWS::SageMaker::Model")["Properties"]
    assert "EndpointConfigName" not in only(stacks["gpu"], "AWS::SageMaker::EndpointConfig")["Properties"]


def test_model_waits_for_its_role_policy(stacks):
    model = only(stacks["gpu"], "AWS::SageMaker::Model")
    (policy_id,) = [k for k in stacks["gpu"].find_resources("AWS::IAM::Policy") if k.startswith("DecisionExecutionRole")]
    assert policy_id in model["DependsOn"]


def test_autoscaling_tracks_concurrent_requests_with_the_high_resolution_metric(stacks):
    target = only(stacks["gpu"], "AWS::ApplicationAutoScaling::ScalableTarget")["Properties"]
    assert target["ResourceId"] == "endpoint/gpu-decision/variant/AllTraffic"
    assert target["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    assert (target["MinCapacity"], target["MaxCapacity"]) == (2, 4)
    # Application Auto Scaling uses (and on a fresh account creates) its SageMaker service-linked role itself.
    assert "RoleARN" not in target
    assert not [r for r in stacks["gpu"].find_resources("AWS::IAM::Role").values()
                if "application-autoscaling" in json.dumps(r["Properties"]["AssumeRolePolicyDocument"])]
    stacks["gpu"].resource_count_is("AWS::IAM::ServiceLinkedRole", 0)
    policy = only(stacks["gpu"], "AWS::ApplicationAutoScaling::ScalingPolicy")["Properties"]
    tracking = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == (
        "SageMakerVariantConcurrentRequestsPerModelHighResolution")
    assert tracking["TargetValue"] == 4.5


def test_the_concurrency_target_is_a_share_of_what_one_instance_admits():
    from constructs_lib.serving_endpoint import target_concurrency

    # 1 running + 16 queued admitted; scale out at half of that, long before the 17th request gets a 503.
    assert target_concurrency(admitted_per_instance=17, fraction=0.5) == 8.5
    assert target_concurrency(admitted_per_instance=2, fraction=1.0) == 2.0
    assert target_concurrency(admitted_per_instance=1, fraction=0.25) == 1.0


def test_with_autoscaling_disabled_no_scalable_target_is_registered():
    app = App()
    stack, _ = decision_stack(app, "Fixed", compute_=compute(instance_type="ml.c6i.xlarge", autoscaling_enabled=False))
    template = Template.from_stack(stack)
    template.resource_count_is("AWS::ApplicationAutoScaling::ScalableTarget", 0)
    template.resource_count_is("AWS::ApplicationAutoScaling::ScalingPolicy", 0)


def test_log_group_is_the_endpoints_own_with_retention(stacks):
    stacks["gpu"].has_resource_properties("AWS::Logs::LogGroup", {
        "LogGroupName": "/aws/sagemaker/Endpoints/gpu-decision", "RetentionInDays": 30})
    endpoint = only(stacks["gpu"], "AWS::SageMaker::Endpoint")
    (log_group_id,) = stacks["gpu"].find_resources("AWS::Logs::LogGroup")
    assert log_group_id in endpoint["DependsOn"]


def test_metric_filter_counts_the_adapters_503_log_lines(stacks):
    (log_group_id,) = stacks["gpu"].find_resources("AWS::Logs::LogGroup")
    stacks["gpu"].has_resource_properties("AWS::Logs::MetricFilter", {
        "FilterPattern": "{ $.status = 503 }",
        "LogGroupName": {"Ref": log_group_id},
        "MetricTransformations": [{"MetricName": "Overload503", "MetricNamespace": "SemIf/gpu-decision",
                                   "MetricValue": "1", "Unit": "Count"}],
    })


def test_metric_filters_separate_client_errors_and_weak_decisions(stacks):
    template = stacks["gpu"]
    template.has_resource_properties("AWS::Logs::MetricFilter", {
        "FilterPattern": "{ $.status >= 400 && $.status < 500 }",
        "MetricTransformations": [Match.object_like({"MetricName": "ClientErrorsByCode",
                                                     "Dimensions": [{"Key": "ErrorCode", "Value": "$.error_code"}]})],
    })
    template.has_resource_properties("AWS::Logs::MetricFilter", {
        "FilterPattern": "{ $.margin < 0.15 }",
        "MetricTransformations": [Match.object_like({"MetricName": "LowMarginDecisions"})],
    })
    template.has_resource_properties("AWS::Logs::MetricFilter", {
        "FilterPattern": "{ $.label_mass < 0.5 }",
        "MetricTransformations": [Match.object_like({"MetricName": "LowLabelMassDecisions"})],
    })
    for action in ("accept", "review", "abstain"):
        template.has_resource_properties("AWS::Logs::MetricFilter", {
            "FilterPattern": f'{{ $.action = "{action}" }}',
            "MetricTransformations": [Match.object_like({"MetricName": f"Decisions{action.capitalize()}"})],
        })


def _alarm(template: Template, metric_name: str) -> dict:
    """The paging alarm on ``metric_name`` (not its one-minute rollback twin)."""
    alarms = [a["Properties"] for a in template.find_resources("AWS::CloudWatch::Alarm").values()
              if a["Properties"].get("MetricName") == metric_name and "-rollback-" not in a["Properties"]["AlarmName"]]
    assert len(alarms) == 1, metric_name
    return alarms[0]


def _named(template: Template, name: str) -> dict:
    (alarm,) = [a["Properties"] for a in template.find_resources("AWS::CloudWatch::Alarm").values()
                if a["Properties"]["AlarmName"] == name]
    return alarm


def test_alarms_notify_the_topic_on_alarm_and_ok(stacks):
    template = stacks["gpu"]
    (topic_id,) = template.find_resources("AWS::SNS::Topic")
    overload = _alarm(template, "Overload503")
    assert overload["Namespace"] == "SemIf/gpu-decision"
    assert (overload["Statistic"], overload["Threshold"], overload["Period"]) == ("Sum", 7, 300)
    latency = _alarm(template, "ModelLatency")
    assert latency["ExtendedStatistic"] == "p95"
    assert latency["Threshold"] == 4000 * 1000  # ModelLatency is in microseconds
    for alarm in template.find_resources("AWS::CloudWatch::Alarm").values():
        if "-rollback-" in alarm["Properties"]["AlarmName"]:
            continue  # only a blue/green update acts on these
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": topic_id}]
        assert alarm["Properties"]["OKActions"] == [{"Ref": topic_id}]
        assert alarm["Properties"]["AlarmName"].startswith("gpu-decision-")


def test_the_server_error_alarm_leaves_out_the_adapters_designed_in_503s(stacks):
    errors = _named(stacks["gpu"], "gpu-decision-server-errors")
    assert errors["Threshold"] == 3
    (expression,) = [m for m in errors["Metrics"] if "Expression" in m]
    assert expression["Expression"] == "FILL(errors, 0) - FILL(overload, 0)"
    by_id = {m["Id"]: m["MetricStat"]["Metric"] for m in errors["Metrics"] if "MetricStat" in m}
    assert by_id["errors"]["MetricName"] == "Invocation5XXErrors"
    assert {d["Name"]: d["Value"] for d in by_id["errors"]["Dimensions"]} == {"EndpointName": "gpu-decision",
                                                                              "VariantName": "AllTraffic"}
    assert (by_id["overload"]["Namespace"], by_id["overload"]["MetricName"]) == ("SemIf/gpu-decision", "Overload503")
    assert errors["TreatMissingData"] == "notBreaching"


def _named_resource(template: Template, name: str) -> tuple[str, dict]:
    ((logical_id, alarm),) = [(k, a) for k, a in template.find_resources("AWS::CloudWatch::Alarm").items()
                              if a["Properties"]["AlarmName"] == name]
    return logical_id, alarm


INSTANCE_KINDS = ("cpu-utilization", "memory-utilization", "disk-utilization", "gpu-utilization",
                  "gpu-memory-utilization", "scaling-at-max")


def test_no_alarm_fires_on_missing_data_and_instance_alarms_start_once_the_endpoint_is_in_service(stacks):
    """CloudWatch puts an alarm whose whole evaluation range is missing in ALARM when it treats missing data as
    breaching: every instance alarm of an endpoint that is still provisioning, and the bake would fail on it."""
    for name in ("gpu", "cpu", "chat"):
        template = stacks[name]
        (endpoint_id,) = template.find_resources("AWS::SageMaker::Endpoint")
        alarms = template.find_resources("AWS::CloudWatch::Alarm")
        assert alarms
        for logical_id, alarm in alarms.items():
            properties = alarm["Properties"]
            assert properties["TreatMissingData"] != "breaching", properties["AlarmName"]
            if properties["AlarmName"].endswith(INSTANCE_KINDS):
                assert endpoint_id in alarm.get("DependsOn", []), properties["AlarmName"]
                assert properties["TreatMissingData"] in ("missing", "notBreaching"), properties["AlarmName"]


def test_a_dead_endpoint_is_not_quiet(stacks):
    """No instance reporting leaves the CPU alarm without data: INSUFFICIENT_DATA notifies the topic."""
    template = stacks["gpu"]
    (topic_id,) = template.find_resources("AWS::SNS::Topic")
    _, cpu = _named_resource(template, "gpu-decision-cpu-utilization")
    assert cpu["Properties"]["InsufficientDataActions"] == [{"Ref": topic_id}]
    assert cpu["Properties"]["TreatMissingData"] == "missing"
    others = [a["Properties"] for a in template.find_resources("AWS::CloudWatch::Alarm").values()
              if a["Properties"].get("InsufficientDataActions")]
    assert [a["AlarmName"] for a in others] == ["gpu-decision-cpu-utilization"]  # one page for one outage


def test_instance_alarms_cover_cpu_memory_gpu_and_disk(stacks):
    template = stacks["gpu"]
    cpu = _named(template, "gpu-decision-cpu-utilization")
    assert (cpu["Namespace"], cpu["MetricName"]) == ("/aws/sagemaker/Endpoints", "CPUUtilization")
    assert cpu["Threshold"] == 90 * 4  # % x vCPUs of an xlarge
    assert _named(template, "gpu-decision-gpu-utilization")["MetricName"] == "GPUUtilization"
    assert _named(template, "gpu-decision-gpu-memory-utilization")["MetricName"] == "GPUMemoryUtilization"
    assert _named(template, "gpu-decision-disk-utilization")["MetricName"] == "DiskUtilization"
    cpu_names = {a["Properties"]["AlarmName"] for a in stacks["cpu"].find_resources("AWS::CloudWatch::Alarm").values()}
    assert "cpu-decision-gpu-utilization" not in cpu_names and "cpu-decision-cpu-utilization" in cpu_names


def test_scaling_stuck_at_max_instances_alarms(stacks):
    stuck = _named(stacks["gpu"], "gpu-decision-scaling-at-max")
    assert stuck["Threshold"] == 4 and stuck["EvaluationPeriods"] == 6
    stats = {m["Id"]: m["MetricStat"] for m in stuck["Metrics"] if "MetricStat" in m}
    assert (stats["samples"]["Metric"]["MetricName"], stats["samples"]["Stat"]) == ("CPUUtilization", "SampleCount")
    # The metric the scaling policy tracks, as the policy sees it.
    assert (stats["load"]["Metric"]["Namespace"], stats["load"]["Metric"]["MetricName"], stats["load"]["Stat"]) == (
        "AWS/SageMaker", "ConcurrentRequestsPerModel", "Average")


def _scaling_at_max_value(alarm: dict, *, instances: int, load_per_instance: float) -> float:
    """The alarm's metric math on five minutes of ``instances`` reporting CPUUtilization once a minute."""
    (expression,) = [m["Expression"] for m in alarm["Metrics"] if "Expression" in m]
    python = expression.replace("FILL(load, 0)", "load").replace(" AND ", " and ")
    assert set(re.findall(r"[A-Za-z_]+", python)) <= {"IF", "samples", "load", "and"}, expression
    return eval(python, {"IF": lambda condition, then, otherwise: then if condition else otherwise,  # noqa: S307
                         "samples": instances * 5, "load": load_per_instance})


def test_an_ordinary_blue_green_deploy_does_not_page_scaling_at_max(stacks):
    """Two instances of max four, under light load: during the update the new fleet of two reports beside the old
    one. Only a fleet at max_instances whose requests in flight are at the scaling target pages."""
    stuck = _named(stacks["gpu"], "gpu-decision-scaling-at-max")
    deploy = _scaling_at_max_value(stuck, instances=4, load_per_instance=1.0)
    saturated = _scaling_at_max_value(stuck, instances=4, load_per_instance=5.0)
    below_max = _scaling_at_max_value(stuck, instances=3, load_per_instance=5.0)
    assert stuck["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert deploy < stuck["Threshold"] and below_max < stuck["Threshold"]
    assert saturated >= stuck["Threshold"]


def test_dashboard_separates_failure_classes_from_latency_and_invocations(stacks):
    body = json.dumps(only(stacks["gpu"], "AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"])
    for title in ("Invocations", "Model latency", "503 overload (queue full)", "4xx by error_code",
                  "Decisions by action", "Low-margin decisions", "Alarms"):
        assert title in body, title
    assert "ClientErrorsByCode" in body and "DecisionsAbstain" in body and "LowLabelMassDecisions" in body


def _statements(template: Template, role_prefix: str) -> list[dict]:
    statements = []
    for logical_id, policy in template.find_resources("AWS::IAM::Policy").items():
        if logical_id.startswith(role_prefix):
            statements.extend(policy["Properties"]["PolicyDocument"]["Statement"])
    return statements


def _as_list(value):
    return value if isinstance(value, list) else [value]


def test_execution_role_names_every_resource_it_can_name(stacks):
    statements = _statements(stacks["gpu"], "DecisionExecutionRole")
    by_action = {}
    for statement in statements:
        for action in _as_list(statement["Action"]):
            by_action.setdefault(action, []).extend(_as_list(statement["Resource"]))
    assert set(by_action) == {
        "s3:GetObject", "s3:ListBucket", "kms:Decrypt", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
        "ecr:BatchCheckLayerAvailability", "ecr:GetAuthorizationToken", "logs:CreateLogGroup", "logs:CreateLogStream",
        "logs:PutLogEvents", "logs:DescribeLogStreams", "cloudwatch:PutMetricData", "cloudwatch:DescribeAlarms",
    }
    # SageMaker reads the auto-rollback alarms with the execution role: those two, by name.
    assert by_action["cloudwatch:DescribeAlarms"] == [{"Fn::Join": ["", [
        "arn:", {"Ref": "AWS::Partition"}, f":cloudwatch:us-east-1:123456789012:alarm:gpu-decision-rollback-{kind}"]]}
        for kind in ("server-errors", "latency-p95")]
    # SageMaker's documented CreateModel permissions include logs:CreateLogGroup; here it names the one group.
    assert by_action["logs:CreateLogGroup"] == [{"Fn::Join": ["", [
        "arn:", {"Ref": "AWS::Partition"}, ":logs:us-east-1:123456789012:log-group:/aws/sagemaker/Endpoints/gpu-decision"]]}]
    wildcard_actions = {a for a, resources in by_action.items() if "*" in resources}
    assert wildcard_actions == {"ecr:GetAuthorizationToken", "cloudwatch:PutMetricData"}
    assert "models-bucket/models/m/1/*" in json.dumps(by_action["s3:GetObject"])
    assert by_action["kms:Decrypt"] == ["arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"]
    assert "repository/semif-adapter" in json.dumps(by_action["ecr:BatchGetImage"])
    (log_group_id,) = stacks["gpu"].find_resources("AWS::Logs::LogGroup")
    assert by_action["logs:PutLogEvents"] == [{"Fn::GetAtt": [log_group_id, "Arn"]}]
    (list_bucket,) = [s for s in statements if "s3:ListBucket" in _as_list(s["Action"])]
    assert list_bucket["Condition"] == {"StringLike": {"s3:prefix": ["models/m/1/*"]}}
    (metrics,) = [s for s in statements if "cloudwatch:PutMetricData" in _as_list(s["Action"])]
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/Endpoints"}}


def test_grant_invoke_allows_invoke_endpoint_and_streaming_on_this_endpoint_only(stacks):
    (statement,) = _statements(stacks["gpu"], "AppRole")
    assert statement["Action"] == ["sagemaker:InvokeEndpoint", "sagemaker:InvokeEndpointWithResponseStream"]
    assert statement["Resource"] == {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"},
                                                        ":sagemaker:us-east-1:123456789012:endpoint/gpu-decision"]]}


def test_chat_grant_invoke_adds_bearer_tokens_for_the_openai_route(stacks):
    statements = _statements(stacks["chat"], "AppRole")
    by_action = {a: s["Resource"] for s in statements for a in _as_list(s["Action"])}
    assert set(by_action) == {"sagemaker:InvokeEndpoint", "sagemaker:InvokeEndpointWithResponseStream",
                              "sagemaker:CallWithBearerToken"}
    assert "endpoint/chat-endpoint" in json.dumps(by_action["sagemaker:InvokeEndpoint"])
    # SageMaker accepts no resource ARN for CallWithBearerToken; InvokeEndpoint bounds the endpoint.
    assert by_action["sagemaker:CallWithBearerToken"] == "*"


def test_chat_endpoint_runs_the_dlc_image_with_llama_cpp_environment(stacks):
    container = only(stacks["chat"], "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
    assert container["Image"] == "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp:server-sagemaker-cuda-v1"
    assert container["Environment"] == {
        "SM_LLAMA_CPP_CTX_SIZE": "4096", "SM_LLAMA_CPP_N_GPU_LAYERS": "999", "SM_LLAMA_CPP_THREADS": "4",
        "SM_LLAMA_CPP_BATCH_SIZE": "512", "SM_LLAMA_CPP_PARALLEL": "2", "SM_LLAMA_CPP_JINJA": "true",
    }
    statements = _statements(stacks["chat"], "ChatExecutionRole")
    (describe,) = [s for s in statements if "cloudwatch:DescribeAlarms" in _as_list(s["Action"])]
    assert [r["Fn::Join"][1][-1].rsplit(":", 1)[-1] for r in describe["Resource"]] == [
        "chat-endpoint-rollback-server-errors", "chat-endpoint-rollback-latency-p95"]
    pull = [s for s in statements if "ecr:BatchGetImage" in _as_list(s["Action"])]
    assert "763104351884:repository/llama-cpp" in json.dumps(pull)


def test_chat_endpoint_has_no_adapter_metrics_and_its_own_thresholds(stacks):
    stacks["chat"].resource_count_is("AWS::Logs::MetricFilter", 0)
    latency = _named(stacks["chat"], "chat-endpoint-latency-p95")
    assert latency["Threshold"] == 45000 * 1000  # generation takes longer than a decision
    errors = _named(stacks["chat"], "chat-endpoint-server-errors")
    assert (errors["MetricName"], errors["Threshold"]) == ("Invocation5XXErrors", 2)
    assert not [a for a in stacks["chat"].find_resources("AWS::CloudWatch::Alarm").values()
                if "overload" in a["Properties"]["AlarmName"]]


def test_volume_key_grants_are_only_for_aws_resources(stacks):
    (grant,) = [s for s in _statements(stacks["cpu"], "DecisionExecutionRole")
                if "kms:CreateGrant" in _as_list(s["Action"])]
    assert _as_list(grant["Action"]) == ["kms:CreateGrant"]
    assert grant["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}


def test_endpoint_resources_are_kept_on_update_and_delete_but_not_after_a_failed_create(stacks):
    (log_group,) = stacks["cpu"].find_resources("AWS::Logs::LogGroup").values()
    assert log_group["DeletionPolicy"] == "RetainExceptOnCreate"
    keys = stacks["cpu"].find_resources("AWS::KMS::Key").values()
    assert len(keys) == 2 and all(k["DeletionPolicy"] == "RetainExceptOnCreate" for k in keys)


def test_endpoint_logs_are_encrypted_with_a_key_cloudwatch_logs_may_use_for_that_log_group_only(stacks):
    (log_group,) = stacks["gpu"].find_resources("AWS::Logs::LogGroup").values()
    (key_id,) = _keys(stacks["gpu"], "Log encryption")
    assert log_group["Properties"]["KmsKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    statements = stacks["gpu"].find_resources("AWS::KMS::Key")[key_id]["Properties"]["KeyPolicy"]["Statement"]
    (logs_statement,) = [s for s in statements if s.get("Principal", {}).get("Service") == "logs.us-east-1.amazonaws.com"]
    condition = json.dumps(logs_statement["Condition"])
    assert "kms:EncryptionContext:aws:logs:arn" in condition
    assert "log-group:/aws/sagemaker/Endpoints/gpu-decision" in condition


def test_decision_endpoint_exposes_its_parts(stacks):
    endpoint = stacks["gpu_endpoint"]
    for attribute in ("cfn_model", "cfn_endpoint_config", "cfn_endpoint", "role", "log_group", "dashboard"):
        assert getattr(endpoint, attribute) is not None
    assert endpoint.grant_principal is endpoint.role


def test_adapter_environment_refuses_foreign_and_reserved_variables():
    app = App()
    for bad in ({"PATH": "/bin"}, {"SEMIF_IMAGE_DIGEST": "sha256:00"}):
        stack = Stack(app, f"Bad{len(app.node.children)}", env=ENV)
        bucket, key, topic, repo = _deps(stack)
        with pytest.raises(ValueError, match="not allowed"):
            DecisionEndpoint(stack, "D", endpoint_name="x", image=BuiltImage(repository=repo, digest=DIGEST),
                             model_bucket=bucket, model_key=key, model_prefix="models/m/1/",
                             adapter_environment=bad, compute=compute(instance_type="ml.c6i.xlarge"),
                             alarm_topic=topic, alarm_thresholds=THRESHOLDS, low_margin_threshold=0.1,
                             log_retention=logs.RetentionDays.ONE_DAY)


def test_no_doc_promises_a_type_change_restarts_at_min_instances_while_the_count_is_retained(stacks):
    """UpdateEndpoint with RetainAllVariantProperties keeps the variant's instance count, whatever the instance type."""
    from pathlib import Path

    assert only(stacks["gpu"], "AWS::SageMaker::Endpoint")["Properties"]["RetainAllVariantProperties"] is True
    docs = Path(__file__).resolve().parents[2] / "docs"
    for page in docs.rglob("*.md"):
        text = " ".join(page.read_text().split())
        assert not re.search(r"new fleet starts at `min_instances`", text), page


def test_model_role_names_fit_iam_and_keep_environments_and_kinds_apart():
    from constructs_lib.serving_endpoint import model_role_name

    assert model_role_name("prod", "semif-prod-decision", "endpoint") == "semif-prod-semif-prod-decision-endpoint"
    longest = "e" * 63  # SageMaker's longest endpoint name
    names = {model_role_name(env, longest, kind) for env in ("staging", "staging2") for kind in ("endpoint", "transform")}
    assert len(names) == 4
    assert all(len(n) <= 64 and re.fullmatch(r"[\w+=,.@-]+", n) for n in names)


# ---- model location and key (a prefix SageMaker refuses, a grant wider than the model, an alias for a key) ----

def _decision(model_prefix: str = "models/m/1/", key_arn: str = None, **props):
    stack = Stack(App(), "Check", env=ENV)
    bucket, key, topic, repo = _deps(stack)
    if key_arn is not None:
        key = kms.Key.from_key_arn(stack, "OtherKey", key_arn)
    return DecisionEndpoint(
        stack, "D", endpoint_name="check-decision", image=BuiltImage(repository=repo, digest=DIGEST),
        model_bucket=bucket, model_key=key, model_prefix=model_prefix, adapter_environment=ADAPTER.to_environment(),
        compute=compute(instance_type="ml.c6i.xlarge"), alarm_topic=topic, alarm_thresholds=THRESHOLDS,
        low_margin_threshold=0.1, log_retention=logs.RetentionDays.ONE_DAY, **props)


@pytest.mark.parametrize("prefix", ["models/r/1", "models/r/1/model.gguf", "/models/r/1/", "/", "models/r/1.tar"])
def test_a_model_prefix_that_is_neither_a_directory_nor_a_tarball_is_refused_naming_the_field(prefix):
    """SageMaker refuses an S3Prefix S3Uri without its trailing '/', and the read grant 'models/r/1*' would also match
    models/r/10/ (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_S3ModelDataSource.html)."""
    with pytest.raises(ValueError, match=f"model_prefix: '{re.escape(prefix)}' is not a model location"):
        _decision(model_prefix=prefix)


def test_the_grant_helpers_refuse_a_prefix_without_its_slash_too():
    from constructs_lib.model_bucket import ModelBucket, grant_model_read

    stack = Stack(App(), "Grant", env=ENV)
    bucket, key, _, _ = _deps(stack)
    role = iam.Role(stack, "Reader", assumed_by=iam.AccountPrincipal("123456789012"))
    with pytest.raises(ValueError, match="model_prefix: 'models/r/1' is not a model location"):
        grant_model_read(role, bucket=bucket, key=key, model_prefix="models/r/1")
    models = ModelBucket(stack, "Models")
    with pytest.raises(ValueError, match="model_prefix: 'models/r/1' is not a model location"):
        models.grant_read_model(role, "models/r/1")
    assert grant_model_read(role, bucket=bucket, key=key, model_prefix="models/r/1/") == "models/r/1/*"


def test_a_model_key_given_by_its_alias_arn_is_refused_naming_the_field():
    """An alias ARN in an identity policy's Resource controls the alias, not the key
    (https://docs.aws.amazon.com/kms/latest/developerguide/alias-authorization.html): the download would fail."""
    with pytest.raises(ValueError, match="model_key: 'arn:aws:kms:us-east-1:123456789012:alias/models' is not a KMS"):
        _decision(key_arn="arn:aws:kms:us-east-1:123456789012:alias/models")


def test_a_model_key_imported_as_an_alias_is_refused_even_with_a_partition_token():
    from constructs_lib.model_bucket import grant_model_read

    stack = Stack(App(), "Alias", env=ENV)
    bucket, _, _, _ = _deps(stack)
    role = iam.Role(stack, "Reader", assumed_by=iam.AccountPrincipal("123456789012"))
    with pytest.raises(ValueError, match="model_key: .*alias/models"):
        grant_model_read(role, bucket=bucket, key=kms.Alias.from_alias_name(stack, "A", "alias/models"),
                         model_prefix="models/r/1/")


def test_a_model_key_created_in_the_stack_is_accepted():
    stack = Stack(App(), "OwnKey", env=ENV)
    bucket, _, topic, repo = _deps(stack)
    endpoint = DecisionEndpoint(
        stack, "D", endpoint_name="own-key", image=BuiltImage(repository=repo, digest=DIGEST), model_bucket=bucket,
        model_key=kms.Key(stack, "Key"), model_prefix="models/m/1/", adapter_environment=ADAPTER.to_environment(),
        compute=compute(instance_type="ml.c6i.xlarge"), alarm_topic=topic, alarm_thresholds=THRESHOLDS,
        low_margin_threshold=0.1, log_retention=logs.RetentionDays.ONE_DAY)
    assert endpoint.model_prefix == "models/m/1/"


# ---- routing: a request goes to the instance with the fewest outstanding requests ----

def test_decision_variants_route_to_the_instance_with_the_fewest_outstanding_requests(stacks):
    """Random routing (SageMaker's default) can fill one adapter's bounded queue, and answer 503, while another
    instance is idle (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariantRoutingConfig.html)."""
    for name in ("gpu", "cpu"):  # instance pools and one instance type alike
        assert variant(stacks[name])["RoutingConfig"] == {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}


@pytest.mark.parametrize("strategy, expected", [("RANDOM", {"RoutingStrategy": "RANDOM"}), (None, None)])
def test_the_routing_strategy_can_be_changed_or_left_to_sagemaker(strategy, expected):
    endpoint = _decision(routing_strategy=strategy)
    (production_variant,) = Template.from_stack(Stack.of(endpoint)).find_resources(
        "AWS::SageMaker::EndpointConfig").popitem()[1]["Properties"]["ProductionVariants"]
    assert production_variant.get("RoutingConfig") == expected


def test_an_unknown_routing_strategy_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="routing_strategy: 'ROUND_ROBIN' is not one of"):
        _decision(routing_strategy="ROUND_ROBIN")


# ---- trust: SageMaker may assume the roles only for this account and region ----

def _trust(template: Template, role_prefix: str) -> list[dict]:
    roles = {k: r for k, r in template.find_resources("AWS::IAM::Role").items() if k.startswith(role_prefix)}
    assert len(roles) == 1, roles
    return next(iter(roles.values()))["Properties"]["AssumeRolePolicyDocument"]["Statement"]


def test_the_execution_role_trusts_sagemaker_only_for_this_account_and_region(stacks):
    """Cross-service confused deputy: AWS's template for SageMaker inference, aws:SourceArn like
    arn:<partition>:sagemaker:<region>:<account>:*
    (https://docs.aws.amazon.com/sagemaker/latest/dg/security-confused-deputy-prevention.html)."""
    for name, prefix in (("gpu", "DecisionExecutionRole"), ("chat", "ChatExecutionRole")):
        assert _trust(stacks[name], prefix) == [{
            "Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"},
            "Condition": {"ArnLike": {"aws:SourceArn": {"Fn::Join": ["", [
                "arn:", {"Ref": "AWS::Partition"}, ":sagemaker:us-east-1:123456789012:*"]]}}}}]


def test_the_batch_transform_role_trusts_sagemaker_only_for_this_account_and_region():
    from constructs_lib.batch_transform import BatchTransform

    stack = Stack(App(), "Batch", env=ENV)
    bucket, key, _, repo = _deps(stack)
    BatchTransform(stack, "Batch", image=BuiltImage(repository=repo, digest=DIGEST), model_bucket=bucket,
                   model_key=key, model_prefix="models/m/1/", environment=ADAPTER.to_environment())
    (statement,) = _trust(Template.from_stack(stack), "BatchTransformRole")
    assert statement["Condition"] == {"ArnLike": {"aws:SourceArn": {"Fn::Join": ["", [
        "arn:", {"Ref": "AWS::Partition"}, ":sagemaker:us-east-1:123456789012:*"]]}}}


# ---- compute: what SageMaker would refuse fails synth ----

def _sagemaker_shape(name: str):
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker").shape_for(name)


def test_the_compute_limits_are_those_of_the_sagemaker_api_model_of_the_pinned_boto3():
    """The constants cite the API; the service model shipped with the pinned boto3 is the machine-readable copy."""
    from constructs_lib import endpoint_compute as ec

    members = _sagemaker_shape("ProductionVariant").members
    assert tuple(members["InferenceAmiVersion"].enum) == ec.INFERENCE_AMI_VERSIONS
    provision = members["VariantInstanceProvisionTimeoutInSeconds"].metadata
    assert (provision["min"], provision["max"]) == (ec.MIN_PROVISION_TIMEOUT_S, ec.MAX_TIMEOUT_S)
    download = members["ModelDataDownloadTimeoutInSeconds"].metadata
    assert (download["min"], download["max"]) == (ec.MIN_MODEL_DOWNLOAD_S, ec.MAX_TIMEOUT_S)
    startup = members["ContainerStartupHealthCheckTimeoutInSeconds"].metadata
    # The API's floor is lower; this project's (the llama.cpp DLC's 600 s) sits inside the API's range.
    assert startup["min"] <= ec.MIN_STARTUP_HEALTH_CHECK_S and startup["max"] == ec.MAX_TIMEOUT_S
    strategies = _sagemaker_shape("ProductionVariantRoutingConfig").members["RoutingStrategy"].enum
    from constructs_lib.serving_endpoint import ROUTING_STRATEGIES
    assert set(ROUTING_STRATEGIES) <= set(strategies)


@pytest.mark.parametrize("timeout", [299, 3601])
def test_a_provision_timeout_sagemaker_would_refuse_fails_naming_the_field(timeout):
    with pytest.raises(ValueError, match=f"provision_timeout_s must be 300 to 3600, got {timeout}"):
        compute(instance_pools=[InstancePool(instance_type="ml.g6.xlarge", priority=1)], provision_timeout_s=timeout)


def test_provision_timeouts_at_the_limits_pass():
    for timeout in (300, 3600):
        pools = [InstancePool(instance_type="ml.g6.xlarge", priority=1)]
        assert compute(instance_pools=pools, provision_timeout_s=timeout).provision_timeout_s == timeout


@pytest.mark.parametrize("ami", ["al2-ami-sagemaker-inference-gpu-4", "AL2023-ami-sagemaker-inference-gpu-4-1", ""])
def test_an_inference_ami_version_sagemaker_does_not_know_fails_naming_the_field(ami):
    with pytest.raises(ValueError, match=f"inference_ami_version '{ami}' is not one of"):
        compute(instance_type="ml.g6.xlarge", inference_ami_version=ami)


@pytest.mark.parametrize("cls, args", [
    (EndpointCompute, (1, 2, 4.0, 600, 600)),
    (EndpointAlarmThresholds, (5, 20000)),
])
def test_the_settings_dataclasses_take_keyword_arguments_only(cls, args):
    """Positional values would silently land in the wrong field when a field is added or moved."""
    with pytest.raises(TypeError, match="positional argument"):
        cls(*args)
