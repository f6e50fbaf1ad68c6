"""The gate step's shell end to end with the real tools: `semif-eval` as the step calls it, against a real adapter
(embedded SmolLM2) posing as the staging endpoint, S3 and KMS through moto. A first release is gated on the
absolute limits, its report promoted, the next release compared with it case by case, and a limit that fails
fails the step with the verdict in the report. What stays a stand-in: `aws` for the listing and the copy (a folder
plays the bucket), and SageMaker's runtime (a proxy to the adapter's /invocations)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from serving import ServeProcess, embedded_model, free_port, load_sample_decisions
from stacks.pipeline_steps import SEMIF_TOOLS_VENV, gate_commands, promote_baseline_commands

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("release_check_steps", HERE / "cdk" / "test_release_check_steps.py")
steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steps)

CASE_IDS = ["sample-route-01", "sample-route-02", "sample-route-03", "sample-route-04", "sample-extract-01",
            "sample-extract-02"]

# `semif-eval` as the step installs it, run inside moto: the folder's objects are the bucket before the run, and the
# objects it writes come back to the folder, with their encryption recorded in sse.json.
SEMIF_EVAL = """#!{python}
import json, os, pathlib, sys
import boto3
from moto import mock_aws

bucket = os.environ["MODEL_BUCKET"]
root = pathlib.Path(os.environ["STUB"]) / "s3" / bucket
with mock_aws(config={{"core": {{"passthrough": {{"urls": [r"http://127\\.0\\.0\\.1.*"], "services": []}}}}}}):
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for path in root.rglob("*"):
        if path.is_file():
            s3.put_object(Bucket=bucket, Key=str(path.relative_to(root)), Body=path.read_bytes())
    before = {{o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}}
    from semif.tools import evaluate
    code = evaluate.main(sys.argv[1:])
    sse_path = pathlib.Path(os.environ["STUB"]) / "sse.json"
    sse = json.loads(sse_path.read_text()) if sse_path.exists() else {{}}
    for obj in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
        if obj["Key"] not in before:
            head = s3.head_object(Bucket=bucket, Key=obj["Key"])
            sse[obj["Key"]] = [head.get("ServerSideEncryption"), head.get("SSEKMSKeyId")]
            (root / obj["Key"]).parent.mkdir(parents=True, exist_ok=True)
            (root / obj["Key"]).write_bytes(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
    sse_path.write_text(json.dumps(sse))
sys.exit(code)
"""


class _SageMakerRuntime(http.server.BaseHTTPRequestHandler):
    """InvokeEndpoint's REST call (POST /endpoints/<name>/invocations) passed to the adapter's /invocations, as
    SageMaker passes it to the container; the endpoint name is recorded."""

    adapter_url = ""
    invoked: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        parts = self.path.split("/")
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if len(parts) != 4 or parts[1] != "endpoints" or parts[3] != "invocations":
            self.send_error(404)
            return
        type(self).invoked.append(parts[2])
        request = urllib.request.Request(f"{self.adapter_url}/invocations", data=body, method="POST",
                                         headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
        with urllib.request.urlopen(request, timeout=60) as answer:
            payload = answer.read()
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("x-Amzn-Invoked-Production-Variant", "AllTraffic")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def staging_endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staging")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_MODEL_PATH=str(embedded_model()),
               SEMIF_MODEL_DIR=str(tmp / "no-model-dir"))
    adapter = ServeProcess(env, port, tmp / "serve.log").wait_ready()
    _SageMakerRuntime.adapter_url = adapter.base_url
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SageMakerRuntime)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        adapter.stop()


def _run_gate(work: Path, endpoint_url: str, release: str, limits: dict) -> tuple[int, str]:
    code, _, output = steps.run_step(work, gate_commands(), {
        **steps.GATE_ENV, "RELEASE_ID": release, "GATE_LIMITS": json.dumps(limits),
        "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=600)
    return code, output


def _gate_run(work: Path, endpoint_url: str, release: str, limits: dict) -> tuple[int, str, dict]:
    # run_step writes its stand-ins first; write the real tool over them, then run the step.
    (work / SEMIF_TOOLS_VENV / "bin").mkdir(parents=True, exist_ok=True)
    original = steps.TOOL_STUB
    try:
        steps.TOOL_STUB = SEMIF_EVAL.format(python=sys.executable)
        code, output = _run_gate(work, endpoint_url, release, limits)
    finally:
        steps.TOOL_STUB = original
    report_path = work / "stub" / "s3" / steps.BUCKET / "reports" / "staging" / release / "report.json"
    return code, output, json.loads(report_path.read_text()) if report_path.exists() else {}


def test_releases_through_the_gate_step_first_release_promotion_comparison_and_a_failed_limit(staging_endpoint,
                                                                                             tmp_path):
    """One bucket across three releases, in the order a pipeline meets them."""
    by_id = {row["id"]: row for row in load_sample_decisions()}
    data = tmp_path / "stub" / "s3" / steps.BUCKET / "eval" / "decisions.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps(by_id[i]) + "\n" for i in CASE_IDS))
    _SageMakerRuntime.invoked.clear()

    # 1. A first release: no prod report, so the absolute limits alone.
    code, output, first = _gate_run(tmp_path, staging_endpoint, "release-1", {"absolute": {"min_valid_share": 1.0}})
    assert code == 0, output
    assert "a first release, gated on the absolute limits alone" in output
    gate = first["gate"]
    assert gate["passed"] and not gate["baseline_present"] and {c["kind"] for c in gate["checks"]} == {"absolute"}
    assert gate["candidate"]["cases"] == len(CASE_IDS)
    # Every decision went to the staging endpoint, by name; report and plots are SSE-KMS with the bucket's key.
    assert set(_SageMakerRuntime.invoked) == {"semif-staging-decision"} and len(_SageMakerRuntime.invoked) >= len(CASE_IDS)
    sse = json.loads((tmp_path / "stub" / "sse.json").read_text())
    written = {k: v for k, v in sse.items() if k.startswith("reports/staging/release-1/")}
    assert "reports/staging/release-1/report.json" in written and len(written) >= 2  # the report and its PNGs
    assert all(v == ["aws:kms", steps.KEY_ARN] for v in written.values()), written

    # 2. Prod deployed it and answered its smoke test: the promotion makes it the baseline, in prod's bucket.
    code, _, output = steps.run_step(tmp_path, promote_baseline_commands(), {**steps.COMMON, "RELEASE_ID": "release-1"},
                                     prod_endpoint="InService")
    assert code == 0, output
    assert json.loads((tmp_path / "stub" / "s3" / steps.PROD_BUCKET / "reports/prod/report.json").read_text()) == first

    # 3. The next release is compared with it, case by case: the same build answers the same.
    code, output, second = _gate_run(tmp_path, staging_endpoint, "release-2", {"change": {"max_changed_share": 0.0}})
    assert code == 0, output
    gate = second["gate"]
    assert gate["baseline_present"] and gate["shared_cases"] == len(CASE_IDS) and gate["changed_cases"] == []
    # Read from prod's bucket as prod's check role; the tool compares with that copy.
    assert gate["baseline"]["report"] == "baseline-report.json"
    assert f"baseline: s3://{steps.PROD_BUCKET}/reports/prod/report.json" in output
    assert {c["kind"] for c in gate["checks"]} == {"absolute", "change"}

    # 4. A limit the release misses fails the step; the report in the bucket says which.
    code, output, third = _gate_run(tmp_path, staging_endpoint, "release-3", {"absolute": {"min_accuracy": 1.0}})
    assert code != 0
    assert "gate FAILED: a limit was exceeded" in output and "min_accuracy" in output
    assert third["gate"]["passed"] is False and third["gate"]["failed"] == ["min_accuracy"]
