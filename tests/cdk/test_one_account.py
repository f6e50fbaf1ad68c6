"""One environment from its own account (`make deploy`): its image repository and build project in the same account,
the Model pinned to the digest that build pushed, a CPU environment without any CUDA build, a first create that
cannot leave a repository behind to block the retry, and the DLC digest the command looked up."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from aws_cdk.assertions import Template

from cdk_testing import CPU_DIGEST, GPU_DIGEST, IMAGE_DIGESTS, REPO, synth_real_app

DLC = "sha256:" + "dc" * 32


def templates(assembly) -> dict[str, dict]:
    return {s.stack_name: s.template for s in assembly.stacks_recursively}


def _resources(template: dict, type_: str) -> dict[str, dict]:
    return {k: r for k, r in template["Resources"].items() if r["Type"] == type_}


def _rendered(value) -> str:
    if isinstance(value, str):
        return value
    ((function, arguments),) = value.items()
    assert function == "Fn::Join"
    return arguments[0].join("amazonaws.com" if v == {"Ref": "AWS::URLSuffix"} else _rendered(v) for v in arguments[1])


def test_a_cpu_environment_builds_its_own_cpu_image_in_its_own_account_and_no_cuda(dev_assembly):
    stacks = templates(dev_assembly[1])
    image = stacks["semif-dev-image"]
    (project,) = _resources(image, "AWS::CodeBuild::Project").values()
    variables = {v["Name"]: v["Value"] for v in project["Properties"]["Environment"]["EnvironmentVariables"]}
    assert variables["LLAMA_CPP_VARIANT"] == "cpu"
    assert project["Properties"]["Name"] == "semif-dev-adapter-image-cpu"
    assert project["Properties"]["Source"]["Type"] == "S3"  # container/ as a CDK asset: buildspec.yml at its root
    assert project["Properties"]["TimeoutInMinutes"] > 60  # no custom resource (1 h cap) waits on it
    repositories = {r["Properties"]["RepositoryName"] for r in _resources(image, "AWS::ECR::Repository").values()}
    assert repositories == {"semif/dev/adapter", "semif/dev/adapter-build-cache"}
    # No CUDA anywhere in the environment: no GPU project, no CUDA base image, no cuda variant.
    for name, template in stacks.items():
        text = json.dumps(template)
        assert "server-sagemaker-cuda" not in text and '"cuda"' not in text and "image-gpu" not in text, name


def test_the_model_runs_the_digest_the_command_built_from_the_environments_own_repository(dev_assembly):
    stacks = templates(dev_assembly[1])
    images = {_rendered(r["Properties"]["PrimaryContainer"]["Image"])
              for r in _resources(stacks["semif-dev-decision"], "AWS::SageMaker::Model").values()}
    assert images == {f"111111111111.dkr.ecr.us-east-1.amazonaws.com/semif/dev/adapter@{CPU_DIGEST}"}
    # The image stack deploys before the decision stack, so the repository exists when CreateModel pulls.
    (decision,) = [s for s in dev_assembly[1].stacks if s.stack_name == "semif-dev-decision"]
    assert "SemIf-dev-Image" in [d.id for d in decision.dependencies]
    # The execution role pulls from that repository only.
    pulls = [s for p in _resources(stacks["semif-dev-decision"], "AWS::IAM::Policy").values()
             for s in p["Properties"]["PolicyDocument"]["Statement"] if "ecr:BatchGetImage" in s["Action"]]
    assert pulls and {json.dumps(s["Resource"]) for s in pulls} == {
        '"arn:aws:ecr:us-east-1:111111111111:repository/semif/dev/adapter"'}


def test_a_failed_first_create_leaves_no_repository_or_key_that_blocks_the_retry(dev_assembly, prod_assembly):
    """CloudFormation deletes what a failed create made unless a resource says RETAIN; a retained repository keeps
    its name, and the retry fails with 'already exists'. Prod keeps its repository on update and delete, but not
    after a failed create (RetainExceptOnCreate)."""
    for assembly, policy in ((dev_assembly, "Delete"), (prod_assembly, "RetainExceptOnCreate")):
        image = templates(assembly[1])[f"semif-{'dev' if policy == 'Delete' else 'prod'}-image"]
        for kind in ("AWS::ECR::Repository", "AWS::KMS::Key"):
            for key, resource in _resources(image, kind).items():
                assert resource["DeletionPolicy"] in (policy, "Delete"), key
        (repository,) = [r for r in _resources(image, "AWS::ECR::Repository").values()
                         if not r["Properties"]["RepositoryName"].endswith("-build-cache")]
        assert repository["DeletionPolicy"] == policy
        if policy == "Delete":  # a dev teardown removes the images with the repository
            assert repository["Properties"]["EmptyOnDelete"] is True


def test_a_gpu_environment_builds_its_cuda_image_on_2xlarge_without_a_local_cache_and_a_cpu_image_for_batch(prod_assembly):
    image = templates(prod_assembly[1])["semif-prod-image"]
    projects = {p["Properties"]["Name"]: p for p in _resources(image, "AWS::CodeBuild::Project").values()}
    assert sorted(projects) == ["semif-prod-adapter-image-cpu", "semif-prod-adapter-image-gpu"]
    gpu = projects["semif-prod-adapter-image-gpu"]["Properties"]
    variables = {v["Name"]: v["Value"] for v in gpu["Environment"]["EnvironmentVariables"]}
    assert variables["LLAMA_CPP_VARIANT"] == "cuda"
    assert gpu["Environment"]["ComputeType"] == "BUILD_GENERAL1_2XLARGE"
    assert gpu.get("Cache", {"Type": "NO_CACHE"})["Type"] == "NO_CACHE"
    cpu = projects["semif-prod-adapter-image-cpu"]["Properties"]
    assert {v["Name"]: v["Value"] for v in cpu["Environment"]["EnvironmentVariables"]}["LLAMA_CPP_VARIANT"] == "cpu"
    # Each project logs to a group the stack owns, with the environment's retention.
    groups = {g["Properties"]["LogGroupName"]: g for g in _resources(image, "AWS::Logs::LogGroup").values()}
    assert sorted(groups) == ["/aws/codebuild/semif-prod-adapter-image-cpu", "/aws/codebuild/semif-prod-adapter-image-gpu"]
    assert {g["Properties"]["RetentionInDays"] for g in groups.values()} == {365}


def test_batch_transform_runs_the_cpu_image_on_a_cpu_instance_on_a_gpu_environment(prod_assembly, dev_assembly):
    """Batch Transform's GPU hosts offer drivers 470 and 535 only, which cannot run the CUDA 13 image."""
    decision = templates(prod_assembly[1])["semif-prod-decision"]
    models = {k: r["Properties"] for k, r in _resources(decision, "AWS::SageMaker::Model").items()}
    (batch,) = [m for k, m in models.items() if k.startswith("Batch")]
    (endpoint,) = [m for k, m in models.items() if not k.startswith("Batch")]
    assert _rendered(batch["PrimaryContainer"]["Image"]).endswith(f"semif/prod/adapter@{CPU_DIGEST}")
    assert _rendered(endpoint["PrimaryContainer"]["Image"]).endswith(f"semif/prod/adapter@{GPU_DIGEST}")
    environment = batch["PrimaryContainer"]["Environment"]
    assert environment["SEMIF_N_GPU_LAYERS"] == "0" and environment["SEMIF_IMAGE_DIGEST"] == CPU_DIGEST
    assert "SEMIF_REQUIRE_GPU" not in environment
    assert endpoint["PrimaryContainer"]["Environment"]["SEMIF_REQUIRE_GPU"] == "1"
    (instance_type,) = [r["Properties"]["Value"] for r in _resources(decision, "AWS::SSM::Parameter").values()
                        if r["Properties"]["Name"] == "/semif/prod/decision/batch-instance-type"]
    assert instance_type == "ml.c6i.xlarge"
    # A CPU environment's batch Model is its endpoint's image.
    dev = templates(dev_assembly[1])["semif-dev-decision"]
    images = {_rendered(r["Properties"]["PrimaryContainer"]["Image"]) for r in _resources(dev, "AWS::SageMaker::Model").values()}
    assert len(images) == 1


