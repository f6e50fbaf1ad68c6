"""The release checks' shell (stacks/pipeline_steps.py), run as CodeBuild runs it: `aws` is a stand-in that keeps the
bucket in a folder, `semif-eval` and `semif-loadcheck` stand-ins that record their arguments and exit as told. The
tools themselves are tested against real adapters in tests/test_gate.py and tests/test_loadcheck.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from stacks.pipeline_steps import (SEMIF_TOOLS_VENV, gate_commands, load_check_commands, promote_baseline_commands)

BUCKET = "semif-staging-models-111111111111-us-east-1"
KEY_ARN = "arn:aws:kms:us-east-1:111111111111:key/0f0f0f0f-0000-4000-8000-000000000000"
RELEASE = "01234567-89ab-4def-8123-456789abcdef"
# The baseline lives in prod's bucket (retained), read and written as prod's check role.
PROD_BUCKET = "semif-prod-models-222222222222-us-east-1"
BASELINE = {"BASELINE_BUCKET": PROD_BUCKET, "BASELINE_KEY": "reports/prod/report.json",
            "BASELINE_ROLE_ARN": "arn:aws:iam::222222222222:role/semif-prod-pipeline-check",
            "BASELINE_REGION": "us-east-1", "BASELINE_ENDPOINT": "semif-prod-decision"}
COMMON = {"MODEL_BUCKET": BUCKET, "EVAL_DATA_KEY": "eval/decisions.jsonl", "ENDPOINT_NAME": "semif-staging-decision",
          "AWS_DEFAULT_REGION": "us-east-1", "MODEL_KEY_ARN": KEY_ARN, "REPORT_PREFIX": "reports/staging/",
          "RELEASE_ID": RELEASE, **BASELINE}
GATE_ENV = {**COMMON, "GATE_LIMITS": '{"absolute":{"min_accuracy":0.5}}'}
LOAD_ENV = {**COMMON, "LOAD_CLIENTS": "8", "LOAD_DURATION_S": "120", "LOAD_MAX_ATTEMPTS": "5",
            "LOAD_MAX_ELAPSED_S": "30", "LOAD_REQUEST_TIMEOUT_S": "70", "LOAD_LIMITS": '{"max_p95_ms":5000}',
            "LOAD_BOUND_S": "320"}

# Bucket B is "$STUB/s3/B/<key>"; LIST_DENIED makes the listing fail as S3 refuses it. An endpoint exists when
# "$STUB/endpoints/<name>" holds its status; ENDPOINT_DENIED makes DescribeEndpoint refuse. Each call is recorded with
# the profile it ran as ("aws --profile semif-baseline …", or "aws …" as the step's own role).
AWS_STUB = r"""#!/usr/bin/env bash
printf '%s\n' "aws $*" >> "$STUB/calls"
[ "$1" != --profile ] || shift 2
arg() { local want="$1"; shift; while [ $# -gt 0 ]; do [ "$1" = "$want" ] && { echo "$2"; return; }; shift; done; }
case "$1 $2" in
  "s3api list-objects-v2")
    [ -z "$LIST_DENIED" ] || { echo "An error occurred (AccessDenied) when calling the ListObjectsV2 operation" >&2; exit 254; }
    bucket="$(arg --bucket "$@")"; prefix="$(arg --prefix "$@")"; found=""
    mkdir -p "$STUB/s3/$bucket"
    for f in $(cd "$STUB/s3/$bucket" && find . -type f | sed 's|^\./||' | sort); do
      case "$f" in "$prefix"*) found="${found:+$found	}$f" ;; esac
    done
    echo "${found:-None}" ;;
  "s3 cp")
    src="$3"; dst="$4"
    if [ "${src#s3://}" != "$src" ]; then
      path="${src#s3://}"; [ -f "$STUB/s3/$path" ] || { echo "fatal error: An error occurred (404) when calling the HeadObject operation: Key \"${path#*/}\" does not exist" >&2; exit 1; }
      cp "$STUB/s3/$path" "$dst"
    else
      path="${dst#s3://}"; mkdir -p "$(dirname "$STUB/s3/$path")"; cp "$src" "$STUB/s3/$path"
    fi ;;
  "sagemaker describe-endpoint")
    name="$(arg --endpoint-name "$@")"
    [ -z "$ENDPOINT_DENIED" ] || { echo "An error occurred (AccessDeniedException) when calling the DescribeEndpoint operation" >&2; exit 254; }
    [ -f "$STUB/endpoints/$name" ] || { echo "An error occurred (ValidationException) when calling the DescribeEndpoint operation: Could not find endpoint \"$name\"." >&2; exit 254; }
    cat "$STUB/endpoints/$name" ;;
