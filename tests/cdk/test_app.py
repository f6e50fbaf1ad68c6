"""The real app, synthesized as `cdk synth` does, with cdk-nag AwsSolutions on."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
from aws_cdk.assertions import Match, Template

from cdk_testing import CPU_DIGEST, GPU_DIGEST, IMAGE_DIGESTS, all_stacks, synth_real_app

CENTRAL_REPOSITORY = "333333333333.dkr.ecr.us-east-1.amazonaws.com/semif/adapter"
# A hand deploy (`make deploy`) pulls from the environment's own repository, built in its own account.
DEV_REPOSITORY = "111111111111.dkr.ecr.us-east-1.amazonaws.com/semif/dev/adapter"
PROD_REPOSITORY = "222222222222.dkr.ecr.us-east-1.amazonaws.com/semif/prod/adapter"


def templates(assembly) -> dict[str, dict]:
    return {s.stack_name: s.template for s in all_stacks(assembly)}


def nag_violations(assembly) -> list[str]:
    report = Path(assembly.directory) / "validation-report.json"
    if not report.exists():
        return []
    found = []
    for plugin in json.loads(report.read_text())["pluginReports"]:
        for violation in plugin["violations"]:
            for construct in violation["violatingConstructs"]:
                found.append(f"{violation['ruleName']} @ {construct['constructPath']}")
    return found


@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_real_app_synthesizes_with_cdk_nag_and_no_unacknowledged_finding(request, assembly_name):
    # Synth raises ValidationFailed on any finding; the report must be empty as well.
    _, assembly = request.getfixturevalue(assembly_name)
    assert nag_violations(assembly) == []
    report = json.loads((Path(assembly.directory) / "validation-report.json").read_text())
    assert report["pluginReports"] == [] or all(p["conclusion"] == "success" for p in report["pluginReports"])


def test_an_unacknowledged_finding_fails_synth(tmp_path):
    """The nag gate is live on the real app: one bucket without logging or SSL policy fails synth."""
    from aws_cdk import App, aws_s3 as s3

    import app as semif_app
    from cdk_testing import cdk_json_context

    cdk_app = semif_app.build_app(App(outdir=str(tmp_path), context={**cdk_json_context(), "env": "dev",
                                                                      **IMAGE_DIGESTS}))
    shared = next(c for c in cdk_app.node.children if getattr(c, "stack_name", "") == "semif-dev-shared")
    s3.Bucket(shared, "Unreviewed")
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        cdk_app.synth()
    assert any("AwsSolutions-S1 @ SemIf-dev-Shared/Unreviewed" in v for v in nag_violations_in(tmp_path))


def nag_violations_in(directory) -> list[str]:
    class _Assembly:
        pass

    assembly = _Assembly()
    assembly.directory = str(directory)
    return nag_violations(assembly)


def test_each_environment_is_four_stacks_with_fixed_names(dev_assembly, prod_assembly):
    assert sorted(templates(dev_assembly[1])) == ["semif-dev-decision", "semif-dev-image", "semif-dev-shared",
                                                  "semif-dev-text"]
    assert sorted(templates(prod_assembly[1])) == ["semif-prod-decision", "semif-prod-image", "semif-prod-shared",
                                                   "semif-prod-text"]
    for stack in prod_assembly[1].stacks:
        assert (stack.environment.account, stack.environment.region) == ("222222222222", "us-east-1")


def test_unknown_env_fails_synth_with_a_clear_message(tmp_path):
    from config import ConfigError

    with pytest.raises(ConfigError, match="unknown environment 'qa'"):
        synth_real_app(tmp_path, env="qa", **IMAGE_DIGESTS)


def test_synth_without_a_promoted_image_digest_says_how_to_get_one(tmp_path):
    from config import ConfigError

    with pytest.raises(ConfigError, match="no adapter image digest for the 'gpu' variant.*-c adapter-image-gpu="):
        synth_real_app(tmp_path, env="prod")


ZERO = "sha256:" + "0" * 64


def _rule_holds(expression) -> bool:
    """A rule assertion made of the two rule functions the app uses, evaluated as CloudFormation does."""
    ((function, arguments),) = expression.items()
    if function == "Fn::Not":
        return not _rule_holds(arguments[0])
    if function == "Fn::Equals":
        return arguments[0] == arguments[1]
    raise AssertionError(f"unexpected rule function {function}")


def _image_rules(template: dict) -> dict[str, dict]:
    return {k: r for k, r in template.get("Rules", {}).items() if k != "CheckBootstrapVersion"}


def test_a_placeholder_digest_synthesizes_but_cloudformation_refuses_to_deploy_it(tmp_path, dev_assembly):
    """CloudFormation evaluates a template's rules before it creates or updates anything (`cdk deploy` and the
    pipeline's change sets alike): a failed assertion refuses the deploy with its description."""
    _, assembly = synth_real_app(tmp_path, env="dev", **{"adapter-image-cpu": ZERO})
    stacks = templates(assembly)
    (adapter_rule,) = _image_rules(stacks["semif-dev-decision"]).values()
    (assertion,) = adapter_rule["Assertions"]
    assert _rule_holds(assertion["Assert"]) is False
    assert "adapter image is the all-zero placeholder" in assertion["AssertDescription"]
    assert "`make deploy ENV=dev`, which builds the image and deploys its digest" in assertion["AssertDescription"]
    # The example config's DLC pins are placeholders too: the chat stack refuses, naming the DLC's look-up.
    (dlc_rule,) = _image_rules(stacks["semif-dev-text"]).values()
    (assertion,) = dlc_rule["Assertions"]
    assert _rule_holds(assertion["Assert"]) is False
    assert ("aws ecr batch-get-image --region us-east-1 --registry-id 763104351884 --repository-name llama-cpp "
            "--image-ids imageTag=server-sagemaker-cpu-v1 --query 'images[0].imageId.imageDigest' --output text"
            ) in assertion["AssertDescription"]
    # A real digest: no rule, nothing refused.
    assert _image_rules(templates(dev_assembly[1])["semif-dev-decision"]) == {}


