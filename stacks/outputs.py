"""Stack outputs for apps: an SSM parameter under /semif/<env>/, and for stable values a CfnOutput export.

A value that changes with every model or image (the model prefix, the image digest) is published
through SSM only: once another stack imports an export, CloudFormation refuses to change it.
"""

from __future__ import annotations

from typing import Optional

from aws_cdk import CfnOutput, aws_ssm as ssm
from constructs import Construct


def publish(scope: Construct, *, env_name: str, key: str, value: str, description: str,
            stable: bool = True) -> Optional[CfnOutput]:
    """``key`` is a path like ``decision/endpoint-name``: SSM ``/semif/<env>/<key>``, export ``semif-<env>-<key>``.

    ``stable=False``: SSM only, no output (a changing value must never be importable).
    """
    slug = key.replace("/", "-")
    ssm.StringParameter(scope, f"Param-{slug}", parameter_name=f"/semif/{env_name}/{key}", string_value=value,
                        description=description)
    if not stable:
        return None
    return CfnOutput(scope, f"Out-{slug}", value=value, description=description,
                     export_name=f"semif-{env_name}-{slug}")
