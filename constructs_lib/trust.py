"""Trust policies: roles of another stack or account, named so that the stacks deploy in any order, and AWS service
principals held to this stack's account and region (cross-service confused deputy)."""

from __future__ import annotations

from aws_cdk import Stack, aws_iam as iam


def named_role_principal(*role_arns: str) -> iam.IPrincipal:
    """Trust named roles by their ARN, not as principals: IAM refuses a trust policy whose principal role does not
    exist yet ("Invalid principal"), and a principal role deleted and re-created no longer matches (the policy holds
    its unique id). The account of each role is the principal, and ``aws:PrincipalArn`` admits only the named roles.
    """
    by_account: dict[str, list[str]] = {}
    for arn in role_arns:
        parts = arn.split(":")
        if len(parts) != 6 or parts[2] != "iam" or not parts[5].startswith("role/"):
            raise ValueError(f"{arn!r} is not an IAM role ARN")
        by_account.setdefault(parts[4], []).append(arn)
    principals = [iam.AccountPrincipal(account).with_conditions({"ArnEquals": {"aws:PrincipalArn": sorted(arns)}})
                  for account, arns in sorted(by_account.items())]
    return principals[0] if len(principals) == 1 else iam.CompositePrincipal(*principals)


def sagemaker_principal(stack: Stack) -> iam.IPrincipal:
    """``sagemaker.amazonaws.com``, for SageMaker work in this stack's account and region only (cross-service
    confused deputy). The condition is AWS's template for SageMaker inference, ``aws:SourceArn`` like
    ``arn:<partition>:sagemaker:<region>:<account>:*``, which it says must not name one model or endpoint; the account
    is in the ARN, so AWS asks for no ``aws:SourceAccount``
    (https://docs.aws.amazon.com/sagemaker/latest/dg/security-confused-deputy-prevention.html#security-confused-deputy-inference).
    The same pattern covers Batch Transform jobs (``transform-job/*``) of the account and region."""
    return iam.ServicePrincipal("sagemaker.amazonaws.com").with_conditions({
        "ArnLike": {"aws:SourceArn": f"arn:{stack.partition}:sagemaker:{stack.region}:{stack.account}:*"}})


def ecs_tasks_principal(stack: Stack) -> iam.IPrincipal:
    """``ecs-tasks.amazonaws.com``, for ECS tasks of this stack's account and region only: ECS documents both
    ``aws:SourceArn`` (``arn:<partition>:ecs:<region>:<account>:*``; naming one cluster is not supported) and
    ``aws:SourceAccount`` in a task role's trust policy against the confused deputy
    (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task-iam-roles.html)."""
    return iam.ServicePrincipal("ecs-tasks.amazonaws.com").with_conditions({
        "ArnLike": {"aws:SourceArn": f"arn:{stack.partition}:ecs:{stack.region}:{stack.account}:*"},
        "StringEquals": {"aws:SourceAccount": stack.account}})