def _rendered(value) -> str:
    """An image URI as CloudFormation renders it in the aws partition (URLSuffix = amazonaws.com)."""
    if isinstance(value, str):
        return value
    separator, parts = value["Fn::Join"]
    return separator.join("amazonaws.com" if p == {"Ref": "AWS::URLSuffix"} else p for p in parts)


def _model(template: Template) -> dict:
    """The endpoint's Model (the one its EndpointConfig names; Batch Transform has a Model of its own)."""
    (config,) = template.find_resources("AWS::SageMaker::EndpointConfig").values()
    (logical_id, _) = config["Properties"]["ProductionVariants"][0]["ModelName"]["Fn::GetAtt"]
    return template.to_json()["Resources"][logical_id]["Properties"]["PrimaryContainer"]


def test_prod_decision_endpoint_uses_gpu_pools_and_the_promoted_adapter_image(prod_assembly):
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-decision"])
    template.has_resource_properties("AWS::SageMaker::EndpointConfig", {"ProductionVariants": [Match.object_like({
        "InstancePools": [{"InstanceType": "ml.g6e.xlarge", "Priority": 1},
                          {"InstanceType": "ml.g6.xlarge", "Priority": 2},
                          {"InstanceType": "ml.g5.xlarge", "Priority": 3},
                          {"InstanceType": "ml.g4dn.xlarge", "Priority": 4}],
        # One timeout for the whole variant, shared by its four pools: SageMaker's maximum.
        "VariantInstanceProvisionTimeoutInSeconds": 3600,
        "InitialInstanceCount": 2,
        "InferenceAmiVersion": "al2023-ami-sagemaker-inference-gpu-4-1",
    })]})
    container = _model(template)
    # Built once in the pipeline account; nothing is built while the stack deploys.
    assert _rendered(container["Image"]) == f"{PROD_REPOSITORY}@{GPU_DIGEST}"
    assert container["Environment"]["SEMIF_IMAGE_DIGEST"] == GPU_DIGEST
    assert container["Environment"]["SEMIF_REQUIRE_GPU"] == "1"
    assert container["Environment"]["SEMIF_N_CTX"] == "8192"
    # The one custom resource is the model check (tests/cdk/test_model_check.py), which reads S3 and builds nothing.
    assert not [r for r in template.to_json()["Resources"].values()
                if r["Type"] == "AWS::CodeBuild::Project"
                or (r["Type"].startswith("Custom::") and r["Type"] != "Custom::SemIfModelCheck")]
    models = template.find_resources("AWS::SageMaker::Model").values()
    assert len(models) == 2  # the endpoint's and Batch Transform's (docs/how-to/batch-transform.md): pinned and configured alike
    endpoint_environment = dict(container["Environment"])
    environments = []
    # The endpoint runs the GPU image; Batch Transform the CPU image on CPU (tests/cdk/test_one_account.py).
    assert sorted(_rendered(m["Properties"]["PrimaryContainer"]["Image"]) for m in models) == sorted(
        [f"{PROD_REPOSITORY}@{GPU_DIGEST}", f"{PROD_REPOSITORY}@{CPU_DIGEST}"])
    for model in models:
        environment = dict(model["Properties"]["PrimaryContainer"]["Environment"])
        if environment["SEMIF_IMAGE_DIGEST"] == CPU_DIGEST:  # the batch Model: no GPU, its own digest
            assert environment.pop("SEMIF_N_GPU_LAYERS") == "0" and "SEMIF_REQUIRE_GPU" not in environment
            environment.update(SEMIF_IMAGE_DIGEST=GPU_DIGEST, SEMIF_REQUIRE_GPU="1",
                               SEMIF_N_GPU_LAYERS=endpoint_environment["SEMIF_N_GPU_LAYERS"])
        environments.append(environment)
    # Only Batch Transform's Model runs JSON Lines under the batch limits (semif/serving/http/jsonlines.py).
    assert sorted(str(e.pop("SEMIF_BATCH_TRANSFORM", "")) for e in environments) == ["", "1"]
    assert environments == [endpoint_environment, endpoint_environment]


def test_dev_decision_endpoint_is_cpu_sized_to_its_model(dev_assembly):
    template = Template.from_json(templates(dev_assembly[1])["semif-dev-decision"])
    template.has_resource_properties("AWS::SageMaker::EndpointConfig", {
        "ProductionVariants": [Match.object_like({"InstanceType": "ml.c6i.xlarge"})],
        "KmsKeyId": Match.any_value()})
    container = _model(template)
    assert _rendered(container["Image"]) == f"{DEV_REPOSITORY}@{CPU_DIGEST}"
    assert "SEMIF_REQUIRE_GPU" not in container["Environment"]
    (config,) = template.find_resources("AWS::SageMaker::EndpointConfig").values()
    assert "InferenceAmiVersion" not in config["Properties"]["ProductionVariants"][0]


