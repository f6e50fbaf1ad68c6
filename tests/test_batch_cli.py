"""`semif-batch run` against AWS as moto models it (S3, SSM, SageMaker create/describe transform job), and
botocore's Stubber where moto lacks a call (stopping a job). The job request is checked field by field."""

from __future__ import annotations

import argparse
import datetime
import io
import json

import boto3
import pytest
from botocore.stub import Stubber
from hypothesis import given, settings, strategies as st
from moto import mock_aws
from rich.console import Console

from semif.serving.http.jsonlines import split_lines
from semif.tools import batch

REGION = "us-east-1"
BUCKET = "semif-test-models-123456789012-us-east-1"
ROLE_ARN = "arn:aws:iam::123456789012:role/semif-test-batch"
MODEL = "BatchModel-abc123"


@pytest.fixture
def aws(monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                       "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        session = boto3.session.Session(region_name=REGION)
        s3 = session.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        ssm = session.client("ssm")
        published = {"decision/batch-model-name": MODEL, "decision/batch-role-arn": ROLE_ARN,
                     "decision/batch-instance-type": "ml.c6i.8xlarge", "model-bucket/name": BUCKET}
        for key, value in published.items():
            ssm.put_parameter(Name=f"/semif/test/{key}", Value=value, Type="String")
        session.client("sagemaker").create_model(
            ModelName=MODEL, ExecutionRoleArn=ROLE_ARN,
            PrimaryContainer={"Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/semif@sha256:" + "ab" * 32})
        yield session


def run_args(**overrides) -> argparse.Namespace:
    values = dict(endpoint_stack="test", input=f"s3://{BUCKET}/uploads/tickets.jsonl", output=None, instance_type=None,
                  instance_count=3, job_name="semif-test-job", region=REGION, max_payload_mb=None,
                  max_concurrent_transforms=None, invocation_timeout_s=3600, join_input=False, poll_s=0.0, no_wait=True,
                  no_progress=True)
    values.update(overrides)
    return argparse.Namespace(**values)


def records(n: int, prefix: str = "r") -> list[str]:
    return [json.dumps({"decision": {"id": f"{prefix}{i}", "state": f"ticket {i}", "question": "Which queue?",
                                     "options": [{"id": "a"}, {"id": "b"}]}}) for i in range(n)]


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def object_lines(s3, key: str) -> list[str]:
    return s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode().splitlines()


def test_run_shards_one_object_into_one_per_instance_and_creates_the_job_field_by_field(aws):
    s3 = aws.client("s3")
    lines = records(10)
    s3.put_object(Bucket=BUCKET, Key="uploads/tickets.jsonl", Body=("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:])).encode())
    assert batch.run_job(run_args(), session=aws, console=quiet()) == 0

    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="batch/semif-test-job/in/")["Contents"]
    shards = [item["Key"] for item in listed]
    assert shards == [f"batch/semif-test-job/in/part-0000{i}.jsonl" for i in range(3)]
    # Contiguous, balanced, blank line dropped, order kept.
    assert [object_lines(s3, key) for key in shards] == [lines[0:4], lines[4:7], lines[7:10]]

    job = aws.client("sagemaker").describe_transform_job(TransformJobName="semif-test-job")
    assert job["ModelName"] == MODEL
    assert job["BatchStrategy"] == "MultiRecord"
    assert job["TransformInput"]["DataSource"]["S3DataSource"] == {
        "S3DataType": "S3Prefix", "S3Uri": f"s3://{BUCKET}/batch/semif-test-job/in/"}
    assert job["TransformInput"]["ContentType"] == "application/jsonlines"
    assert job["TransformInput"]["SplitType"] == "Line"
    assert job["TransformInput"]["CompressionType"] == "None"
    assert job["TransformOutput"]["S3OutputPath"] == f"s3://{BUCKET}/batch/semif-test-job/out/"
    assert job["TransformOutput"]["AssembleWith"] == "Line"
    assert job["TransformOutput"]["Accept"] == "application/jsonlines"
    assert job["TransformResources"] == {"InstanceType": "ml.c6i.8xlarge", "InstanceCount": 3}
    assert job["ModelClientConfig"] == {"InvocationsTimeoutInSeconds": 3600, "InvocationsMaxRetries": 1}
    # Left to the container's GET /execution-parameters.
    assert "MaxPayloadInMB" not in job and "MaxConcurrentTransforms" not in job


def test_the_request_carries_overrides_and_the_join_only_when_asked():
    request = batch.transform_job_request(
        job_name="j", model_name="m", input_uri="s3://b/batch/j/in/", output_uri="s3://b/batch/j/out/",
        instance_type="ml.g5.xlarge", instance_count=2, env="prod", max_payload_mb=4, max_concurrent=2, join_input=True)
    assert request["MaxPayloadInMB"] == 4 and request["MaxConcurrentTransforms"] == 2
    assert request["DataProcessing"] == {"JoinSource": "Input"}
    assert request["Tags"] == [{"Key": "project", "Value": "semif"}, {"Key": "environment", "Value": "prod"}]
    plain = batch.transform_job_request(
        job_name="j", model_name="m", input_uri="s3://b/batch/j/in/", output_uri="s3://b/batch/j/out/",
        instance_type="ml.g5.xlarge", instance_count=2, env="prod")
    assert "DataProcessing" not in plain and "MaxPayloadInMB" not in plain


def test_an_input_already_split_under_the_batch_prefix_is_used_in_place(aws):
    s3 = aws.client("s3")
    for i in range(2):
        s3.put_object(Bucket=BUCKET, Key=f"batch/tickets/in/part-{i}.jsonl", Body=("\n".join(records(3, f"p{i}-")) + "\n").encode())
    args = run_args(input=f"s3://{BUCKET}/batch/tickets/in/", output=f"s3://{BUCKET}/batch/tickets/out",
                    instance_count=2, instance_type="ml.m5.xlarge")
    assert batch.run_job(args, session=aws, console=quiet()) == 0
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="batch/semif-test-job/")
    job = aws.client("sagemaker").describe_transform_job(TransformJobName="semif-test-job")
    assert job["TransformInput"]["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{BUCKET}/batch/tickets/in/"
    assert job["TransformOutput"]["S3OutputPath"] == f"s3://{BUCKET}/batch/tickets/out/"
    assert job["TransformResources"]["InstanceType"] == "ml.m5.xlarge"


def test_an_output_the_transform_role_cannot_write_is_refused_before_any_job(aws):
    s3 = aws.client("s3")
    s3.put_object(Bucket=BUCKET, Key="uploads/tickets.jsonl", Body=(records(1)[0] + "\n").encode())
    with pytest.raises(batch.BatchError, match="batch/<job>/out/"):
        batch.run_job(run_args(output=f"s3://{BUCKET}/results/"), session=aws, console=quiet())
    assert aws.client("sagemaker").list_transform_jobs()["TransformJobSummaries"] == []
    assert batch.main(["run", "--endpoint-stack", "test", "--input", f"s3://{BUCKET}/uploads/tickets.jsonl",
                       "--output", "s3://elsewhere/out/", "--region", REGION, "--no-progress"]) == 2


def test_missing_stack_outputs_name_the_parameters_and_the_deploy_command(aws):
    with pytest.raises(batch.BatchError, match=r"/semif/staging/decision/batch-model-name.*cdk deploy -c env=staging"):
        batch.run_job(run_args(endpoint_stack="staging"), session=aws, console=quiet())


def test_a_gpu_environments_batch_model_is_refused_before_anything_is_written_or_started(aws):
    """Batch Transform GPU hosts run driver 470 or 535; the adapter's CUDA 13 image needs 580 or newer."""
    sagemaker = aws.client("sagemaker")
    sagemaker.create_model(ModelName="GpuBatchModel", ExecutionRoleArn=ROLE_ARN, PrimaryContainer={
        "Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/semif@sha256:" + "cd" * 32,
        "Environment": {"SEMIF_REQUIRE_GPU": "1", "SEMIF_N_GPU_LAYERS": "-1"}})
    aws.client("ssm").put_parameter(Name="/semif/test/decision/batch-model-name", Value="GpuBatchModel",
                                    Type="String", Overwrite=True)
    s3 = aws.client("s3")
    s3.put_object(Bucket=BUCKET, Key="uploads/tickets.jsonl", Body="\n".join(records(4)).encode())
    with pytest.raises(batch.BatchError, match=r"GPU image \(SEMIF_REQUIRE_GPU=1\).*CUDA 13.*driver 470 or 535.*"
                                               r"semif-batch local --url"):
        batch.run_job(run_args(), session=aws, console=quiet())
    assert sagemaker.list_transform_jobs()["TransformJobSummaries"] == []
    assert "batch/" not in " ".join(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []))


def test_run_waits_with_progress_and_ends_with_records_answers_error_codes_and_the_output(aws, monkeypatch):
    s3 = aws.client("s3")
    s3.put_object(Bucket=BUCKET, Key="uploads/tickets.jsonl", Body=("\n".join(records(5)) + "\n").encode())
    # What the job writes: one .out per input object, one line per record.
    answers = [json.dumps({"id": "r0", "option_ids": ["a", "b"], "probabilities": [0.6, 0.4], "choice": "a"}),
               json.dumps({"error": {"code": "invalid_json", "message": "line 1", "field": "<line>"}}),
               json.dumps({"detail": [{"loc": ["body", "state"], "msg": "Field required", "type": "missing"}], "id": "x"}),
               json.dumps({"detail": {"error_type": "api_error", "code": "deadline_exceeded", "message": "…"}}),
               json.dumps({"id": "r4", "option_ids": ["a", "b"], "probabilities": [0.1, 0.9], "choice": "b"})]
    s3.put_object(Bucket=BUCKET, Key="batch/semif-test-job/out/part-00000.jsonl.out", Body="\n".join(answers[:2]).encode())
    s3.put_object(Bucket=BUCKET, Key="batch/semif-test-job/out/part-00001.jsonl.out", Body="\n".join(answers[2:]).encode())
    sagemaker = aws.client("sagemaker")
    statuses = iter(["InProgress", "InProgress", "Completed"])
    real_describe = sagemaker.describe_transform_job

    def describe(**kwargs):
        described = real_describe(**kwargs)
        described["TransformJobStatus"] = next(statuses)
        return described

    monkeypatch.setattr(sagemaker, "describe_transform_job", describe)
    clients = {"sagemaker": sagemaker, "s3": s3, "ssm": aws.client("ssm")}
    session = type("Session", (), {"client": lambda self, name: clients[name]})()
    printed = io.StringIO()
    slept = []
    code = batch.run_job(run_args(no_wait=False, instance_count=2), session=session, console=quiet(),
                         out_console=Console(file=printed, width=200), sleep=slept.append)
    assert code == 0 and len(slept) == 2
    rows = {}
    for row in printed.getvalue().splitlines():
        cells = [cell.strip() for cell in row.split("│") if cell.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert rows == {"records in": "5", "answers out": "2", "error lines": "3", "invalid_json": "1", "missing": "1",
                    "deadline_exceeded": "1", "output": f"s3://{BUCKET}/batch/semif-test-job/out/"}
    summary = batch.summarize_output(s3, batch.S3Location(BUCKET, "batch/semif-test-job/out/"), 5)
    assert (summary.records_in, summary.answers_out, dict(summary.errors)) == (
        5, 2, {"invalid_json": 1, "missing": 1, "deadline_exceeded": 1})


def _described(name: str, status: str) -> dict:
    return {"TransformJobName": name, "TransformJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:transform-job/{name}",
            "TransformJobStatus": status, "ModelName": MODEL,
            "TransformInput": {"DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://b/batch/j/in/"}}},
            "TransformResources": {"InstanceType": "ml.c6i.8xlarge", "InstanceCount": 1},
            "CreationTime": datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)}


