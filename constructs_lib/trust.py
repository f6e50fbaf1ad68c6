"""Trust policies that name roles of another stack or account, written so that the stacks deploy in any order."""

from __future__ import annotations

from aws_cdk import aws_iam as iam


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
