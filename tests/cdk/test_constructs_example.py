"""The example CDK app a platform team copies (examples/own-cdk-app/) and the reference page of the constructs it
imports (docs/reference/constructs.md): the app synthesizes with cdk-nag on and passes cfn-lint, its endpoint runs the
digest it is given and its caller may invoke that endpoint only, and the page lists every prop the code takes."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import re
from pathlib import Path

import pytest
from aws_cdk import App, aws_s3 as s3

from cdk_testing import REPO
from constructs_lib.chat_endpoint import ChatEndpoint
from constructs_lib.decision_endpoint import DecisionEndpoint
from constructs_lib.endpoint_alarms import EndpointAlarmThresholds
from constructs_lib.endpoint_compute import EndpointCompute, InstancePool
from constructs_lib.image_sources import BuiltImage, DlcImage
from constructs_lib.model_bucket import ModelBucket
from constructs_lib.model_check import ModelCheck

EXAMPLE = REPO / "examples" / "own-cdk-app"
DOC = REPO / "docs" / "reference" / "constructs.md"
ACCOUNT, REGION = "123456789012", "us-east-1"
DIGEST = "sha256:" + "5e" * 32
# The constructs the page documents, by the name of their section.
COVERED = {cls.__name__: cls for cls in (DecisionEndpoint, EndpointCompute, InstancePool, EndpointAlarmThresholds,
                                         BuiltImage, DlcImage, ModelCheck, ModelBucket, ChatEndpoint)}
# What the design promises an endpoint construct exposes.
ENDPOINT_SEAMS = ("cfn_model", "cfn_endpoint_config", "cfn_endpoint", "role")


def load_example():
    spec = importlib.util.spec_from_file_location("own_cdk_app", EXAMPLE / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_context(**overrides) -> dict:
    """The example's own cdk.json context, with a real-looking digest in place of its placeholder."""
    context = json.loads((EXAMPLE / "cdk.json").read_text())["context"]
    return {**context, "adapter-image-digest": DIGEST, **overrides}


def build_example(outdir: Path, context: dict, *, region: str = REGION) -> App:
    with pytest.MonkeyPatch.context() as env:
        # What the CDK CLI sets from the credentials it runs with.
        env.setenv("CDK_DEFAULT_ACCOUNT", ACCOUNT)
        env.setenv("CDK_DEFAULT_REGION", region)
        return load_example().build_app(App(outdir=str(outdir), context=context))


def synth_example(outdir: Path, **overrides):
    app = build_example(outdir, example_context(**overrides))
    return app, app.synth()


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    app, assembly = synth_example(tmp_path_factory.mktemp("own-cdk-app"))
    stack = app.node.find_child("DecisionService")
    return stack, assembly, assembly.get_stack_by_name(stack.stack_name).template


def resources(template: dict, type_: str) -> dict[str, dict]:
    return {k: r for k, r in template["Resources"].items() if r["Type"] == type_}


def nag_violations(outdir: str) -> list[str]:
    report = json.loads((Path(outdir) / "validation-report.json").read_text())
    return [f"{v['ruleName']} @ {c['constructPath']}" for p in report["pluginReports"] for v in p["violations"]
            for c in v["violatingConstructs"]]


# ---- the example app ----

def test_the_example_synthesizes_with_cdk_nag_and_no_unacknowledged_finding(example):
    _, assembly, _ = example
    assert nag_violations(assembly.directory) == []


def test_every_acknowledged_finding_in_the_example_names_one_finding_and_its_reason(example):
    _, assembly, _ = example
    metadata = json.loads((Path(assembly.directory) / "DecisionService.metadata.json").read_text())
    acknowledged = {rule: reason for entries in metadata.values() for e in entries
                    if e["type"] == "aws:cdk:acknowledged-rules" for rule, reason in e["data"].items()}
    assert acknowledged
    for rule, reason in acknowledged.items():
        assert re.fullmatch(r"Annotation::AwsSolutions-\w+\[.+\]", rule), rule  # one finding, never a whole rule
        assert len(reason.split()) >= 5, (rule, reason)


def test_an_unreviewed_resource_in_the_example_fails_its_synth(tmp_path):
    """cdk-nag is live in the example: a bucket without logging or an SSL policy stops synth."""
    app = build_example(tmp_path, example_context())
    s3.Bucket(app.node.find_child("DecisionService"), "Unreviewed")
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        app.synth()
    assert any(v.startswith("AwsSolutions-S1 @ DecisionService/Unreviewed") for v in nag_violations(str(tmp_path)))