def _interrupting_sleep(times: int):
    calls = {"n": 0}

    def sleep(_seconds):
        calls["n"] += 1
        if calls["n"] <= times:
            raise KeyboardInterrupt

    return sleep


def test_ctrl_c_offers_to_stop_the_job_and_stops_it_when_accepted(aws):
    sagemaker = aws.client("sagemaker")
    plan = batch.Plan(job_name="semif-test-job", input=batch.S3Location(BUCKET, "batch/semif-test-job/in/"),
                      output=batch.S3Location(BUCKET, "batch/semif-test-job/out/"), source=batch.S3Location(BUCKET, "x"),
                      source_keys=["x"], stage=False)
    with Stubber(sagemaker) as stub:
        stub.add_response("describe_transform_job", _described(plan.job_name, "InProgress"), {"TransformJobName": plan.job_name})
        stub.add_response("stop_transform_job", {}, {"TransformJobName": plan.job_name})
        stub.add_response("describe_transform_job", _described(plan.job_name, "Stopping"), {"TransformJobName": plan.job_name})
        stub.add_response("describe_transform_job", _described(plan.job_name, "Stopped"), {"TransformJobName": plan.job_name})
        asked = []
        status = batch.wait_for_job(sagemaker, aws.client("s3"), plan, 1, console=quiet(), poll_s=0, disable=True,
                                    ask_stop=lambda: asked.append(True) or True, sleep=_interrupting_sleep(1))
        stub.assert_no_pending_responses()
    assert status == "Stopped" and asked == [True]


