"""Batch Transform infrastructure: the transform Model and its role (a purpose-built small stack), the model
bucket's batch lifecycle rule, and what the real decision stack publishes for `semif-batch run`.
cdk-nag over the real app (tests/cdk/test_app.py) and cfn-lint (tests/cdk/test_cfn_lint.py) cover it too."""

from __future__ import annotations

import json

import pytest
from aws_cdk import App, Environment, Stack, aws_ecr as ecr, aws_kms as kms, aws_s3 as s3
from aws_cdk.assertions import Match, Template

from constructs_lib.batch_transform import BatchTransform
from constructs_lib.image_sources import BuiltImage
from stacks.shared_stack import SharedStack

ENV = Environment(account="123456789012", region="us-east-1")
DIGEST = "sha256:" + "cd" * 32
KEY_ARN = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
ENVIRONMENT = {"SEMIF_N_CTX": "4096", "SEMIF_MAX_BODY_BYTES": "1048576", "SEMIF_IMAGE_DIGEST": DIGEST}


@pytest.fixture(scope="module")
def batch_stack():
    stack = Stack(App(), "Batch", env=ENV)
    bucket = s3.Bucket.from_bucket_name(stack, "ModelBucket", "models-bucket")
    key = kms.Key.from_key_arn(stack, "ModelKey", KEY_ARN)
    repo = ecr.Repository.from_repository_name(stack, "Repo", "semif-adapter")
    construct = BatchTransform(stack, "Batch", image=BuiltImage(repository=repo, digest=DIGEST), model_bucket=bucket,
                               model_key=key, model_prefix="models/m/1/", environment=ENVIRONMENT)
    return Template.from_stack(stack), construct


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _by_action(template: Template) -> tuple[dict, list[dict]]:
    statements = []
    for policy in template.find_resources("AWS::IAM::Policy").values():
        statements.extend(policy["Properties"]["PolicyDocument"]["Statement"])
    by_action: dict[str, list] = {}
    for statement in statements:
        for action in _as_list(statement["Action"]):
            by_action.setdefault(action, []).extend(_as_list(statement["Resource"]))
    return by_action, statements


def test_transform_model_runs_the_pinned_image_the_model_data_and_the_adapter_environment(batch_stack):
    template, _ = batch_stack
    (model,) = template.find_resources("AWS::SageMaker::Model").values()
    props = model["Properties"]
    container = props["PrimaryContainer"]
    assert container["Image"]["Fn::Join"][1][-1] == f"/semif-adapter@{DIGEST}"  # pinned by digest, like the endpoint
    # The endpoint's environment, plus what makes JSON Lines run under the batch limits in this Model only.
    assert container["Environment"] == {**ENVIRONMENT, "SEMIF_BATCH_TRANSFORM": "1"}
    # CreateTransformJob refuses a Model whose container uses ModelDataSource: a model.tar.gz, beside the prefix.
    assert "ModelDataSource" not in container
    assert container["ModelDataUrl"] == "s3://models-bucket/models/m/1.tar.gz"
    assert props["EnableNetworkIsolation"] is True
    (role_id,) = template.find_resources("AWS::IAM::Role")
    assert props["ExecutionRoleArn"] == {"Fn::GetAtt": [role_id, "Arn"]}
    assert any(d.startswith("BatchTransformRoleDefaultPolicy") for d in _as_list(model["DependsOn"]))


def test_transform_role_reads_batch_inputs_writes_batch_outputs_and_holds_nothing_else(batch_stack):
    template, _ = batch_stack
    by_action, statements = _by_action(template)
    assert set(by_action) == {
        # run the model
        "s3:GetObject", "s3:ListBucket", "kms:Decrypt", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
        "ecr:BatchCheckLayerAvailability", "ecr:GetAuthorizationToken", "logs:CreateLogGroup", "logs:CreateLogStream",
        "logs:PutLogEvents", "logs:DescribeLogStreams", "cloudwatch:PutMetricData",
        # batch data
        "s3:PutObject", "s3:AbortMultipartUpload", "kms:GenerateDataKey",
    }
    reads = json.dumps(by_action["s3:GetObject"])
    assert "models-bucket/models/m/1/*" in reads and "models-bucket/batch/*/in/*" in reads and "out/" not in reads
    assert "models-bucket/models/m/1.tar.gz" in reads  # the Model's ModelDataUrl
    # CreateLogGroup names the log group itself, not only its streams.
    assert {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"},
                              ":logs:us-east-1:123456789012:log-group:/aws/sagemaker/TransformJobs"]]} in (
        by_action["logs:CreateLogGroup"])
    writes = json.dumps(by_action["s3:PutObject"] + by_action["s3:AbortMultipartUpload"])
    assert "models-bucket/batch/*/out/*" in writes and "/in/" not in writes and "models/" not in writes
    assert by_action["kms:Decrypt"] == [KEY_ARN] and by_action["kms:GenerateDataKey"] == [KEY_ARN]
    listing = [s["Condition"]["StringLike"]["s3:prefix"] for s in statements if s["Action"] == "s3:ListBucket"]
    assert sorted(listing) == [["batch/*/in/*"], ["models/m/1/*"]]
    logs = json.dumps(by_action["logs:PutLogEvents"])
    assert "log-group:/aws/sagemaker/TransformJobs:*" in logs
    (metrics,) = [s for s in statements if s["Action"] == "cloudwatch:PutMetricData"]
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/TransformJobs"}}
    wildcards = {a for a, resources in by_action.items() if "*" in resources}
    assert wildcards == {"ecr:GetAuthorizationToken", "cloudwatch:PutMetricData"}


