"""Model bucket, alarm topic and the central image repository, asserted on purpose-built small apps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aws_cdk import App, Environment, RemovalPolicy, Stack
from aws_cdk.assertions import Match, Template

from constructs_lib.image_build import AdapterImageRepository, read_image_digests
from stacks.shared_stack import SharedStack

ENV = Environment(account="123456789012", region="us-east-1")
CHECK_PRINCIPAL = "arn:aws:iam::333333333333:role/semif-pipeline-checks"
PULL_ROLES = ["arn:aws:iam::111111111111:role/semif-dev-semif-dev-decision-endpoint",
              "arn:aws:iam::111111111111:role/semif-dev-semif-dev-decision-transform",
              "arn:aws:iam::222222222222:role/semif-prod-semif-prod-decision-endpoint",
              "arn:aws:iam::333333333333:role/semif-ops-semif-ops-decision-endpoint"]


def shared_stack(removal_policy=RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE, **overrides) -> Template:
    values = dict(env_name="test", model_bucket_name="semif-test-models", model_prefix="models/m/1/",
                  alarm_email="ops@example.com", removal_policy=removal_policy,
                  pipeline_check_principal_arn=CHECK_PRINCIPAL, endpoint_names=("semif-test-decision",))
    values.update(overrides)
    return Template.from_stack(SharedStack(App(), "Shared", env=ENV, **values))


@pytest.fixture(scope="module")
def shared():
    return shared_stack()


@pytest.fixture(scope="module")
def shared_dev():
    return shared_stack(RemovalPolicy.DESTROY)


@pytest.fixture(scope="module")
def images():
    stack = Stack(App(), "Images", env=Environment(account="333333333333", region="us-east-1"))
    AdapterImageRepository(stack, "AdapterImages", keep_last_images=12,
                           pull_roles=PULL_ROLES, environments=["dev", "prod"])
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


def test_alarm_topic_is_kms_encrypted_and_only_this_accounts_cloudwatch_may_use_the_key(shared):
    (topic,) = shared.find_resources("AWS::SNS::Topic").values()
    assert topic["Properties"]["TopicName"] == "semif-test-alarms"
    (key_id,) = shared.find_resources("AWS::KMS::Key", {"Properties": {"Description": "SemIf alarm topic encryption"}})
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    statements = shared.find_resources("AWS::KMS::Key")[key_id]["Properties"]["KeyPolicy"]["Statement"]
    (cloudwatch,) = [s for s in statements if s.get("Principal", {}).get("Service") == "cloudwatch.amazonaws.com"]
    assert cloudwatch["Condition"] == {"StringEquals": {"aws:SourceAccount": "123456789012"}}
    assert sorted(cloudwatch["Action"]) == ["kms:Decrypt", "kms:GenerateDataKey"]
    shared.has_resource_properties("AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": "ops@example.com"})


def test_the_alarm_topic_lets_this_accounts_cloudwatch_alarms_publish(shared):
    """The SSL-only topic policy replaces SNS's default one: CloudWatch needs its own Allow, or every alarm action
    fails (the alarm history shows "not authorized to perform: SNS:Publish")."""
    (topic_id,) = shared.find_resources("AWS::SNS::Topic")
    (policy,) = shared.find_resources("AWS::SNS::TopicPolicy").values()
    assert policy["Properties"]["Topics"] == [{"Ref": topic_id}]
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    (allow,) = [s for s in statements if s["Effect"] == "Allow"]
    assert allow["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    assert allow["Action"] == "sns:Publish" and allow["Resource"] == {"Ref": topic_id}
    assert allow["Condition"]["StringEquals"] == {"aws:SourceAccount": "123456789012"}
    assert allow["Condition"]["ArnLike"] == {"aws:SourceArn": {"Fn::Join": ["", [
        "arn:", {"Ref": "AWS::Partition"}, ":cloudwatch:us-east-1:123456789012:alarm:*"]]}}
    (deny,) = [s for s in statements if s["Effect"] == "Deny"]
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_stable_shared_outputs_are_exported_and_the_model_prefix_is_in_ssm_only(shared):
    for key, export in [("model-bucket/name", "semif-test-model-bucket-name"),
                        ("alarm-topic-arn", "semif-test-alarm-topic-arn")]:
        shared.has_resource_properties("AWS::SSM::Parameter", {"Name": f"/semif/test/{key}"})
        assert shared.find_outputs("*", {"Export": {"Name": export}}), export
    shared.has_resource_properties("AWS::SSM::Parameter", {"Name": "/semif/test/model-prefix"})
    # An export changes with every model; once imported, CloudFormation would refuse the next model.
    assert not [o for o in shared.find_outputs("*").values() if "model-prefix" in json.dumps(o)]


def test_prod_buckets_and_keys_are_kept_on_update_and_delete_but_not_after_a_failed_create(shared):
    for type_ in ("AWS::S3::Bucket", "AWS::KMS::Key"):
        for resource in shared.find_resources(type_).values():
            assert resource["DeletionPolicy"] == "RetainExceptOnCreate", type_
            assert resource["UpdateReplacePolicy"] == "Retain", type_
    shared.resource_count_is("Custom::S3AutoDeleteObjects", 0)


def test_dev_buckets_are_destroyed_with_their_objects(shared_dev):
    for resource in shared_dev.find_resources("AWS::S3::Bucket").values():
        assert resource["DeletionPolicy"] == "Delete"
    # Versioned buckets with models in them cannot be deleted empty-handed: CDK's auto-delete empties them first.
    shared_dev.resource_count_is("Custom::S3AutoDeleteObjects", 2)


def test_pipeline_check_role_trusts_one_named_pipeline_role_and_reads_only_the_manifest(shared):
    (role,) = [r["Properties"] for r in shared.find_resources("AWS::IAM::Role").values()
               if r["Properties"].get("RoleName") == "semif-test-pipeline-check"]
    (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
    # The pipeline's role by ARN in a condition, not as the principal: IAM refuses a principal role that does not
    # exist yet (a hand deploy before the pipeline), and one re-created under the same name would not match.
    assert trust["Principal"] == {"AWS": {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":iam::333333333333:root"]]}}
    assert trust["Condition"] == {"ArnEquals": {"aws:PrincipalArn": [CHECK_PRINCIPAL]}}
    policy = json.dumps([p for k, p in shared.find_resources("AWS::IAM::Policy").items()
                         if k.startswith("PipelineCheckRole")])
    # What the model check reads (the pipeline's CheckModel step runs it): the manifest and the prefix's GGUFs.
    assert "models/m/1/model-manifest.json" in policy and "models/m/1/*.gguf" in policy
    assert '"models/m/1/*"' not in policy and "models/m/1/*\"" not in policy
    assert "endpoint/semif-test-decision" in policy
    assert "alarm:semif-test-decision-*" in policy


def test_stage_checks_read_write_and_list_only_the_keys_and_prefixes_the_shared_stack_names_for_them():
    template = shared_stack(check_reads=("eval/decisions.jsonl", "reports/test/"),
                            check_writes=("reports/test/", "reports/prod/report.json"),
                            check_lists=("reports/prod/report.json",), check_describes_endpoint_configs=True)
    statements = [s for k, p in template.find_resources("AWS::IAM::Policy").items() if k.startswith("PipelineCheckRole")
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]

    def resources(action: str) -> list[str]:
        return sorted(json.dumps(r) for s in statements if action in (s["Action"] if isinstance(s["Action"], list)
                                                                        else [s["Action"]])
                      for r in (s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]))

    reads = [r for r in resources("s3:GetObject") if "models/" not in r]  # the model check's own reads aside
    assert len(reads) == 2 and any('/eval/decisions.jsonl"' in r for r in reads) and any('/reports/test/*"' in r for r in reads)
    writes = resources("s3:PutObject")
    assert len(writes) == 2 and any('/reports/test/*"' in r for r in writes)
    assert any('/reports/prod/report.json"' in r for r in writes)
    listing = [s for s in statements if s["Action"] == "s3:ListBucket" and "reports/" in json.dumps(s)]
    # Exactly the key: whether it exists, and nothing else of the folder.
    assert [s["Condition"] for s in listing] == [{"StringEquals": {"s3:prefix": ["reports/prod/report.json"]}}]
    assert [r for r in resources("sagemaker:DescribeEndpointConfig")] == [json.dumps({"Fn::Join": ["", [
        "arn:", {"Ref": "AWS::Partition"}, ":sagemaker:us-east-1:123456789012:endpoint-config/*"]]})]
    assert any("GenerateDataKey" in json.dumps(s["Action"]) for s in statements)
    # Without stage checks, the role writes nothing and reads no endpoint config.
    plain = json.dumps([p for k, p in shared_stack().find_resources("AWS::IAM::Policy").items()
                        if k.startswith("PipelineCheckRole")])
    assert "s3:PutObject" not in plain and "DescribeEndpointConfig" not in plain
    for bad in ("/reports/", "reports/*", ""):
        with pytest.raises(ValueError, match="a key, or a key prefix ending in '/'"):
            shared_stack(check_writes=(bad,))


def test_for_a_tarball_the_pipeline_check_role_reads_the_manifest_beside_it_as_the_model_check_does():
    policy = json.dumps([p for k, p in shared_stack(model_prefix="models/m/2/model.tar.gz").find_resources(
        "AWS::IAM::Policy").items() if k.startswith("PipelineCheckRole")])
    # Where `semif-package-model upload --tar-gz` writes it, and where the custom resource reads it; and the tarball.
    assert "models/m/2/model-manifest.json" in policy and "models/m/2/model.tar.gz" in policy
    assert "*" not in policy.replace("alarm:semif-test-decision-*", "")


def test_central_repository_keeps_immutable_scanned_encrypted_images_and_lets_environment_accounts_pull(images):
    repositories = images.find_resources("AWS::ECR::Repository")
    (image_repo,) = [r["Properties"] for r in repositories.values() if r["Properties"]["RepositoryName"] == "semif/adapter"]
    # Immutable but for the candidate tag a build checks before it tags (build-image.sh).
    assert image_repo["ImageTagMutability"] == "IMMUTABLE_WITH_EXCLUSION"
    assert image_repo["ImageTagMutabilityExclusionFilters"] == [
        {"ImageTagMutabilityExclusionFilterType": "WILDCARD", "ImageTagMutabilityExclusionFilterValue": "candidate-*"}]
    assert image_repo["ImageScanningConfiguration"] == {"ScanOnPush": True}
    assert image_repo["EncryptionConfiguration"]["EncryptionType"] == "KMS"
    lifecycle = json.loads(image_repo["LifecyclePolicyText"] if "LifecyclePolicyText" in image_repo
                           else image_repo["LifecyclePolicy"]["LifecyclePolicyText"])
    # The images each environment was last deployed with first, prod ahead of dev; the 'any' rule (which ECR
    # requires last) cannot expire an image a higher-priority rule's tags select.
    rules = sorted(lifecycle["rules"], key=lambda r: r["rulePriority"])
    assert [r["selection"].get("tagPrefixList") for r in rules] == [["deployed-prod-"], ["deployed-dev-"], None]
    assert rules[-1]["selection"]["tagStatus"] == "any"
    assert all(r["selection"]["countNumber"] == 12 for r in rules)
    (statement,) = image_repo["RepositoryPolicyText"]["Statement"]
    principals = json.dumps(statement["Principal"])
    assert "111111111111" in principals and "222222222222" in principals and "333333333333" not in principals
    # Not every role of those accounts: the named pull roles only (the repository's own account needs no statement).
    assert statement["Condition"] == {"ArnEquals": {"aws:PrincipalArn": PULL_ROLES[:3]}}
    assert sorted(statement["Action"]) == ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage",
                                          "ecr:GetDownloadUrlForLayer"]
    (cache_repo,) = [r["Properties"] for r in repositories.values()
                     if r["Properties"]["RepositoryName"] == "semif/adapter-build-cache"]
    assert cache_repo["ImageTagMutability"] == "MUTABLE"  # BuildKit rewrites one cache tag per variant


def ecr_lifecycle_expires(policy: dict, images: list[dict]) -> set[str]:
    """The digests ECR's lifecycle expires, by its documented evaluation: rules from the lowest ``rulePriority``
    up; an image is expired by exactly one or zero rules, and an image that matches the tags of a higher-priority
    rule cannot be expired by a lower-priority one (it is that rule's, kept or expired); ``imageCountMoreThan``
    keeps the newest pushed of the images a rule selects. ``images``: ``{"digest", "pushed", "tags"}``."""
    claimed: set[str] = set()
    expired: set[str] = set()
    for rule in sorted(policy["rules"], key=lambda r: r["rulePriority"]):
        selection = rule["selection"]
        assert selection["countType"] == "imageCountMoreThan"
        if selection["tagStatus"] == "tagged":
            prefixes = tuple(selection["tagPrefixList"])
            matching = [i for i in images if any(t.startswith(prefixes) for t in i["tags"])]
        elif selection["tagStatus"] == "untagged":
            matching = [i for i in images if not i["tags"]]
        else:
            matching = list(images)
        mine = sorted((i for i in matching if i["digest"] not in claimed), key=lambda i: i["pushed"], reverse=True)
        expired |= {i["digest"] for i in mine[selection["countNumber"]:]}
        claimed |= {i["digest"] for i in mine}
    return expired


def _lifecycle_policy(environments: list[str], keep: int) -> dict:
    stack = Stack(App(), "Lifecycle", env=Environment(account="333333333333", region="us-east-1"))
    AdapterImageRepository(stack, "AdapterImages", keep_last_images=keep, pull_roles=[],
                           environments=environments)
    (repository,) = [r["Properties"] for r in Template.from_stack(stack).find_resources("AWS::ECR::Repository").values()
                     if r["Properties"]["RepositoryName"] == "semif/adapter"]
    return json.loads(repository["LifecyclePolicy"]["LifecyclePolicyText"])


def test_a_promoted_image_also_tagged_for_earlier_environments_is_never_expired_by_their_rules():
    """One image deployed to dev, staging and prod; then dev and staging move on by more than ``keep`` images while
    prod keeps running it. Only prod's rule may decide its fate, and prod deployed nothing since."""
    keep = 3
    policy = _lifecycle_policy(["dev", "staging", "prod"], keep)
    promoted = {"digest": "promoted", "pushed": 0,
                "tags": ["hash-0", "deployed-dev-promoted", "deployed-staging-promoted", "deployed-prod-promoted"]}
    later = [{"digest": f"later-{n}", "pushed": n + 1, "tags": [f"hash-{n + 1}", f"deployed-dev-later-{n}"]
              + ([f"deployed-staging-later-{n}"] if n % 2 else [])} for n in range(4 * keep)]
    assert "promoted" not in ecr_lifecycle_expires(policy, [promoted, *later])
    # An image in dev and staging only is staging's; it goes once staging deployed ``keep`` newer ones, which dev
    # deployed too: neither environment still needs it.
    staged = {**promoted, "tags": ["hash-0", "deployed-dev-promoted", "deployed-staging-promoted"]}
    assert "promoted" in ecr_lifecycle_expires(policy, [staged, *later])
    assert "promoted" not in ecr_lifecycle_expires(policy, [staged, *later[:2 * keep - 1]])


def test_image_repository_outlives_the_pipeline_stack(images):
    for resource in images.find_resources("AWS::ECR::Repository", {"Properties": {"RepositoryName": "semif/adapter"}}).values():
        assert resource["DeletionPolicy"] == "Retain"


def test_image_digests_are_read_from_the_image_steps_outputs(tmp_path):
    for variant, digest in (("cpu", "sha256:" + "1" * 64), ("gpu", "sha256:" + "2" * 64)):
        (tmp_path / variant).mkdir()
        (tmp_path / variant / "image.json").write_text(json.dumps({"imageDigest": digest}))
    assert read_image_digests(tmp_path) == {"cpu": "sha256:" + "1" * 64, "gpu": "sha256:" + "2" * 64}


def test_the_image_build_role_cannot_delete_from_the_repository_environments_pull_from():
    """The build runs repository code in privileged Docker: it pushes and tags, and nothing it runs can delete an
    image an endpoint may still pull. Both callers: the pipeline's image step and one environment's project."""
    from aws_cdk import pipelines

    from constructs_lib.image_build import default_build_specs

    app = App()
    stack = Stack(app, "Images", env=Environment(account="333333333333", region="us-east-1"))
    images = AdapterImageRepository(stack, "AdapterImages", keep_last_images=12, environments=["dev"])
    (spec,) = [s for s in default_build_specs(cpu_base_image="b@sha256:" + "b" * 64, gpu_base_image="g@sha256:" + "c" * 64)
               if s.variant == "cpu"]
    step = images.build_step(spec, source=pipelines.CodePipelineSource.connection(
        "o/r", "main", connection_arn="arn:aws:codeconnections:us-east-1:333333333333:connection/x"))
    statements = [s.to_json() for s in step.role_policy_statements]
    actions = {a for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert {"ecr:PutImage", "ecr:BatchGetImage", "ecr:DescribeImages"} <= actions
    assert not {a for a in actions if a in ("ecr:BatchDeleteImage", "ecr:*") or "Delete" in a}

    env_stack = Stack(app, "EnvImages", env=Environment(account="111111111111", region="us-east-1"))
    own = AdapterImageRepository(env_stack, "AdapterImages", keep_last_images=12, environments=["dev"], env_name="dev")
    own.build_project(spec, source_dir=Path(__file__).resolve().parents[2] / "container")
    policies = Template.from_stack(env_stack).find_resources("AWS::IAM::Policy")
    granted = json.dumps(policies)
    assert "ecr:PutImage" in granted and "ecr:BatchDeleteImage" not in granted