def test_ctrl_c_declined_leaves_the_job_running_and_stops_nothing(aws):
    sagemaker = aws.client("sagemaker")
    plan = batch.Plan(job_name="semif-test-job", input=batch.S3Location(BUCKET, "batch/j/in/"),
                      output=batch.S3Location(BUCKET, "batch/j/out/"), source=batch.S3Location(BUCKET, "x"),
                      source_keys=["x"], stage=False)
    console = Console(file=io.StringIO(), width=200)
    with Stubber(sagemaker) as stub:
        stub.add_response("describe_transform_job", _described(plan.job_name, "InProgress"), {"TransformJobName": plan.job_name})
        status = batch.wait_for_job(sagemaker, aws.client("s3"), plan, 1, console=console, poll_s=0, disable=True,
                                    ask_stop=lambda: False, sleep=_interrupting_sleep(1))
        stub.assert_no_pending_responses()  # no stop_transform_job was made
    assert status == "Detached"
    assert "describe-transform-job --transform-job-name semif-test-job" in console.file.getvalue()


def test_error_codes_are_read_from_every_contracts_error_shape():
    assert batch.error_code_of({"error": {"code": "invalid_json", "message": "…", "field": "<line>"}}) == "invalid_json"
    assert batch.error_code_of({"error": {"message": "…", "type": "invalid_request_error", "param": "id",
                                          "code": "invalid_request"}}) == "invalid_request"
    assert batch.error_code_of({"detail": [{"loc": ["body", "state"], "msg": "Field required", "type": "missing"}]}) == "missing"
    assert batch.error_code_of({"detail": {"error_type": "not_found_error", "message": "…", "code": "model_not_found"}}) == "model_not_found"
    assert batch.error_code_of({"id": "q", "results": []}) is None
    assert batch.error_code_of({"model": "m", "answers": {}, "usage": {}}) is None


