"""The deploy-time model check (lambda/model_check/handler.py) against moto S3.

Models are put there by the real `semif-package-model upload`, so the check reads what the tool writes.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import sys
import threading
from pathlib import Path

import boto3
import numpy as np
import pytest
from gguf import GGUFWriter, LlamaFileType
from moto import mock_aws

from semif.serving.engine.manifest import ModelManifest
from semif.tools.package_model import EXIT_OK, main

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.model_manifest_schema import SCHEMA_PATH, manifest_schema_text  # noqa: E402

BUCKET = "semif-dev-models-111111111111-us-east-1"
PREFIX = "models/tiny/v1/"
TAR_PREFIX = "models/tiny/v1/model.tar.gz"


def _load_handler():
    spec = importlib.util.spec_from_file_location("model_check_handler", REPO / "lambda" / "model_check" / "handler.py")
    module = importlib.util.module_from_spec(spec)
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in the asset directory
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes_bytecode
    return module


handler = _load_handler()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A real GGUF of about 6 MiB: with 5 MiB parts it uploads multipart, as large models do."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-test.F32.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.arange(1536 * 1024, dtype=np.float32).reshape(1536, 1024))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def s3(monkeypatch):
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _upload(gguf: Path, *extra: str) -> None:
    assert main(["upload", str(gguf), "--bucket", BUCKET, "--name", "tiny", "--version", "v1",
                 "--part-size-mib", "5", "--no-progress", *extra]) == EXIT_OK


def _event(request: str = "Create", model_prefix: str = PREFIX, **extra) -> dict:
    from constructs_lib.model_check import manifest_key

    return {"RequestType": request, "StackId": "arn:aws:cloudformation:us-east-1:111111111111:stack/s/1",
            "RequestId": "r-1", "LogicalResourceId": "ModelCheck", "ResponseURL": "http://127.0.0.1:1/unused",
            "ResourceProperties": {"ServiceToken": "arn:fn", "Bucket": BUCKET, "ModelPrefix": model_prefix,
                                   "ManifestKey": manifest_key(model_prefix)}, **extra}


def _manifest(s3, key: str = PREFIX + "model-manifest.json") -> dict:
    return json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())


# --- the schema is the adapter's ---------------------------------------------------------------


def test_the_bundled_schema_is_generated_from_the_adapters_manifest_model():
    assert SCHEMA_PATH.read_text() == manifest_schema_text(), "run: .venv/bin/python tools/model_manifest_schema.py"


@pytest.mark.parametrize("change", [
    {}, {"size_bytes": -1}, {"size_bytes": "12"}, {"size_bytes": True}, {"sha256": "ABC"}, {"file": ""},
    {"file": None}, {"architecture": 3}, {"context_length": None}, {"has_chat_template": "yes"},
    {"stored": {"file": "x.gguf"}}, {"stored": None}, {"extra_field": "kept"},
    {"stored": {"file": "x.gguf", "sha256": "a" * 64, "size_bytes": 1, "s3_checksum_sha256": "short",
                "part_size_bytes": 0}},
])
def test_the_check_accepts_and_rejects_the_manifests_the_adapters_pydantic_model_does(change):
    from pydantic import ValidationError

    manifest = {"file": "m.gguf", "sha256": "a" * 64, "size_bytes": 12, "architecture": "llama",
                "stored": {"file": "m.gguf", "sha256": "a" * 64, "size_bytes": 12,
                           "s3_checksum_sha256": "A" * 43 + "=", "part_size_bytes": 0}, **change}
    try:
        ModelManifest.model_validate_json(json.dumps(manifest), strict=True)
        pydantic_ok = True
    except ValidationError:
        pydantic_ok = False
    assert (handler.schema_problem(manifest) is None) is pydantic_ok, handler.schema_problem(manifest)
    for field in ("file", "sha256", "size_bytes"):
        missing = {k: v for k, v in manifest.items() if k != field}
        assert handler.schema_problem(missing) == f"field '{field}': missing"


# --- Create and Update -------------------------------------------------------------------------


def test_a_model_uploaded_by_the_packaging_tool_passes_with_its_checksum_compared(s3, tiny_gguf):
    _upload(tiny_gguf)
    result = handler.handle(_event(), s3)
    assert result["Status"] == "SUCCESS", result
    assert result["PhysicalResourceId"] == f"s3://{BUCKET}/{PREFIX}"
    manifest = _manifest(s3)
    assert result["Data"] == {"ModelObject": f"s3://{BUCKET}/{PREFIX}{tiny_gguf.name}",
                              "ModelSha256": manifest["sha256"], "SizeBytes": str(tiny_gguf.stat().st_size),
                              "ChecksumChecked": "true"}
    assert manifest["stored"]["part_size_bytes"] > 0  # multipart: a composite checksum was compared


def test_a_missing_manifest_fails_with_one_line_naming_it_and_the_upload_command(s3):
    result = handler.handle(_event(), s3)
    assert result["Status"] == "FAILED"
    reason = result["Reason"]
    assert "\n" not in reason
    assert f"no model manifest at s3://{BUCKET}/{PREFIX}model-manifest.json" in reason
    assert f"`semif-package-model upload <model.gguf> --bucket {BUCKET} --name tiny --version v1`" in reason


def test_a_manifest_whose_gguf_is_missing_fails_and_names_the_gguf(s3, tiny_gguf):
    _upload(tiny_gguf)
    s3.delete_object(Bucket=BUCKET, Key=PREFIX + tiny_gguf.name)
    result = handler.handle(_event(), s3)
    assert result["Status"] == "FAILED"
    assert f"names {tiny_gguf.name}, but s3://{BUCKET}/{PREFIX}{tiny_gguf.name} is missing" in result["Reason"]
    assert f"semif-package-model upload {tiny_gguf.name} --bucket {BUCKET} --name tiny --version v1 --force" in (
        result["Reason"])


def test_a_gguf_of_another_size_than_the_manifest_says_fails(s3, tiny_gguf):
    _upload(tiny_gguf)
    s3.put_object(Bucket=BUCKET, Key=PREFIX + tiny_gguf.name, Body=tiny_gguf.read_bytes()[:-1])
    result = handler.handle(_event(), s3)
    assert result["Status"] == "FAILED"
    size = tiny_gguf.stat().st_size
    assert f"is {size - 1} bytes; s3://{BUCKET}/{PREFIX}model-manifest.json says {size}" in result["Reason"]


def test_a_gguf_replaced_by_other_bytes_of_the_same_size_fails_on_the_s3_checksum(s3, tiny_gguf):
    _upload(tiny_gguf)
    tampered = bytearray(tiny_gguf.read_bytes())
    tampered[len(tampered) // 2] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=PREFIX + tiny_gguf.name, Body=bytes(tampered), ChecksumAlgorithm="SHA256")
    result = handler.handle(_event(), s3)
    assert result["Status"] == "FAILED"
    assert "has S3 checksum" in result["Reason"] and _manifest(s3)["stored"]["s3_checksum_sha256"] in result["Reason"]


def test_a_gguf_copied_without_a_checksum_passes_on_its_size_alone(s3, tiny_gguf):
    _upload(tiny_gguf)
    s3.put_object(Bucket=BUCKET, Key=PREFIX + tiny_gguf.name, Body=tiny_gguf.read_bytes())  # no ChecksumAlgorithm
    result = handler.handle(_event(), s3)
    assert result["Status"] == "SUCCESS", result
    assert result["Data"]["ChecksumChecked"] == "false"


def test_a_manifest_that_breaks_the_schema_fails_naming_the_field(s3, tiny_gguf):
    _upload(tiny_gguf)
    manifest = _manifest(s3)
    manifest["sha256"] = "not-a-digest"
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "model-manifest.json", Body=json.dumps(manifest).encode())
    result = handler.handle(_event(), s3)
    assert result["Status"] == "FAILED"
    assert "is not a valid model manifest (field 'sha256': does not match" in result["Reason"]


def test_the_tar_gz_layout_checks_the_manifest_beside_the_tarball_and_the_tarball_itself(s3, tiny_gguf):
    _upload(tiny_gguf, "--tar-gz")
    result = handler.handle(_event(model_prefix=TAR_PREFIX), s3)
    assert result["Status"] == "SUCCESS", result
    assert result["Data"]["ModelObject"] == f"s3://{BUCKET}/{TAR_PREFIX}"
    assert result["Data"]["ChecksumChecked"] == "true"

    archive = s3.get_object(Bucket=BUCKET, Key=TAR_PREFIX)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=TAR_PREFIX, Body=archive[:-10], ChecksumAlgorithm="SHA256")
    result = handler.handle(_event(model_prefix=TAR_PREFIX), s3)
    assert result["Status"] == "FAILED"
    assert f"s3://{BUCKET}/{TAR_PREFIX} is {len(archive) - 10} bytes" in result["Reason"]
    assert "--name tiny --version v1 --tar-gz --force" in result["Reason"]


def test_the_tar_gz_layout_without_a_model_says_to_upload_with_tar_gz(s3):
    result = handler.handle(_event(model_prefix=TAR_PREFIX), s3)
    assert result["Status"] == "FAILED"
    assert f"no model manifest at s3://{BUCKET}/models/tiny/v1/model-manifest.json" in result["Reason"]
    assert "--name tiny --version v1 --tar-gz`" in result["Reason"]


def test_an_update_to_a_new_prefix_checks_the_new_model(s3, tiny_gguf):
    _upload(tiny_gguf)
    event = _event("Update", model_prefix="models/tiny/v2/", PhysicalResourceId=f"s3://{BUCKET}/{PREFIX}",
                   OldResourceProperties=_event()["ResourceProperties"])
    result = handler.handle(event, s3)
    assert result["Status"] == "FAILED"
    assert "models/tiny/v2/model-manifest.json" in result["Reason"]
    assert result["PhysicalResourceId"] == f"s3://{BUCKET}/{PREFIX}"  # a failed update keeps the verified id


def test_the_rollback_to_an_already_verified_model_succeeds_without_reading_s3(s3):
    # Nothing in the bucket: a re-check would fail the rollback.
    event = _event("Update", PhysicalResourceId=f"s3://{BUCKET}/{PREFIX}")
    assert handler.handle(event, s3)["Status"] == "SUCCESS"


def test_delete_is_a_no_op_that_reads_nothing(s3):
    event = _event("Delete", PhysicalResourceId=f"s3://{BUCKET}/{PREFIX}")
    assert handler.handle(event, s3) == {"Status": "SUCCESS", "PhysicalResourceId": f"s3://{BUCKET}/{PREFIX}"}


# --- access denied is not "upload the model" ----------------------------------------------------

KMS_DENIED = ("User: arn:aws:sts::111111111111:assumed-role/check/x is not authorized to perform: kms:Decrypt on "
              "resource: arn:aws:kms:us-east-1:111111111111:key/k because no identity-based policy allows it")


def _denied_client(*, manifest_listed: bool, message: str = KMS_DENIED, list_denied: bool = False):
    """A real S3 client whose answers are stubbed: GetObject of the manifest is denied (403), then the listing of
    that one key shows it, does not, or is denied too."""
    from botocore.stub import Stubber

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    stubber = Stubber(client)
    key = PREFIX + "model-manifest.json"
    stubber.add_client_error("get_object", service_error_code="AccessDenied", service_message=message,
                             http_status_code=403, expected_params={"Bucket": BUCKET, "Key": key})
    listing = {"Bucket": BUCKET, "Prefix": key, "MaxKeys": 1}
    if list_denied:
        stubber.add_client_error("list_objects_v2", service_error_code="AccessDenied", http_status_code=403,
                                 expected_params=listing)
    else:
        contents = {"Contents": [{"Key": key, "Size": 10}], "KeyCount": 1} if manifest_listed else {"KeyCount": 0}
        stubber.add_response("list_objects_v2", contents, expected_params=listing)
    stubber.activate()
    return client, stubber


def test_a_kms_refusal_on_a_manifest_that_is_there_names_the_key_policy_not_an_upload():
    client, stubber = _denied_client(manifest_listed=True)
    result = handler.handle(_event(), client)
    stubber.assert_no_pending_responses()
    assert result["Status"] == "FAILED"
    assert "access denied reading" in result["Reason"] and "which exists" in result["Reason"]
    assert "KMS key" in result["Reason"] and "kms:Decrypt" in result["Reason"]
    assert "upload" not in result["Reason"]


def test_an_iam_refusal_on_a_manifest_that_is_there_names_the_roles_grant():
    client, _ = _denied_client(manifest_listed=True, message="Access Denied")
    reason = handler.handle(_event(), client)["Reason"]
    assert "may not read it" in reason and "s3:GetObject" in reason and "upload" not in reason


def test_a_403_for_a_manifest_that_is_not_there_still_says_upload_it():
    client, _ = _denied_client(manifest_listed=False, message="Access Denied")
    reason = handler.handle(_event(), client)["Reason"]
    assert reason.startswith(f"no model manifest at s3://{BUCKET}/{PREFIX}model-manifest.json (S3: AccessDenied)")
    assert "semif-package-model upload" in reason


def test_a_403_that_cannot_be_told_apart_says_what_to_check_instead_of_upload():
    client, _ = _denied_client(manifest_listed=False, list_denied=True)
    reason = handler.handle(_event(), client)["Reason"]
    assert "listing it was denied too" in reason and "KMS key" in reason and "upload" not in reason


# --- the same check from the pipeline's CheckModel step -----------------------------------------


def test_the_command_line_check_passes_an_uploaded_model_and_fails_a_missing_gguf_with_the_reason(s3, tiny_gguf,
                                                                                                 capsys):
    args = ["--bucket", BUCKET, "--model-prefix", PREFIX, "--manifest-key", PREFIX + "model-manifest.json"]
    assert handler.main(args, s3) == 1
    assert "model check failed: no model manifest at" in capsys.readouterr().err
    _upload(tiny_gguf)
    assert handler.main(args, s3) == 0
    assert f"model OK: s3://{BUCKET}/{PREFIX}{tiny_gguf.name}" in capsys.readouterr().out
    s3.put_object(Bucket=BUCKET, Key=PREFIX + tiny_gguf.name, Body=tiny_gguf.read_bytes()[:-1])
    assert handler.main(args, s3) == 1
    assert "bytes;" in capsys.readouterr().err  # the GGUF itself is checked, not only the manifest's presence


def test_upload_command_keeps_a_non_default_models_root():
    assert handler.upload_command("b", "team/x/m/7/") == "semif-package-model upload <model.gguf> --bucket b --name m " \
                                                        "--version 7 --prefix 'team/x'"


# --- the reply to CloudFormation ---------------------------------------------------------------


class _ResponseSink(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_PUT(self):  # noqa: N802 (http.server's naming)
        length = int(self.headers["Content-Length"])
        type(self).received.append((self.headers.get("Content-Type"), json.loads(self.rfile.read(length))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def response_url():
    _ResponseSink.received = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _ResponseSink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/presigned", _ResponseSink.received
    server.shutdown()
    server.server_close()


def test_on_event_puts_the_failure_to_the_response_url_with_the_request_echoed(s3, response_url):
    url, received = response_url
    handler.on_event({**_event(), "ResponseURL": url})
    ((content_type, body),) = received
    assert content_type == ""  # the pre-signed URL is signed without a content type
    assert body["Status"] == "FAILED" and body["Reason"].startswith("no model manifest at")
    assert {k: body[k] for k in ("StackId", "RequestId", "LogicalResourceId")} == {
        "StackId": "arn:aws:cloudformation:us-east-1:111111111111:stack/s/1", "RequestId": "r-1",
        "LogicalResourceId": "ModelCheck"}
    assert body["PhysicalResourceId"] == f"s3://{BUCKET}/{PREFIX}"


def test_on_event_answers_failed_instead_of_hanging_when_the_event_is_malformed(response_url):
    url, received = response_url
    event = _event()
    del event["ResourceProperties"]["Bucket"]
    handler.on_event({**event, "ResponseURL": url})
    ((_, body),) = received
    assert body["Status"] == "FAILED" and body["Reason"] == "model check crashed: KeyError: 'Bucket'"


# --- Batch Transform's tarball (the decision stack's check) --------------------------------------

TRANSFORM_KEY = "models/tiny/v1.tar.gz"


def _transform_event(**extra) -> dict:
    event = _event(**extra)
    event["ResourceProperties"]["TransformTarball"] = "true"
    return event


def test_the_handler_and_the_stack_name_the_same_transform_tarball():
    from constructs_lib.model_check import transform_tarball_key

    for prefix in (PREFIX, TAR_PREFIX, "team/x/m/7/"):
        assert handler.transform_tarball_key(prefix) == transform_tarball_key(prefix)
    assert handler.transform_tarball_key(PREFIX) == TRANSFORM_KEY


def test_an_upload_writes_the_transform_tarball_beside_the_prefix_and_the_check_compares_its_checksum(s3, tiny_gguf):
    _upload(tiny_gguf)
    result = handler.handle(_transform_event(), s3)
    assert result["Status"] == "SUCCESS", result
    assert result["Data"]["TransformObject"] == f"s3://{BUCKET}/{TRANSFORM_KEY}"
    record = _manifest(s3)["transform_tarball"]
    head = s3.head_object(Bucket=BUCKET, Key=TRANSFORM_KEY, ChecksumMode="ENABLED")
    assert (record["file"], record["size_bytes"]) == ("v1.tar.gz", head["ContentLength"])
    assert head["ChecksumSHA256"].split("-")[0] == record["s3_checksum_sha256"].split("-")[0]


def test_a_replaced_transform_tarball_fails_the_decision_check_but_not_the_chat_check(s3, tiny_gguf):
    _upload(tiny_gguf)
    archive = s3.get_object(Bucket=BUCKET, Key=TRANSFORM_KEY)["Body"].read()
    # Same size, other bytes: only the checksum can tell.
    s3.put_object(Bucket=BUCKET, Key=TRANSFORM_KEY, Body=archive[:-1] + bytes([archive[-1] ^ 1]),
                  ChecksumAlgorithm="SHA256")
    result = handler.handle(_transform_event(), s3)
    assert result["Status"] == "FAILED"
    assert f"s3://{BUCKET}/{TRANSFORM_KEY} has S3 checksum" in result["Reason"]
    assert "--name tiny --version v1 --force" in result["Reason"]
    assert handler.handle(_event(), s3)["Status"] == "SUCCESS"  # no Batch Transform there: not its concern


def test_a_missing_transform_tarball_or_a_manifest_without_one_fails_the_decision_check(s3, tiny_gguf):
    _upload(tiny_gguf)
    s3.delete_object(Bucket=BUCKET, Key=TRANSFORM_KEY)
    result = handler.handle(_transform_event(), s3)
    assert result["Status"] == "FAILED"
    assert f"s3://{BUCKET}/{TRANSFORM_KEY} is missing" in result["Reason"]
    manifest = _manifest(s3)
    del manifest["transform_tarball"]  # a model uploaded before the tool wrote the tarball
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "model-manifest.json", Body=json.dumps(manifest).encode())
    result = handler.handle(_transform_event(), s3)
    assert result["Status"] == "FAILED"
    assert "records no Batch Transform tarball" in result["Reason"]
    assert "upload" in result["Reason"] and "--force" in result["Reason"]


def test_a_tar_gz_model_is_its_own_transform_tarball(s3, tiny_gguf):
    _upload(tiny_gguf, "--tar-gz")
    result = handler.handle(_transform_event(model_prefix=TAR_PREFIX), s3)
    assert result["Status"] == "SUCCESS", result
    assert "TransformObject" not in result["Data"]
    assert "transform_tarball" not in _manifest(s3)


def test_the_pipelines_command_line_check_includes_the_transform_tarball(s3, tiny_gguf, capsys):
    _upload(tiny_gguf)
    s3.delete_object(Bucket=BUCKET, Key=TRANSFORM_KEY)
    args = ["--bucket", BUCKET, "--model-prefix", PREFIX, "--manifest-key", PREFIX + "model-manifest.json"]
    assert handler.main(args, s3) == 0
    assert handler.main(args + ["--transform-tarball"], s3) == 1
    assert f"{TRANSFORM_KEY} is missing" in capsys.readouterr().err