def test_dev_is_destroyed_with_its_stacks_and_prod_keeps_its_data(dev_assembly, prod_assembly):
    for assembly, env, policy in ((dev_assembly, "dev", "Delete"), (prod_assembly, "prod", "RetainExceptOnCreate")):
        for stack in ("shared", "decision", "text"):
            template = templates(assembly[1])[f"semif-{env}-{stack}"]
            kept = [r for r in template["Resources"].values()
                    if r["Type"] in ("AWS::S3::Bucket", "AWS::Logs::LogGroup", "AWS::KMS::Key")]
            assert kept, stack
            for resource in kept:
                assert resource.get("DeletionPolicy") == policy, (env, stack, resource["Type"])


@pytest.mark.parametrize("stack_name,stable,changing", [
    ("semif-prod-shared", ["model-bucket/name", "alarm-topic-arn"], ["model-prefix"]),
    ("semif-prod-decision", ["decision/endpoint-name", "decision/endpoint-arn", "decision/repository-uri"],
     ["decision/image-digest"]),
    ("semif-prod-text", ["text/endpoint-name", "text/endpoint-arn", "text/client-role-arn"], []),
])
def test_stable_outputs_are_exports_and_changing_ones_are_ssm_parameters_only(prod_assembly, stack_name, stable,
                                                                               changing):
    template = Template.from_json(templates(prod_assembly[1])[stack_name])
    for key in stable + changing:
        template.has_resource_properties("AWS::SSM::Parameter", {"Name": f"/semif/prod/{key}", "Type": "String"})
    for key in stable:
        export = f"semif-prod-{key.replace('/', '-')}"
        assert template.find_outputs("*", {"Export": {"Name": export}}), export
    outputs = json.dumps(template.find_outputs("*"))
    for key in changing:
        # Once imported, an export can never change: the next model or image would fail the deploy.
        assert key.replace("/", "-") not in outputs


def test_endpoint_name_output_is_the_configured_name(prod_assembly):
    outputs = templates(prod_assembly[1])["semif-prod-decision"]["Outputs"]
    (value,) = [o["Value"] for o in outputs.values() if o.get("Export", {}).get("Name") == "semif-prod-decision-endpoint-name"]
    assert value == "semif-prod-decision"


def test_text_path_uses_the_pinned_dlc_with_typed_llama_cpp_settings(prod_assembly):
    from config import load_settings

    digest = load_settings().dlc_images.gpu
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-text"])
    template.has_resource_properties("AWS::SageMaker::Model", {"PrimaryContainer": Match.object_like({
        "Image": f"763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@{digest}",
        "Environment": {"SM_LLAMA_CPP_CTX_SIZE": "8192", "SM_LLAMA_CPP_N_GPU_LAYERS": "999",
                        "SM_LLAMA_CPP_THREADS": "4", "SM_LLAMA_CPP_BATCH_SIZE": "1024",
                        "SM_LLAMA_CPP_PARALLEL": "2", "SM_LLAMA_CPP_JINJA": "true"},
    })})


def test_prod_chat_has_two_instances_its_own_thresholds_and_scales_on_llama_server_slots(prod_assembly):
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-text"])
    template.has_resource_properties("AWS::SageMaker::EndpointConfig", {"ProductionVariants": [Match.object_like({
        "InitialInstanceCount": 2, "InstanceType": "ml.g6.xlarge"})]})
    alarms = {a["Properties"]["AlarmName"]: a["Properties"]
              for a in template.find_resources("AWS::CloudWatch::Alarm").values()}
    assert alarms["semif-prod-chat-latency-p95"]["Threshold"] == 55000 * 1000
    (policy,) = template.find_resources("AWS::ApplicationAutoScaling::ScalingPolicy").values()
    assert policy["Properties"]["TargetTrackingScalingPolicyConfiguration"]["TargetValue"] == 2.0  # parallel=2


def test_prod_decision_scales_before_its_queue_is_full(prod_assembly):
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-decision"])
    (policy,) = template.find_resources("AWS::ApplicationAutoScaling::ScalingPolicy").values()
    tracking = policy["Properties"]["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == (
        "SageMakerVariantConcurrentRequestsPerModelHighResolution")
    assert tracking["TargetValue"] == 8.5  # half of 1 running + SEMIF_MAX_QUEUE=16 waiting


def test_chat_client_role_trusts_the_named_app_roles_only(prod_assembly):
    template = Template.from_json(templates(prod_assembly[1])["semif-prod-text"])
    (role,) = [r["Properties"] for k, r in template.find_resources("AWS::IAM::Role").items()
               if k.startswith("ChatClientRole")]
    (statement,) = role["AssumeRolePolicyDocument"]["Statement"]
    # The app role's account, narrowed to the named role by ARN: no role principal that IAM would resolve (and
    # refuse while the app role does not exist, or stop matching once it is re-created).
    assert statement["Principal"] == {"AWS": {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"},
                                                                ":iam::222222222222:root"]]}}
    assert statement["Condition"] == {"ArnEquals": {"aws:PrincipalArn": ["arn:aws:iam::222222222222:role/semif-prod-chat-app"]}}


# ---- pipeline ----

@pytest.fixture(scope="module")
def pipeline_template(pipeline_assembly):
    return templates(pipeline_assembly[1])["semif-pipeline"]


