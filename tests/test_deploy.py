"""`make deploy`'s steps against botocore's Stubber (ECR, CodeBuild, SageMaker runtime) and moto (S3): the DLC digest
looked up once, the image built and waited for or found built, the model uploaded once, and the smoke decision
that proves the endpoint runs the digest just deployed. The smoke answers are the real adapter's, on the embedded
model, with SEMIF_IMAGE_DIGEST set as the stack sets it."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import boto3
import httpx
import pytest
from botocore.stub import Stubber

from serving import ServeProcess, embedded_model, free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from constructs_lib.image_sources import PLACEHOLDER_DIGEST  # noqa: E402
from deploy import DeployError  # noqa: E402
from deploy.image import DOCKER_MANIFEST, ImageProject, ensure_image, image_tag, resolve_dlc_digest  # noqa: E402
from deploy.model import ensure_model  # noqa: E402
from deploy.smoke import SMOKE_DECISION, smoke  # noqa: E402

REGION = "us-east-1"
DLC_DIGEST = "sha256:" + "d1" * 32
BUILT_DIGEST = "sha256:" + "b2" * 32
PROJECT = ImageProject(project_name="semif-dev-adapter-image-cpu",
                       repository_uri="111111111111.dkr.ecr.us-east-1.amazonaws.com/semif/dev/adapter",
                       source_hash="a" * 64, variant="cpu")
BASE_IMAGE = f"763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@{DLC_DIGEST}"
LOG = "https://console.aws.amazon.com/cloudwatch/home?region=us-east-1#logEvent:group=/aws/codebuild/x;stream=y"


@pytest.fixture(autouse=True)
def fake_credentials(monkeypatch):
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(var, value)


def stubbed(service: str):
    client = boto3.client(service, region_name=REGION)
    return client, Stubber(client)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# --- the DLC digest ---------------------------------------------------------------------------------------------

def test_a_digest_pinned_in_config_wins_and_nothing_is_looked_up():
    ecr, stub = stubbed("ecr")
    with stub:  # no response queued: any call fails the test
        assert resolve_dlc_digest(ecr, region=REGION, variant="gpu", pinned=DLC_DIGEST) == (DLC_DIGEST, False)
    stub.assert_no_pending_responses()


def test_the_dlc_tag_is_resolved_to_its_digest_in_the_regions_dlc_registry():
    ecr, stub = stubbed("ecr")
    stub.add_response("batch_get_image", {"images": [{"imageId": {"imageTag": "server-sagemaker-cpu-v1",
                                                                   "imageDigest": DLC_DIGEST}}], "failures": []},
                      {"registryId": "763104351884", "repositoryName": "llama-cpp",
                       "imageIds": [{"imageTag": "server-sagemaker-cpu-v1"}], "acceptedMediaTypes": [DOCKER_MANIFEST]})
    with stub:
        assert resolve_dlc_digest(ecr, region=REGION, variant="cpu", pinned=PLACEHOLDER_DIGEST) == (DLC_DIGEST, True)


def test_a_dlc_tag_that_is_gone_fails_naming_the_image_and_the_pin_to_set():
    ecr, stub = stubbed("ecr")
    stub.add_response("batch_get_image", {"images": [], "failures": [
        {"imageId": {"imageTag": "server-sagemaker-cuda-v1"}, "failureCode": "ImageNotFound",
         "failureReason": "Requested image not found"}]})
    with stub, pytest.raises(DeployError, match=r"llama-cpp:server-sagemaker-cuda-v1 was not found "
                                                 r"\(ImageNotFound.*dlc_images.gpu"):
        resolve_dlc_digest(ecr, region=REGION, variant="gpu", pinned=None)


# --- the adapter image ------------------------------------------------------------------------------------------

def _not_built(stub, tag):
    stub.add_client_error("describe_images", service_error_code="ImageNotFoundException",
                          expected_params={"repositoryName": "semif/dev/adapter", "imageIds": [{"imageTag": tag}]})


def _a_new_build():
    """Stubs for a tag not in the repository, no build of it running, and a build started for it."""
    tag = image_tag(PROJECT, BASE_IMAGE)
    ecr, ecr_stub = stubbed("ecr")
    codebuild, cb_stub = stubbed("codebuild")
    _not_built(ecr_stub, tag)
    cb_stub.add_response("list_builds_for_project", {})
    cb_stub.add_response("start_build", {"build": {"id": "semif-dev-adapter-image-cpu:1"}})
    return tag, ecr, ecr_stub, codebuild, cb_stub


def _build(status, *, phase="BUILD", exported=None, phases=None, tag=None):
    build = {"id": "semif-dev-adapter-image-cpu:1", "buildStatus": status, "currentPhase": phase,
             "logs": {"deepLink": LOG}, "environment": {"type": "LINUX_CONTAINER", "image": "x",
                                                          "computeType": "BUILD_GENERAL1_LARGE",
                                                          "environmentVariables": [
                                                              {"name": "IMAGE_TAG", "value": tag or "", "type": "PLAINTEXT"}]}}
    if exported is not None:
        build["exportedEnvironmentVariables"] = [{"name": k, "value": v} for k, v in exported.items()]
    if phases is not None:
        build["phases"] = phases
    return {"builds": [build]}


def test_unchanged_inputs_find_the_image_built_and_start_no_build():
    tag = image_tag(PROJECT, BASE_IMAGE)
    ecr, ecr_stub = stubbed("ecr")
    codebuild, cb_stub = stubbed("codebuild")
    ecr_stub.add_response("describe_images", {"imageDetails": [{"imageDigest": BUILT_DIGEST, "imageTags": [tag],
                                                                "imageManifestMediaType": DOCKER_MANIFEST}]},
                          {"repositoryName": "semif/dev/adapter", "imageIds": [{"imageTag": tag}]})
    with ecr_stub, cb_stub:  # CodeBuild has nothing queued: a start_build would fail the test
        image = ensure_image(codebuild, ecr, PROJECT, region=REGION, dlc_digest=DLC_DIGEST, timeout_s=60, say=lambda m: None)
    assert (image.digest, image.skipped, image.base_image) == (BUILT_DIGEST, True, BASE_IMAGE)
    ecr_stub.assert_no_pending_responses()


def test_the_tag_names_the_sources_the_base_image_and_the_variant():
    tag = image_tag(PROJECT, BASE_IMAGE)
    assert len(tag) == 40
    assert image_tag(ImageProject(**{**PROJECT.__dict__, "source_hash": "b" * 64}), BASE_IMAGE) != tag
    assert image_tag(PROJECT, BASE_IMAGE.replace("d1", "d2")) != tag
    assert image_tag(ImageProject(**{**PROJECT.__dict__, "variant": "gpu"}), BASE_IMAGE) != tag


def test_a_new_build_is_started_with_the_resolved_base_and_waited_for_until_it_exports_its_digest():
    tag = image_tag(PROJECT, BASE_IMAGE)
    ecr, ecr_stub = stubbed("ecr")
    codebuild, cb_stub = stubbed("codebuild")
    _not_built(ecr_stub, tag)
    cb_stub.add_response("list_builds_for_project", {})
    cb_stub.add_response("start_build", {"build": {"id": "semif-dev-adapter-image-cpu:1", "logs": {"deepLink": LOG}}},
                         {"projectName": PROJECT.project_name, "environmentVariablesOverride": [
                             {"name": "BASE_IMAGE", "value": BASE_IMAGE, "type": "PLAINTEXT"},
                             {"name": "IMAGE_TAG", "value": tag, "type": "PLAINTEXT"}]})
    cb_stub.add_response("batch_get_builds", _build("IN_PROGRESS", phase="PROVISIONING"))
    cb_stub.add_response("batch_get_builds", _build("IN_PROGRESS", phase="BUILD"))
    cb_stub.add_response("batch_get_builds", _build("SUCCEEDED", phase="COMPLETED",
                                                    exported={"IMAGE_DIGEST": BUILT_DIGEST, "IMAGE_TAG": tag}))
    clock, said = Clock(), []
    with ecr_stub, cb_stub:
        image = ensure_image(codebuild, ecr, PROJECT, region=REGION, dlc_digest=DLC_DIGEST, timeout_s=3600,
                             poll_s=15, say=said.append, clock=clock, sleep=clock.sleep)
    cb_stub.assert_no_pending_responses()
    assert (image.digest, image.skipped, image.tag, image.log_url) == (BUILT_DIGEST, False, tag, LOG)
    assert clock.now == 30  # two polls while in progress
    assert any("provisioning" in line for line in said) and any("build (" in line for line in said)


def test_a_failed_build_fails_the_command_with_the_phase_the_reason_and_the_log_address():
    tag, ecr, ecr_stub, codebuild, cb_stub = _a_new_build()
    cb_stub.add_response("batch_get_builds", _build("FAILED", phase="COMPLETED", phases=[
        {"phaseType": "SUBMITTED", "phaseStatus": "SUCCEEDED"},
        {"phaseType": "BUILD", "phaseStatus": "FAILED",
         "contexts": [{"statusCode": "COMMAND_EXECUTION_ERROR", "message": "Error while executing command: bash x. "
                                                                            "Reason: exit status 1"}]}]))
    with ecr_stub, cb_stub, pytest.raises(DeployError) as failed:
        ensure_image(codebuild, ecr, PROJECT, region=REGION, dlc_digest=DLC_DIGEST, timeout_s=3600, say=lambda m: None,
                     sleep=lambda s: None)
    message = str(failed.value)
    assert "ended FAILED in BUILD" in message and "exit status 1" in message and LOG in message


def test_a_build_still_running_at_the_timeout_fails_with_its_log_and_the_next_run_waits_for_it_instead_of_a_new_one():
    tag, ecr, ecr_stub, codebuild, cb_stub = _a_new_build()
    for _ in range(4):
        cb_stub.add_response("batch_get_builds", _build("IN_PROGRESS"))
    clock = Clock()
    with ecr_stub, cb_stub, pytest.raises(DeployError, match=r"still running after 1 min.*next `make deploy` waits"):
        ensure_image(codebuild, ecr, PROJECT, region=REGION, dlc_digest=DLC_DIGEST, timeout_s=60, poll_s=20,
                     say=lambda m: None, clock=clock, sleep=clock.sleep)
    cb_stub.assert_no_pending_responses()

    # The next run: the same tag is still building, so it is waited for and no second build starts.
    ecr, ecr_stub = stubbed("ecr")
    codebuild, cb_stub = stubbed("codebuild")
    _not_built(ecr_stub, tag)
    cb_stub.add_response("list_builds_for_project", {"ids": ["semif-dev-adapter-image-cpu:1"]})
    cb_stub.add_response("batch_get_builds", _build("IN_PROGRESS", tag=tag))
    cb_stub.add_response("batch_get_builds", _build("SUCCEEDED", exported={"IMAGE_DIGEST": BUILT_DIGEST}, tag=tag))
    with ecr_stub, cb_stub:
        image = ensure_image(codebuild, ecr, PROJECT, region=REGION, dlc_digest=DLC_DIGEST, timeout_s=60,
                             say=lambda m: None, sleep=lambda s: None)
    cb_stub.assert_no_pending_responses()
    assert image.digest == BUILT_DIGEST


def test_a_build_that_succeeds_without_a_digest_is_a_failure():
    tag, ecr, ecr_stub, codebuild, cb_stub = _a_new_build()
    cb_stub.add_response("batch_get_builds", _build("SUCCEEDED", exported={"IMAGE_DIGEST": ""}))
    with ecr_stub, cb_stub, pytest.raises(DeployError, match="exported no IMAGE_DIGEST"):
        ensure_image(codebuild, ecr, PROJECT, region=REGION, dlc_digest=DLC_DIGEST, timeout_s=60, say=lambda m: None)


# --- the model --------------------------------------------------------------------------------------------------

def test_the_embedded_model_is_uploaded_once_with_its_manifest_and_found_the_next_time():
    from moto import mock_aws

    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket="semif-dev-models")
        prefix = "models/smollm2-135m-instruct-q4_1/1/"
        assert ensure_model(s3, bucket="semif-dev-models", model_prefix=prefix, model_source="embedded", region=REGION,
                            say=lambda m: None) is True
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="semif-dev-models")["Contents"])
        assert f"{prefix}model-manifest.json" in keys and any(k.endswith(".gguf") for k in keys)
        manifest = json.loads(s3.get_object(Bucket="semif-dev-models", Key=f"{prefix}model-manifest.json")["Body"].read())
        import hashlib
        assert manifest["sha256"] == hashlib.sha256(embedded_model().read_bytes()).hexdigest()

        def no_upload(arguments):
            raise AssertionError("uploaded again")

        assert ensure_model(s3, bucket="semif-dev-models", model_prefix=prefix, model_source="embedded", region=REGION,
                            say=lambda m: None, upload=no_upload) is False


def test_a_bucket_without_the_model_and_no_model_source_fails_with_the_upload_command():
    from moto import mock_aws

    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket="semif-prod-models")
        with pytest.raises(DeployError, match=r"no model_source.*semif-package-model upload MODEL.gguf --bucket "
                                              r"semif-prod-models --name qwen --version 1"):
            ensure_model(s3, bucket="semif-prod-models", model_prefix="models/qwen/1/", model_source=None,
                         region=REGION, say=lambda m: None)


# --- the smoke decision -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter_answer(tmp_path_factory):
    """The real adapter's answer to the smoke decision, served as the stack serves it (SEMIF_IMAGE_DIGEST set)."""
    port = free_port()
    env = {**os.environ, "SEMIF_MODEL_PATH": str(embedded_model()), "SEMIF_PORT": str(port),
           "SEMIF_HOST": "127.0.0.1", "SEMIF_IMAGE_DIGEST": BUILT_DIGEST}
    server = ServeProcess(env, port, tmp_path_factory.mktemp("smoke") / "serve.log").wait_ready()
    try:
        response = httpx.post(server.base_url + "/invocations", json=SMOKE_DECISION, timeout=60)
        assert response.status_code == 200, response.text
        return response.content
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)


