"""Model bucket, alarm topic and image build constructs, asserted on a purpose-built small app."""

from __future__ import annotations

import json

import pytest
from aws_cdk import App, Environment, Stack, aws_logs as logs
from aws_cdk.assertions import Match, Template

from constructs_lib.image_build import ImageBuild, image_input_hash
from stacks.shared_stack import SharedStack

ENV = Environment(account="123456789012", region="us-east-1")
BASE_IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp:server-sagemaker-cuda-v1"


@pytest.fixture(scope="module")
def context_dir(tmp_path_factory):
    context = tmp_path_factory.mktemp("container")
    (context / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nCOPY semif /opt/semif\n")
    (context / "buildspec.yml").write_text("version: 0.2\n")
    (context / "semif").mkdir()
    (context / "semif" / "app.py").write_text("print('adapter')\n")
    return context


def build_stack(context_dir, *, base_image=BASE_IMAGE) -> tuple[Stack, ImageBuild]:
    stack = Stack(App(), "Build", env=ENV)
    build = ImageBuild(stack, "AdapterImage", context_dir=context_dir, base_image=base_image, keep_last_images=12,
                       log_retention=logs.RetentionDays.TWO_WEEKS)
    return stack, build


@pytest.fixture(scope="module")
def build(context_dir):
    stack, image_build = build_stack(context_dir)
    return Template.from_stack(stack), image_build


@pytest.fixture(scope="module")
def shared():
    stack = SharedStack(App(), "Shared", env=ENV, env_name="test", model_bucket_name="semif-test-models",
                        model_prefix="models/m/1/", alarm_email="ops@example.com")
    return Template.from_stack(stack)


def test_model_bucket_is_kms_encrypted_versioned_private_and_ssl_only(shared):
    (key_id,) = shared.find_resources("AWS::KMS::Key", {"Properties": {"Description": "SemIf model bucket encryption"}})
    shared.has_resource_properties("AWS::KMS::Key", {"Description": "SemIf model bucket encryption",
                                                     "EnableKeyRotation": True})
    shared.has_resource_properties("AWS::S3::Bucket", {
        "BucketName": "semif-test-models",
        "BucketEncryption": {"ServerSideEncryptionConfiguration": [{
            "BucketKeyEnabled": True,
            "ServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms",
                                              "KMSMasterKeyID": {"Fn::GetAtt": [key_id, "Arn"]}}}]},
        "VersioningConfiguration": {"Status": "Enabled"},
        "PublicAccessBlockConfiguration": {"BlockPublicAcls": True, "BlockPublicPolicy": True,
                                           "IgnorePublicAcls": True, "RestrictPublicBuckets": True},
        "LoggingConfiguration": {"DestinationBucketName": Match.any_value(), "LogFilePrefix": "model-bucket/"},
        "LifecycleConfiguration": {"Rules": Match.array_with([Match.object_like({
            "Id": "expire-old-model-versions", "Status": "Enabled",
            "NoncurrentVersionExpiration": {"NoncurrentDays": 90}})])},
    })
    buckets = shared.find_resources("AWS::S3::Bucket")
    model_bucket = next(b for b in buckets.values() if b["Properties"].get("BucketName") == "semif-test-models")
    log_bucket_ref = model_bucket["Properties"]["LoggingConfiguration"]["DestinationBucketName"]
    assert log_bucket_ref["Ref"] in buckets and log_bucket_ref["Ref"] != "semif-test-models"


def test_every_bucket_refuses_plain_http(shared):
    policies = shared.find_resources("AWS::S3::BucketPolicy")
    assert len(policies) == 2
    for policy in policies.values():
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        assert any(s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
                   for s in statements)


def test_alarm_topic_is_kms_encrypted_and_cloudwatch_may_use_the_key(shared):
    (topic,) = shared.find_resources("AWS::SNS::Topic").values()
    (key_id,) = shared.find_resources("AWS::KMS::Key", {"Properties": {"Description": "SemIf alarm topic encryption"}})
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    key_policy = json.dumps(shared.find_resources("AWS::KMS::Key")[key_id]["Properties"]["KeyPolicy"])
    assert "cloudwatch.amazonaws.com" in key_policy
    shared.has_resource_properties("AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": "ops@example.com"})


def test_shared_outputs_are_exported_and_in_ssm(shared):
    for key, export in [("model-bucket/name", "semif-test-model-bucket-name"),
                        ("model-prefix", "semif-test-model-prefix"),
                        ("alarm-topic-arn", "semif-test-alarm-topic-arn")]:
        shared.has_resource_properties("AWS::SSM::Parameter", {"Name": f"/semif/test/{key}"})
        assert shared.find_outputs("*", {"Export": {"Name": export}}), export


