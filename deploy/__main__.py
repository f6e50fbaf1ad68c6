"""python -m deploy {up,smoke,down} ENV: one environment from its own account (``make deploy|smoke|destroy ENV=…``).

    up      bootstrap if needed, build the adapter image (or find it built), upload the model if missing, deploy
            every stack of ENV pinned to that image, then send one smoke decision
    smoke   one decision through InvokeEndpoint; fails unless it names the digest the stack deployed
    down    delete every stack of ENV (dev and staging take their data; prod keeps its bucket and repository)

Exit codes: 0 done, 1 a step failed (the message names it and where to look), 2 usage or config error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from . import DeployError

REPO = Path(__file__).resolve().parents[1]
# CDK's default bootstrap qualifier: the stack `cdk bootstrap` creates publishes its version here.
BOOTSTRAP_VERSION_PARAMETER = "/cdk-bootstrap/hnb659fds/version"
DEFAULT_BUILD_TIMEOUT_MIN = 200  # the project's own limit is 3 h (constructs_lib/image_build.BUILD_TIMEOUT)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _step(message: str) -> None:
    _say(f"\n>> {message}")


@dataclass
class Cdk:
    """The pinned CDK CLI (node_modules) running this interpreter's app.py."""

    profile: Optional[str] = None
    run: Callable[[list[str]], int] = lambda argv: subprocess.call(argv, cwd=REPO)

    def __call__(self, verb: str, env_name: str, contexts: dict[str, str], stacks: Sequence[str], *extra: str) -> None:
        argv = ["npx", "--no-install", "cdk", verb, "--app", f"{shlex.quote(sys.executable)} app.py",
                "-c", f"env={env_name}"]
        for key, value in contexts.items():
            argv += ["-c", f"{key}={value}"]
        if self.profile:
            argv += ["--profile", self.profile]
        argv += [*extra, *stacks]
        _say("$ " + " ".join(shlex.quote(a) for a in argv))
        code = self.run(argv)
        if code != 0:
            raise DeployError(f"`cdk {verb}` exited {code} (see its output above); a stack that failed its first "
                              "create is left in ROLLBACK_COMPLETE, and the next run's `cdk deploy` replaces it")


def _contexts(adapter_digests: dict[str, str], dlc_digests: dict[str, str]) -> dict[str, str]:
    return {**{f"adapter-image-{v}": d for v, d in adapter_digests.items()},
            **{f"dlc-image-{v}": d for v, d in dlc_digests.items()}}


def variants_of(env) -> list[str]:
    """The images an environment runs (constructs_lib.image_build.image_variants)."""
    from constructs_lib.image_build import image_variants

    return image_variants(env.variant)


def _stack_outputs(cloudformation, stack_name: str) -> dict[str, str]:
    (stack,) = cloudformation.describe_stacks(StackName=stack_name)["Stacks"]
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


def _print_answer(result) -> None:
    print(json.dumps({"choice": result.answer["choice"], "probabilities": result.answer["probabilities"],
                      "record": result.record}, indent=2))


def up(args, session, settings, env, cdk: Cdk) -> None:
    from constructs_lib.image_sources import PLACEHOLDER_DIGEST
    from constructs_lib.model_bucket import model_bucket_name
    from stacks import image_stack

    from .image import ImageProject, ensure_image, resolve_dlc_digest
    from .model import ensure_model
    from .smoke import smoke

    region = env.region
    variants = variants_of(env)
    placeholders = {v: PLACEHOLDER_DIGEST for v in variants}
    _step(f"the llama.cpp DLC ({', '.join(variants)})")
    dlc_digests = {}
    for variant in variants:
        dlc_digests[variant], looked_up = resolve_dlc_digest(session.client("ecr"), region=region, variant=variant,
                                                             pinned=settings.dlc_images.digest(variant))
        _say(f"{variant}: {dlc_digests[variant]} "
             f"({'looked up from its tag now' if looked_up else 'pinned in config/environments.json'})")

    if not _bootstrapped(session.client("ssm")):
        _step(f"bootstrapping CDK in aws://{env.account}/{region} (once per account and region)")
        # The CLI synthesizes the app even for an explicit environment: it gets the contexts synth needs.
        cdk("bootstrap", env.name, _contexts(placeholders, dlc_digests), [f"aws://{env.account}/{region}"])

    _step(f"the model bucket and the image build projects of {env.name}")
    cdk("deploy", env.name, _contexts(placeholders, dlc_digests),
        [f"SemIf-{env.name}-Shared", f"SemIf-{env.name}-Image"], "--require-approval", "never")

    outputs = _stack_outputs(session.client("cloudformation"), f"semif-{env.name}-image")
    images = {}
    for variant in variants:  # CPU first: the shorter build fails sooner
        _step(f"the {variant} adapter image")
        project = ImageProject(project_name=outputs[image_stack.output_project(variant)],
                               repository_uri=outputs[image_stack.OUTPUT_REPOSITORY_URI],
                               source_hash=outputs[image_stack.OUTPUT_SOURCE_HASH], variant=variant)
        images[variant] = ensure_image(session.client("codebuild"), session.client("ecr"), project, region=region,
                                       dlc_digest=dlc_digests[variant], timeout_s=args.build_timeout_min * 60, say=_say)
    image = images[env.variant]

    _step("the model")
    bucket = model_bucket_name(settings.project, env.name, env.account, region)
    ensure_model(session.client("s3"), bucket=bucket, model_prefix=env.model_prefix, model_source=env.model_source,
                 region=region, say=_say)

    _step(f"every stack of {env.name}, pinned to {image.digest}")
    cdk("deploy", env.name, _contexts({v: i.digest for v, i in images.items()}, dlc_digests), [],
        "--all", "--require-approval", "never")

    record = {"environment": env.name, "endpoint": env.decision.endpoint_name,
              "images": {v: {"digest": i.digest, "tag": i.tag, "base_image": i.base_image, "built": not i.skipped,
                             "build_log": i.log_url} for v, i in images.items()}}
    _say(json.dumps(record, indent=2))
    if args.no_smoke:
        return
    _step(f"one decision through {env.decision.endpoint_name}")
    result = smoke(session.client("sagemaker-runtime"), endpoint_name=env.decision.endpoint_name,
                   expected_digest=image.digest)
    _print_answer(result)


