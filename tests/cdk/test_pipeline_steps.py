"""The pipeline steps' shell (stacks/pipeline_steps.py), run as CodeBuild runs it, with a stand-in for `aws` that
keeps CloudFormation's and CloudWatch's answers in files; and the stage-check slot on a purpose-built pipeline."""

from __future__ import annotations

import datetime
import http.server
import json
import subprocess
import threading
from pathlib import Path

import pytest
from aws_cdk import App, CfnOutput, Environment, Stack, aws_sns as sns
from aws_cdk.assertions import Template

from stacks.pipeline_steps import TARGET_PROFILE, assume_role, bake_commands, pre_deploy_commands, smoke_commands

DIGEST = "sha256:" + "4e" * 32

AWS_STUB = r"""#!/usr/bin/env bash
printf '%s\n' "aws $*" >> "$STUB/calls"
arg() { local want="$1"; shift; while [ $# -gt 0 ]; do [ "$1" = "$want" ] && { echo "$2"; return; }; shift; done; }
case "$1 $2" in
  "ecr describe-images") tag="$(arg --image-ids "$@")"
    [ -f "$STUB/tagged-${tag#imageTag=}" ] || { echo "ImageNotFoundException" >&2; exit 254; } ;;
  "ecr batch-get-image") echo '{"schemaVersion": 2}' ;;
  "ecr put-image") touch "$STUB/tagged-$(arg --image-tag "$@")" ;;
  "cloudformation describe-stacks")
    stack="$(arg --stack-name "$@")"
    [ -f "$STUB/stacks/$stack" ] || { echo "An error occurred (ValidationError) when calling the DescribeStacks operation: Stack with id $stack does not exist" >&2; exit 254; }
    status="$(cat "$STUB/stacks/$stack")"
    [ "$status" != DENIED ] || { echo "An error occurred (AccessDenied) when calling the DescribeStacks operation" >&2; exit 254; }
    echo "$status" ;;
  "cloudformation delete-stack") echo DELETE_IN_PROGRESS > "$STUB/stacks/$(arg --stack-name "$@")" ;;
  "cloudformation wait") rm -f "$STUB/stacks/$(arg --stack-name "$@")" ;;
  "sagemaker describe-endpoint") cat "$STUB/endpoints/$(arg --endpoint-name "$@")" ;;
  "cloudwatch describe-alarms")
    polls=$(( $(cat "$STUB/polls" 2>/dev/null || echo 0) + 1 )); echo "$polls" > "$STUB/polls"
    shift 2
    while [ $# -gt 0 ] && [ "$1" != --alarm-names ]; do shift; done; shift
    while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do
      if [ -f "$STUB/alarms/$1" ]; then
        state="$(cat "$STUB/alarms/$1")"
        [ -z "$FIRE_ON_POLL" ] || [ "$polls" -lt "$FIRE_ON_POLL" ] || state=ALARM
        printf '%s\t%s\n' "$1" "$state"
      fi
      shift
    done ;;
esac
"""


def run_step(tmp_path: Path, commands: list[str], env: dict[str, str]) -> tuple[int, list[str], str]:
    """The commands in one bash session, as CodeBuild runs a buildspec's: the first that fails ends the build."""
    stub = tmp_path / "stub"
    (stub / "bin").mkdir(parents=True, exist_ok=True)
    (stub / "bin" / "aws").write_text(AWS_STUB)
    (stub / "bin" / "aws").chmod(0o755)
    (stub / "calls").touch()
    script = "\n".join(f'{{\n{c}\n}} || {{ echo "FAILED command {i}" >&2; exit 1; }}' for i, c in enumerate(commands, 1))
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{stub / 'bin'}:/usr/bin:/bin", "STUB": str(stub), "HOME": str(tmp_path),
                               **env})
    return proc.returncode, (stub / "calls").read_text().splitlines(), proc.stdout + proc.stderr


def _stacks(tmp_path: Path, **statuses: str) -> None:
    (tmp_path / "stub" / "stacks").mkdir(parents=True, exist_ok=True)
    for name, status in statuses.items():
        (tmp_path / "stub" / "stacks" / name.replace("_", "-")).write_text(status)


PRE_DEPLOY_ENV = {"STAGE_NAME": "prod", "IMAGE_REPOSITORY": "semif/adapter", "IMAGE_REGION": "us-east-1",
                  "DEPLOYED_TAG_PREFIX": "deployed-prod-", "AWS_DEFAULT_REGION": "us-east-1",
                  "DEPLOY_ROLE_ARN": "arn:aws:iam::222222222222:role/cdk-hnb659fds-deploy-role-222222222222-us-east-1",
                  "STACKS": "semif-prod-text semif-prod-decision semif-prod-shared"}