def _stages(pipeline_template) -> list[dict]:
    (pipeline,) = [r for r in pipeline_template["Resources"].values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    return pipeline["Properties"]["Stages"]


def _actions(pipeline_template, stage_name: str) -> list[dict]:
    (stage,) = [s for s in _stages(pipeline_template) if s["Name"] == stage_name]
    return sorted(stage["Actions"], key=lambda a: a["RunOrder"])


def _project(pipeline_template, action: dict) -> dict:
    name = action["Configuration"]["ProjectName"]["Ref"]
    return pipeline_template["Resources"][name]["Properties"]


def _variables(pipeline_template, action: dict) -> dict[str, str]:
    """A step's fixed environment: CDK Pipelines puts it on the step's CodeBuild project."""
    project = _project(pipeline_template, action)
    return {v["Name"]: v["Value"] for v in project["Environment"].get("EnvironmentVariables", [])}


def test_pipeline_has_one_stage_per_environment_with_gpu_staging_ahead_of_prod(pipeline_template):
    names = [s["Name"] for s in _stages(pipeline_template)]
    assert names[:2] == ["Source", "Build"]
    assert names.index("dev") < names.index("staging") < names.index("prod")


def test_each_image_variant_is_built_once_before_synth_and_without_the_custom_resource_wall(pipeline_template):
    build = _actions(pipeline_template, "Build")
    images = {a["Name"]: a for a in build if a["Name"].startswith("Image-")}
    (synth,) = [a for a in build if a["Name"] == "Synth"]
    assert sorted(images) == ["Image-cpu", "Image-gpu"]
    assert all(a["RunOrder"] < synth["RunOrder"] for a in images.values())
    # The synth reads both digests from the image steps' output artifacts.
    assert {i["Name"] for i in synth["InputArtifacts"]} >= {a["OutputArtifacts"][0]["Name"] for a in images.values()}
    gpu = _project(pipeline_template, images["Image-gpu"])
    assert gpu["Name"] == "semif-adapter-image-gpu"
    assert gpu["TimeoutInMinutes"] > 60  # no CloudFormation custom resource (1 h cap) is waiting on this build
    assert gpu["Environment"]["ComputeType"] == "BUILD_GENERAL1_2XLARGE"
    assert gpu["Environment"]["PrivilegedMode"] is True
    # CodeBuild offers no local cache on 2XLARGE: the registry cache (CACHE_REPOSITORY_URI) carries the layers.
    assert "Cache" not in gpu or gpu["Cache"] == {"Type": "NO_CACHE"}
    assert _project(pipeline_template, images["Image-cpu"])["Cache"] == {"Type": "LOCAL",
                                                                          "Modes": ["LOCAL_DOCKER_LAYER_CACHE"]}
    # CodeBuild refuses a build beyond a project's concurrent-build limit instead of queueing it; without one, a
    # second build of the same tag runs, and build-image.sh takes the image the first one pushed.
    assert "ConcurrentBuildLimit" not in gpu
    variables = {v["Name"]: v["Value"] for v in gpu["Environment"]["EnvironmentVariables"]}
    from config import load_settings

    assert variables["BASE_IMAGE"] == (
        f"763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@{load_settings().dlc_images.gpu}")
    assert variables["GB_PER_BUILD_JOB"] == "4" and variables["LLAMA_CPP_VARIANT"] == "cuda"
    assert "CACHE_REPOSITORY_URI" in variables
    assert "bash container/build-image.sh" in gpu["Source"]["BuildSpec"]


def test_one_digest_per_variant_is_promoted_to_every_stage_of_that_variant(pipeline_assembly):
    images = {}
    for name, template in templates(pipeline_assembly[1]).items():
        if name.endswith("-decision"):
            images[name] = _rendered(_model(Template.from_json(template))["Image"])
    assert images == {"semif-dev-decision": f"{CENTRAL_REPOSITORY}@{CPU_DIGEST}",
                      "semif-staging-decision": f"{CENTRAL_REPOSITORY}@{GPU_DIGEST}",
                      "semif-prod-decision": f"{CENTRAL_REPOSITORY}@{GPU_DIGEST}"}


def test_hand_and_pipeline_synths_give_the_same_environment_templates(prod_assembly, pipeline_assembly):
    """A hand `cdk deploy -c env=prod` must not delete what the pipeline needs (the check role, say)."""
    from test_cli_synth import comparable

    hand = templates(prod_assembly[1])
    piped = templates(pipeline_assembly[1])
    # The one difference: where the image comes from (the environment's own repository, or the pipeline's).
    own = {"333333333333.dkr.ecr.us-east-1.": "222222222222.dkr.ecr.us-east-1.",
           "/semif/adapter": "/semif/prod/adapter",
           "ecr:us-east-1:333333333333:repository/": "ecr:us-east-1:222222222222:repository/"}
    for name in ("semif-prod-shared", "semif-prod-decision", "semif-prod-text"):
        piped_text = json.dumps(piped[name])
        for central, local in own.items():
            piped_text = piped_text.replace(central, local)
        assert comparable(hand[name]) == comparable(json.loads(piped_text)), name


def _policy_statements(template: dict, role_name: str) -> list[dict]:
    """The statements of every inline policy attached to the role named ``role_name`` in ``template``."""
    (role_id,) = [k for k, r in template["Resources"].items()
                  if r["Type"] == "AWS::IAM::Role" and r["Properties"].get("RoleName") == role_name]
    return [s for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"
            and {"Ref": role_id} in r["Properties"]["Roles"] for s in r["Properties"]["PolicyDocument"]["Statement"]]


def _allowed(statements: list[dict], action: str) -> list:
    return [resource for s in statements if action in _as_list(s["Action"]) for resource in _as_list(s["Resource"])]


def _arn_text(value) -> str:
    """An ARN as IAM sees it in the aws partition (AWS::Partition rendered)."""
    if isinstance(value, str):
        return value
    separator, parts = value["Fn::Join"]
    return separator.join("aws" if p == {"Ref": "AWS::Partition"} else p for p in parts)


def test_prod_needs_a_manual_approval_and_a_clean_staging_bake_before_any_deploy(pipeline_template, pipeline_assembly):
    actions = _actions(pipeline_template, "prod")
    first_deploy = min(a["RunOrder"] for a in actions if a["ActionTypeId"]["Category"] == "Deploy")
    (approval,) = [a for a in actions if a["ActionTypeId"]["Category"] == "Approval"]
    assert approval["RunOrder"] < first_deploy
    # The bake is the last action of staging's own stage, not prod's: while it runs, CodePipeline lets no newer
    # execution into staging, so the endpoints it watches run the digest prod deploys next.
    assert not [a for a in actions if a["Name"].startswith("Bake-")]
    staging = _actions(pipeline_template, "staging")
    (bake,) = [a for a in staging if a["Name"].startswith("Bake-staging")]
    assert bake["RunOrder"] == max(a["RunOrder"] for a in staging)
    assert bake["RunOrder"] > max(a["RunOrder"] for a in staging if a["ActionTypeId"]["Category"] == "Deploy")
    spec = _project(pipeline_template, bake)["Source"]["BuildSpec"]
    assert _project(pipeline_template, bake)["TimeoutInMinutes"] == 30 + 15
    assert "describe-alarms --alarm-names $ALARM_NAMES" in spec and "describe-endpoint" in spec
    variables = _variables(pipeline_template, bake)
    assert variables["BAKE_SECONDS"] == "1800"
    assert variables["ENDPOINT_NAMES"] == "semif-staging-decision"
    # Every alarm of staging, by name, ...
    staging_alarms = sorted(r["Properties"]["AlarmName"] for t in templates(pipeline_assembly[1]).values()
                            for r in t["Resources"].values() if r["Type"] == "AWS::CloudWatch::Alarm"
                            and r["Properties"]["AlarmName"].startswith("semif-staging-"))
    assert sorted(variables["ALARM_NAMES"].split()) == staging_alarms and len(staging_alarms) >= 8
    # ... and staging's check role may describe each of them (the bake fails on one it cannot read).
    shared = templates(pipeline_assembly[1])["semif-staging-shared"]
    patterns = [_arn_text(r) for r in _allowed(_policy_statements(shared, "semif-staging-pipeline-check"),
                                                "cloudwatch:DescribeAlarms")]
    for name in staging_alarms:
        assert any(fnmatch.fnmatchcase(f"arn:aws:cloudwatch:us-east-1:111111111111:alarm:{name}", p)
                   for p in patterns), (name, patterns)
    assert not any(a["ActionTypeId"]["Category"] == "Approval" for a in _actions(pipeline_template, "dev"))


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_shared_stack_deploys_and_the_model_is_checked_before_any_endpoint(pipeline_template, pipeline_assembly, env):
    actions = _actions(pipeline_template, env)
    order = {a["Name"]: a["RunOrder"] for a in actions}
    (check,) = [a for a in actions if a["Name"].endswith(f"CheckModel-{env}")]
    assert order[f"semif-{env}-shared.Deploy"] < check["RunOrder"] < order[f"semif-{env}-decision.Deploy"]
    if f"semif-{env}-text.Deploy" in order:
        assert order[f"semif-{env}-decision.Deploy"] < order[f"semif-{env}-text.Deploy"]
    # The model check custom resource's own check (manifest schema, GGUF size and checksum), from the checkout.
    spec = _project(pipeline_template, check)["Source"]["BuildSpec"]
    assert ('python3 lambda/model_check/handler.py --bucket \\"$MODEL_BUCKET\\" --model-prefix \\"$MODEL_PREFIX\\" '
            '--manifest-key \\"$MANIFEST_KEY\\" --transform-tarball') in spec
    assert len(check["InputArtifacts"]) == 1
    variables = _variables(pipeline_template, check)
    assert variables["MANIFEST_KEY"] == variables["MODEL_PREFIX"] + "model-manifest.json"
    assert variables["CHECK_ROLE_ARN"].endswith(f":role/semif-{env}-pipeline-check")
    # The check role reads what the handler reads: the manifest, the prefix's GGUFs and Batch Transform's tarball
    # beside the prefix, and lists those keys.
    statements = _policy_statements(templates(pipeline_assembly[1])[f"semif-{env}-shared"],
                                    f"semif-{env}-pipeline-check")
    reads = json.dumps(_allowed(statements, "s3:GetObject"))
    tarball = variables["MODEL_PREFIX"].rstrip("/") + ".tar.gz"
    assert f"/{variables['MODEL_PREFIX']}model-manifest.json" in reads and f"/{variables['MODEL_PREFIX']}*.gguf" in reads
    assert f"/{tarball}" in reads
    (listing,) = [s for s in statements if s["Action"] == "s3:ListBucket" and variables["MODEL_PREFIX"] in json.dumps(s)]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": [f"{variables['MODEL_PREFIX']}model-manifest.json",
                                                                  f"{variables['MODEL_PREFIX']}*.gguf", tarball]}}