def smoke_only(args, session, settings, env, cdk: Cdk) -> None:
    from .smoke import smoke

    parameter = f"/semif/{env.name}/decision/image-digest"
    try:
        expected = session.client("ssm").get_parameter(Name=parameter)["Parameter"]["Value"]
    except Exception as exc:  # noqa: BLE001 - any failure to read it means the stack is not deployed
        raise DeployError(f"could not read {parameter} ({exc}): is {env.name} deployed (make deploy ENV={env.name})?") from None
    result = smoke(session.client("sagemaker-runtime"), endpoint_name=env.decision.endpoint_name, expected_digest=expected)
    _print_answer(result)


def down(args, session, settings, env, cdk: Cdk) -> None:
    from constructs_lib.image_sources import PLACEHOLDER_DIGEST

    cdk("destroy", env.name, _contexts({v: PLACEHOLDER_DIGEST for v in variants_of(env)},
                                       {v: settings.dlc_images.digest(v) for v in variants_of(env)}),
        [], "--all", "--force")
    if env.tier == "prod":
        _say("prod keeps its model bucket, image repository and their keys (RETAIN): delete them by hand if you mean to")


def _bootstrapped(ssm) -> bool:
    try:
        ssm.get_parameter(Name=BOOTSTRAP_VERSION_PARAMETER)
        return True
    except ssm.exceptions.ParameterNotFound:
        return False


# The accounts of the example config/environments.json (AWS's documentation style): never a real account.
EXAMPLE_ACCOUNTS = frozenset({"111111111111", "222222222222", "333333333333"})


def check_account(sts, env, settings=None) -> None:
    """Before anything is created: the credentials are for the environment's account, and no account the stacks
    would trust (the pipeline's, the chat clients') is still one of the example config's."""
    account = sts.get_caller_identity()["Account"]
    if account != env.account:
        raise DeployError(f"your credentials are for account {account}, but environments.{env.name}.account in "
                          f"config/environments.json is {env.account}: set it to the account to deploy to")
    if settings is None:
        return
    pipeline = settings.pipeline
    if pipeline is not None and env.name in pipeline.stages and pipeline.account in EXAMPLE_ACCOUNTS:
        raise DeployError(f"pipeline.account in config/environments.json is the example {pipeline.account}, which "
                          f"{env.name}'s check role would trust: set your pipeline account, or \"pipeline\": null to "
                          "deploy each environment from its own account")
    for arn in env.text.client_role_arns if env.text else ():
        if arn.split(":")[4] in EXAMPLE_ACCOUNTS:
            raise DeployError(f"environments.{env.name}.text.client_role_arns names {arn}, in an example account: "
                              "name the roles of your apps that call the chat endpoint, or \"text\": null to "
                              "leave the chat endpoint out")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("command", choices=("up", "smoke", "down"))
    parser.add_argument("env", help="an environment of config/environments.json (dev, staging, prod)")
    parser.add_argument("--profile", default=os.environ.get("AWS_PROFILE"), help="AWS profile (default: AWS_PROFILE)")
    parser.add_argument("--build-timeout-min", type=int, default=DEFAULT_BUILD_TIMEOUT_MIN,
                        help=f"stop waiting for the image build after this (default {DEFAULT_BUILD_TIMEOUT_MIN}); the build goes on")
    parser.add_argument("--no-smoke", action="store_true", help="up: skip the smoke decision")
    args = parser.parse_args(argv)

    from config import ConfigError, load_settings

    try:
        settings = load_settings()
        env = settings.environment(args.env)
    except (ConfigError, KeyError) as exc:
        _say(f"config error: {exc}")
        return 2
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        session = boto3.Session(profile_name=args.profile, region_name=env.region)
        check_account(session.client("sts"), env, settings if args.command == "up" else None)
        {"up": up, "smoke": smoke_only, "down": down}[args.command](args, session, settings, env, Cdk(profile=args.profile))
    except DeployError as exc:
        _say(f"\nerror: {exc}")
        return 1
    except NoCredentialsError:
        _say("\nerror: no AWS credentials: sign in (aws configure sso, aws sso login) or set AWS_PROFILE")
        return 1
    except (BotoCoreError, ClientError) as exc:
        _say(f"\nerror: AWS: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