def test_mini_batches_respect_the_payload_limit_and_keep_every_line():
    lines = [b"x" * 300 for _ in range(10)]
    batches = list(batch.mini_batches(lines, 1000))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert [line for b in batches for line in b] == lines
    assert list(batch.mini_batches([b"y" * 5000], 1000)) == [[b"y" * 5000]]  # an oversized record goes alone
    assert [len(b) for b in batch.mini_batches(lines, 1 << 20, max_records=4)] == [4, 4, 2]


@settings(deadline=None)  # a shared 2-core machine: timing says nothing here
@given(st.lists(st.binary(min_size=1, max_size=400).filter(lambda b: b"\n" not in b), max_size=60),
       st.integers(min_value=64, max_value=2000), st.integers(min_value=0, max_value=7))
def test_mini_batches_keep_every_line_in_order_within_both_limits(lines, max_bytes, max_records):
    batches = list(batch.mini_batches(lines, max_bytes, max_records))
    assert [line for b in batches for line in b] == lines
    for b in batches:
        assert len(b) == 1 or sum(len(line) + 1 for line in b) <= max_bytes
        assert max_records == 0 or len(b) <= max_records


@settings(deadline=None)
@given(st.lists(st.binary(max_size=50).filter(lambda b: b"\n" not in b and not b.endswith(b"\r")), min_size=1, max_size=30))
def test_a_body_splits_back_into_its_records_whatever_the_line_ending(records):
    assert split_lines(b"\n".join(records) + b"\n") == records
    assert split_lines(b"\r\n".join(records) + b"\r\n") == records


def test_requests_keeps_a_row_whose_strings_hold_line_and_paragraph_separators(tmp_path):
    """JSON Lines end at "\\n" only: U+2028 and U+2029 are legal, unescaped, inside a JSON string."""
    state = "First line\u2028second line\u2029third line\x85fourth"
    rows = [{"id": "a", "state": state, "question": "Which queue?", "options": [{"id": "billing"}, {"id": "shipping"}],
             "answer": "billing"},
            {"id": "b", "state": "Plain.", "question": "Which queue?", "options": [{"id": "billing"}, {"id": "shipping"}],
             "answer": "shipping"}]
    labeled = tmp_path / "labeled.jsonl"
    labeled.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert "\u2028" in labeled.read_text(encoding="utf-8")
    out = tmp_path / "requests.jsonl"
    assert batch.main(["requests", str(labeled), "-o", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    assert [r["decision"]["state"] for r in records] == [state, "Plain."]