@pytest.mark.parametrize("env,variant", [("dev", "cpu"), ("staging", "gpu"), ("prod", "gpu")])
def test_each_stage_first_marks_its_digest_and_clears_a_failed_first_create(pipeline_template, env, variant):
    actions = _actions(pipeline_template, env)
    (pre_deploy,) = [a for a in actions if a["Name"] == f"PreDeploy-{env}"]
    deploys = [a["RunOrder"] for a in actions if a["ActionTypeId"]["Category"] == "Deploy"]
    prepares = [a["RunOrder"] for a in actions if a["Name"].endswith(".Prepare")]  # change-set creation
    assert pre_deploy["RunOrder"] < min(deploys + prepares)
    waits = [a["RunOrder"] for a in actions if a["Name"].startswith("Approve-")]
    assert all(w < pre_deploy["RunOrder"] for w in waits)  # prod: nothing is touched before approval
    # Its input is the output of the image step of its variant: the digest it deploys; a GPU stage's also the CPU
    # image step's, the image its Batch Transform runs.
    build = {a["Name"]: a for a in _actions(pipeline_template, "Build")}
    expected = build[f"Image-{variant}"]["OutputArtifacts"] + (build["Image-cpu"]["OutputArtifacts"]
                                                                if variant == "gpu" else [])
    assert sorted(a["Name"] for a in pre_deploy["InputArtifacts"]) == sorted(a["Name"] for a in expected)
    variables = _variables(pipeline_template, pre_deploy)
    stacks = [f"semif-{env}-text", f"semif-{env}-decision", f"semif-{env}-shared"]
    assert variables["STACKS"].split() == [s for s in stacks if env != "staging" or not s.endswith("-text")]
    assert variables["DEPLOYED_TAG_PREFIX"] == f"deployed-{env}-"
    account = {"dev": "111111111111", "staging": "111111111111", "prod": "222222222222"}[env]
    assert variables["DEPLOY_ROLE_ARN"] == f"arn:aws:iam::{account}:role/cdk-hnb659fds-deploy-role-{account}-us-east-1"
    statements = _policy_statements(pipeline_template, "semif-pipeline-pre-deploy")
    assert sorted(_allowed(statements, "sts:AssumeRole")) == [
        f"arn:aws:iam::{a}:role/cdk-hnb659fds-deploy-role-{a}-us-east-1" for a in ("111111111111", "222222222222")]
    assert len(_allowed(statements, "ecr:PutImage")) == 1
    # The check steps' role may not assume the deploy roles.
    assert not [r for r in _allowed(_policy_statements(pipeline_template, "semif-pipeline-checks"), "sts:AssumeRole")
                if "deploy-role" in json.dumps(r)]


