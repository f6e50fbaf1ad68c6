"""The release gate offline: real `semif-eval` runs against real `serve` processes (embedded SmolLM2), held
against each other by `semif-eval --baseline` and `semif-gate`. Two identical adapters pass; an adapter
whose layout moves decisions fails, with the changed cases listed by id. S3 through moto (KMS), the
endpoint's instance types through moto and botocore's Stubber (instance pools, which moto lacks)."""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from serving import ServeProcess, embedded_model, free_port, load_sample_decisions
from semif.tools import evaluate, gate

# A handful of cases: four routing tickets, and two language questions whose answers the options-first
# layout moves on this model (measured in the layout benchmark of docs/benchmarks.md).
CASE_IDS = ["sample-route-01", "sample-route-02", "sample-route-03", "sample-route-04", "sample-extract-01", "sample-extract-02"]
EVAL_ARGS = ["--no-contextual", "--folds", "2", "--no-progress"]
REGION = "eu-west-1"
BUCKET = "semif-gate-test-models"


def _start(tmp: Path, name: str, **env_overrides) -> ServeProcess:
    """The real `serve` with the production defaults (label memo, flash attention, prefix snapshots)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_MODEL_PATH=str(embedded_model()),
               SEMIF_MODEL_DIR=str(tmp / "no-model-dir"), **{k: str(v) for k, v in env_overrides.items()})
    return ServeProcess(env, port, tmp / f"serve-{name}.log").wait_ready()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def labeled(workdir) -> Path:
    by_id = {row["id"]: row for row in load_sample_decisions()}
    path = workdir / "labeled.jsonl"
    path.write_text("".join(json.dumps(by_id[i]) + "\n" for i in CASE_IDS))
    return path


@pytest.fixture(scope="module")
def adapters(workdir):
    """Prod and an identical twin (state-first), and a candidate whose only difference is SEMIF_LAYOUT."""
    started = {}
    try:
        started["prod"] = _start(workdir, "prod")
        started["twin"] = _start(workdir, "twin")
        started["options_first"] = _start(workdir, "options-first", SEMIF_LAYOUT="options_first")
        yield started
    finally:
        for proc in started.values():
            proc.stop()


@pytest.fixture(scope="module")
def baseline(adapters, labeled, workdir) -> Path:
    out = workdir / "prod"
    assert evaluate.main([str(labeled), "--url", adapters["prod"].base_url, *EVAL_ARGS, "--out", str(out)]) == 0
    return out / "report.json"


@pytest.fixture(scope="module")
def twin_run(adapters, labeled, baseline, workdir) -> tuple[int, Path]:
    """The twin's gated run, before any other test sends it other requests: its caches then hold what
    prod's held, case by case."""
    out = workdir / "twin"
    status = evaluate.main([str(labeled), "--url", adapters["twin"].base_url, *EVAL_ARGS, "--out", str(out),
                            "--baseline", str(baseline)])
    return status, out / "report.json"


def _cases(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in report["runs"]["label"]["cases_detail"]}


def test_two_identical_adapters_pass_the_gate_with_no_changed_case(twin_run, baseline, capsys):
    status, twin_report = twin_run
    report = json.loads(twin_report.read_text())
    verdict = report["gate"]
    assert status == 0 and verdict["passed"] and verdict["failed"] == []
    assert verdict["changed_cases"] == [] and verdict["option_set_changes"] == []
    assert verdict["shared_cases"] == len(CASE_IDS) and verdict["metrics"]["change"]["changed_share"] == 0.0
    assert {c["name"] for c in verdict["checks"]} >= {"min_valid_share", "max_changed_share", "max_accuracy_drop", "max_ece_rise"}
    assert verdict["record_differences"] == []  # same model, build, template, option sets, hardware, data
    # the twin computed the same distributions (same build, threads and requests): the gate saw real answers
    before = _cases(json.loads(baseline.read_text()))
    for case_id, case in _cases(report).items():
        assert case["probabilities"] == pytest.approx(before[case_id]["probabilities"], abs=1e-6)
        assert case["options_sha256"] == before[case_id]["options_sha256"]
    capsys.readouterr()
    assert gate.main([str(twin_report), "--baseline", str(baseline)]) == 0  # semif-gate on the stored reports agrees
    assert "Release gate (label scoring, against the baseline): PASSED" in capsys.readouterr().out


