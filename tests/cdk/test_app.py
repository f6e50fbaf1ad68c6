"""The real app, synthesized as `cdk synth` does, with cdk-nag AwsSolutions on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aws_cdk.assertions import Match, Template

from cdk_testing import all_stacks, synth_real_app


def templates(assembly) -> dict[str, dict]:
    return {s.stack_name: s.template for s in all_stacks(assembly)}


def nag_violations(assembly) -> list[str]:
    report = Path(assembly.directory) / "validation-report.json"
    if not report.exists():
        return []
    found = []
    for plugin in json.loads(report.read_text())["pluginReports"]:
        for violation in plugin["violations"]:
            for construct in violation["violatingConstructs"]:
                found.append(f"{violation['ruleName']} @ {construct['constructPath']}")
    return found


@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_real_app_synthesizes_with_cdk_nag_and_no_unacknowledged_finding(request, assembly_name):
    # Synth raises ValidationFailed on any finding; the report must be empty as well.
    _, assembly = request.getfixturevalue(assembly_name)
    assert nag_violations(assembly) == []
    report = json.loads((Path(assembly.directory) / "validation-report.json").read_text())
    assert report["pluginReports"] == [] or all(p["conclusion"] == "success" for p in report["pluginReports"])


def test_an_unacknowledged_finding_fails_synth(tmp_path):
    """The nag gate is live on the real app: one bucket without logging or SSL policy fails synth."""
    from aws_cdk import App, aws_s3 as s3

    import app as semif_app
    from cdk_testing import cdk_json_context

    cdk_app = semif_app.build_app(App(outdir=str(tmp_path), context={**cdk_json_context(), "env": "dev"}))
    shared = next(c for c in cdk_app.node.children if getattr(c, "stack_name", "") == "semif-dev-shared")
    s3.Bucket(shared, "Unreviewed")
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        cdk_app.synth()
    assert any("AwsSolutions-S1 @ SemIf-dev-Shared/Unreviewed" in v for v in nag_violations_in(tmp_path))


def nag_violations_in(directory) -> list[str]:
    class _Assembly:
        pass

    assembly = _Assembly()
    assembly.directory = str(directory)
    return nag_violations(assembly)


def test_each_environment_is_three_stacks_with_fixed_names(dev_assembly, prod_assembly):
    assert sorted(templates(dev_assembly[1])) == ["semif-dev-decision", "semif-dev-shared", "semif-dev-text"]
    assert sorted(templates(prod_assembly[1])) == ["semif-prod-decision", "semif-prod-shared", "semif-prod-text"]
    for stack in prod_assembly[1].stacks:
        assert (stack.environment.account, stack.environment.region) == ("222222222222", "us-east-1")


def test_unknown_env_fails_synth_with_a_clear_message(tmp_path):
    from config import ConfigError

    with pytest.raises(ConfigError, match="unknown environment 'qa'"):
        synth_real_app(tmp_path, env="qa")


def test_prod_decision_endpoint_uses_gpu_pools_and_the_pinned_adapter_image(prod_assembly):
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-decision"])
    template.has_resource_properties("AWS::SageMaker::EndpointConfig", {"ProductionVariants": [Match.object_like({
        "InstancePools": [{"InstanceType": "ml.g6e.xlarge", "Priority": 1},
                          {"InstanceType": "ml.g6.xlarge", "Priority": 2},
                          {"InstanceType": "ml.g5.xlarge", "Priority": 3},
                          {"InstanceType": "ml.g4dn.xlarge", "Priority": 4}],
        "VariantInstanceProvisionTimeoutInSeconds": 1800,
        "InitialInstanceCount": 2,
    })]})
    (build_id,) = template.find_resources("Custom::SemIfImageBuild")
    models = template.find_resources("AWS::SageMaker::Model").values()
    assert len(models) == 2  # the endpoint's and Batch Transform's (docs/batch.md): both pinned alike
    for model in models:
        image = model["Properties"]["PrimaryContainer"]["Image"]
        assert image["Fn::Join"][1][-2:] == ["@", {"Fn::GetAtt": [build_id, "ImageDigest"]}]
    (build,) = template.find_resources("Custom::SemIfImageBuild").values()
    assert build["Properties"]["BaseImage"].endswith("/llama-cpp:server-sagemaker-cuda-v1")


def test_dev_decision_endpoint_is_cpu_on_the_cpu_dlc(dev_assembly):
    template = Template.from_json(templates(dev_assembly[1])["semif-dev-decision"])
    template.has_resource_properties("AWS::SageMaker::EndpointConfig", {
        "ProductionVariants": [Match.object_like({"InstanceType": "ml.c6i.8xlarge"})],
        "KmsKeyId": Match.any_value()})
    (build,) = template.find_resources("Custom::SemIfImageBuild").values()
    assert build["Properties"]["BaseImage"] == (
        "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp:server-sagemaker-cpu-v1")


@pytest.mark.parametrize("stack_name,keys", [
    ("semif-prod-shared", ["model-bucket/name", "model-prefix", "alarm-topic-arn"]),
    ("semif-prod-decision", ["decision/endpoint-name", "decision/endpoint-arn", "decision/repository-uri",
                             "decision/image-digest"]),
    ("semif-prod-text", ["text/endpoint-name", "text/endpoint-arn", "text/client-role-arn"]),
])
def test_outputs_for_apps_are_exports_and_ssm_parameters(prod_assembly, stack_name, keys):
    template = Template.from_json(templates(prod_assembly[1])[stack_name])
    for key in keys:
        template.has_resource_properties("AWS::SSM::Parameter", {"Name": f"/semif/prod/{key}", "Type": "String"})
        export = f"semif-prod-{key.replace('/', '-')}"
        assert template.find_outputs("*", {"Export": {"Name": export}}), export


def test_endpoint_name_output_is_the_configured_name(prod_assembly):
    outputs = templates(prod_assembly[1])["semif-prod-decision"]["Outputs"]
    (value,) = [o["Value"] for o in outputs.values() if o["Export"]["Name"] == "semif-prod-decision-endpoint-name"]
    assert value == "semif-prod-decision"


def test_text_path_uses_the_dlc_itself_with_typed_llama_cpp_settings(prod_assembly):
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-text"])
    template.has_resource_properties("AWS::SageMaker::Model", {"PrimaryContainer": Match.object_like({
        "Image": "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp:server-sagemaker-cuda-v1",
        "Environment": {"SM_LLAMA_CPP_CTX_SIZE": "8192", "SM_LLAMA_CPP_N_GPU_LAYERS": "999",
                        "SM_LLAMA_CPP_THREADS": "4", "SM_LLAMA_CPP_BATCH_SIZE": "1024",
                        "SM_LLAMA_CPP_PARALLEL": "2", "SM_LLAMA_CPP_JINJA": "true"},
    })})


# ---- pipeline ----

@pytest.fixture(scope="module")
def pipeline_template(pipeline_assembly):
    return templates(pipeline_assembly[1])["semif-pipeline"]


def _stages(pipeline_template) -> list[dict]:
    (pipeline,) = [r for r in pipeline_template["Resources"].values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    return pipeline["Properties"]["Stages"]


def test_pipeline_has_one_stage_per_environment_in_order(pipeline_template):
    names = [s["Name"] for s in _stages(pipeline_template)]
    assert names[:2] == ["Source", "Build"]
    assert names.index("dev") < names.index("prod")


def test_prod_needs_a_manual_approval_before_any_deploy(pipeline_template):
    (prod,) = [s for s in _stages(pipeline_template) if s["Name"] == "prod"]
    first = min(prod["Actions"], key=lambda a: a["RunOrder"])
    assert first["ActionTypeId"]["Category"] == "Approval"
    assert all(a["RunOrder"] > first["RunOrder"] for a in prod["Actions"] if a is not first)
    (dev,) = [s for s in _stages(pipeline_template) if s["Name"] == "dev"]
    assert not any(a["ActionTypeId"]["Category"] == "Approval" for a in dev["Actions"])


def test_smoke_step_reads_the_endpoint_name_from_stack_outputs_after_deploy(pipeline_template):
    for stage in (s for s in _stages(pipeline_template) if s["Name"] in ("dev", "prod")):
        deploys = [a for a in stage["Actions"] if a["ActionTypeId"]["Category"] == "Deploy"]
        (smoke,) = [a for a in stage["Actions"] if a["Name"].startswith("Smoke")]
        assert smoke["RunOrder"] > max(a["RunOrder"] for a in deploys)
        variables = json.loads(smoke["Configuration"]["EnvironmentVariables"])
        (endpoint_var,) = [v for v in variables if v["name"] == "ENDPOINT_NAME"]
        assert endpoint_var["value"].startswith("#{")  # a CodePipeline variable from the deploy action's outputs
        decision_deploy = [a for a in deploys if a["Configuration"]["StackName"] == f"semif-{stage['Name']}-decision"
                           and a.get("Namespace")]
        assert decision_deploy and endpoint_var["value"].startswith("#{" + decision_deploy[0]["Namespace"])


def test_synth_step_runs_the_tests_and_cdk_synth(pipeline_template):
    projects = [r["Properties"] for r in pipeline_template["Resources"].values() if r["Type"] == "AWS::CodeBuild::Project"]
    buildspecs = "\n".join(p["Source"].get("BuildSpec", "") for p in projects)
    assert "npm ci" in buildspecs
    assert "python -m pytest tests/cdk tests/lambda" in buildspecs
    assert "npx cdk synth -c pipeline=true" in buildspecs


def test_smoke_role_in_each_environment_trusts_the_pipeline_account_only(pipeline_assembly):
    template = Template.from_json(templates(pipeline_assembly[1])["semif-prod-decision"])
    template.has_resource_properties("AWS::IAM::Role", {
        "RoleName": "semif-prod-smoke-test",
        "AssumeRolePolicyDocument": {"Statement": [Match.object_like({
            "Principal": {"AWS": {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":iam::333333333333:root"]]}}})],
            "Version": "2012-10-17"},
    })


def test_resource_counts(dev_assembly, prod_assembly, pipeline_assembly):
    counts = {name: len(t["Resources"]) for a in (dev_assembly, prod_assembly, pipeline_assembly)
              for name, t in templates(a[1]).items()}
    print("resource counts:", json.dumps(counts, sort_keys=True))
    assert all(n < 500 for n in counts.values())  # CloudFormation's per-template limit