@pytest.fixture
def image_json(tmp_path):
    (tmp_path / "image.json").write_text(json.dumps({"imageDigest": DIGEST, "imageTag": "t" * 40}))


def test_a_stack_left_in_rollback_complete_is_deleted_before_the_deploy_and_the_others_are_left(tmp_path, image_json):
    _stacks(tmp_path, semif_prod_shared="CREATE_COMPLETE", semif_prod_decision="ROLLBACK_COMPLETE")
    code, calls, output = run_step(tmp_path, pre_deploy_commands(), PRE_DEPLOY_ENV)

    assert code == 0, output
    deletes = [c for c in calls if c.startswith("aws cloudformation delete-stack")]
    assert deletes == ["aws cloudformation delete-stack --stack-name semif-prod-decision"]
    # The deploy that follows creates the stack anew: the delete must have finished.
    assert "aws cloudformation wait stack-delete-complete --stack-name semif-prod-decision" in calls
    assert not (tmp_path / "stub" / "stacks" / "semif-prod-decision").exists()
    assert (tmp_path / "stub" / "stacks" / "semif-prod-shared").read_text() == "CREATE_COMPLETE"
    assert "semif-prod-text: not created yet" in output


@pytest.mark.parametrize("status", ["UPDATE_ROLLBACK_COMPLETE", "CREATE_COMPLETE", "UPDATE_COMPLETE"])
def test_a_stack_that_ever_served_is_never_deleted(tmp_path, image_json, status):
    _stacks(tmp_path, semif_prod_decision=status)
    code, calls, output = run_step(tmp_path, pre_deploy_commands(), PRE_DEPLOY_ENV)
    assert code == 0, output
    assert not [c for c in calls if c.startswith("aws cloudformation delete-stack")]


def test_a_stack_that_cannot_be_read_fails_the_step_instead_of_being_taken_as_absent(tmp_path, image_json):
    _stacks(tmp_path, semif_prod_text="DENIED", semif_prod_decision="ROLLBACK_COMPLETE")
    code, calls, output = run_step(tmp_path, pre_deploy_commands(), PRE_DEPLOY_ENV)
    assert code != 0
    assert "cannot read semif-prod-text" in output and "AccessDenied" in output
    assert not [c for c in calls if c.startswith("aws cloudformation delete-stack")]


def test_the_digest_is_marked_for_the_stage_once_before_anything_else(tmp_path, image_json):
    code, calls, output = run_step(tmp_path, pre_deploy_commands(), PRE_DEPLOY_ENV)
    assert code == 0, output
    (put,) = [c for c in calls if c.startswith("aws ecr put-image")]
    assert f"--image-tag deployed-prod-{DIGEST.removeprefix('sha256:')} --image-digest {DIGEST}" in put
    assert "--image-manifest-media-type application/vnd.docker.distribution.manifest.v2+json" in put
    assert calls.index(put) < min(i for i, c in enumerate(calls) if "cloudformation" in c)
    # Run again (a retried stage): the tag is there, nothing is written.
    code, calls, output = run_step(tmp_path, pre_deploy_commands(), PRE_DEPLOY_ENV)
    assert code == 0 and len([c for c in calls if c.startswith("aws ecr put-image")]) == 1, output


def test_a_gpu_stage_marks_the_cpu_image_its_batch_transform_runs_too(tmp_path, image_json):
    cpu = "sha256:" + "c1" * 32
    (tmp_path / "batch-image").mkdir()
    (tmp_path / "batch-image" / "image.json").write_text(json.dumps({"imageDigest": cpu, "imageTag": "c" * 40}))
    code, calls, output = run_step(tmp_path, pre_deploy_commands(), PRE_DEPLOY_ENV)
    assert code == 0, output
    tagged = sorted(c.split("--image-tag ")[1].split()[0] for c in calls if c.startswith("aws ecr put-image"))
    assert tagged == sorted([f"deployed-prod-{DIGEST.removeprefix('sha256:')}", f"deployed-prod-{'c1' * 32}"])


ALARMS = ["semif-staging-decision-cpu-utilization", "semif-staging-decision-latency-p95",
          "semif-staging-decision-server-errors"]
BAKE_ENV = {"CHECK_ROLE_ARN": "arn:aws:iam::111111111111:role/semif-staging-pipeline-check",
            "ENDPOINT_NAMES": "semif-staging-decision", "ALARM_NAMES": " ".join(ALARMS), "BAKE_SECONDS": "0",
            "BAKE_POLL_SECONDS": "1"}


def _watch(tmp_path: Path, endpoint: str = "InService", states: dict[str, str] | None = None) -> None:
    stub = tmp_path / "stub"
    for directory in ("endpoints", "alarms"):
        (stub / directory).mkdir(parents=True, exist_ok=True)
    (stub / "endpoints" / "semif-staging-decision").write_text(endpoint)
    for name, state in (states if states is not None else {a: "OK" for a in ALARMS}).items():
        (stub / "alarms" / name).write_text(state)