def test_a_layout_change_fails_the_gate_listing_the_changed_cases_by_id(adapters, labeled, baseline, workdir, capsys):
    out = workdir / "options-first"
    status = evaluate.main([str(labeled), "--url", adapters["options_first"].base_url, *EVAL_ARGS, "--out", str(out),
                            "--baseline", str(baseline), "--limits", '{"change": {"max_changed_share": 0.0}}'])
    report = json.loads((out / "report.json").read_text())
    verdict = report["gate"]
    before, after = _cases(json.loads(baseline.read_text())), _cases(report)
    moved = sorted(i for i in CASE_IDS if before[i]["predicted"] != after[i]["predicted"])
    assert moved, "the options-first layout moved no decision of this set: the test set no longer exercises the gate"
    assert status == 1 and not verdict["passed"] and "max_changed_share" in verdict["failed"]
    assert sorted(c["id"] for c in verdict["changed_cases"]) == moved
    for case in verdict["changed_cases"]:
        assert (case["baseline_choice"], case["candidate_choice"]) == (before[case["id"]]["predicted"], after[case["id"]]["predicted"])
        assert not case["option_set_changed"]
    assert verdict["metrics"]["change"]["changed_share"] == pytest.approx(len(moved) / len(CASE_IDS))
    differences = {d["field"]: d for d in verdict["record_differences"]}
    assert differences["template_version"]["candidate"].endswith("+options-first")
    assert differences["template_version"]["baseline"] == verdict["baseline"]["template_version"]
    printed = capsys.readouterr().out
    assert "FAILED: " in printed and "max_changed_share" in printed
    assert all(case_id in printed for case_id in moved)
    # ids only: no state text in the verdict, nor on the terminal's gate tables
    gate_text = json.dumps(verdict)
    for row in load_sample_decisions():
        if row["id"] in CASE_IDS:
            assert row["state"] not in gate_text and row["state"] not in printed
    # semif-gate on the two stored reports reaches the same verdict
    assert gate.main([str(out / "report.json"), "--baseline", str(baseline), "--limits", '{"change": {"max_changed_share": 0.0}}',
                      "--out", str(workdir / "verdict.json")]) == 1
    again = json.loads((workdir / "verdict.json").read_text())
    assert again["failed"] == verdict["failed"] and again["changed_cases"] == verdict["changed_cases"]


def test_a_reworded_option_is_listed_as_an_option_set_change_by_case(adapters, labeled, baseline, twin_run, workdir):
    rows = [json.loads(line) for line in labeled.read_text().splitlines()]
    reworded = {r["id"] for r in rows if r["category"] == "extract"}
    for row in rows:
        for option in row["options"]:
            if option["id"] == "fr":
                option["description"] = "French, or any other Romance language."
    data = workdir / "labeled-reworded.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = workdir / "reworded"
    status = evaluate.main([str(data), "--url", adapters["twin"].base_url, *EVAL_ARGS, "--out", str(out), "--baseline", str(baseline)])
    verdict = json.loads((out / "report.json").read_text())["gate"]
    assert status in (0, 1)
    assert set(verdict["option_set_changes"]) == reworded
    assert {c["id"] for c in verdict["changed_cases"] if c["option_set_changed"]} <= reworded
    differences = {d["field"] for d in verdict["record_differences"]}
    assert {"option_set_sha256", "data_sha256"} <= differences and "template_version" not in differences


def test_a_first_release_is_gated_on_the_absolute_limits_alone(baseline, workdir, capsys):
    report = json.loads(baseline.read_text())
    accuracy = report["runs"]["label"]["accuracy"]
    at_measured = json.dumps({"absolute": {"min_accuracy": accuracy}})
    above = json.dumps({"absolute": {"min_accuracy": accuracy + 1 / len(CASE_IDS)}})
    assert gate.main([str(baseline), "--limits", at_measured]) == 0
    assert gate.main([str(baseline), "--limits", above, "--out", str(workdir / "first.json")]) == 1
    verdict = json.loads((workdir / "first.json").read_text())
    assert verdict["failed"] == ["min_accuracy"] and not verdict["baseline_present"]
    assert {c["kind"] for c in verdict["checks"]} == {"absolute"}
    assert verdict["metrics"]["candidate"]["accuracy"] == pytest.approx(accuracy)
    missing = str(workdir / "no-prod-report-yet.json")
    assert gate.main([str(baseline), "--baseline", missing, "--limits", at_measured]) == 2  # a typo must not pass as a first release
    capsys.readouterr()
    assert gate.main([str(baseline), "--baseline", missing, "--allow-missing-baseline", "--limits", above]) == 1
    assert "a first release, gated on the absolute limits alone" in capsys.readouterr().err