def _invoke(stub, body: bytes):
    stub.add_response("invoke_endpoint", {"Body": io.BytesIO(body), "ContentType": "application/json"},
                      {"EndpointName": "semif-dev-decision", "ContentType": "application/json",
                       "Accept": "application/json", "Body": json.dumps(SMOKE_DECISION).encode()})


def test_the_smoke_decision_passes_when_the_answer_names_the_digest_just_deployed(adapter_answer):
    runtime, stub = stubbed("sagemaker-runtime")
    _invoke(stub, adapter_answer)
    with stub:
        result = smoke(runtime, endpoint_name="semif-dev-decision", expected_digest=BUILT_DIGEST)
    assert result.record["image_digest"] == BUILT_DIGEST
    assert len(result.record["model_sha256"]) == 64 and result.record["template_version"]
    assert result.record["options_sha256"] and result.record["llama_cpp_build"]


def test_the_smoke_decision_fails_when_the_endpoint_still_runs_another_image(adapter_answer):
    runtime, stub = stubbed("sagemaker-runtime")
    _invoke(stub, adapter_answer)
    with stub, pytest.raises(DeployError, match=r"answers from image sha256:b2.*not sha256:ee.*rollback"):
        smoke(runtime, endpoint_name="semif-dev-decision", expected_digest="sha256:" + "ee" * 32)