def test_no_check_step_exports_credentials_that_expire_after_an_hour(pipeline_template):
    """Role chaining caps an assumed session at one hour; the bake may run 8 h. Every step that acts in an
    environment assumes its role through a profile the CLI renews, never through exported keys."""
    specs = {a["Name"]: _project(pipeline_template, a)["Source"]["BuildSpec"]
             for stage in ("dev", "staging", "prod") for a in _actions(pipeline_template, stage)
             if a["ActionTypeId"]["Category"] == "Build"}
    assert {n.split("-")[0] for n in specs} >= {"PreDeploy", "Smoke", "Bake"}
    for name, spec in specs.items():
        assert "AWS_SESSION_TOKEN" not in spec and "sts assume-role" not in spec, name
        assert "credential_source = EcsContainer" in spec and "AWS_PROFILE=semif-target" in spec, name


def _lifecycle_survivors(policy: dict, images: list[dict]) -> set[str]:
    """The digests ECR's lifecycle keeps, by its documented rules: rules apply lowest priority first; an image
    that matches the tag selection of a rule cannot be expired by a rule of lower priority; ``imageCountMoreThan``
    keeps the newest pushed; ``any`` selects every image not already selected."""
    selected: set[str] = set()
    expired: set[str] = set()
    for rule in sorted(policy["rules"], key=lambda r: r["rulePriority"]):
        selection = rule["selection"]
        if selection["tagStatus"] == "tagged":
            matching = [i for i in images if any(tag.startswith(tuple(selection["tagPrefixList"]))
                                                 for tag in i["tags"])]
        elif selection["tagStatus"] == "untagged":
            matching = [i for i in images if not i["tags"]]
        else:
            matching = images
        candidates = [i for i in matching if i["digest"] not in selected]
        assert selection["countType"] == "imageCountMoreThan"
        newest_first = sorted(candidates, key=lambda i: i["pushed"], reverse=True)
        expired |= {i["digest"] for i in newest_first[selection["countNumber"]:]}
        selected |= {i["digest"] for i in candidates}
    return {i["digest"] for i in images} - expired


def test_the_repository_never_expires_an_image_an_environment_may_still_run(pipeline_template):
    """60 releases: each builds a cpu and a gpu image; dev and staging deploy every release, prod every tenth. Each
    stage's pre-deploy step tags what it deploys; the images prod runs now and ran before must survive."""
    (repository,) = [r["Properties"] for r in pipeline_template["Resources"].values()
                     if r["Type"] == "AWS::ECR::Repository" and r["Properties"]["RepositoryName"] == "semif/adapter"]
    policy = json.loads(repository["LifecyclePolicy"]["LifecyclePolicyText"])
    prefixes = {env: _variables(pipeline_template, a)["DEPLOYED_TAG_PREFIX"]
                for env in ("dev", "staging", "prod") for a in _actions(pipeline_template, env)
                if a["Name"] == f"PreDeploy-{env}"}
    images: list[dict] = []
    prod_ran: list[str] = []
    for release in range(60):
        built = {}
        for variant in ("cpu", "gpu"):
            built[variant] = {"digest": f"{variant}-{release}", "pushed": len(images), "tags": [f"hash-{release}"]}
            images.append(built[variant])
        deployed = {"dev": built["cpu"], "staging": built["gpu"]}
        if release % 10 == 0:
            deployed["prod"] = built["gpu"]
            prod_ran.append(built["gpu"]["digest"])
        for env, image in deployed.items():
            image["tags"].append(prefixes[env] + image["digest"])
        survivors = _lifecycle_survivors(policy, images)
        assert prod_ran[-1] in survivors, (release, "prod's running image")
        assert all(d in survivors for d in prod_ran[-3:]), (release, "an image prod may roll back to")
        assert built["cpu"]["digest"] in survivors and built["gpu"]["digest"] in survivors