def test_transform_construct_exposes_its_model_and_role(batch_stack):
    _, construct = batch_stack
    assert construct.cfn_model.attr_model_name == construct.model_name
    assert construct.role.assume_role_policy is not None


def test_model_bucket_expires_batch_inputs_and_outputs():
    template = Template.from_stack(SharedStack(App(), "Shared", env=ENV, env_name="test", model_bucket_name="semif-test-models",
                                               model_prefix="models/m/1/"))
    template.has_resource_properties("AWS::S3::Bucket", {
        "BucketName": "semif-test-models",
        "LifecycleConfiguration": {"Rules": Match.array_with([{
            "Id": "expire-batch-data", "Status": "Enabled", "Prefix": "batch/", "ExpirationInDays": 30,
            "NoncurrentVersionExpiration": {"NoncurrentDays": 1},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}])},
    })


def test_the_decision_stack_publishes_the_batch_model_role_and_default_instance_type(dev_assembly):
    _, assembly = dev_assembly
    template = assembly.get_stack_by_name("semif-dev-decision").template
    params = {p["Properties"]["Name"]: p["Properties"]["Value"]
              for p in template["Resources"].values() if p["Type"] == "AWS::SSM::Parameter"}
    models = [k for k, r in template["Resources"].items() if r["Type"] == "AWS::SageMaker::Model"]
    batch_model = next(k for k in models if k.startswith("Batch"))
    assert params["/semif/dev/decision/batch-model-name"] == {"Fn::GetAtt": [batch_model, "ModelName"]}
    role_id = template["Resources"][batch_model]["Properties"]["ExecutionRoleArn"]["Fn::GetAtt"][0]
    assert params["/semif/dev/decision/batch-role-arn"] == {"Fn::GetAtt": [role_id, "Arn"]}
    assert params["/semif/dev/decision/batch-instance-type"] == "ml.c6i.xlarge"  # dev's endpoint type
    # The same image (by digest) and environment as the endpoint's Model (plus the batch limits' switch); the
    # same model, as the tarball beside the prefix the endpoint serves.
    endpoint_model = next(k for k in models if k != batch_model)
    batch, endpoint = (template["Resources"][k]["Properties"]["PrimaryContainer"] for k in (batch_model, endpoint_model))
    assert batch["Environment"] == {**endpoint["Environment"], "SEMIF_BATCH_TRANSFORM": "1"}
    assert {k: v for k, v in batch.items() if k not in ("ModelDataUrl", "Environment")} == {
        k: v for k, v in endpoint.items() if k not in ("ModelDataSource", "Environment")}
    prefix_uri = endpoint["ModelDataSource"]["S3DataSource"]["S3Uri"]
    assert batch["ModelDataUrl"] == prefix_uri.rstrip("/") + ".tar.gz"


def test_a_tar_gz_model_is_its_own_batch_model_data():
    stack = Stack(App(), "BatchTar", env=ENV)
    bucket = s3.Bucket.from_bucket_name(stack, "ModelBucket", "models-bucket")
    repo = ecr.Repository.from_repository_name(stack, "Repo", "semif-adapter")
    BatchTransform(stack, "Batch", image=BuiltImage(repository=repo, digest=DIGEST), model_bucket=bucket,
                   model_key=kms.Key.from_key_arn(stack, "ModelKey", KEY_ARN),
                   model_prefix="models/m/2/model.tar.gz", environment=ENVIRONMENT)
    (model,) = Template.from_stack(stack).find_resources("AWS::SageMaker::Model").values()
    container = model["Properties"]["PrimaryContainer"]
    assert container["ModelDataUrl"] == "s3://models-bucket/models/m/2/model.tar.gz"
    assert "ModelDataSource" not in container


def test_prod_batch_jobs_default_to_a_cpu_instance(prod_assembly):
    _, assembly = prod_assembly
    template = assembly.get_stack_by_name("semif-prod-decision").template
    params = {p["Properties"]["Name"]: p["Properties"]["Value"]
              for p in template["Resources"].values() if p["Type"] == "AWS::SSM::Parameter"}
    # Batch Transform's GPU hosts cannot run the CUDA 13 image: a GPU environment batches on CPU.
    assert params["/semif/prod/decision/batch-instance-type"] == "ml.c6i.xlarge"
