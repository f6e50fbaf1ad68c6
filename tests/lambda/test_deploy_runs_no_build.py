"""No Lambda-backed custom resource builds the image during `cdk deploy` any more.

The image-build custom resource (and its handlers in lambda/image_build/) is gone: a CloudFormation custom
resource waits at most an hour, and a cold CUDA build can take longer. The pipeline builds each variant before
any deploy (tests/cdk/test_app.py); `make deploy` starts the environment's own project and waits for it outside
any stack operation (deploy/). This guards against the build creeping back into a stack: the image stack holds
the projects, and nothing in any stack starts them. The one custom resource the endpoint stacks keep is the
model check (lambda/model_check/), which reads S3 for seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cdk"))
from cdk_testing import IMAGE_DIGESTS, REPO, all_stacks, synth_real_app  # noqa: E402

# The Lambdas left in the environments: CDK's own S3 auto-delete handler (disposable tiers), and the model check.
ALLOWED_HANDLER = "Custom::S3AutoDeleteObjectsCustomResourceProvider"
ALLOWED_CUSTOM = {"Custom::S3AutoDeleteObjects", "Custom::SemIfModelCheck"}


@pytest.fixture(scope="module")
def environment_templates(tmp_path_factory):
    templates = {}
    for env in ("dev", "prod"):
        _, assembly = synth_real_app(tmp_path_factory.mktemp(env), env=env, **IMAGE_DIGESTS)
        templates.update({s.stack_name: s.template for s in all_stacks(assembly)})
    return templates


def test_no_stack_builds_an_image_while_it_deploys(environment_templates):
    for name, template in environment_templates.items():
        types = {r["Type"] for r in template["Resources"].values()}
        if name.endswith("-image"):  # the projects deploy/ starts, and nothing that could start them
            assert "AWS::CodeBuild::Project" in types, name
            assert not [t for t in types if t.startswith("Custom::") or t.startswith("AWS::Lambda::")
                        or t in ("AWS::Events::Rule", "AWS::Scheduler::Schedule")], name
        else:
            assert "AWS::CodeBuild::Project" not in types, name
        assert not [t for t in types if t.startswith("Custom::") and t not in ALLOWED_CUSTOM], name
        assert "AWS::StepFunctions::StateMachine" not in types, name  # no Provider waiter


def test_the_lambdas_are_cdks_auto_delete_handler_in_disposable_tiers_and_the_model_check(environment_templates):
    for name, template in environment_templates.items():
        functions = [k for k, r in template["Resources"].items() if r["Type"] in ("AWS::Lambda::Function",)]
        if name == "semif-dev-shared":
            assert functions and all(k.startswith("CustomS3AutoDeleteObjectsCustomResourceProviderHandler")
                                     for k in functions)
        elif name.endswith(("-decision", "-text")):
            assert [k for k in functions if not k.startswith("ModelCheckFunction")] == [], name
            assert len(functions) == 1, name
        else:
            assert functions == [], name


def test_the_old_handler_code_is_gone():
    assert not (REPO / "lambda" / "image_build").exists()