def test_smoke_step_checks_the_answers_of_both_endpoints_after_deploy(pipeline_template):
    for stage in ("dev", "prod"):
        actions = _actions(pipeline_template, stage)
        deploys = [a for a in actions if a["ActionTypeId"]["Category"] == "Deploy"]
        (smoke,) = [a for a in actions if a["Name"].startswith("Smoke")]
        assert smoke["RunOrder"] > max(a["RunOrder"] for a in deploys)
        variables = json.loads(smoke["Configuration"]["EnvironmentVariables"])
        (endpoint_var,) = [v for v in variables if v["name"] == "ENDPOINT_NAME"]
        assert endpoint_var["value"].startswith("#{")  # a CodePipeline variable from the deploy action's outputs
        assert _variables(pipeline_template, smoke)["CHAT_ENDPOINT_NAME"] == f"semif-{stage}-chat"
        spec = _project(pipeline_template, smoke)["Source"]["BuildSpec"]
        assert "r['choice'] in ids" in spec and "abs(sum(p)-1)<1e-3" in spec  # the body, not just a 200
        assert "choices'][0]['message']['content']" in spec
        # The answer names the stage's digest (image.json, the image step's output) ...
        variant = "cpu" if stage == "dev" else "gpu"
        (image_step,) = [a for a in _actions(pipeline_template, "Build") if a["Name"] == f"Image-{variant}"]
        assert smoke["InputArtifacts"] == image_step["OutputArtifacts"]
        assert "got==want" in spec and "open('image.json')" in spec
        # ... and the endpoint runs the decision stack's endpoint config, read from its output when the step runs.
        (config_var,) = [v for v in variables if v["name"] == "ENDPOINT_CONFIG_NAME"]
        assert config_var["value"].startswith("#{") and config_var["value"].endswith(".DecisionEndpointConfigName}")
        assert '[ \\"$2\\" = \\"$ENDPOINT_CONFIG_NAME\\" ]' in spec


def test_the_decision_stack_outputs_the_endpoint_config_its_endpoint_runs(pipeline_assembly):
    decision = templates(pipeline_assembly[1])["semif-prod-decision"]
    output = decision["Outputs"]["DecisionEndpointConfigName"]
    (config_id,) = [k for k, r in decision["Resources"].items() if r["Type"] == "AWS::SageMaker::EndpointConfig"
                    and "Decision" in k]
    assert output["Value"] == {"Fn::GetAtt": [config_id, "EndpointConfigName"]}
    assert "Export" not in output  # it changes with every image: never importable
    (endpoint,) = [r for k, r in decision["Resources"].items() if r["Type"] == "AWS::SageMaker::Endpoint"]
    assert endpoint["Properties"]["EndpointConfigName"] == output["Value"]


def test_smoke_check_asserts_on_a_real_decision_body(tmp_path):
    """The smoke step's checker, run on a good and a bad answer."""
    import subprocess
    import sys

    from stacks.pipeline_stack import CHECK_DECISION

    deployed, previous = "sha256:" + "4e" * 32, "sha256:" + "0d" * 32
    (tmp_path / "image.json").write_text(json.dumps({"imageDigest": deployed}))
    good = {"option_ids": ["billing", "technical", "sales"], "choice": "billing", "probabilities": [0.7, 0.2, 0.1],
            "model": {"image_digest": deployed}}
    bad = {**good, "probabilities": [0.7, 0.7, 0.1]}
    rolled_back = {**good, "model": {"image_digest": previous}}  # InService, answering, on the old config
    unrecorded = {k: v for k, v in good.items() if k != "model"}
    for body, ok in ((good, True), (bad, False), ({"error": "x"}, False), (rolled_back, False), (unrecorded, False)):
        (tmp_path / "response.json").write_text(json.dumps(body))
        result = subprocess.run([sys.executable, "-c", CHECK_DECISION], cwd=tmp_path, capture_output=True, text=True)
        assert (result.returncode == 0) is ok, body
        if body is rolled_back:
            assert f"answers from image {previous}, not {deployed}" in result.stderr


def test_synth_step_runs_the_tests_and_cdk_synth_with_the_built_digests(pipeline_template):
    projects = [r["Properties"] for r in pipeline_template["Resources"].values() if r["Type"] == "AWS::CodeBuild::Project"]
    buildspecs = "\n".join(p["Source"].get("BuildSpec", "") for p in projects)
    assert "npm ci" in buildspecs
    assert "python -m pytest tests/cdk" in buildspecs
    assert "npx cdk synth -c pipeline=true -c adapter-images-dir=adapter-images" in buildspecs


def test_every_environment_check_role_trusts_the_pipelines_named_check_role_only(pipeline_assembly):
    for env in ("dev", "staging", "prod"):
        template = Template.from_json(templates(pipeline_assembly[1])[f"semif-{env}-shared"])
        template.has_resource_properties("AWS::IAM::Role", {
            "RoleName": f"semif-{env}-pipeline-check",
            "AssumeRolePolicyDocument": {"Statement": [Match.object_like({
                "Principal": {"AWS": {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"},
                                                        ":iam::333333333333:root"]]}},
                "Condition": {"ArnEquals": {
                    "aws:PrincipalArn": ["arn:aws:iam::333333333333:role/semif-pipeline-checks"]}}})],
                "Version": "2012-10-17"},
        })


