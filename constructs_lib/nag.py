"""cdk-nag acknowledgments (and checkov skips) that name the exact finding, never a whole rule.

cdk-nag 3 reports one finding per wildcard, e.g. ``AwsSolutions-IAM5[Resource::<Fn1234.Arn>:*]``.
``finding_resource`` renders a resource the way cdk-nag does, so the acknowledgment is computed
from the same token the policy holds and follows it when logical ids change.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import Acknowledgment, CfnResource, Stack, Validations
from constructs import IConstruct


def finding_resource(scope: IConstruct, value: str) -> str:
    return _render(Stack.of(scope).resolve(value))


def _render(node: Any) -> str:
    if isinstance(node, str):
        return node
    if isinstance(node, dict) and len(node) == 1:
        ((fn, arg),) = node.items()
        if fn == "Ref":
            return f"<{arg}>"
        if fn == "Fn::GetAtt":
            return f"<{arg[0]}.{arg[1]}>"
        if fn == "Fn::Join":
            return arg[0].join(_render(part) for part in arg[1])
        if fn == "Fn::ImportValue":
            return _render(arg)
    raise ValueError(f"cannot render {node!r} as a cdk-nag finding id")


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    Validations.of(scope).acknowledge(Acknowledgment(id=rule, reason=reason))


def acknowledge_wildcard_resource(scope: IConstruct, resource: str, reason: str) -> None:
    """Acknowledge ``AwsSolutions-IAM5`` for exactly this resource pattern."""
    acknowledge(scope, f"AwsSolutions-IAM5[Resource::{finding_resource(scope, resource)}]", reason)


def checkov_skip(scope: IConstruct, check_id: str, reason: str) -> None:
    """Skip one checkov check on one resource, in its template metadata, with the reason beside it.

    ``scope`` is the CloudFormation resource or a construct whose default child is one.
    """
    resource = scope if isinstance(scope, CfnResource) else scope.node.default_child
    if not isinstance(resource, CfnResource):
        raise TypeError(f"{scope.node.path} has no CloudFormation resource to carry a checkov skip")
    existing = resource.get_metadata("checkov") or {}
    skips = [s for s in existing.get("skip", []) if s["id"] != check_id]
    resource.add_metadata("checkov", {"skip": skips + [{"id": check_id, "comment": reason}]})