def _endpoint(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / "stub" / "endpoints").mkdir(parents=True, exist_ok=True)
    (tmp_path / "stub" / "endpoints" / name).write_text(text)


@pytest.mark.parametrize("described,passes,says", [
    ("InService\tsemif-prod-decision-cfg-new", True, ""),
    # A blue/green update that rolled back: InService, on the previous config.
    ("InService\tsemif-prod-decision-cfg-old", False, "runs endpoint config semif-prod-decision-cfg-old, not "
                                                     "semif-prod-decision-cfg-new that the stack deployed"),
    ("Updating\tsemif-prod-decision-cfg-new", False, "is Updating, not InService"),
])
def test_the_smoke_step_fails_unless_the_endpoint_runs_the_stacks_endpoint_config(tmp_path, described, passes, says):
    commands = smoke_commands(chat=False)
    describe = commands[len(assume_role("CHECK_ROLE_ARN"))]
    _endpoint(tmp_path, "semif-prod-decision", described + "\n")
    code, calls, output = run_step(tmp_path, [describe], {
        "ENDPOINT_NAME": "semif-prod-decision", "ENDPOINT_CONFIG_NAME": "semif-prod-decision-cfg-new"})
    assert (code == 0) is passes, output
    assert says in output
    assert calls == ['aws sagemaker describe-endpoint --endpoint-name semif-prod-decision '
                     '--query [EndpointStatus,EndpointConfigName] --output text']


def test_the_bake_passes_when_the_endpoint_serves_and_every_alarm_is_quiet(tmp_path):
    _watch(tmp_path, states={ALARMS[0]: "INSUFFICIENT_DATA", ALARMS[1]: "OK", ALARMS[2]: "OK"})
    code, calls, output = run_step(tmp_path, bake_commands(), BAKE_ENV)
    assert code == 0, output
    assert "bake passed" in output
    (query,) = [c for c in calls if c.startswith("aws cloudwatch describe-alarms")]
    assert query.startswith("aws cloudwatch describe-alarms --alarm-names " + " ".join(ALARMS))


def test_the_bake_fails_on_an_alarm_that_fires_during_it(tmp_path):
    _watch(tmp_path)
    code, calls, output = run_step(tmp_path, bake_commands(), {**BAKE_ENV, "BAKE_SECONDS": "30",
                                                                "FIRE_ON_POLL": "3"})
    assert code != 0
    assert f"alarms firing: {ALARMS[0]}" in output
    assert len([c for c in calls if c.startswith("aws cloudwatch describe-alarms")]) == 3  # polled until it fired


def test_the_bake_fails_when_an_alarm_cannot_be_read_instead_of_passing_unwatched(tmp_path):
    _watch(tmp_path, states={ALARMS[0]: "OK", ALARMS[1]: "OK"})  # the role may not read the third
    code, _, output = run_step(tmp_path, bake_commands(), BAKE_ENV)
    assert code != 0
    assert "read 2 of the 3 alarms" in output


def test_the_bake_fails_when_the_endpoint_is_not_in_service(tmp_path):
    _watch(tmp_path, endpoint="Updating")
    code, _, output = run_step(tmp_path, bake_commands(), BAKE_ENV)
    assert code != 0
    assert "semif-staging-decision is Updating, not InService" in output


