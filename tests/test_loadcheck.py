"""`semif-loadcheck` against the real `serve` (embedded SmolLM2): a small queue gives real 503s and retries,
counted as the adapter's own log lines count them; a load within capacity passes. S3 through moto."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from serving import ServeProcess, embedded_model, free_port
from semif.tools import loadcheck

REGION = "eu-west-1"
BUCKET = "semif-loadcheck-test-models"


def _start(tmp: Path, name: str, **env_overrides) -> ServeProcess:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_MODEL_PATH=str(embedded_model()),
               SEMIF_MODEL_DIR=str(tmp / "no-model-dir"), **{k: str(v) for k, v in env_overrides.items()})
    return ServeProcess(env, port, tmp / f"serve-{name}.log").wait_ready()


def _served_statuses(server: ServeProcess) -> Counter:
    return Counter(line["status"] for line in server.log_lines() if line.get("message") == "request" and line.get("route") == "/invocations")


def test_a_small_queue_gives_real_503s_and_retries_counted_as_the_adapter_logs_them(tmp_path, capsys):
    # One request runs, one waits, the rest are refused at once; Retry-After 0 sends the clients straight back.
    server = _start(tmp_path, "small-queue", SEMIF_MAX_QUEUE=1, SEMIF_RETRY_AFTER_S=0)
    try:
        duration, clients = 4.0, 6
        started = time.monotonic()
        status = loadcheck.main(["--url", server.base_url, "--clients", str(clients), "--duration-s", str(duration),
                                 "--max-attempts", "2", "--max-elapsed-s", "5", "--request-timeout-s", "60",
                                 "--limits", '{"max_503_share": 0.0}', "--out", str(tmp_path / "out"), "--no-progress"])
        wall = time.monotonic() - started
        time.sleep(0.5)  # the adapter writes its last log line after the response
        served = _served_statuses(server)
    finally:
        server.stop()
    report = json.loads((tmp_path / "out" / "loadcheck.json").read_text())
    assert status == 1 and report["verdict"]["failed"][0] == "max_503_share"
    # every attempt the client counted is one the adapter logged (the warm-up request is the one 200 more)
    assert report["attempts_503"] == served[503] > 0
    assert report["successes"] + 1 == served[200]
    assert report["attempts"] == served[200] - 1 + served[503]
    assert report["retries"] > 0 and report["retry_reasons"].get("http_503", 0) > 0
    assert report["attempts_per_success"] == pytest.approx(report["attempts"] / report["successes"]) and report["attempts_per_success"] > 1
    assert report["share_503"] == pytest.approx(served[503] / report["attempts"])
    # with two attempts each, some requests were refused twice: failed after retries, as final 503s
    assert report["failed"] == report["final_statuses"].get("503", 0) > 0
    assert report["failed_share"] == pytest.approx(report["failed"] / report["requests"])
    assert report["throughput_rps"] == pytest.approx(report["successes"] / report["elapsed_s"], rel=1e-3)
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    # it stops by itself: no request starts after the duration, and the one in flight ends within its budget
    assert duration <= report["elapsed_s"] <= wall < duration + 5 + 60
    assert report["abandoned_clients"] == 0
    assert report["model"]["sha256"] and report["model"]["hardware"]
    printed = capsys.readouterr().out
    assert "FAILED: max_503_share" in printed and "attempts per success" in printed


def test_a_load_within_capacity_passes_with_no_503_and_writes_its_report_to_s3_with_kms(tmp_path, monkeypatch):
    server = _start(tmp_path, "roomy")  # the default queue (8) holds both clients' requests
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                       "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    try:
        with mock_aws():
            s3 = boto3.client("s3", region_name=REGION)
            s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
            key_arn = boto3.client("kms", region_name=REGION).create_key()["KeyMetadata"]["Arn"]
            status = loadcheck.main(["--url", server.base_url, "--clients", "2", "--duration-s", "3", "--no-progress",
                                     "--limits", '{"max_503_share": 0.0, "max_attempts_per_success": 1.0, "max_failed_share": 0.0}',
                                     "--out", f"s3://{BUCKET}/reports/staging/", "--kms-key-id", key_arn])
            head = s3.head_object(Bucket=BUCKET, Key="reports/staging/loadcheck.json")
            report = json.loads(s3.get_object(Bucket=BUCKET, Key="reports/staging/loadcheck.json")["Body"].read())
        time.sleep(0.5)  # the adapter writes its last log line after the response
        served = _served_statuses(server)
        decisions = [line for line in server.log_lines() if line.get("message") == "request" and line.get("status") == 200]
    finally:
        server.stop()
    assert status == 0 and report["verdict"]["passed"]
    assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] == key_arn
    assert report["successes"] == report["requests"] > 0 and report["attempts_503"] == 0 == served[503]
    assert report["attempts_per_success"] == 1.0 and report["failed_share"] == 0.0
    # every state was new to the adapter: its label memo answered none of them
    assert len({line["state_sha256"] for line in decisions}) == len(decisions) == report["successes"] + 1


@pytest.mark.timeout(60)  # a plan that escaped its bounds would run for its whole duration: fail in a minute, not 15
@pytest.mark.parametrize("arguments, field", [
    (["--clients", "0"], "clients"),
    (["--duration-s", "7200"], "duration_s"),
    (["--limits", '{"max_p95_ms": 0}'], "max_p95_ms"),
    (["--limits", '{"max_p59_ms": 100}'], "max_p59_ms"),
])
def test_invalid_plans_and_limits_are_refused_naming_the_field_before_any_load(arguments, field, capsys):
    closed = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert loadcheck.main(["--url", closed, "--no-progress", *arguments]) == 2
    assert field in capsys.readouterr().err and time.monotonic() - started < 5
