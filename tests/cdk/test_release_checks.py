"""The labeled regression gate and the load check in the synthesized pipeline: where they run in a release, what they
run, and what staging's check role lets them touch. The real app (config/environments.json), cdk-nag on."""

from __future__ import annotations

import fnmatch
import json

import pytest

from cdk_testing import all_stacks

STAGING_ACCOUNT, REGION = "111111111111", "us-east-1"
STAGING_BUCKET = f"semif-staging-models-{STAGING_ACCOUNT}-{REGION}"
PROD_ACCOUNT = "222222222222"
PROD_BUCKET = f"semif-prod-models-{PROD_ACCOUNT}-{REGION}"


def _templates(assembly) -> dict[str, dict]:
    return {s.stack_name: s.template for s in all_stacks(assembly)}


@pytest.fixture(scope="module")
def pipeline(pipeline_assembly):
    return _templates(pipeline_assembly[1])["semif-pipeline"]


@pytest.fixture(scope="module")
def settings():
    from config import load_settings

    return load_settings()


def _actions(template: dict, stage_name: str) -> list[dict]:
    (pipeline,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    (stage,) = [s for s in pipeline["Properties"]["Stages"] if s["Name"] == stage_name]
    return sorted(stage["Actions"], key=lambda a: a["RunOrder"])


def _stage_names(template: dict) -> list[str]:
    (pipeline,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    return [s["Name"] for s in pipeline["Properties"]["Stages"]]


def _action(template: dict, stage_name: str, name: str) -> dict:
    (action,) = [a for a in _actions(template, stage_name) if a["Name"] == name]
    return action


def _project(template: dict, action: dict) -> dict:
    return template["Resources"][action["Configuration"]["ProjectName"]["Ref"]]["Properties"]


def _variables(template: dict, action: dict) -> dict[str, str]:
    """The project's fixed variables and the action's per-execution ones (CodePipeline variables, stack outputs)."""
    fixed = {v["Name"]: v["Value"] for v in _project(template, action)["Environment"].get("EnvironmentVariables", [])}
    per_run = {v["name"]: v["value"] for v in json.loads(action["Configuration"].get("EnvironmentVariables", "[]"))}
    assert not set(fixed) & set(per_run)
    return {**fixed, **per_run}


def _buildspec(template: dict, action: dict) -> dict:
    return json.loads(_project(template, action)["Source"]["BuildSpec"])


def _statements(template: dict, role_name: str) -> list[dict]:
    (role_id,) = [k for k, r in template["Resources"].items()
                  if r["Type"] == "AWS::IAM::Role" and r["Properties"].get("RoleName") == role_name]
    return [s for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"
            and {"Ref": role_id} in r["Properties"]["Roles"] for s in r["Properties"]["PolicyDocument"]["Statement"]]


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _arn(value, names: dict[str, str]) -> str:
    """A resource as IAM sees it: the partition rendered, the stack's own bucket and key by name."""
    if isinstance(value, str):
        return value
    if "Fn::GetAtt" in value:
        return names[value["Fn::GetAtt"][0]]
    separator, parts = value["Fn::Join"]
    return separator.join("aws" if p == {"Ref": "AWS::Partition"} else _arn(p, names) for p in parts)


def _allowed(template: dict, role_name: str, action: str) -> list[str]:
    names = {}
    for logical_id, resource in template["Resources"].items():
        if resource["Type"] == "AWS::S3::Bucket" and resource["Properties"].get("BucketName") == STAGING_BUCKET:
            names[logical_id] = f"arn:aws:s3:::{STAGING_BUCKET}"
        elif resource["Type"] == "AWS::KMS::Key":
            names[logical_id] = f"<key {logical_id}>"
    return sorted(_arn(r, names) for s in _statements(template, role_name)
                  if action in _as_list(s["Action"]) for r in _as_list(s["Resource"]))


# ---- where they run -------------------------------------------------------------------------------------------------


def test_gate_then_load_check_run_after_stagings_smoke_test_and_before_prod_is_approved(pipeline):
    stages = _stage_names(pipeline)
    assert stages.index("staging") + 1 == stages.index("prod")  # nothing between staging's checks and prod
    order = {a["Name"]: a["RunOrder"] for a in _actions(pipeline, "staging")}
    deploys = [a["RunOrder"] for a in _actions(pipeline, "staging") if a["ActionTypeId"]["Category"] == "Deploy"]
    assert max(deploys) < order["Smoke-staging"] < order["Gate-staging"] < order["LoadCheck-staging"]
    # The stage ends with them and the bake that follows: prod waits for all three.
    assert order["LoadCheck-staging"] < order["Bake-staging-before-prod"] == max(order.values())
    # prod starts with its approval: a person approves what staging's gate and load check passed.
    assert _action(pipeline, "prod", "Approve-prod")["RunOrder"] == min(a["RunOrder"] for a in _actions(pipeline, "prod"))
    # Dev runs no release check: it serves another variant and model.
    assert not [a for a in _actions(pipeline, "dev") if a["Name"].startswith(("Gate", "LoadCheck", "Promote"))]


def test_the_gated_report_becomes_the_baseline_only_after_prod_runs_the_release_and_answers(pipeline):
    order = {a["Name"]: a["RunOrder"] for a in _actions(pipeline, "prod")}
    deploys = [a["RunOrder"] for a in _actions(pipeline, "prod") if a["ActionTypeId"]["Category"] == "Deploy"]
    assert max(deploys) < order["Smoke-prod"] < order["PromoteBaseline-prod"] == max(order.values())
    promote = _action(pipeline, "prod", "PromoteBaseline-prod")
    variables = _variables(pipeline, promote)
    # Staging's bucket and role for the gated report; prod's (retained) bucket and role for the baseline, which
    # outlives a torn-down staging.
    assert variables["CHECK_ROLE_ARN"] == f"arn:aws:iam::{STAGING_ACCOUNT}:role/semif-staging-pipeline-check"
    assert variables["MODEL_BUCKET"] == STAGING_BUCKET
    assert variables["REPORT_PREFIX"] == "reports/staging/" and variables["BASELINE_KEY"] == "reports/prod/report.json"
    assert variables["BASELINE_BUCKET"] == PROD_BUCKET and variables["BASELINE_REGION"] == REGION
    assert variables["BASELINE_ROLE_ARN"] == f"arn:aws:iam::{PROD_ACCOUNT}:role/semif-prod-pipeline-check"
    # The report of this execution's gate, not the last one written under staging.
    assert variables["RELEASE_ID"] == "#{codepipeline.PipelineExecutionId}"
    gate = _variables(pipeline, _action(pipeline, "staging", "Gate-staging"))
    assert gate["RELEASE_ID"] == variables["RELEASE_ID"]
    for name in ("BASELINE_KEY", "BASELINE_BUCKET", "BASELINE_ROLE_ARN", "BASELINE_REGION"):
        assert gate[name] == variables[name], name
    assert gate["BASELINE_ENDPOINT"] == "semif-prod-decision"
    commands = " ".join(_buildspec(pipeline, promote)["phases"]["build"]["commands"])
    assert "'passed') is True" in commands
    assert 'aws --profile semif-baseline s3 cp gated-report.json "$baseline"' in commands


# ---- what they run --------------------------------------------------------------------------------------------------


def test_the_gate_step_evaluates_the_labeled_data_on_the_staging_endpoint_with_the_configured_limits(pipeline, settings):
    action = _action(pipeline, "staging", "Gate-staging")
    variables = _variables(pipeline, action)
    checks = settings.environment("staging").release_checks
    assert variables["ENDPOINT_NAME"] == "semif-staging-decision" == settings.environment("staging").decision.endpoint_name
    assert variables["ENDPOINT_NAMES"] == "semif-staging-decision"
    assert variables["MODEL_BUCKET"] == STAGING_BUCKET and variables["EVAL_DATA_KEY"] == checks.data_key
    assert json.loads(variables["GATE_LIMITS"]) == json.loads(checks.gate.to_json())
    assert json.loads(variables["GATE_LIMITS"])["absolute"]["min_accuracy"] == checks.gate.absolute.min_accuracy
    # The bucket's own key, read from the staging shared stack's output when the step runs.
    assert variables["MODEL_KEY_ARN"].startswith("#{") and variables["MODEL_KEY_ARN"].endswith(".Outmodelbucketkeyarn}")
    assert variables["AWS_DEFAULT_REGION"] == REGION
    spec = _buildspec(pipeline, action)
    build = " ".join(spec["phases"]["build"]["commands"])
    assert 'credential_source = EcsContainer' in build  # as staging's check role
    for flag in ('semif-eval "s3://${MODEL_BUCKET}/${EVAL_DATA_KEY}"', '--endpoint "$ENDPOINT_NAME"',
                 '--region "$AWS_DEFAULT_REGION"', "--no-contextual", "--no-progress", '--kms-key-id "$MODEL_KEY_ARN"',
                 '--out "$report"', '--limits "$GATE_LIMITS"', 'set -- --baseline baseline-report.json',
                 'aws --profile semif-baseline s3api list-objects-v2 --bucket "$BASELINE_BUCKET" --prefix "$BASELINE_KEY"',
                 'aws --profile semif-baseline sagemaker describe-endpoint --endpoint-name "$BASELINE_ENDPOINT"'):
        assert flag in build, flag
    install = " ".join(spec["phases"]["install"]["commands"])
    # The tools with the package's pins, without llama.cpp (a remote evaluation scores nothing locally).
    assert "pip install --quiet --no-deps ./container" in install and "llama-cpp-python" in install
    assert "[tools]" not in install
    assert _project(pipeline, action)["TimeoutInMinutes"] == 60
    assert len(action["InputArtifacts"]) == 1  # the repository checkout: the project's own tools


def test_the_load_check_is_bounded_by_the_configured_run_and_sends_only_to_the_staging_endpoint(pipeline, settings):
    action = _action(pipeline, "staging", "LoadCheck-staging")
    variables = _variables(pipeline, action)
    load = settings.environment("staging").release_checks.load
    assert variables["ENDPOINT_NAME"] == "semif-staging-decision"
    assert (variables["LOAD_CLIENTS"], variables["LOAD_DURATION_S"], variables["LOAD_MAX_ATTEMPTS"]) == (
        str(load.clients), str(load.duration_s), str(load.max_attempts))
    assert float(variables["LOAD_MAX_ELAPSED_S"]) == load.max_elapsed_s
    assert float(variables["LOAD_REQUEST_TIMEOUT_S"]) == load.request_timeout_s
    assert json.loads(variables["LOAD_LIMITS"]) == json.loads(load.limits.to_json())
    bound = int(variables["LOAD_BOUND_S"])
    assert load.bound_s <= bound <= load.duration_s + 2 * (load.max_elapsed_s + load.request_timeout_s) + 1
    # The step outlives the run (install, warm-up) but not by hours: minutes, and it stops by itself.
    timeout_min = _project(pipeline, action)["TimeoutInMinutes"]
    assert bound / 60 < timeout_min <= bound / 60 + 12
    build = " ".join(_buildspec(pipeline, action)["phases"]["build"]["commands"])
    assert 'timeout --signal=INT --kill-after=30 "$LOAD_BOUND_S"' in build
    for flag in ('--endpoint "$ENDPOINT_NAME"', '--data "s3://${MODEL_BUCKET}/${EVAL_DATA_KEY}"',
                 '--clients "$LOAD_CLIENTS"', '--duration-s "$LOAD_DURATION_S"', '--limits "$LOAD_LIMITS"',
                 '--kms-key-id "$MODEL_KEY_ARN"', "--no-progress"):
        assert flag in build, flag
    assert "--url" not in build


# ---- what staging's check role may touch ------------------------------------------------------------------------------


def test_stagings_check_role_reads_only_the_labeled_data_and_the_reports_and_invokes_only_staging(pipeline_assembly):
    shared = _templates(pipeline_assembly[1])["semif-staging-shared"]
    role = "semif-staging-pipeline-check"
    bucket = f"arn:aws:s3:::{STAGING_BUCKET}"
    model = "models/qwen2.5-coder-1.5b-instruct-q4_k_m/1/"
    assert _allowed(shared, role, "s3:GetObject") == sorted([
        f"{bucket}/eval/decisions.jsonl", f"{bucket}/reports/staging/*",
        f"{bucket}/{model}*.gguf", f"{bucket}/{model}model-manifest.json",
        f"{bucket}/{model.rstrip('/')}.tar.gz"])  # the last three: the model check's
    # The baseline is no longer here: staging's bucket is deleted with staging.
    assert _allowed(shared, role, "s3:PutObject") == [f"{bucket}/reports/staging/*"]
    for action in ("s3:DeleteObject", "s3:PutObjectAcl", "s3:*", "s3:GetObject*"):
        assert _allowed(shared, role, action) == [], action
    assert not [s for s in _statements(shared, role) if "s3:ListBucket" in _as_list(s["Action"])
                and "reports/" in json.dumps(s)]
    endpoint = f"arn:aws:sagemaker:{REGION}:{STAGING_ACCOUNT}:endpoint/semif-staging-decision"
    assert _allowed(shared, role, "sagemaker:InvokeEndpoint") == [endpoint]
    assert _allowed(shared, role, "sagemaker:DescribeEndpoint") == [endpoint]
    assert _allowed(shared, role, "sagemaker:DescribeEndpointConfig") == [
        f"arn:aws:sagemaker:{REGION}:{STAGING_ACCOUNT}:endpoint-config/*"]
    assert _allowed(shared, role, "sagemaker:InvokeEndpointAsync") == []
    # The bucket key: to read the labeled data, and to write reports under it.
    (key,) = {r for a in ("kms:Decrypt", "kms:GenerateDataKey") for r in _allowed(shared, role, a)}
    assert key.startswith("<key ModelsKey")
    # Every object the steps name lies inside what the role may read or write.
    for name in ("eval/decisions.jsonl", "reports/staging/e-123/report.json", "reports/staging/e-123/loadcheck.json"):
        assert any(fnmatch.fnmatchcase(f"{bucket}/{name}", p) for p in _allowed(shared, role, "s3:GetObject")), name
    for name in ("models/other/1/x.gguf", "reports/prod/other.json", "eval/other.jsonl", "batch/j/in/x"):
        assert not any(fnmatch.fnmatchcase(f"{bucket}/{name}", p) for p in _allowed(shared, role, "s3:GetObject")), name


def test_prods_check_role_reads_writes_and_lists_exactly_the_baseline_in_its_own_retained_bucket(pipeline_assembly):
    shared = _templates(pipeline_assembly[1])["semif-prod-shared"]
    role, bucket = "semif-prod-pipeline-check", f"arn:aws:s3:::{PROD_BUCKET}"
    names = {k: bucket for k, r in shared["Resources"].items()
             if r["Type"] == "AWS::S3::Bucket" and r["Properties"].get("BucketName") == PROD_BUCKET}
    names.update({k: f"<key {k}>" for k, r in shared["Resources"].items() if r["Type"] == "AWS::KMS::Key"})
    allowed = lambda action: sorted(_arn(r, names) for s in _statements(shared, role)  # noqa: E731
                                    if action in _as_list(s["Action"]) for r in _as_list(s["Resource"]))
    assert f"{bucket}/reports/prod/report.json" in allowed("s3:GetObject")
    assert allowed("s3:PutObject") == [f"{bucket}/reports/prod/report.json"]
    listings = [s for s in _statements(shared, role) if "s3:ListBucket" in _as_list(s["Action"])
                and "reports/" in json.dumps(s)]
    assert [s["Condition"] for s in listings] == [{"StringEquals": {"s3:prefix": ["reports/prod/report.json"]}}]
    assert [k for k in allowed("kms:GenerateDataKey")] and all(k.startswith("<key ModelsKey")
                                                               for k in allowed("kms:GenerateDataKey"))
    # Whether prod serves: its decision endpoint, described.
    assert f"arn:aws:sagemaker:{REGION}:{PROD_ACCOUNT}:endpoint/semif-prod-decision" in allowed(
        "sagemaker:DescribeEndpoint")
    # The bucket outlives the stack (and a torn-down staging).
    (bucket_resource,) = [r for r in shared["Resources"].values() if r["Type"] == "AWS::S3::Bucket"
                          and r["Properties"].get("BucketName") == PROD_BUCKET]
    assert bucket_resource["DeletionPolicy"] in ("Retain", "RetainExceptOnCreate")
    assert "eval/" not in json.dumps(_statements(shared, role))
    assert allowed("sagemaker:DescribeEndpointConfig") == []


def test_environments_without_release_checks_grant_their_check_roles_no_report_access(pipeline_assembly):
    templates = _templates(pipeline_assembly[1])
    for env in ("dev",):
        role = f"semif-{env}-pipeline-check"
        shared = templates[f"semif-{env}-shared"]
        assert _allowed(shared, role, "s3:PutObject") == [], env
        assert _allowed(shared, role, "sagemaker:DescribeEndpointConfig") == [], env
        assert "reports/" not in json.dumps(_statements(shared, role)) and "eval/" not in json.dumps(
            _statements(shared, role)), env


def test_the_pipelines_check_steps_reach_staging_only_through_stagings_own_check_role(pipeline):
    """The pipeline's step role holds nothing of staging's: it may only assume the environments' check roles."""
    statements = _statements(pipeline, "semif-pipeline-checks")
    assert not [s for s in statements if any(a.startswith(("sagemaker:", "s3:PutObject")) for a in _as_list(s["Action"]))
                and "semif-staging" in json.dumps(s)]
    assumed = sorted(r for s in statements if "sts:AssumeRole" in _as_list(s["Action"]) for r in _as_list(s["Resource"]))
    assert f"arn:aws:iam::{STAGING_ACCOUNT}:role/semif-staging-pipeline-check" in assumed


def test_a_stage_check_naming_an_output_its_stage_lacks_fails_synth_with_the_names_it_has():
    from aws_cdk import App, CfnOutput, Environment, Stack

    from stacks.pipeline_stack import PipelineStack, PipelineStageSpec, StageCheck, StageStacks

    def build(scope) -> StageStacks:
        stack = Stack(scope, "staging-decision", stack_name="semif-staging-decision")
        return StageStacks(decision=stack, endpoint_name_output=CfnOutput(stack, "Name", value="e"), stacks=[stack],
                           endpoint_names=["e"], outputs={"model_key_arn": CfnOutput(stack, "Key", value="k")})

    spec = PipelineStageSpec(
        name="staging", account=STAGING_ACCOUNT, region=REGION, variant="gpu", needs_approval=False,
        check_role_arn=f"arn:aws:iam::{STAGING_ACCOUNT}:role/semif-staging-pipeline-check", model_bucket="b",
        model_prefix="models/m/1/", manifest_key="models/m/1/model-manifest.json", chat_endpoint=None, build=build,
        checks=[StageCheck(name="Gate", commands=["true"], env_from_outputs={"MODEL_KEY_ARN": "model_key"})])
    with pytest.raises(ValueError, match="stage check Gate: stage staging has no output model_key "
                                         r"\(it has model_key_arn\)"):
        PipelineStack(App(), "P", env=Environment(account="333333333333", region=REGION),
                      connection_arn="arn:aws:codeconnections:us-east-1:333333333333:connection/x", repository="o/r",
                      branch="main", stages=[spec], bakes={}, bake_minutes=1, image_keep_last=5,
                      dlc_base_images={v: "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@sha256:" + "4e" * 32
                                       for v in ("cpu", "gpu")},
                      pull_roles=[f"arn:aws:iam::{STAGING_ACCOUNT}:role/staging-decision"])