def test_the_looked_up_dlc_digest_reaches_the_build_and_the_chat_endpoint(tmp_path):
    _, assembly = synth_real_app(tmp_path, env="dev", **IMAGE_DIGESTS, **{"dlc-image-cpu": DLC})
    stacks = templates(assembly)
    (project,) = _resources(stacks["semif-dev-image"], "AWS::CodeBuild::Project").values()
    variables = {v["Name"]: v["Value"] for v in project["Properties"]["Environment"]["EnvironmentVariables"]}
    assert variables["BASE_IMAGE"] == f"763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@{DLC}"
    (chat,) = _resources(stacks["semif-dev-text"], "AWS::SageMaker::Model").values()
    assert _rendered(chat["Properties"]["PrimaryContainer"]["Image"]).endswith(f"llama-cpp@{DLC}")
    assert "Rules" not in stacks["semif-dev-text"] or all(
        k == "CheckBootstrapVersion" for k in stacks["semif-dev-text"]["Rules"])


def test_a_malformed_dlc_digest_or_one_that_contradicts_the_pin_fails_synth_naming_it(tmp_path):
    from config import ConfigError

    with pytest.raises(ConfigError, match="-c dlc-image-cpu: 'latest' is not a digest"):
        synth_real_app(tmp_path / "a", env="dev", **IMAGE_DIGESTS, **{"dlc-image-cpu": "latest"})
    config = json.loads((REPO / "config" / "environments.json").read_text())
    config["dlc_images"]["cpu"] = "sha256:" + "ab" * 32
    path = tmp_path / "environments.json"
    path.write_text(json.dumps(config))
    from aws_cdk import App

    import app as semif_app
    from cdk_testing import cdk_json_context

    with pytest.raises(ConfigError, match="differs from dlc_images.cpu"):
        semif_app.build_app(App(outdir=str(tmp_path / "b"), context={**cdk_json_context(), "env": "dev", **IMAGE_DIGESTS,
                                                                     "dlc-image-cpu": DLC}), config_path=path)