esac
"""
# A tool that records its arguments, one per line, and exits with $TOOL_EXIT after $TOOL_SLEEP seconds.
TOOL_STUB = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$STUB/$(basename "$0").args"
trap 'echo interrupted > "$STUB/$(basename "$0").signal"; kill "$pid" 2>/dev/null; exit 130' INT
[ -z "$TOOL_SLEEP" ] || { sleep "$TOOL_SLEEP" > /dev/null 2>&1 & pid=$!; wait "$pid"; }
exit "${TOOL_EXIT:-0}"
"""


def run_step(tmp_path: Path, commands: list[str], env: dict[str, str], *, objects: dict[str, str] | None = None,
             prod_objects: dict[str, str] | None = None, prod_endpoint: str | None = None,
             timeout: float = 60, shell: str = "bash") -> tuple[int, list[str], str]:
    """The commands in one bash session, as CodeBuild runs a buildspec's phase: the first that fails ends it.
    ``objects`` are in staging's bucket, ``prod_objects`` in prod's; ``prod_endpoint``: prod's endpoint status."""
    stub = tmp_path / "stub"
    (stub / "bin").mkdir(parents=True, exist_ok=True)
    (stub / "s3").mkdir(exist_ok=True)
    (stub / "endpoints").mkdir(exist_ok=True)
    (tmp_path / "aws-config").unlink(missing_ok=True)  # each step starts with its own (assume_role writes it anew)
    if prod_endpoint:
        (stub / "endpoints" / BASELINE["BASELINE_ENDPOINT"]).write_text(prod_endpoint)
    for bucket, contents in ((BUCKET, objects), (PROD_BUCKET, prod_objects)):
        for key, body in (contents or {}).items():
            (stub / "s3" / bucket / key).parent.mkdir(parents=True, exist_ok=True)
            (stub / "s3" / bucket / key).write_text(body)
    (stub / "bin" / "aws").write_text(AWS_STUB)
    (stub / "bin" / "aws").chmod(0o755)
    tools = tmp_path / SEMIF_TOOLS_VENV / "bin"
    tools.mkdir(parents=True, exist_ok=True)
    for name in ("semif-eval", "semif-loadcheck"):
        (tools / name).write_text(TOOL_STUB)
        (tools / name).chmod(0o755)
    (stub / "calls").touch()
    script = "\n".join(f'{{\n{c}\n}} || {{ echo "FAILED command {i}" >&2; exit 1; }}' for i, c in enumerate(commands, 1))
    proc = subprocess.run([shell, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": f"{stub / 'bin'}:/usr/bin:/bin", "STUB": str(stub), "HOME": str(tmp_path),
                               "AWS_CONFIG_FILE": str(tmp_path / "aws-config"), **env})
    return proc.returncode, (stub / "calls").read_text().splitlines(), proc.stdout + proc.stderr


def _args(tmp_path: Path, tool: str) -> list[str]:
    path = tmp_path / "stub" / f"{tool}.args"
    return path.read_text().splitlines() if path.exists() else []


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ---- the gate ---------------------------------------------------------------------------------------------------------


def test_a_first_release_is_gated_on_the_absolute_limits_alone(tmp_path):
    code, calls, output = run_step(tmp_path, gate_commands(), GATE_ENV, objects={"eval/decisions.jsonl": "{}"})
    assert code == 0, output
    args = _args(tmp_path, "semif-eval")
    assert args[0] == f"s3://{BUCKET}/eval/decisions.jsonl"
    assert "--baseline" not in args and "--allow-missing-baseline" not in args
    assert f"no baseline at s3://{PROD_BUCKET}/reports/prod/report.json and no semif-prod-decision: a first release" \
        in output
    assert _value(args, "--limits") == GATE_ENV["GATE_LIMITS"]
    # Both asked of prod, as prod's check role.
    assert calls == [f"aws --profile semif-baseline s3api list-objects-v2 --bucket {PROD_BUCKET} "
                     "--prefix reports/prod/report.json --query Contents[].Key --output text",
                     "aws --profile semif-baseline sagemaker describe-endpoint --endpoint-name semif-prod-decision "
                     "--query EndpointStatus --output text"]
    profile = (tmp_path / "aws-config").read_text()
    assert "[profile semif-baseline]\nrole_arn = arn:aws:iam::222222222222:role/semif-prod-pipeline-check\n" in profile
    assert "credential_source = EcsContainer" in profile and "region = us-east-1" in profile


