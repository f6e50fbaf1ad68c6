"""The image-build custom resource handlers, against botocore Stubber (no AWS calls)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import boto3
import pytest
from botocore.stub import ANY, Stubber

HANDLER = Path(__file__).resolve().parents[2] / "lambda" / "image_build" / "handler.py"
DIGEST = "sha256:" + "cd" * 32
PROPS = {
    "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:provider",
    "ProjectName": "AdapterImageProject",
    "RepositoryName": "semif-adapter",
    "RepositoryUri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/semif-adapter",
    "BaseImage": "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp:server-sagemaker-cpu-v1",
    "ImageTag": "0123456789abcdef0123456789abcdef01234567",
    "SourceLocation": "cdk-assets-bucket/abc.zip",
}
IMAGE_ID = {"repositoryName": "semif-adapter", "imageIds": [{"imageTag": PROPS["ImageTag"]}]}


@pytest.fixture
def handler(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    spec = importlib.util.spec_from_file_location("image_build_handler", HANDLER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    codebuild = boto3.client("codebuild", region_name="us-east-1")
    ecr = boto3.client("ecr", region_name="us-east-1")
    module._codebuild = lambda: codebuild
    module._ecr = lambda: ecr
    with Stubber(codebuild) as codebuild_stub, Stubber(ecr) as ecr_stub:
        module.stubs = {"codebuild": codebuild_stub, "ecr": ecr_stub}
        yield module
        codebuild_stub.assert_no_pending_responses()
        ecr_stub.assert_no_pending_responses()


def image_missing(stub):
    stub.add_client_error("describe_images", service_error_code="ImageNotFoundException",
                          expected_params=IMAGE_ID)


def image_present(stub):
    stub.add_response("describe_images", {"imageDetails": [{"imageDigest": DIGEST, "imageTags": [PROPS["ImageTag"]]}]},
                      expected_params=IMAGE_ID)


def build(status, **extra):
    return {"id": "AdapterImageProject:build-1", "arn": "arn:aws:codebuild:us-east-1:123456789012:build/x",
            "buildStatus": status, **extra}


def test_create_starts_the_build_with_the_project_source_and_overrides(handler):
    image_missing(handler.stubs["ecr"])
    handler.stubs["codebuild"].add_response("start_build", {"build": build("IN_PROGRESS")}, expected_params={
        "projectName": "AdapterImageProject",
        "sourceTypeOverride": "S3",
        "sourceLocationOverride": "cdk-assets-bucket/abc.zip",
        "environmentVariablesOverride": [
            {"name": "BASE_IMAGE", "value": PROPS["BaseImage"], "type": "PLAINTEXT"},
            {"name": "REPOSITORY_URI", "value": PROPS["RepositoryUri"], "type": "PLAINTEXT"},
            {"name": "IMAGE_TAG", "value": PROPS["ImageTag"], "type": "PLAINTEXT"},
        ],
    })
    result = handler.on_event({"RequestType": "Create", "ResourceProperties": PROPS})
    assert result == {"PhysicalResourceId": f"semif-adapter:{PROPS['ImageTag']}",
                      "Data": {"BuildId": "AdapterImageProject:build-1"}}


def test_polling_while_the_build_runs_is_not_complete(handler):
    handler.stubs["codebuild"].add_response("batch_get_builds", {"builds": [build("IN_PROGRESS")]},
                                            expected_params={"ids": ["AdapterImageProject:build-1"]})
    event = {"RequestType": "Create", "ResourceProperties": PROPS, "Data": {"BuildId": "AdapterImageProject:build-1"}}
    assert handler.is_complete(event) == {"IsComplete": False}


def test_polling_a_succeeded_build_returns_the_pushed_digest(handler):
    handler.stubs["codebuild"].add_response("batch_get_builds", {"builds": [build("SUCCEEDED")]},
                                            expected_params={"ids": ["AdapterImageProject:build-1"]})
    image_present(handler.stubs["ecr"])
    event = {"RequestType": "Create", "ResourceProperties": PROPS, "Data": {"BuildId": "AdapterImageProject:build-1"}}
    result = handler.is_complete(event)
    assert result["IsComplete"] is True
    assert result["Data"]["ImageDigest"] == DIGEST
    assert result["Data"]["ImageUri"] == f"{PROPS['RepositoryUri']}@{DIGEST}"


@pytest.mark.parametrize("status", ["FAILED", "FAULT", "STOPPED", "TIMED_OUT"])
def test_polling_a_failed_build_fails_with_the_log_link(handler, status):
    deep_link = "https://console.aws.amazon.com/cloudwatch/home?region=us-east-1#logEvent:group=/b;stream=s"
    handler.stubs["codebuild"].add_response("batch_get_builds", {"builds": [build(
        status, logs={"deepLink": deep_link},
        phases=[{"phaseType": "BUILD", "phaseStatus": status,
                 "contexts": [{"statusCode": "COMMAND_EXECUTION_ERROR", "message": "docker build exited 1"}]}],
    )]}, expected_params={"ids": ["AdapterImageProject:build-1"]})
    event = {"RequestType": "Update", "ResourceProperties": PROPS, "Data": {"BuildId": "AdapterImageProject:build-1"}}
    with pytest.raises(RuntimeError) as failure:
        handler.is_complete(event)
    message = str(failure.value)
    assert f"ended {status}" in message
    assert "BUILD: docker build exited 1" in message
    assert f"Logs: {deep_link}" in message


def test_update_with_unchanged_inputs_does_not_rebuild(handler):
    image_present(handler.stubs["ecr"])  # same tag = same inputs: the image is already there
    event = {"RequestType": "Update", "ResourceProperties": PROPS, "OldResourceProperties": PROPS,
             "PhysicalResourceId": f"semif-adapter:{PROPS['ImageTag']}"}
    result = handler.on_event(event)
    assert result == {"PhysicalResourceId": f"semif-adapter:{PROPS['ImageTag']}", "Data": {"BuildId": ""}}
    # No start_build was stubbed: a call would have raised. Completion reads the existing digest.
    image_present(handler.stubs["ecr"])
    completed = handler.is_complete({**event, **result})
    assert completed["IsComplete"] is True and completed["Data"]["ImageDigest"] == DIGEST


def test_update_with_a_new_input_hash_builds(handler):
    new_props = {**PROPS, "ImageTag": "f" * 40}
    handler.stubs["ecr"].add_client_error("describe_images", service_error_code="ImageNotFoundException",
                                          expected_params={"repositoryName": "semif-adapter",
                                                           "imageIds": [{"imageTag": "f" * 40}]})
    handler.stubs["codebuild"].add_response("start_build", {"build": build("IN_PROGRESS")}, expected_params={
        "projectName": "AdapterImageProject", "sourceTypeOverride": "S3",
        "sourceLocationOverride": "cdk-assets-bucket/abc.zip", "environmentVariablesOverride": ANY})
    result = handler.on_event({"RequestType": "Update", "ResourceProperties": new_props,
                               "OldResourceProperties": PROPS, "PhysicalResourceId": "semif-adapter:old"})
    assert result["PhysicalResourceId"] == f"semif-adapter:{'f' * 40}"
    assert result["Data"]["BuildId"] == "AdapterImageProject:build-1"


def test_delete_is_a_no_op(handler):
    event = {"RequestType": "Delete", "ResourceProperties": PROPS, "PhysicalResourceId": "semif-adapter:abc"}
    assert handler.on_event(event) == {"PhysicalResourceId": "semif-adapter:abc"}
    assert handler.is_complete(event) == {"IsComplete": True}
    # Stubber raises on any unexpected call; none were stubbed.


def test_a_missing_image_after_success_is_an_error(handler):
    handler.stubs["codebuild"].add_response("batch_get_builds", {"builds": [build("SUCCEEDED")]},
                                            expected_params={"ids": ["AdapterImageProject:build-1"]})
    image_missing(handler.stubs["ecr"])
    event = {"RequestType": "Create", "ResourceProperties": PROPS, "Data": {"BuildId": "AdapterImageProject:build-1"}}
    with pytest.raises(RuntimeError, match="not found after build AdapterImageProject:build-1"):
        handler.is_complete(event)