def test_cfn_lint_finds_no_errors_in_the_example_template(example):
    from cfnlint.api import lint_file

    _, assembly, _ = example
    path = Path(assembly.get_stack_by_name("DecisionService").template_full_path)
    errors = [f"{m.rule.id} {m.message} (line {m.linenumber})" for m in lint_file(path) if m.rule.id.startswith("E")]
    assert errors == []


def test_the_endpoints_model_runs_the_adapter_image_pinned_by_the_digest_given(example):
    _, _, template = example
    ((_, model),) = resources(template, "AWS::SageMaker::Model").items()
    container = model["Properties"]["PrimaryContainer"]
    repository = example_context()["adapter-repository"]
    assert container["Image"] == {"Fn::Join": ["", [f"{ACCOUNT}.dkr.ecr.{REGION}.", {"Ref": "AWS::URLSuffix"},
                                                    f"/{repository}@{DIGEST}"]]}
    assert container["Environment"]["SEMIF_IMAGE_DIGEST"] == DIGEST


def test_the_caller_role_may_invoke_exactly_this_endpoint_and_nothing_else(example):
    stack, _, template = example
    caller = stack.get_logical_id(stack.caller_role.node.default_child)
    policies = [p["Properties"] for p in resources(template, "AWS::IAM::Policy").values()]
    statements = [s for p in policies if {"Ref": caller} in p["Roles"] for s in p["PolicyDocument"]["Statement"]]
    endpoint_name = example_context()["endpoint-name"]
    endpoint_arn = {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"},
                                      f":sagemaker:{REGION}:{ACCOUNT}:endpoint/{endpoint_name}"]]}
    assert statements == [{"Effect": "Allow", "Action": ["sagemaker:InvokeEndpoint",
                                                         "sagemaker:InvokeEndpointWithResponseStream"],
                           "Resource": endpoint_arn}]
    ((_, endpoint),) = resources(template, "AWS::SageMaker::Endpoint").items()
    assert endpoint["Properties"]["EndpointName"] == endpoint_name
    assert template["Outputs"]["EndpointArn"]["Value"] == endpoint_arn


def test_the_model_check_guards_the_endpoints_model(example):
    stack, _, template = example
    ((check_id, _),) = resources(template, "Custom::SemIfModelCheck").items()
    ((_, model),) = resources(template, "AWS::SageMaker::Model").items()
    assert check_id in model["DependsOn"]


def test_the_example_names_the_context_keys_it_misses(tmp_path):
    context = example_context()
    del context["model-bucket"], context["alarm-topic-arn"]
    with pytest.raises(ValueError, match="context: set model-bucket, alarm-topic-arn in cdk.json"):
        build_example(tmp_path, context)


@pytest.mark.parametrize("name", ["team_decisions", "-team", "team-", "a" * 64])
def test_an_endpoint_name_sagemaker_would_refuse_fails_synth_naming_the_field(tmp_path, name):
    with pytest.raises(ValueError, match=f"endpoint_name: '{name}' is not a SageMaker endpoint name"):
        build_example(tmp_path, example_context(**{"endpoint-name": name}))


def test_an_endpoint_name_sagemaker_accepts_passes(tmp_path):
    app = build_example(tmp_path, example_context(**{"endpoint-name": "Team-2"}))
    assert app.node.find_child("DecisionService").endpoint.endpoint_name == "Team-2"


def test_a_role_name_iam_would_refuse_is_refused_naming_the_field():
    from constructs_lib.serving_endpoint import ROLE_NAME_MAX, check_names, model_role_name

    with pytest.raises(ValueError, match="role_name: 'r+' has 65 characters; IAM allows 1 to 64"):
        check_names("team-decisions", "r" * (ROLE_NAME_MAX + 1))
    check_names("team-decisions", model_role_name("prod", "a" * 63, "endpoint"))  # shortened to fit


def test_the_example_refuses_to_synthesize_without_a_region(tmp_path):
    """A stack without a region synthesizes region-agnostic ARNs; the model bucket and the image must be in the
    endpoint's region (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ContainerDefinition.html)."""
    with pytest.raises(ValueError, match="CDK_DEFAULT_REGION is not set"):
        build_example(tmp_path, example_context(), region="")