def test_repository_scans_on_push_keeps_tags_immutable_and_expires_old_images(build):
    template, _ = build
    template.has_resource_properties("AWS::ECR::Repository", {
        "ImageScanningConfiguration": {"ScanOnPush": True},
        "ImageTagMutability": "IMMUTABLE",
        "EncryptionConfiguration": {"EncryptionType": "KMS", "KmsKey": Match.any_value()},
    })
    (repository,) = template.find_resources("AWS::ECR::Repository").values()
    policy = json.loads(repository["Properties"]["LifecyclePolicy"]["LifecyclePolicyText"])
    assert policy["rules"][0]["selection"] == {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": 12}


def test_codebuild_builds_privileged_encrypted_with_logs_and_the_build_inputs(build):
    template, image_build = build
    (project,) = template.find_resources("AWS::CodeBuild::Project").values()
    properties = project["Properties"]
    assert properties["Environment"]["PrivilegedMode"] is True
    assert "EncryptionKey" in properties
    variables = {v["Name"]: v["Value"] for v in properties["Environment"]["EnvironmentVariables"]}
    assert variables["BASE_IMAGE"] == BASE_IMAGE
    assert variables["IMAGE_TAG"] == image_build.image_tag
    assert "REPOSITORY_URI" in variables
    assert properties["Source"]["Type"] == "S3"
    (log_group_id,) = [k for k in template.find_resources("AWS::Logs::LogGroup") if k.startswith("AdapterImageBuildLogs")]
    assert properties["LogsConfig"]["CloudWatchLogs"]["GroupName"] == {"Ref": log_group_id}
    template.has_resource_properties("AWS::Logs::LogGroup", {"RetentionInDays": 14})


def test_custom_resource_carries_the_input_hash_and_returns_the_digest(build):
    template, image_build = build
    (resource,) = template.find_resources("Custom::SemIfImageBuild").values()
    properties = resource["Properties"]
    assert properties["ImageTag"] == image_build.image_tag == image_input_hash(
        image_build.context_asset.asset_hash, BASE_IMAGE)
    assert properties["BaseImage"] == BASE_IMAGE
    assert properties["SourceLocation"].endswith(".zip")
    assert image_build.image_digest  # a token for Fn::GetAtt ImageDigest
    assert "ImageDigest" in json.dumps(Stack.of(image_build).resolve(image_build.image_digest))


def test_handlers_run_python_3_14(build):
    template, _ = build
    handlers = [f["Properties"] for f in template.find_resources("AWS::Lambda::Function").values()
                if f["Properties"].get("Handler", "").startswith("handler.")]
    assert sorted(h["Handler"] for h in handlers) == ["handler.is_complete", "handler.on_event"]
    assert {h["Runtime"] for h in handlers} == {"python3.14"}


def test_build_roles_name_their_resources(build):
    template, _ = build
    for logical_id, policy in template.find_resources("AWS::IAM::Policy").items():
        if not logical_id.startswith(("AdapterImageProjectRole", "AdapterImageHandlerRole")):
            continue
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            if statement["Resource"] == "*":
                assert actions == ["ecr:GetAuthorizationToken"] or actions == "ecr:GetAuthorizationToken"
            assert not any(a.endswith("*") for a in actions), actions
    handler_policy = json.dumps([p for k, p in template.find_resources("AWS::IAM::Policy").items()
                                 if k.startswith("AdapterImageHandlerRole")])
    assert "codebuild:StartBuild" in handler_policy and "ecr:DescribeImages" in handler_policy


def test_without_dockerignore_tests_and_caches_are_not_build_inputs(context_dir, build):
    _, first = build
    _, other_base = build_stack(context_dir, base_image=BASE_IMAGE.replace("cuda", "cpu"))
    assert other_base.image_tag != first.image_tag
    (context_dir / "tests").mkdir(exist_ok=True)
    (context_dir / "tests" / "test_new.py").write_text("def test_x(): pass\n")
    (context_dir / "semif" / "__pycache__").mkdir(exist_ok=True)
    (context_dir / "semif" / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    _, with_tests = build_stack(context_dir)
    assert with_tests.image_tag == first.image_tag
    (context_dir / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nCOPY semif /srv/semif\n")
    _, changed = build_stack(context_dir)
    assert changed.image_tag != first.image_tag


def test_the_build_context_follows_dockerignore_plus_dockerfile_and_buildspec(tmp_path):
    from constructs_lib.image_build import build_context_excludes

    (tmp_path / ".dockerignore").write_text("# allow-list\n*\n!pyproject.toml\n!semif/\nsemif/**/__pycache__\n")
    for name in ("Dockerfile", "buildspec.yml", "pyproject.toml"):
        (tmp_path / name).write_text(name)
    (tmp_path / "semif").mkdir()
    (tmp_path / "semif" / "app.py").write_text("v1")
    (tmp_path / "notes.md").write_text("not a build input")
    excludes, _ = build_context_excludes(tmp_path)
    assert excludes[:2] == ["*", "!pyproject.toml"] and excludes[-3:] == ["!Dockerfile", "!buildspec.yml",
                                                                          "!.dockerignore"]
    _, first = build_stack(tmp_path)
    (tmp_path / "notes.md").write_text("edited, still not a build input")
    _, unchanged = build_stack(tmp_path)
    assert unchanged.image_tag == first.image_tag
    for name, content in (("semif/serving/app.py", "v2"), ("buildspec.yml", "v2"), ("Dockerfile", "v2")):
        (tmp_path / name).write_text(content)
        _, changed = build_stack(tmp_path)
        assert changed.image_tag != first.image_tag, name
        first = changed