class _ContainerCredentials(http.server.BaseHTTPRequestHandler):
    """CodeBuild's container credential endpoint: the step's own role, as the ECS provider reads it."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        body = json.dumps({"AccessKeyId": "AKIAIOSFODNN7EXAMPLE", "SecretAccessKey": "codebuild-secret",
                           "Token": "codebuild-token", "Expiration": "2099-01-01T00:00:00Z"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def container_credentials_url():
    server = http.server.HTTPServer(("127.0.0.1", 0), _ContainerCredentials)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v2/credentials"
    server.shutdown()
    server.server_close()


def test_the_assumed_role_renews_itself_instead_of_expiring_with_its_first_session(tmp_path, monkeypatch,
                                                                                   container_credentials_url):
    """The profile the steps write makes botocore (and the AWS CLI, built on it) assume the role from CodeBuild's
    container credentials, and assume it again once it expires: a role-chained session lasts one hour at most, a
    bake up to eight."""
    import botocore.session
    from moto import mock_aws

    code, _, output = run_step(tmp_path, [*assume_role("CHECK_ROLE_ARN"),
                                          'echo "CONFIG=$AWS_CONFIG_FILE PROFILE=$AWS_PROFILE"'],
                               {"CHECK_ROLE_ARN": BAKE_ENV["CHECK_ROLE_ARN"]})
    assert code == 0, output
    config = tmp_path / ".semif-aws-config"
    assert f"CONFIG={config} PROFILE={TARGET_PROFILE}" in output
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", container_credentials_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        session = botocore.session.Session(profile=TARGET_PROFILE)
        assumed = []
        session.register("before-call.sts.AssumeRole", lambda params, **_: assumed.append(params["body"]["RoleArn"]))
        credentials = session.get_credentials()
        assert credentials.method == "assume-role"
        first = credentials.get_frozen_credentials()
        assert assumed == [BAKE_ENV["CHECK_ROLE_ARN"]] and first.access_key != "AKIAIOSFODNN7EXAMPLE"
        # 55 minutes on, near the end of the first (role-chained, one-hour) session: the next call assumes again.
        import botocore.credentials

        now = botocore.credentials._local_now()
        later = lambda: now + datetime.timedelta(minutes=55)  # noqa: E731
        monkeypatch.setattr(botocore.credentials, "_local_now", later)  # the assume-role fetcher's cache clock
        credentials._time_fetcher = later  # the credentials' own clock
        credentials.get_frozen_credentials()
        assert assumed == [BAKE_ENV["CHECK_ROLE_ARN"]] * 2


# --- the stage-check slot, on a purpose-built pipeline ------------------------------------------------------------


def _pipeline_with_a_staging_check():
    from stacks.pipeline_stack import PipelineStack, PipelineStageSpec, StageCheck, StageStacks

    def stage(name: str, account: str):
        def build(scope) -> StageStacks:
            stack = Stack(scope, f"{name}-decision", stack_name=f"semif-{name}-decision")
            sns.Topic(stack, "Topic")
            return StageStacks(decision=stack, endpoint_name_output=CfnOutput(stack, "Name", value=f"{name}-e"),
                               stacks=[stack], endpoint_names=[f"{name}-e"], alarm_names=[f"{name}-e-server-errors"])

        checks = [StageCheck(name="RegressionGate", commands=["python3 tools/gate.py"]),
                  StageCheck(name="LoadCheck", commands=["python3 tools/load.py"])] if name == "staging" else []
        return PipelineStageSpec(
            name=name, account=account, region="us-east-1", variant="gpu", needs_approval=name == "prod",
            check_role_arn=f"arn:aws:iam::{account}:role/semif-{name}-pipeline-check", model_bucket=f"{name}-models",
            model_prefix="models/m/1/", manifest_key="models/m/1/model-manifest.json", chat_endpoint=None,
            build=build, checks=checks)

    staging, prod = stage("staging", "111111111111"), stage("prod", "222222222222")
    app = App()
    stack = PipelineStack(app, "P", env=Environment(account="333333333333", region="us-east-1"),
                          connection_arn="arn:aws:codeconnections:us-east-1:333333333333:connection/x",
                          repository="o/r", branch="main", stages=[staging, prod], bakes={"prod": staging},
                          bake_minutes=1, image_keep_last=5,
                          dlc_base_images={v: f"763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@{DIGEST}"
                                           for v in ("cpu", "gpu")},
                          pull_roles=["arn:aws:iam::111111111111:role/staging-decision",
                                      "arn:aws:iam::222222222222:role/prod-decision"])
    return Template.from_stack(stack).to_json()


def test_stage_checks_run_after_the_smoke_test_one_by_one_and_before_the_next_stage_is_approved():
    template = _pipeline_with_a_staging_check()
    (pipeline,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    stages = {s["Name"]: s for s in pipeline["Properties"]["Stages"]}
    order = {a["Name"]: a["RunOrder"] for a in stages["staging"]["Actions"]}
    assert order["Smoke-staging"] < order["RegressionGate-staging"] < order["LoadCheck-staging"]
    # The bake of staging ends staging's stage, after its checks: no newer release enters staging while it bakes.
    assert max(order.values()) == order["Bake-staging-before-prod"] == order["LoadCheck-staging"] + 1
    assert "Approve-prod" in {a["Name"] for a in stages["prod"]["Actions"]}  # the next stage, after all of them
    assert not [a for a in stages["prod"]["Actions"] if a["Name"].startswith("Bake-")]
    (gate,) = [a for a in stages["staging"]["Actions"] if a["Name"] == "RegressionGate-staging"]
    project = template["Resources"][gate["Configuration"]["ProjectName"]["Ref"]]["Properties"]
    spec = project["Source"]["BuildSpec"]
    assert "python3 tools/gate.py" in spec and "credential_source = EcsContainer" in spec
    variables = {v["Name"]: v["Value"] for v in project["Environment"]["EnvironmentVariables"]}
    assert variables["CHECK_ROLE_ARN"] == "arn:aws:iam::111111111111:role/semif-staging-pipeline-check"
    assert variables["ENDPOINT_NAMES"] == "staging-e"
    assert len(gate["InputArtifacts"]) == 1  # the repository checkout: the project's own tools
