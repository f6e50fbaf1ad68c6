"""Pipeline-wide settings on the synthesized pipeline stack: its type, the CodeBuild runtimes, the Source role's
connection grant and where the cdk-nag acknowledgement for ``ecr:GetAuthorizationToken`` sits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cdk_testing import all_stacks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline_template(pipeline_assembly):
    (template,) = [s.template for s in all_stacks(pipeline_assembly[1]) if s.stack_name == "semif-pipeline"]
    return template


def _resources(template: dict, type_: str) -> dict[str, dict]:
    return {k: r for k, r in template["Resources"].items() if r["Type"] == type_}


def test_the_pipeline_is_declared_v2(pipeline_template):
    (pipeline,) = _resources(pipeline_template, "AWS::CodePipeline::Pipeline").values()
    assert pipeline["Properties"]["PipelineType"] == "V2"


def _buildspec(project: dict) -> dict:
    return yaml.safe_load(project["Properties"]["Source"]["BuildSpec"])


def test_every_codebuild_project_runs_standard_8_with_node_22_and_python_3_12(pipeline_template):
    """The CDK dropped Node 20 at its end of life; aws/codebuild/standard:7.0 offers Node 18 and 20 only, standard:8.0
    Node 22 and 24. The CDK CLI, npm ci and the pip installs must not move with the image's defaults. Every project:
    synth, self-mutation, asset publishing, image builds, checks."""
    projects = _resources(pipeline_template, "AWS::CodeBuild::Project")
    specs = {k: _buildspec(p) for k, p in projects.items()}
    runs_npm_or_pip = [k for k, p in projects.items()
                       if any(word in p["Properties"]["Source"]["BuildSpec"] for word in ("npm ", "pip "))]
    # The synth, self-mutation, asset publishing and model-check projects all install with npm or pip.
    assert len(runs_npm_or_pip) >= 4, runs_npm_or_pip
    for logical_id, spec in specs.items():
        versions = spec.get("phases", {}).get("install", {}).get("runtime-versions")
        assert versions == {"nodejs": "22", "python": "3.12"}, (logical_id, json.dumps(spec)[:300])
        assert projects[logical_id]["Properties"]["Environment"]["Image"] == "aws/codebuild/standard:8.0", logical_id


def test_self_mutation_and_asset_publishing_install_the_cdk_toolchain_package_json_pins(pipeline_template):
    """Unpinned, CDK Pipelines installs aws-cdk@2 and cdk-assets@latest at every run: a release could deploy with a
    CLI nobody tested. Both come from package.json, as `npm ci` installs them for the synth."""
    pins = json.loads((ROOT / "package.json").read_text())["devDependencies"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins["aws-cdk"]) and re.fullmatch(r"\d+\.\d+\.\d+", pins["cdk-assets"])
    installs = [line for p in _resources(pipeline_template, "AWS::CodeBuild::Project").values()
                for line in json.dumps(_buildspec(p)).split('"') if line.startswith("npm install -g")]
    assert installs, "no project installs a CDK tool"
    for line in installs:
        assert line in (f"npm install -g aws-cdk@{pins['aws-cdk']}", f"npm install -g cdk-assets@{pins['cdk-assets']}"), line
    assert f"npm install -g aws-cdk@{pins['aws-cdk']}" in installs
    assert f"npm install -g cdk-assets@{pins['cdk-assets']}" in installs


def _statements(template: dict) -> list[tuple[str, dict]]:
    return [(k, s) for k, p in _resources(template, "AWS::IAM::Policy").items()
            for s in p["Properties"]["PolicyDocument"]["Statement"]]


def _as_list(value):
    return value if isinstance(value, list) else [value]


def test_the_source_role_may_use_the_connection_under_the_prefix_of_its_arn(pipeline_template):
    """The configured connection is an arn:aws:codeconnections:… ARN; IAM matches codestar-connections:* actions only
    to codestar-connections resources, so the Source action needs codeconnections:UseConnection on it."""
    from config import load_settings

    connection_arn = load_settings().pipeline.connection_arn
    assert connection_arn.startswith("arn:aws:codeconnections:")
    grants = {}
    for policy_id, statement in _statements(pipeline_template):
        for action in _as_list(statement["Action"]):
            if action.endswith(":UseConnection"):
                grants.setdefault(action, set()).add((policy_id, json.dumps(statement["Resource"])))
    assert {r for _, r in grants["codeconnections:UseConnection"]} == {json.dumps(connection_arn)}
    # On the same role CDK gives the old-prefix action to: the Source action's.
    assert {p for p, _ in grants["codeconnections:UseConnection"]} == {p for p, _ in
                                                                      grants["codestar-connections:UseConnection"]}


def test_the_use_connection_action_follows_the_arns_service_prefix():
    from stacks.pipeline_stack import connection_use_action

    new = "arn:aws:codeconnections:us-east-1:333333333333:connection/0a1b2c3d-0000-0000-0000-000000000000"
    old = "arn:aws:codestar-connections:us-east-1:333333333333:connection/0a1b2c3d-0000-0000-0000-000000000000"
    assert connection_use_action(new) == "codeconnections:UseConnection"
    assert connection_use_action(old) == "codestar-connections:UseConnection"
    for bad in ("arn:aws:codecommit:us-east-1:333333333333:repo", "owner/repo", ""):
        with pytest.raises(ValueError, match="connection_arn"):
            connection_use_action(bad)


def test_only_the_image_steps_may_hold_an_unreviewed_wildcard_resource(tmp_path):
    """The ``ecr:GetAuthorizationToken`` acknowledgement sits on the image steps' roles, not on the whole pipeline:
    a new wildcard elsewhere in the pipeline construct fails synth."""
    from aws_cdk import App, aws_iam as iam

    import app as semif_app
    from cdk_testing import CPU_DIGEST, GPU_DIGEST, cdk_json_context
    from stacks.pipeline_stack import PipelineStack

    images = tmp_path / "adapter-images"
    for variant, digest in (("cpu", CPU_DIGEST), ("gpu", GPU_DIGEST)):
        (images / variant).mkdir(parents=True)
        (images / variant / "image.json").write_text(json.dumps({"imageDigest": digest, "imageTag": "t" * 40}))
    out = tmp_path / "out"
    cdk_app = semif_app.build_app(App(outdir=str(out), context={**cdk_json_context(), "pipeline": "true",
                                                                "adapter-images-dir": str(images)}))
    (stack,) = [c for c in cdk_app.node.children if isinstance(c, PipelineStack)]
    for step in stack.image_steps.values():
        assert step.project.role is not None
    unreviewed = iam.Role(stack.pipeline, "Unreviewed", assumed_by=iam.ServicePrincipal("codebuild.amazonaws.com"))
    unreviewed.add_to_policy(iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]))
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        cdk_app.synth()
    report = json.loads((out / "validation-report.json").read_text())
    found = [f"{v['ruleName']} @ {c['constructPath']}" for p in report["pluginReports"] for v in p["violations"]
             for c in v["violatingConstructs"]]
    assert found and all("Pipeline/Unreviewed" in f for f in found), found
    assert any(f.startswith("AwsSolutions-IAM5") for f in found), found