def test_the_central_repository_lets_in_the_roles_that_run_each_stage_model_only(pipeline_template, pipeline_assembly):
    """Each stage's endpoint and Batch Transform Models pull with roles of fixed names; the repository policy names
    exactly those (its accounts as principals, the roles by aws:PrincipalArn), not every role of the accounts."""
    (repository,) = [r["Properties"] for r in pipeline_template["Resources"].values()
                     if r["Type"] == "AWS::ECR::Repository" and r["Properties"]["RepositoryName"] == "semif/adapter"]
    (statement,) = repository["RepositoryPolicyText"]["Statement"]
    pulling = set()
    for env, account in (("dev", "111111111111"), ("staging", "111111111111"), ("prod", "222222222222")):
        resources = templates(pipeline_assembly[1])[f"semif-{env}-decision"]["Resources"]
        for model in (r for r in resources.values() if r["Type"] == "AWS::SageMaker::Model"):
            role = resources[model["Properties"]["ExecutionRoleArn"]["Fn::GetAtt"][0]]["Properties"]
            assert len(role["RoleName"]) <= 64
            pulling.add(f"arn:aws:iam::{account}:role/{role['RoleName']}")
    assert len(pulling) == 6  # an endpoint and a transform role per stage
    assert statement["Condition"] == {"ArnEquals": {"aws:PrincipalArn": sorted(pulling)}}
    assert sorted(_arn_text(p) for p in _as_list(statement["Principal"]["AWS"])) == [
        "arn:aws:iam::111111111111:root", "arn:aws:iam::222222222222:root"]


def _roles_of_stacks(assembly) -> dict[str, set[str]]:
    """Stack name -> the names of the IAM roles it creates."""
    return {name: {r["Properties"]["RoleName"] for r in t["Resources"].values()
                   if r["Type"] == "AWS::IAM::Role" and isinstance(r["Properties"].get("RoleName"), str)}
            for name, t in templates(assembly).items()}


@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_no_trust_policy_names_a_role_of_another_stack_as_its_principal(request, assembly_name):
    """IAM refuses a trust policy whose principal role does not exist yet ("Invalid principal"): a hand deploy of an
    environment before the pipeline stack would fail, and so would any deploy order the stacks do not force."""
    _, assembly = request.getfixturevalue(assembly_name)
    created_by = {role: stack for stack, roles in _roles_of_stacks(assembly).items() for role in roles}
    created_by["semif-pipeline-checks"] = "semif-pipeline"  # a stack of another assembly, for the environment apps
    found = []
    for name, template in templates(assembly).items():
        for logical_id, resource in template["Resources"].items():
            if resource["Type"] != "AWS::IAM::Role":
                continue
            for statement in resource["Properties"]["AssumeRolePolicyDocument"]["Statement"]:
                for principal in _as_list(statement.get("Principal", {}).get("AWS", [])):
                    if isinstance(principal, str) and ":role/" in principal:
                        owner = created_by.get(principal.rsplit("/", 1)[-1])
                        if owner is not None and owner != name:
                            found.append(f"{name}/{logical_id} trusts {principal} of {owner}")
    assert found == []


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _alarm_topics_and_policies(template: dict) -> tuple[set[str], dict[str, list[dict]]]:
    resources = template["Resources"]
    topics = {k for k, r in resources.items() if r["Type"] == "AWS::SNS::Topic"}
    policies: dict[str, list[dict]] = {}
    for resource in resources.values():
        if resource["Type"] == "AWS::SNS::TopicPolicy":
            for topic in resource["Properties"]["Topics"]:
                policies.setdefault(topic["Ref"], []).extend(resource["Properties"]["PolicyDocument"]["Statement"])
    return topics, policies


@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_every_alarm_topic_lets_cloudwatch_publish(request, assembly_name):
    _, assembly = request.getfixturevalue(assembly_name)
    checked = 0
    for name, template in templates(assembly).items():
        topics, policies = _alarm_topics_and_policies(template)
        for topic in topics:
            if topic not in policies:
                continue  # no topic policy: SNS's default one lets the account's CloudWatch publish
            allows = [s for s in policies[topic] if s["Effect"] == "Allow"
                      and s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"}
                      and "sns:Publish" in _as_list(s["Action"])]
            assert allows, f"{name}: topic {topic} has a policy without an Allow for CloudWatch"
            checked += 1
    assert checked >= 1  # the shared stacks' alarm topics carry the SSL-only policy


@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_no_alarm_of_any_environment_fires_while_its_endpoint_provisions(request, assembly_name):
    """A breaching-on-missing alarm goes to ALARM when its whole evaluation range is missing (CloudWatch's
    documented rule): every instance alarm at create, which would page prod and fail staging's bake."""
    _, assembly = request.getfixturevalue(assembly_name)
    instance_alarms = 0
    for name, template in templates(assembly).items():
        resources = template["Resources"]
        endpoints = {k for k, r in resources.items() if r["Type"] == "AWS::SageMaker::Endpoint"}
        for logical_id, alarm in resources.items():
            if alarm["Type"] != "AWS::CloudWatch::Alarm":
                continue
            properties = alarm["Properties"]
            assert properties.get("TreatMissingData", "missing") != "breaching", (name, properties["AlarmName"])
            if properties.get("Namespace") == "/aws/sagemaker/Endpoints" or "/aws/sagemaker/Endpoints" in json.dumps(
                    properties.get("Metrics", [])):
                assert endpoints & set(alarm.get("DependsOn", [])), (name, properties["AlarmName"])
                instance_alarms += 1
    assert instance_alarms >= 4


def test_resource_counts(dev_assembly, prod_assembly, pipeline_assembly):
    counts = {name: len(t["Resources"]) for a in (dev_assembly, prod_assembly, pipeline_assembly)
              for name, t in templates(a[1]).items()}
    print("resource counts:", json.dumps(counts, sort_keys=True))
    assert all(n < 500 for n in counts.values())  # CloudFormation's per-template limit
