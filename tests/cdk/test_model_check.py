"""The deploy-time model check: a custom resource every endpoint stack runs before it creates its Model."""

from __future__ import annotations

import pytest
from aws_cdk import App, Environment, Stack, aws_kms as kms, aws_logs as logs, aws_s3 as s3
from aws_cdk.assertions import Template

from cdk_testing import REPO, all_stacks
from constructs_lib.model_check import RESOURCE_TYPE, ModelCheck, manifest_key, transform_tarball_key

ENV = Environment(account="123456789012", region="us-east-1")
KEY_ARN = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
BUCKET = "models-bucket"


def _check_template(model_prefix: str, **options) -> dict:
    app = App()
    stack = Stack(app, "Check", env=ENV)
    ModelCheck(stack, "ModelCheck", model_bucket=s3.Bucket.from_bucket_name(stack, "Bucket", BUCKET),
               model_key=kms.Key.from_key_arn(stack, "Key", KEY_ARN), model_prefix=model_prefix,
               log_retention=logs.RetentionDays.ONE_MONTH, **options)
    return Template.from_stack(stack).to_json()


def _object_arn(key: str) -> dict:
    return {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, f":s3:::{BUCKET}/{key}"]]}


def _statements(template: dict) -> list[dict]:
    (policy,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"]
    return policy["Properties"]["PolicyDocument"]["Statement"]


def _by_action(template: dict) -> dict:
    return {s["Action"] if isinstance(s["Action"], str) else tuple(s["Action"]): s for s in _statements(template)}


def test_manifest_key_is_in_the_prefix_or_beside_the_tarball():
    assert manifest_key("models/m/1/") == "models/m/1/model-manifest.json"
    assert manifest_key("models/m/1/model.tar.gz") == "models/m/1/model-manifest.json"


def test_the_check_is_a_python_3_14_function_with_its_own_log_group_and_retention():
    template = _check_template("models/m/1/")
    (function,) = [r["Properties"] for r in template["Resources"].values() if r["Type"] == "AWS::Lambda::Function"]
    assert function["Runtime"] == "python3.14" and function["Handler"] == "handler.on_event"
    (log_group_id,) = [k for k, r in template["Resources"].items() if r["Type"] == "AWS::Logs::LogGroup"]
    assert template["Resources"][log_group_id]["Properties"]["RetentionInDays"] == 30
    assert function["LoggingConfig"] == {"LogGroup": {"Ref": log_group_id}}
    (resource,) = [r["Properties"] for r in template["Resources"].values() if r["Type"] == RESOURCE_TYPE]
    assert {k: v for k, v in resource.items() if k != "ServiceToken"} == {
        "Bucket": BUCKET, "ModelPrefix": "models/m/1/", "ManifestKey": "models/m/1/model-manifest.json",
        "ServiceTimeout": "300"}
    assert function["Timeout"] == 60  # the function answers well inside the resource's timeout


def test_the_check_role_reads_the_manifest_and_the_prefixs_ggufs_only_and_decrypts_with_the_model_key_via_s3():
    template = _check_template("models/m/1/")
    statements = _by_action(template)
    assert set(statements) == {("logs:CreateLogStream", "logs:PutLogEvents"), "s3:GetObject", "s3:ListBucket",
                               "kms:Decrypt"}
    assert sorted(map(str, statements["s3:GetObject"]["Resource"])) == sorted(
        map(str, [_object_arn("models/m/1/model-manifest.json"), _object_arn("models/m/1/*.gguf")]))
    # Listing only the keys it reads: how the check tells a missing model from an access denied.
    assert statements["s3:ListBucket"]["Condition"] == {
        "StringLike": {"s3:prefix": ["models/m/1/model-manifest.json", "models/m/1/*.gguf"]}}
    assert statements["kms:Decrypt"]["Resource"] == KEY_ARN
    assert statements["kms:Decrypt"]["Condition"] == {"StringEquals": {"kms:ViaService": "s3.us-east-1.amazonaws.com"}}
    (log_group_id,) = [k for k, r in template["Resources"].items() if r["Type"] == "AWS::Logs::LogGroup"]
    assert statements[("logs:CreateLogStream", "logs:PutLogEvents")]["Resource"] == {
        "Fn::GetAtt": [log_group_id, "Arn"]}
    roles = [r["Properties"] for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Role"]
    assert all("ManagedPolicyArns" not in r for r in roles)


def test_for_a_tarball_the_check_role_names_both_objects_without_a_wildcard():
    template = _check_template("models/m/2/model.tar.gz")
    resources = _by_action(template)["s3:GetObject"]["Resource"]
    assert sorted(map(str, resources)) == sorted(
        map(str, [_object_arn("models/m/2/model-manifest.json"), _object_arn("models/m/2/model.tar.gz")]))


def test_batch_transforms_tarball_lies_beside_the_prefix_so_the_endpoint_does_not_download_it():
    assert transform_tarball_key("models/m/1/") == "models/m/1.tar.gz"
    assert not transform_tarball_key("models/m/1/").startswith("models/m/1/")
    assert transform_tarball_key("models/m/2/model.tar.gz") == "models/m/2/model.tar.gz"


def test_with_transform_tarball_the_check_reads_and_lists_the_tarball_beside_the_prefix_too():
    template = _check_template("models/m/1/", transform_tarball=True)
    statements = _by_action(template)
    assert sorted(map(str, statements["s3:GetObject"]["Resource"])) == sorted(map(str, [
        _object_arn("models/m/1/model-manifest.json"), _object_arn("models/m/1/*.gguf"),
        _object_arn("models/m/1.tar.gz")]))
    assert "models/m/1.tar.gz" in statements["s3:ListBucket"]["Condition"]["StringLike"]["s3:prefix"]
    (resource,) = [r["Properties"] for r in template["Resources"].values() if r["Type"] == RESOURCE_TYPE]
    assert resource["TransformTarball"] == "true"


def test_a_model_prefix_that_is_neither_a_directory_nor_a_tarball_is_refused():
    with pytest.raises(ValueError, match="end it with '/'"):
        _check_template("models/m/1")


def test_the_asset_holds_the_handler_and_the_generated_schema_only():
    from constructs_lib.model_check import HANDLER_DIR

    assert HANDLER_DIR == REPO / "lambda" / "model_check"
    assert sorted(p.name for p in HANDLER_DIR.iterdir() if p.name != "__pycache__") == [
        "handler.py", "manifest_schema.json"]


# ---- the real app ----

@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_every_endpoint_stack_creates_its_model_only_after_the_model_check(request, assembly_name):
    _, assembly = request.getfixturevalue(assembly_name)
    endpoint_stacks = [s for s in all_stacks(assembly) if s.stack_name.endswith(("-decision", "-text"))]
    assert endpoint_stacks
    for stack in endpoint_stacks:
        resources = stack.template["Resources"]
        (check_id,) = [k for k, r in resources.items() if r["Type"] == RESOURCE_TYPE]
        models = [r for r in resources.values() if r["Type"] == "AWS::SageMaker::Model"]
        assert models, stack.stack_name
        check = resources[check_id]["Properties"]
        for model in models:  # the endpoint's, and in decision stacks Batch Transform's
            assert check_id in model["DependsOn"], stack.stack_name
            container = model["Properties"]["PrimaryContainer"]
            # The check reads exactly what each Model serves: the prefix, or Batch Transform's tarball beside it.
            if "ModelDataSource" in container:
                served = container["ModelDataSource"]["S3DataSource"]["S3Uri"]
                assert served == f"s3://{check['Bucket']}/{check['ModelPrefix']}", stack.stack_name
            else:
                assert container["ModelDataUrl"] == (
                    f"s3://{check['Bucket']}/{transform_tarball_key(check['ModelPrefix'])}"), stack.stack_name
                assert check["TransformTarball"] == "true", stack.stack_name
        if stack.stack_name.endswith("-text"):
            assert "TransformTarball" not in check  # no Batch Transform on the chat path
        (function,) = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::Lambda::Function"]
        assert function["Runtime"] == "python3.14"


def test_prod_check_role_decrypts_with_the_shared_stacks_model_key_only(prod_assembly):
    stacks = {s.stack_name: s.template for s in all_stacks(prod_assembly[1])}
    resources = stacks["semif-prod-decision"]["Resources"]
    (policy,) = [r for k, r in resources.items() if r["Type"] == "AWS::IAM::Policy" and k.startswith("ModelCheck")]
    (decrypt,) = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Action"] == "kms:Decrypt"]
    # An import of the shared stack's model key ARN: one key, named.
    assert list(decrypt["Resource"]) == ["Fn::ImportValue"]
    assert "ModelsKey" in decrypt["Resource"]["Fn::ImportValue"]