def test_the_smoke_decision_retries_a_busy_endpoint_and_gives_up_on_a_model_error(adapter_answer):
    runtime, stub = stubbed("sagemaker-runtime")
    stub.add_client_error("invoke_endpoint", service_error_code="ModelError", service_message="Received server error (503)",
                          http_status_code=424, response_meta={}, modeled_fields={"OriginalStatusCode": 503})
    _invoke(stub, adapter_answer)
    with stub:
        assert smoke(runtime, endpoint_name="semif-dev-decision", expected_digest=BUILT_DIGEST,
                     sleep=lambda s: None).record["image_digest"] == BUILT_DIGEST

    runtime, stub = stubbed("sagemaker-runtime")
    stub.add_client_error("invoke_endpoint", service_error_code="ModelError", service_message="Received client error (422)",
                          http_status_code=424, modeled_fields={"OriginalStatusCode": 422})
    with stub, pytest.raises(DeployError, match=r"smoke decision to semif-dev-decision failed.*/aws/sagemaker/Endpoints/"):
        smoke(runtime, endpoint_name="semif-dev-decision", expected_digest=BUILT_DIGEST, sleep=lambda s: None)


# --- the command ------------------------------------------------------------------------------------------------

def test_credentials_for_another_account_stop_the_command_before_anything_is_created():
    from config import load_settings
    from deploy.__main__ import check_account

    sts, stub = stubbed("sts")
    stub.add_response("get_caller_identity", {"Account": "999999999999", "Arn": "arn:aws:iam::999999999999:user/x",
                                              "UserId": "x"})
    with stub, pytest.raises(DeployError, match=r"account 999999999999.*environments.dev.account.*111111111111"):
        check_account(sts, load_settings().environment("dev"))