@pytest.mark.parametrize("limits, field", [
    ({"change": {"max_changed_share": 1.5}}, "change.max_changed_share"),
    ({"absolute": {"min_acuracy": 0.5}}, "absolute.min_acuracy"),
    ({"absolute": {"min_policy_coverage": 0.5}}, "policy"),
    ({"scoring": "cloze"}, "scoring"),
    ({"policy": {"min_probability": -0.1}}, "policy.min_probability"),
])
def test_invalid_limits_are_refused_naming_the_field_before_any_case_runs(limits, field, labeled, capsys):
    with pytest.raises(gate.GateError, match=field.replace(".", r"\.")):
        gate.parse_limits(limits)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: reaching the target would be exit 3
    assert evaluate.main([str(labeled), "--url", closed, *EVAL_ARGS, "--out", "unused", "--limits", json.dumps(limits)]) == 2
    assert field in capsys.readouterr().err


def test_a_report_the_gate_cannot_use_is_refused_with_a_reason(baseline, workdir):
    report = json.loads(baseline.read_text())
    no_cases = copy.deepcopy(report)
    del no_cases["runs"]["label"]["cases_detail"]
    twice = copy.deepcopy(report)
    twice["runs"]["label"]["cases_detail"].append(twice["runs"]["label"]["cases_detail"][0])
    for broken, reason in ((no_cases, "no per-case results"), (twice, "appears twice"), ({"runs": {}}, "no 'label' run")):
        with pytest.raises(gate.GateError, match=reason):
            gate.compare(report, broken, gate.GateLimits())


@pytest.fixture
def aws(monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                       "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield boto3.session.Session(region_name=REGION)


def test_the_gate_reads_data_and_baseline_from_s3_and_writes_kms_encrypted_report_and_plots(aws, adapters, labeled, baseline, twin_run):
    s3 = aws.client("s3")
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    key_arn = aws.client("kms").create_key(Description="model bucket")["KeyMetadata"]["Arn"]
    s3.put_object(Bucket=BUCKET, Key="eval/labeled.jsonl", Body=labeled.read_bytes())
    s3.put_object(Bucket=BUCKET, Key="reports/prod/report.json", Body=baseline.read_bytes())
    status = evaluate.main([f"s3://{BUCKET}/eval/labeled.jsonl", "--url", adapters["twin"].base_url, *EVAL_ARGS,
                            "--out", f"s3://{BUCKET}/reports/staging/", "--kms-key-id", key_arn,
                            "--baseline", f"s3://{BUCKET}/reports/prod/report.json"])
    assert status == 0
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="reports/staging/")["Contents"])
    assert keys == [f"reports/staging/{name}" for name in ("accuracy-coverage.png", "latency.png", "reliability.png", "report.json")]
    for key in keys:
        head = s3.head_object(Bucket=BUCKET, Key=key)
        assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] == key_arn
    report = json.loads(s3.get_object(Bucket=BUCKET, Key="reports/staging/report.json")["Body"].read())
    assert report["plots"] == [f"s3://{BUCKET}/{k}" for k in ("reports/staging/reliability.png", "reports/staging/accuracy-coverage.png",
                                                              "reports/staging/latency.png")]
    assert s3.get_object(Bucket=BUCKET, Key=keys[0])["Body"].read(8) == b"\x89PNG\r\n\x1a\n"
    assert report["gate"]["passed"] and report["gate"]["baseline"]["report"] == f"s3://{BUCKET}/reports/prod/report.json"
    assert report["reproducibility"]["data_sha256"] == json.loads(baseline.read_text())["reproducibility"]["data_sha256"]
    # a first release: no prod report under the prefix yet
    assert evaluate.main([f"s3://{BUCKET}/eval/labeled.jsonl", "--url", adapters["twin"].base_url, *EVAL_ARGS,
                          "--out", f"s3://{BUCKET}/reports/first/", "--baseline", f"s3://{BUCKET}/reports/none/report.json",
                          "--allow-missing-baseline"]) == 0
    first = json.loads(s3.get_object(Bucket=BUCKET, Key="reports/first/report.json")["Body"].read())["gate"]
    assert not first["baseline_present"] and {c["kind"] for c in first["checks"]} == {"absolute"}