@pytest.mark.parametrize("status", ["InService", "Updating", "Failed"])
def test_no_baseline_while_prod_already_serves_fails_the_gate_instead_of_weakening_it(tmp_path, status):
    """Staging's bucket goes with staging; a baseline lost while prod runs a release is not a first release."""
    code, _, output = run_step(tmp_path, gate_commands(), GATE_ENV, objects={"reports/prod/report.json": "{}"},
                               prod_endpoint=status)
    assert code != 0
    assert f"no baseline at s3://{PROD_BUCKET}/reports/prod/report.json, but semif-prod-decision exists ({status})" \
        in output
    assert _args(tmp_path, "semif-eval") == []  # nothing evaluated, nothing judged


def test_a_prod_endpoint_that_cannot_be_described_fails_the_gate_instead_of_passing_as_a_first_release(tmp_path):
    code, _, output = run_step(tmp_path, gate_commands(), {**GATE_ENV, "ENDPOINT_DENIED": "1"})
    assert code != 0 and "cannot tell whether semif-prod-decision exists" in output and "AccessDenied" in output
    assert _args(tmp_path, "semif-eval") == []


def test_with_prods_report_present_the_gate_compares_with_it_and_may_not_take_it_as_missing(tmp_path):
    code, calls, output = run_step(tmp_path, gate_commands(), GATE_ENV, prod_endpoint="InService",
                                   objects={"eval/decisions.jsonl": "{}"},
                                   prod_objects={"reports/prod/report.json": '{"baseline": 1}',
                                                 "reports/prod/report.json.old": "{}"})
    assert code == 0, output
    args = _args(tmp_path, "semif-eval")
    # Read as prod's check role; the tool, which runs as staging's, reads the copy.
    assert _value(args, "--baseline") == "baseline-report.json"
    assert (tmp_path / "baseline-report.json").read_text() == '{"baseline": 1}'
    assert f"aws --profile semif-baseline s3 cp s3://{PROD_BUCKET}/reports/prod/report.json baseline-report.json " \
        "--only-show-errors" in calls
    # Listed, so it must be read: a baseline that vanished or cannot be read fails the step (semif-eval exit 2).
    assert "--allow-missing-baseline" not in args
    assert f"baseline: s3://{PROD_BUCKET}/reports/prod/report.json" in output


def test_only_the_baseline_key_itself_counts_not_a_key_it_prefixes(tmp_path):
    code, _, output = run_step(tmp_path, gate_commands(), GATE_ENV, prod_objects={"reports/prod/report.json.old": "{}"})
    assert code == 0, output
    assert "--baseline" not in _args(tmp_path, "semif-eval")


def test_a_listing_s3_refuses_fails_the_gate_instead_of_passing_as_a_first_release(tmp_path):
    code, _, output = run_step(tmp_path, gate_commands(), {**GATE_ENV, "LIST_DENIED": "1"},
                               prod_objects={"reports/prod/report.json": "{}"})
    assert code != 0
    assert "cannot list s3://" in output and "AccessDenied" in output
    assert _args(tmp_path, "semif-eval") == []  # nothing evaluated, nothing judged


def test_the_gate_evaluates_the_staging_endpoint_into_this_executions_report_folder(tmp_path):
    code, _, output = run_step(tmp_path, gate_commands(), GATE_ENV)
    assert code == 0, output
    args = _args(tmp_path, "semif-eval")
    assert _value(args, "--endpoint") == "semif-staging-decision" and _value(args, "--region") == "us-east-1"
    assert _value(args, "--out") == f"s3://{BUCKET}/reports/staging/{RELEASE}/"
    assert _value(args, "--kms-key-id") == KEY_ARN
    assert "--no-contextual" in args and "--no-progress" in args
    assert f"gate passed; report: s3://{BUCKET}/reports/staging/{RELEASE}/report.json" in output


@pytest.mark.parametrize("tool_exit,says", [(1, "gate FAILED: a limit was exceeded"), (2, "gate could not run"),
                                            (3, "gate could not run")])
def test_a_failed_limit_or_a_gate_that_cannot_run_fails_the_release(tmp_path, tool_exit, says):
    code, _, output = run_step(tmp_path, gate_commands(), {**GATE_ENV, "TOOL_EXIT": str(tool_exit)})
    assert code != 0
    assert says in output
    if tool_exit == 1:
        assert f"s3://{BUCKET}/reports/staging/{RELEASE}/report.json has it under gate.failed" in output


# ---- the load check ---------------------------------------------------------------------------------------------------