def test_the_deploy_package_imports_without_llama_cpp_or_the_http_server():
    """`make deploy-setup` installs no llama.cpp: the command and the model upload must not import it."""
    import subprocess

    blocker = ("import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('llama_cpp', 'starlette', 'uvicorn', 'httpx'):\n"
               "            raise ImportError('blocked: ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import deploy.__main__, deploy.image, deploy.model, deploy.smoke, semif.tools.package_model, app\n")
    result = subprocess.run([sys.executable, "-c", blocker], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_answer_names_the_dlc_digest_the_image_was_built_from(tmp_path):
    """The image's build record (container/Dockerfile writes /opt/semif/BUILD_INFO.json) reaches every answer."""
    record = tmp_path / "BUILD_INFO.json"
    record.write_text(json.dumps({"base_image_digest": DLC_DIGEST, "input_hash": "x", "variant": "cpu"}))
    port = free_port()
    env = {**os.environ, "SEMIF_MODEL_PATH": str(embedded_model()), "SEMIF_PORT": str(port), "SEMIF_HOST": "127.0.0.1",
           "SEMIF_IMAGE_DIGEST": BUILT_DIGEST, "SEMIF_BUILD_INFO": str(record)}
    server = ServeProcess(env, port, tmp_path / "serve.log").wait_ready()
    try:
        answer = httpx.post(server.base_url + "/invocations", json=SMOKE_DECISION, timeout=60).json()
        criteria = {"model": "jev-latest", "state": "The refund has not arrived.",
                    "questions": {"refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}}
        system_one = httpx.post(server.base_url + "/invocations", json=criteria, timeout=60)
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)
    assert answer["model"]["base_image_digest"] == DLC_DIGEST
    assert answer["model"]["image_digest"] == BUILT_DIGEST
    assert system_one.status_code == 200, system_one.text
    assert system_one.json()["x_semif"]["base_image_digest"] == DLC_DIGEST


def test_an_example_account_left_where_a_stack_would_trust_it_stops_the_command():
    """The example config's accounts are placeholders: a stack must never trust them in a real deploy."""
    import dataclasses

    from config import load_settings
    from deploy.__main__ import check_account

    settings = load_settings()
    dev = dataclasses.replace(settings.environment("dev"), account="444455556666")

    def caller():
        sts, stub = stubbed("sts")
        stub.add_response("get_caller_identity", {"Account": "444455556666", "Arn": "arn:aws:iam::444455556666:user/x",
                                                  "UserId": "x"})
        stub.activate()
        return sts

    with pytest.raises(DeployError, match=r"pipeline.account .* example 333333333333.*\"pipeline\": null"):
        check_account(caller(), dev, settings)
    no_pipeline = dataclasses.replace(settings, pipeline=None)
    with pytest.raises(DeployError, match=r"client_role_arns names arn:aws:iam::111111111111:role/semif-dev-chat-app"):
        check_account(caller(), dev, no_pipeline)
    mine = dataclasses.replace(dev, text=dataclasses.replace(
        dev.text, client_role_arns=("arn:aws:iam::444455556666:role/my-chat-app",)))
    check_account(caller(), mine, no_pipeline)  # nothing left to refuse


def test_up_bootstraps_builds_uploads_deploys_and_smokes_in_order_and_every_cdk_call_synthesizes(adapter_answer, tmp_path):
    """The whole `make deploy` against stubbed AWS: a fresh account (no bootstrap), an image already built from the
    same sources, a model already in the bucket. Every CDK CLI call it makes carries what synth needs: the app is
    synthesized with exactly those contexts (the CLI synthesizes even for `cdk bootstrap`)."""
    import argparse

    from config import load_settings
    from deploy.__main__ import Cdk, up
    from stacks import image_stack

    settings = load_settings()
    env = settings.environment("dev")
    tag = image_tag(PROJECT, BASE_IMAGE)
    clients = {}
    for service in ("ssm", "ecr", "cloudformation", "codebuild", "s3", "sagemaker-runtime"):
        clients[service] = stubbed(service)
    clients["ecr"][1].add_response("batch_get_image", {"images": [{"imageId": {"imageDigest": DLC_DIGEST}}]})
    clients["ssm"][1].add_client_error("get_parameter", service_error_code="ParameterNotFound")
    clients["cloudformation"][1].add_response("describe_stacks", {"Stacks": [{
        "StackName": "semif-dev-image", "CreationTime": "2026-12-06T00:00:00Z", "StackStatus": "CREATE_COMPLETE",
        "Outputs": [{"OutputKey": image_stack.output_project("cpu"), "OutputValue": PROJECT.project_name},
                    {"OutputKey": image_stack.OUTPUT_REPOSITORY_URI, "OutputValue": PROJECT.repository_uri},
                    {"OutputKey": image_stack.OUTPUT_SOURCE_HASH, "OutputValue": PROJECT.source_hash}]}]},
        {"StackName": "semif-dev-image"})
    clients["ecr"][1].add_response("describe_images", {"imageDetails": [
        {"imageDigest": BUILT_DIGEST, "imageManifestMediaType": DOCKER_MANIFEST}]},
        {"repositoryName": "semif/dev/adapter", "imageIds": [{"imageTag": tag}]})
    clients["s3"][1].add_response("head_object", {}, {"Bucket": "semif-dev-models-111111111111-us-east-1",
                                                      "Key": "models/smollm2-135m-instruct-q4_1/1/model-manifest.json"})
    _invoke(clients["sagemaker-runtime"][1], adapter_answer)

    class Session:
        def client(self, name):
            return clients[name][0]

    calls = []
    for _, stub in clients.values():
        stub.activate()
    up(argparse.Namespace(build_timeout_min=200, no_smoke=False), Session(), settings, env,
       Cdk(run=lambda argv: calls.append(argv) or 0))
    for _, stub in clients.values():
        stub.assert_no_pending_responses()

    verbs = [argv[argv.index("cdk") + 1] for argv in calls]
    assert verbs == ["bootstrap", "deploy", "deploy"]
    assert calls[0][-1] == "aws://111111111111/us-east-1"
    assert calls[1][-2:] == ["SemIf-dev-Shared", "SemIf-dev-Image"] and "--all" in calls[2]
    sys.path.insert(0, str(REPO / "tests" / "cdk"))
    from cdk_testing import synth_real_app

    for number, argv in enumerate(calls):
        contexts = dict(argv[i + 1].split("=", 1) for i, word in enumerate(argv) if word == "-c")
        assert contexts["dlc-image-cpu"] == DLC_DIGEST
        synth_real_app(tmp_path / str(number), **contexts)  # raises on a missing digest, a nag finding, …
    assert dict(a.split("=", 1) for a in calls[2] if a.startswith("adapter-image-"))["adapter-image-cpu"] == BUILT_DIGEST


def test_a_gpu_environment_builds_the_cpu_image_for_its_batch_transform_too():
    from config import load_settings
    from deploy.__main__ import variants_of

    settings = load_settings()
    assert variants_of(settings.environment("dev")) == ["cpu"]
    assert variants_of(settings.environment("prod")) == ["cpu", "gpu"]