def _pools_endpoint(sm, name: str):
    """DescribeEndpoint/DescribeEndpointConfig of an endpoint on instance pools (g6 preferred, g5 running)."""
    stubber = Stubber(sm)
    stubber.add_response("describe_endpoint", {
        "EndpointName": name, "EndpointArn": f"arn:aws:sagemaker:{REGION}:123456789012:endpoint/{name}",
        "EndpointConfigName": f"{name}-config-2", "EndpointStatus": "InService",
        "CreationTime": "2026-12-01T00:00:00Z", "LastModifiedTime": "2026-12-01T00:00:00Z",
        "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": 1,
                                "DeployedImages": [{"SpecifiedImage": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/semif@sha256:" + "cd" * 32,
                                                    "ResolvedImage": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/semif@sha256:" + "cd" * 32}],
                                "InstancePools": [{"InstanceType": "ml.g6.xlarge", "CurrentInstanceCount": 0},
                                                  {"InstanceType": "ml.g5.xlarge", "CurrentInstanceCount": 1}]}],
    }, {"EndpointName": name})
    stubber.add_response("describe_endpoint_config", {
        "EndpointConfigName": f"{name}-config-2", "EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:123456789012:endpoint-config/{name}-config-2",
        "CreationTime": "2026-12-01T00:00:00Z",
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "m", "InitialInstanceCount": 1,
                                "InstancePools": [{"InstanceType": "ml.g6.xlarge", "Priority": 1}, {"InstanceType": "ml.g5.xlarge", "Priority": 2}]}],
    }, {"EndpointConfigName": f"{name}-config-2"})
    return stubber


def test_the_record_of_each_side_carries_the_instance_types_its_endpoint_runs(aws, baseline):
    from semif.tools.endpoint_record import describe_endpoint_record

    sm = aws.client("sagemaker")
    sm.create_model(ModelName="m", ExecutionRoleArn="arn:aws:iam::123456789012:role/semif",
                    PrimaryContainer={"Image": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/semif@sha256:" + "ab" * 32})
    sm.create_endpoint_config(EndpointConfigName="prod-config", ProductionVariants=[
        {"VariantName": "AllTraffic", "ModelName": "m", "InitialInstanceCount": 1, "InstanceType": "ml.g4dn.xlarge"}])
    sm.create_endpoint(EndpointName="semif-prod", EndpointConfigName="prod-config")
    # semif-eval --endpoint records what DescribeEndpoint(Config) say, next to the answers' own hardware
    target = evaluate.make_target(argparse.Namespace(model=None, url=None, endpoint="semif-prod", region=REGION,
                                                              max_attempts=1, max_elapsed_s=1.0))
    prod_record = target.describe()["endpoint"]
    target.close()
    assert prod_record["instance_types"] == ["ml.g4dn.xlarge"] and prod_record["endpoint_config_name"] == "prod-config"

    staging_client = boto3.client("sagemaker", region_name=REGION)
    with _pools_endpoint(staging_client, "semif-staging"):
        staging_record = describe_endpoint_record(staging_client, "semif-staging")
    assert staging_record["instance_types"] == ["ml.g5.xlarge"]  # the pool that runs, not the one preferred
    assert staging_record["variants"][0]["instance_pools"] == [{"instance_type": "ml.g6.xlarge", "priority": 1},
                                                               {"instance_type": "ml.g5.xlarge", "priority": 2}]
    missing = describe_endpoint_record(sm, "semif-nowhere")
    assert missing["error"].startswith("DescribeEndpoint: ValidationException") and "instance_types" not in missing

    prod, staging = json.loads(baseline.read_text()), json.loads(baseline.read_text())
    prod["reproducibility"]["endpoint"], staging["reproducibility"]["endpoint"] = prod_record, staging_record
    verdict = gate.compare(staging, prod, gate.GateLimits())
    assert verdict.passed  # same answers: the hardware alone fails nothing, but it is on the record
    assert (verdict.baseline.instance_types, verdict.candidate.instance_types) == (["ml.g4dn.xlarge"], ["ml.g5.xlarge"])
    differences = {d.field: (d.baseline, d.candidate) for d in verdict.record_differences}
    assert differences["instance_types"] == (["ml.g4dn.xlarge"], ["ml.g5.xlarge"])
    assert differences["resolved_images"][1] == ["123456789012.dkr.ecr.eu-west-1.amazonaws.com/semif@sha256:" + "cd" * 32]