def test_a_pipeline_whose_stages_all_run_cpu_builds_no_cuda_image(tmp_path):
    from aws_cdk import App

    import app as semif_app
    from cdk_testing import cdk_json_context
    from stacks.pipeline_stack import PipelineStack

    config = json.loads((REPO / "config" / "environments.json").read_text())
    config["pipeline"].update(stages=["dev"], approval_before=[], bake_before={})
    path = tmp_path / "environments.json"
    path.write_text(json.dumps(config))
    images = tmp_path / "adapter-images" / "cpu"
    images.mkdir(parents=True)
    (images / "image.json").write_text(json.dumps({"imageDigest": CPU_DIGEST, "imageTag": "t" * 40}))
    cdk_app = semif_app.build_app(App(outdir=str(tmp_path / "out"), context={
        **cdk_json_context(), "pipeline": "true", "adapter-images-dir": str(images.parent)}), config_path=path)
    (stack,) = [c for c in cdk_app.node.children if isinstance(c, PipelineStack)]
    assert sorted(stack.image_steps) == ["cpu"]
    text = json.dumps(Template.from_stack(stack).to_json())
    assert "server-sagemaker-cuda" not in text and "semif-adapter-image-gpu" not in text


def test_checkov_finds_no_failed_check_in_the_image_stack(dev_assembly, prod_assembly):
    from test_checkov import CHECKOV

    failed = []
    for assembly, name in ((dev_assembly, "semif-dev-image"), (prod_assembly, "semif-prod-image")):
        (stack,) = [s for s in assembly[1].stacks if s.stack_name == name]
        result = subprocess.run(
            [str(CHECKOV), "-f", stack.template_full_path, "--framework", "cloudformation", "--output", "json",
             "--compact", "--skip-download"], capture_output=True, text=True, timeout=600,
            env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "BC_SKIP_MAPPING": "TRUE",
                 "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"})
        assert result.returncode in (0, 1), result.stderr[-3000:]
        report = json.loads(result.stdout)
        for r in report if isinstance(report, list) else [report]:
            failed += [f"{f['check_id']} {f['resource']} ({name}): {f['check_name']}" for f in r["results"]["failed_checks"]]
            assert r["results"]["passed_checks"], name
    assert failed == []


def _one_account_config(tmp_path) -> Path:
    config = json.loads((REPO / "config" / "environments.json").read_text())
    config["pipeline"] = None
    for env in config["environments"].values():
        env["release_checks"] = None
    path = tmp_path / "environments.json"
    path.write_text(json.dumps(config))
    return path


def test_without_a_pipeline_an_environment_trusts_no_other_account_and_the_pipeline_cannot_synth(tmp_path):
    from aws_cdk import App

    import app as semif_app
    from cdk_testing import cdk_json_context
    from config import ConfigError

    path = _one_account_config(tmp_path)
    cdk_app = semif_app.build_app(App(outdir=str(tmp_path / "out"), context={**cdk_json_context(), "env": "dev",
                                                                           **IMAGE_DIGESTS}), config_path=path)
    stacks = templates(cdk_app.synth())
    shared = stacks["semif-dev-shared"]
    assert not [r for r in _resources(shared, "AWS::IAM::Role").values()
                if "pipeline-check" in r["Properties"].get("RoleName", "")]
    assert "333333333333" not in json.dumps(stacks)
    with pytest.raises(ConfigError, match="pipeline: null.*make deploy"):
        semif_app.build_app(App(outdir=str(tmp_path / "p"), context={**cdk_json_context(), "pipeline": "true"}),
                            config_path=path)


def test_every_cdk_command_of_the_deploy_guide_synthesizes_with_the_contexts_it_passes(tmp_path):
    """`cdk deploy` synthesizes the whole app whatever stacks it names: each command line the guide gives must carry
    every digest synth needs (the CPU digest too on a GPU environment, for its Batch Transform image)."""
    import re
    import shlex

    guide = (REPO / "docs" / "how-to" / "deploy-first-environment.md").read_text()
    zero = "sha256:" + "0" * 64
    lines = [line for line in guide.splitlines() if re.match(r"\s*npx cdk (deploy|synth)\b", line)]
    assert len(lines) >= 4
    for number, line in enumerate(lines):
        words = shlex.split(line.replace("$ZERO", zero))
        contexts = dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "-c")
        if contexts.get("pipeline") == "true":
            images = tmp_path / f"images-{number}"
            for variant in ("cpu", "gpu"):
                (images / variant).mkdir(parents=True)
                (images / variant / "image.json").write_text(json.dumps({
                    "imageDigest": contexts[f"adapter-image-{variant}"], "imageTag": "t" * 40}))
            contexts = {"pipeline": "true", "adapter-images-dir": str(images)}
        synth_real_app(tmp_path / str(number), **contexts)  # raises on a missing digest