def test_the_load_check_runs_the_configured_plan_on_the_staging_endpoint(tmp_path):
    code, _, output = run_step(tmp_path, load_check_commands(), LOAD_ENV)
    assert code == 0, output
    args = _args(tmp_path, "semif-loadcheck")
    expected = {"--endpoint": "semif-staging-decision", "--region": "us-east-1", "--clients": "8", "--duration-s": "120",
                "--max-attempts": "5", "--max-elapsed-s": "30", "--request-timeout-s": "70",
                "--limits": '{"max_p95_ms":5000}', "--data": f"s3://{BUCKET}/eval/decisions.jsonl",
                "--out": f"s3://{BUCKET}/reports/staging/{RELEASE}/", "--kms-key-id": KEY_ARN}
    assert {flag: _value(args, flag) for flag in expected} == expected
    assert "--url" not in args and "--no-progress" in args


def test_a_load_check_limit_that_fails_fails_the_release(tmp_path):
    code, _, output = run_step(tmp_path, load_check_commands(), {**LOAD_ENV, "TOOL_EXIT": "1"})
    assert code != 0 and "load check FAILED" in output


def test_a_load_check_past_its_bound_is_interrupted_and_fails(tmp_path):
    started = time.monotonic()
    code, _, output = run_step(tmp_path, load_check_commands(), {**LOAD_ENV, "LOAD_BOUND_S": "1", "TOOL_SLEEP": "30"})
    assert time.monotonic() - started < 15  # stopped at the bound, not after the tool's own 30 s
    assert code != 0 and "past its bound" in output
    # SIGINT, on which semif-loadcheck stops sending at once.
    assert (tmp_path / "stub" / "semif-loadcheck.signal").read_text().strip() == "interrupted"


# ---- the promotion ----------------------------------------------------------------------------------------------------


def _report(passed) -> str:
    return json.dumps({"runs": {}, **({"gate": {"passed": passed, "failed": []}} if passed is not None else {})})


def test_the_report_the_gate_passed_becomes_prods_baseline_in_prods_bucket(tmp_path):
    gated = f"reports/staging/{RELEASE}/report.json"
    code, calls, output = run_step(tmp_path, promote_baseline_commands(), COMMON, objects={
        gated: _report(True), "reports/staging/other-execution/report.json": _report(True)},
        prod_objects={"reports/prod/report.json": _report(True).replace("runs", "old")})
    assert code == 0, output
    baseline = tmp_path / "stub" / "s3" / PROD_BUCKET / "reports/prod/report.json"
    assert baseline.read_text() == _report(True)
    # Read as staging's check role (the step's), written as prod's, into the bucket that outlives staging.
    assert calls[0] == f"aws s3 cp s3://{BUCKET}/{gated} gated-report.json --only-show-errors"
    assert calls[-1].startswith(f"aws --profile semif-baseline s3 cp gated-report.json s3://{PROD_BUCKET}/"
                                "reports/prod/report.json")
    assert not (tmp_path / "stub" / "s3" / BUCKET / "reports/prod").exists()
    # No SSE flags: S3 encrypts with the bucket's default key (prod's model key), as for every object there.
    assert "--sse" not in " ".join(calls)


@pytest.mark.parametrize("passed", [False, None])
def test_a_report_without_a_passing_verdict_never_becomes_the_baseline(tmp_path, passed):
    old = _report(True).replace("runs", "old")
    code, _, output = run_step(tmp_path, promote_baseline_commands(), COMMON,
                               objects={f"reports/staging/{RELEASE}/report.json": _report(passed)},
                               prod_objects={"reports/prod/report.json": old})
    assert code != 0 and "not promoted" in output
    assert (tmp_path / "stub" / "s3" / PROD_BUCKET / "reports/prod/report.json").read_text() == old


def test_no_report_for_this_execution_fails_the_promotion_and_keeps_the_old_baseline(tmp_path):
    code, _, output = run_step(tmp_path, promote_baseline_commands(), COMMON,
                               objects={"reports/staging/other-execution/report.json": _report(True)})
    assert code != 0 and f"no readable report at s3://{BUCKET}/reports/staging/{RELEASE}/report.json" in output
    assert not (tmp_path / "stub" / "s3" / PROD_BUCKET / "reports/prod/report.json").exists()


def test_the_steps_run_in_a_posix_sh_as_well(tmp_path):
    """CodeBuild may run a buildspec's commands with sh: nothing in them is bash-only."""
    for commands in (gate_commands(), load_check_commands(), promote_baseline_commands()):
        for command in commands:
            proc = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True)
            assert proc.returncode == 0, (command, proc.stderr)
    code, _, output = run_step(tmp_path, gate_commands(), GATE_ENV, prod_objects={"reports/prod/report.json": "{}"},
                               shell="sh")
    assert code == 0, output
    assert _value(_args(tmp_path, "semif-eval"), "--baseline") == "baseline-report.json"
