"""Stack outputs for apps: a CfnOutput with an export name and an SSM parameter under /semif/<env>/."""

from __future__ import annotations

from aws_cdk import CfnOutput, aws_ssm as ssm
from constructs import Construct


def publish(scope: Construct, *, env_name: str, key: str, value: str, description: str) -> CfnOutput:
    """``key`` is a path like ``decision/endpoint-name``: SSM ``/semif/<env>/<key>``, export ``semif-<env>-<key>``."""
    slug = key.replace("/", "-")
    ssm.StringParameter(scope, f"Param-{slug}", parameter_name=f"/semif/{env_name}/{key}", string_value=value,
                        description=description)
    return CfnOutput(scope, f"Out-{slug}", value=value, description=description,
                     export_name=f"semif-{env_name}-{slug}")
