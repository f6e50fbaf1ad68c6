"""Settings that are wrong fail at synth, with a message that says what to fix."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from config import ConfigError, load_settings
from constructs_lib.chat_endpoint import llama_cpp_environment
from constructs_lib.endpoint_compute import EndpointCompute, InstancePool
from constructs_lib.image_sources import dlc_image_uri

BASE = dict(min_instances=1, max_instances=2, target_concurrency=4.0, model_download_timeout_s=600,
            startup_health_check_timeout_s=600)
POOLS = [InstancePool(instance_type="ml.g6e.xlarge", priority=1),
         InstancePool(instance_type="ml.g6.xlarge", priority=2)]


def test_pools_and_a_fixed_instance_type_are_mutually_exclusive():
    with pytest.raises(ValueError, match="either instance_type or instance_pools, never both"):
        EndpointCompute(instance_type="ml.g5.xlarge", instance_pools=POOLS, **BASE)


def test_one_of_instance_type_or_pools_is_required():
    with pytest.raises(ValueError, match="set instance_type or instance_pools"):
        EndpointCompute(**BASE)


def test_more_than_five_pools_are_refused():
    pools = [InstancePool(instance_type=f"ml.g{n}.xlarge", priority=n) for n in range(1, 7)]
    with pytest.raises(ValueError, match="1 to 5 pools, got 6"):
        EndpointCompute(instance_pools=pools, **BASE)


def test_duplicate_pool_priorities_are_refused():
    with pytest.raises(ValueError, match="priorities must be unique"):
        EndpointCompute(instance_pools=[InstancePool(instance_type="ml.g6.xlarge", priority=1),
                                        InstancePool(instance_type="ml.g5.xlarge", priority=1)], **BASE)


@pytest.mark.parametrize("priority", [0, 6])
def test_pool_priorities_outside_one_to_five_are_refused(priority):
    with pytest.raises(ValueError, match="priorities must be 1 to 5"):
        EndpointCompute(instance_pools=[InstancePool(instance_type="ml.g6.xlarge", priority=priority)], **BASE)


def test_provision_timeout_needs_pools():
    with pytest.raises(ValueError, match="provision_timeout_s applies to instance_pools only"):
        EndpointCompute(instance_type="ml.c6i.xlarge", provision_timeout_s=600, **BASE)


def test_startup_health_check_below_the_dlc_minimum_is_refused():
    with pytest.raises(ValueError, match="startup_health_check_timeout_s must be 600"):
        EndpointCompute(instance_type="ml.c6i.xlarge", **{**BASE, "startup_health_check_timeout_s": 300})


def test_instance_type_must_be_a_sagemaker_type():
    with pytest.raises(ValueError, match="not a SageMaker instance type"):
        EndpointCompute(instance_type="g5.xlarge", **BASE)


def test_volume_key_only_where_sagemaker_accepts_it():
    assert EndpointCompute(instance_type="ml.c6i.8xlarge", **BASE).supports_volume_kms_key
    assert not EndpointCompute(instance_type="ml.c6id.8xlarge", **BASE).supports_volume_kms_key
    assert not EndpointCompute(instance_pools=POOLS, **BASE).supports_volume_kms_key


def test_llama_cpp_options_become_sm_llama_cpp_variables():
    assert llama_cpp_environment({"ctx_size": 4096, "n_gpu_layers": 999, "threads": 8, "batch_size": 512,
                                  "parallel": 1, "jinja": True, "no_mmap": False, "temp": 0}) == {
        "SM_LLAMA_CPP_CTX_SIZE": "4096", "SM_LLAMA_CPP_N_GPU_LAYERS": "999", "SM_LLAMA_CPP_THREADS": "8",
        "SM_LLAMA_CPP_BATCH_SIZE": "512", "SM_LLAMA_CPP_PARALLEL": "1", "SM_LLAMA_CPP_JINJA": "true",
        "SM_LLAMA_CPP_TEMP": "0",
    }


def test_unknown_llama_cpp_option_is_refused():
    with pytest.raises(ValueError, match="unknown llama-server option.*ctx_sise"):
        llama_cpp_environment({"ctx_sise": 4096, "n_gpu_layers": 0, "threads": 8, "batch_size": 512, "parallel": 1})


def test_llama_cpp_options_the_dlc_does_not_default_are_required():
    with pytest.raises(ValueError, match="missing required option.*threads"):
        llama_cpp_environment({"ctx_size": 4096, "n_gpu_layers": 0, "batch_size": 512, "parallel": 1})


def test_mistyped_llama_cpp_option_is_refused():
    with pytest.raises(ValueError, match="llama_cpp.ctx_size: expected int"):
        llama_cpp_environment({"ctx_size": "4k", "n_gpu_layers": 0, "threads": 8, "batch_size": 512, "parallel": 1})


def test_dlc_image_uri_uses_the_regional_registry_account():
    assert dlc_image_uri("eu-west-1", "cpu") == (
        "763104351884.dkr.ecr.eu-west-1.amazonaws.com/llama-cpp:server-sagemaker-cpu-v1")
    assert dlc_image_uri("us-east-1", "gpu", "sha256:" + "a" * 64) == (
        "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@sha256:" + "a" * 64)
    with pytest.raises(ValueError, match="sha256:<64 hex>"):
        dlc_image_uri("us-east-1", "gpu", "sha256:short")
    assert dlc_image_uri("ap-east-1", "gpu").startswith("871362719292.dkr.ecr.ap-east-1.")
    with pytest.raises(ValueError, match="no AWS Deep Learning Container registry account known for region"):
        dlc_image_uri("xx-nowhere-1", "cpu")


# ---- the environments file ----

@pytest.fixture
def raw_config():
    from config import CONFIG_PATH

    return json.loads(CONFIG_PATH.read_text())


def _load(tmp_path, raw):
    path = tmp_path / "environments.json"
    path.write_text(json.dumps(raw))
    return load_settings(path)


def test_shipped_config_defines_dev_and_prod():
    settings = load_settings()
    assert {"dev", "prod"} <= set(settings.environments)
    prod = settings.environment("prod")
    assert prod.variant == "gpu"
    assert [(p.instance_type, p.priority) for p in prod.decision.instance_pools] == [
        ("ml.g6e.xlarge", 1), ("ml.g6.xlarge", 2), ("ml.g5.xlarge", 3), ("ml.g4dn.xlarge", 4)]
    assert settings.environment("dev").decision.instance_type == "ml.c6i.xlarge"


def test_unknown_environment_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown environment 'qa'; config/environments.json defines: dev, prod"):
        load_settings().environment("qa")


def test_unknown_key_in_config_is_refused(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["environments"]["dev"]["decision"]["adapter"]["max_queu"] = 3
    with pytest.raises(ConfigError, match=r"environments.dev.decision.adapter: unknown key\(s\) max_queu"):
        _load(tmp_path, raw)


def test_missing_key_in_config_is_refused(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    del raw["environments"]["prod"]["decision"]["alarms"]["model_latency_p95_ms"]
    with pytest.raises(ConfigError, match=r"environments.prod.decision.alarms: missing key\(s\) model_latency_p95_ms"):
        _load(tmp_path, raw)


def test_wrong_type_in_config_is_refused(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["environments"]["dev"]["decision"]["min_instances"] = "1"
    with pytest.raises(ConfigError, match="environments.dev.decision.min_instances: expected an integer"):
        _load(tmp_path, raw)


def test_bad_variant_account_and_endpoint_name_are_refused(tmp_path, raw_config):
    for path, value, message in [
        (("variant",), "tpu", "'tpu' is not one of cpu, gpu"),
        (("account",), "12345", "not a 12-digit account id"),
        (("decision", "endpoint_name"), "Semif_Dev", "must be lowercase letters, digits and '-'"),
        (("model_prefix",), "weights/x/", "must be 'models/<name>/<version>/'"),
    ]:
        raw = copy.deepcopy(raw_config)
        node = raw["environments"]["dev"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(ConfigError, match=message):
            _load(tmp_path, raw)


def test_pipeline_stage_must_be_a_defined_environment(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["pipeline"]["stages"] = ["dev", "qa"]
    with pytest.raises(ConfigError, match="pipeline: stage 'qa' is not a defined environment"):
        _load(tmp_path, raw)


def test_a_pipeline_stage_outside_the_pipelines_region_is_refused(tmp_path, raw_config):
    """SageMaker pulls a model's image only from the model's own region; the pipeline pushes to its own."""
    raw = copy.deepcopy(raw_config)
    raw["environments"]["prod"]["region"] = "eu-west-1"
    with pytest.raises(ConfigError, match=r"environments\.prod\.region: 'eu-west-1' is outside the pipeline's region "
                                          r"'us-east-1'"):
        _load(tmp_path, raw)
    # Outside the pipeline, an environment may live in any region: it builds its image in its own account and region.
    raw["pipeline"] = None
    for env in raw["environments"].values():
        env["release_checks"] = None
    assert _load(tmp_path, raw).environments["prod"].region == "eu-west-1"


def test_adapter_settings_render_the_semif_contract():
    environment = load_settings().environment("dev").decision.adapter.to_environment()
    documented = {"SEMIF_N_CTX", "SEMIF_N_BATCH", "SEMIF_N_THREADS", "SEMIF_N_GPU_LAYERS", "SEMIF_SCORING",
                  "SEMIF_PREFIX_CACHE", "SEMIF_MAX_QUEUE", "SEMIF_QUEUE_TIMEOUT_S", "SEMIF_RETRY_AFTER_S",
                  "SEMIF_MAX_OPTIONS", "SEMIF_MAX_QUESTIONS", "SEMIF_MAX_BODY_BYTES", "SEMIF_LOG_LEVEL"}
    assert set(environment) == documented


def test_every_rendered_variable_is_in_the_configuration_doc():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md").read_text()
    for name in load_settings().environment("prod").decision.adapter.to_environment():
        assert f"`{name}`" in doc, name
    assert "`SEMIF_IMAGE_DIGEST`" in doc


# ---- properties ----

_GPU_TYPES = ["ml.g6e.xlarge", "ml.g6.xlarge", "ml.g5.xlarge", "ml.g4dn.xlarge", "ml.g6e.2xlarge"]


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(1, 6)), st.integers(min_value=1, max_value=5))
def test_valid_pools_come_out_in_priority_order_whatever_order_they_go_in(priorities, count):
    pools = [InstancePool(instance_type=t, priority=p) for t, p in zip(_GPU_TYPES[:count], priorities[:count])]
    compute = EndpointCompute(instance_pools=pools, provision_timeout_s=600, **BASE)
    ordered = [p.priority for p in compute.pools_by_priority]
    assert ordered == sorted(p.priority for p in pools)
    assert set(compute.instance_types) == {p.instance_type for p in pools}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-2, max_value=8), min_size=0, max_size=7))
def test_any_pool_list_is_either_valid_or_refused_with_a_reason(priorities):
    pools = [InstancePool(instance_type=f"ml.g{i + 4}.xlarge", priority=p) for i, p in enumerate(priorities)]
    valid = (1 <= len(pools) <= 5 and len(set(priorities)) == len(priorities)
             and all(1 <= p <= 5 for p in priorities))
    if valid:
        assert len(EndpointCompute(instance_pools=pools, **BASE).pools_by_priority) == len(pools)
    else:
        with pytest.raises(ValueError, match="invalid endpoint compute: "):
            EndpointCompute(instance_pools=pools, **BASE)


# ---- deploy-safety checks on the environments file ----


def _edit(raw_config, env, path, value):
    raw = copy.deepcopy(raw_config)
    node = raw["environments"][env]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return raw


def test_no_environment_may_pin_a_context_too_small_for_system_ones_255_option_standard(tmp_path, raw_config):
    for name in load_settings().environments:
        assert load_settings().environment(name).decision.adapter.n_ctx >= 8192, name
    with pytest.raises(ConfigError, match=r"environments.dev.decision.adapter.n_ctx: 4096 is below 8192"):
        _load(tmp_path, _edit(raw_config, "dev", ("decision", "adapter", "n_ctx"), 4096))


@pytest.mark.parametrize("env,path,value,message", [
    ("prod", ("decision", "instance_pools"), [{"instance_type": "ml.c6i.xlarge", "priority": 1}],
     "ml.c6i.xlarge has no GPU, but variant is 'gpu'"),
    ("dev", ("decision", "instance_type"), "ml.g5.xlarge", "ml.g5.xlarge is a GPU instance, but variant is 'cpu'"),
    ("dev", ("decision", "instance_type"), "ml.c7g.xlarge", "arm64 \\(Graviton\\) instance"),
    ("dev", ("text", "instance_type"), "ml.inf2.xlarge", "no NVIDIA GPU or x86 CPU"),
    ("prod", ("text", "instance_type"), "ml.p3.2xlarge", "not a family al2023-ami-sagemaker-inference-gpu-4-1 supports"),
])
def test_instance_families_must_match_the_variant_the_architecture_and_the_host_ami(tmp_path, raw_config, env, path,
                                                                                   value, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, _edit(raw_config, env, path, value))


def test_gpu_variants_need_a_host_ami_whose_driver_runs_cuda_13(tmp_path, raw_config):
    with pytest.raises(ConfigError, match="environments.prod.inference_ami_version: a GPU variant needs one of "
                                          "al2023-ami-sagemaker-inference-gpu-4-1"):
        _load(tmp_path, _edit(raw_config, "prod", ("inference_ami_version",), "al2-ami-sagemaker-inference-gpu-2"))
    with pytest.raises(ConfigError, match="only GPU variants set a host AMI"):
        _load(tmp_path, _edit(raw_config, "dev", ("inference_ami_version",), "al2023-ami-sagemaker-inference-gpu-4-1"))


@pytest.mark.parametrize("value", [120, 7200])
def test_provisioning_timeout_outside_sagemakers_range_is_refused(tmp_path, raw_config, value):
    with pytest.raises(ConfigError, match=f"variant_instance_provision_timeout_s: {value} is outside 300-3600"):
        _load(tmp_path, _edit(raw_config, "prod", ("decision", "variant_instance_provision_timeout_s"), value))


def test_prod_needs_an_alarm_subscription_or_an_explicit_opt_out(tmp_path, raw_config):
    raw = _edit(raw_config, "prod", ("alarm_email",), None)
    with pytest.raises(ConfigError, match="environments.prod.alarm_email: a prod environment needs an alarm subscription"):
        _load(tmp_path, raw)
    raw["environments"]["prod"]["alarm_opt_out_reason"] = "paged through the org-wide CloudWatch→PagerDuty bridge"
    assert _load(tmp_path, raw).environment("prod").alarm_email is None
    with pytest.raises(ConfigError, match="not an email address"):
        _load(tmp_path, _edit(raw_config, "prod", ("alarm_email",), "oncall"))


def test_a_latency_alarm_at_or_above_invoke_endpoints_60_s_limit_is_refused(tmp_path, raw_config):
    """No request's ModelLatency reaches InvokeEndpoint's 60 s: an alarm at 60 s or more would never fire."""
    for name in load_settings().environments:
        env = load_settings().environment(name)
        for endpoint in (env.decision, env.text):
            assert endpoint is None or endpoint.alarms.model_latency_p95_ms < 60000, name
    with pytest.raises(ConfigError, match=r"environments.prod.text.alarms.model_latency_p95_ms: 60000 can never fire: "
                                          r"SageMaker ends an invocation at 60 s"):
        _load(tmp_path, _edit(raw_config, "prod", ("text", "alarms", "model_latency_p95_ms"), 60000))
    with pytest.raises(ConfigError, match=r"environments.dev.decision.alarms.model_latency_p95_ms: 90000 can never"):
        _load(tmp_path, _edit(raw_config, "dev", ("decision", "alarms", "model_latency_p95_ms"), 90000))
    assert _load(tmp_path, _edit(raw_config, "prod", ("text", "alarms", "model_latency_p95_ms"), 59999))


def test_chat_client_role_must_name_roles_not_accounts(tmp_path, raw_config):
    with pytest.raises(ConfigError, match=r"client_role_arns\[0\]: '111111111111' is not an IAM role ARN"):
        _load(tmp_path, _edit(raw_config, "dev", ("text", "client_role_arns"), ["111111111111"]))
    with pytest.raises(ConfigError, match="name at least one role"):
        _load(tmp_path, _edit(raw_config, "dev", ("text", "client_role_arns"), []))


def test_prod_needs_an_earlier_stage_that_runs_the_same_image_variant(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["pipeline"]["stages"] = ["dev", "prod"]
    raw["pipeline"]["bake_before"] = {}
    with pytest.raises(ConfigError, match="'prod' runs the gpu image, but no earlier stage does"):
        _load(tmp_path, raw)


def test_a_bake_must_name_a_stage_that_runs_before_its_target(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["pipeline"]["bake_before"] = {"staging": "prod"}
    with pytest.raises(ConfigError, match="'prod' must be a stage that runs before 'staging'"):
        _load(tmp_path, raw)


def test_the_repository_keeps_at_least_the_running_image_and_the_one_before(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["pipeline"]["image_keep_last"] = 1
    with pytest.raises(ConfigError, match="pipeline.image_keep_last: keep at least 2"):
        _load(tmp_path, raw)


def test_dlc_images_are_pinned_by_digest(tmp_path, raw_config):
    raw = copy.deepcopy(raw_config)
    raw["dlc_images"]["gpu"] = "server-sagemaker-cuda-v1"
    with pytest.raises(ConfigError, match="dlc_images.gpu: 'server-sagemaker-cuda-v1' is not a 'sha256:<64 hex>'"):
        _load(tmp_path, raw)


DEPLOY_DOC = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "deploy-first-environment.md"
PIPELINE_DOC = Path(__file__).resolve().parents[2] / "docs" / "explanation" / "pipeline.md"


def test_monthly_minimum_cost_table_in_the_deploy_doc_matches_the_config():
    from config.pricing import PRICES_AS_OF, monthly_cost_table

    doc = DEPLOY_DOC.read_text()
    table = monthly_cost_table(load_settings())
    assert table in doc, "the deploy guide's cost table is stale; paste the table `cdk synth` prints"
    assert PRICES_AS_OF in doc
    # Dev is sized to its 135M model: two small CPU instances, well under a GPU instance's month.
    dev_total = float(table.split("| dev | **total** | | | **")[1].split("**")[0].replace(",", ""))
    assert dev_total < 300




def _bash_blocks(doc: str) -> list[str]:
    return [block.split("\n", 1)[1] for block in doc.split("```bash")[1:] for block in [block.split("```")[0]]]


def test_the_deploy_doc_leads_with_the_one_account_path_then_the_pipeline_step_by_step():
    doc = DEPLOY_DOC.read_text()
    headings = [line for line in doc.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## One environment from one account", "## The release pipeline across accounts"]
    one_account = doc.split("## One environment from one account")[1].split("\n## ")[0]
    for needed in ("make deploy-setup", "make deploy ENV=dev", "make smoke ENV=dev", "make destroy ENV=dev",
                   '"text": null', "USD/hour", "no deploy of these stacks has run on AWS"):
        assert needed in doc.split("## The release pipeline across accounts")[0], needed
    assert "invoke-endpoint" in one_account
    tutorial = doc.split("## The release pipeline across accounts")[1].split("\n## ")[0]
    steps = [line for line in tutorial.splitlines() if line.startswith("### ")]
    assert [s.split(".")[0] for s in steps] == [f"### {n}" for n in range(1, 11)]
    for needed in ("batch-get-image", "cdk bootstrap", "codeconnections create-connection", "SemIf-prod-Shared",
                   "semif-package-model upload", "SemIf-Pipeline", "put-approval-result", "invoke-endpoint"):
        assert needed in tutorial, needed


def test_every_shell_block_of_the_deploy_doc_parses_and_names_real_stacks():
    doc = DEPLOY_DOC.read_text()
    blocks = _bash_blocks(doc)
    assert len(blocks) >= 12
    for block in blocks:
        result = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert result.returncode == 0, (block, result.stderr)
    stacks = {"SemIf-Pipeline"} | {f"SemIf-{env}-{kind}" for env in ("dev", "staging", "prod")
                                   for kind in ("Shared", "Decision", "Text", "Image")}
    deployed = re.findall(r"npx cdk deploy [^\n]*?(SemIf-[\w-]+)", doc)
    assert deployed and set(deployed) <= stacks, deployed


def test_the_deploy_doc_looks_the_dlc_digests_up_as_the_refusals_do():
    from constructs_lib.image_sources import dlc_digest_lookup

    doc = " ".join(DEPLOY_DOC.read_text().split())
    for variant in ("cpu", "gpu"):
        essential = dlc_digest_lookup("us-east-1", variant).split("--registry-id")[1]
        assert f"--registry-id{essential}" in doc, variant


def test_the_deploy_doc_says_what_to_do_for_each_failure_in_the_order_a_release_meets_them():
    doc = DEPLOY_DOC.read_text()
    section = doc.split("## When the first release fails")[1].split("\n## ")[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `") or
            line.startswith("| Source")]
    order = ["Source", "`Image-<variant>`", "`Synth`", "`PreDeploy-<env>`", "`semif-<env>-shared`",
             "`CheckModel-<env>`", "`semif-<env>-decision`", "`semif-<env>-text`", "`Smoke-<env>`",
             "`Gate-staging`", "`LoadCheck-staging`", "`Bake-staging-before-prod`", "`PromoteBaseline-prod`"]
    assert [r for i, r in enumerate(rows) if i == 0 or rows[i - 1] != r] == order
    assert "--retry-mode ALL_ACTIONS" in section and "ChangeSet does not exist" in section


def test_the_pipeline_doc_says_what_has_not_met_aws_yet():
    doc = PIPELINE_DOC.read_text()
    unverified = doc.split("## What has not met AWS yet")[1]
    assert "The image build itself is unverified until its first CodeBuild run" in unverified
    assert "autoscaling_enabled: false" in doc  # the instance-type change procedure


def test_the_deploy_doc_checks_quotas_a_fresh_account_has_and_lets_app_roles_assume_the_chat_client_role():
    """ListServiceQuotas lists only applied values (nothing in a fresh account); every CodeBuild compute type the
    pipeline runs at once needs its own concurrent-build quota; a trust policy naming an account needs the app role's
    own identity policy too."""
    from aws_cdk import aws_codebuild as codebuild

    from constructs_lib.image_build import default_build_specs

    doc = " ".join(DEPLOY_DOC.read_text().split())
    assert "list-aws-default-service-quotas" in doc and "--service-code sagemaker" in doc
    types = {s.compute_type for s in default_build_specs(cpu_base_image="c", gpu_base_image="g")}
    names = {codebuild.ComputeType.X2_LARGE: "Linux/2XLarge", codebuild.ComputeType.LARGE: "Linux/Large"}
    quota_section = doc.split("### 6. GPU quotas")[1].split("### 7.")[0]
    for name in [names[t] for t in types] + ["Linux/Small"]:  # Small: CDK Pipelines' default for every other step
        assert name in quota_section, name
    assert "aws iam put-role-policy" in doc and '\\"Action\\":\\"sts:AssumeRole\\"' in doc
    assert "/semif/prod/text/client-role-arn" in doc