def test_the_example_names_semif_home_when_it_holds_no_checkout(tmp_path):
    """Not a ModuleNotFoundError for 'config' or 'constructs_lib', but the variable to set."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SEMIF_HOME", str(tmp_path))
        with pytest.raises(SystemExit, match=f"SEMIF_HOME: {tmp_path} is not a SemIf checkout"):
            load_example()


def test_the_example_serves_a_model_prefix_sagemaker_accepts_and_refuses_one_without_its_slash(example, tmp_path):
    _, _, template = example
    ((_, model),) = resources(template, "AWS::SageMaker::Model").items()
    source = model["Properties"]["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
    assert source["S3DataType"] == "S3Prefix" and source["S3Uri"].endswith("/")
    with pytest.raises(ValueError, match="model_prefix: 'models/routing/1' is not a model location"):
        build_example(tmp_path, example_context(**{"model-prefix": "models/routing/1"}))


def test_the_example_refuses_a_model_key_given_by_its_alias(tmp_path):
    alias = f"arn:aws:kms:{REGION}:{ACCOUNT}:alias/team-models"
    with pytest.raises(ValueError, match="model_key: .*alias/team-models' is not a KMS key ARN"):
        build_example(tmp_path, example_context(**{"model-key-arn": alias}))


def test_the_example_endpoint_routes_to_the_least_busy_instance(example):
    _, _, template = example
    ((_, config),) = resources(template, "AWS::SageMaker::EndpointConfig").items()
    (production_variant,) = config["Properties"]["ProductionVariants"]
    assert production_variant["RoutingConfig"] == {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}


def test_only_ecs_tasks_of_this_account_and_region_may_assume_the_caller_role(example):
    """Cross-service confused deputy, as ECS documents it for a task role
    (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task-iam-roles.html)."""
    stack, _, template = example
    caller = template["Resources"][stack.get_logical_id(stack.caller_role.node.default_child)]
    assert caller["Properties"]["AssumeRolePolicyDocument"]["Statement"] == [{
        "Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Service": "ecs-tasks.amazonaws.com"},
        "Condition": {
            "ArnLike": {"aws:SourceArn": {"Fn::Join": ["", [
                "arn:", {"Ref": "AWS::Partition"}, f":ecs:{REGION}:{ACCOUNT}:*"]]}},
            "StringEquals": {"aws:SourceAccount": ACCOUNT}}}]


# ---- the reference page ----

def doc_sections() -> dict[str, str]:
    """``## `Name` `` (or ###) sections of the page, by name."""
    text = DOC.read_text()
    parts = re.split(r"(?m)^#{2,3} (.+)$", text)
    return {title.strip("`"): body for title, body in zip(parts[1::2], parts[2::2])}


def table_rows(section: str, header: str) -> list[list[str]]:
    """The rows of the section's table whose header starts with ``| <header> |``."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def code_props(cls) -> dict[str, bool]:
    """Each public prop and whether it is required."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                for f in dataclasses.fields(cls)}
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: p.default is inspect.Parameter.empty for p in parameters
            if p.kind is inspect.Parameter.KEYWORD_ONLY and not p.name.startswith("_")}


def test_the_reference_page_shows_the_example_app_as_it_is():
    section = doc_sections()["The example app"]
    shown = section.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"
    assert shown == (EXAMPLE / "app.py").read_text()


def test_the_reference_page_lists_the_context_keys_the_example_reads():
    documented = [row[0].strip("`") for row in table_rows(doc_sections()["The example app"], "Context key")]
    assert documented == list(load_example().CONTEXT_KEYS)
    assert set(documented) <= set(example_context())


@pytest.mark.parametrize("name", sorted(COVERED))
def test_the_reference_page_documents_every_prop_of_each_construct_and_which_are_required(name):
    rows = table_rows(doc_sections()[name], "Prop")
    documented = {row[0].strip("`"): row[2] == "required" for row in rows}
    assert documented == code_props(COVERED[name])


def test_every_construct_the_example_imports_has_its_section():
    imported = re.findall(r"(?m)^from constructs_lib\.\w+ import (.+?)(?:  #.*)?$", (EXAMPLE / "app.py").read_text())
    classes = {name.strip() for line in imported for name in line.split(",") if name.strip()[0].isupper()}
    assert classes and classes <= set(COVERED) & set(doc_sections())


def test_the_decision_endpoint_attributes_on_the_page_exist_and_include_the_designed_seams(example):
    stack, _, _ = example
    section = doc_sections()["DecisionEndpoint"]
    attributes = [row[0].strip("`") for row in table_rows(section, "Attribute")]
    assert set(ENDPOINT_SEAMS) <= set(attributes)
    missing = [a for a in attributes if not hasattr(stack.endpoint, a)]
    assert missing == []
    assert "`grant_invoke(grantee: iam.IGrantable) -> iam.Grant`" in section
