"""A CloudWatch log group encrypted with a customer managed key, which CloudWatch Logs may use for that group only."""

from __future__ import annotations

from aws_cdk import ArnFormat, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms, aws_logs as logs
from constructs import Construct


def encrypted_log_group(scope: Construct, id_: str, *, log_group_name: str, key: kms.IKey,
                        retention: logs.RetentionDays, removal_policy: RemovalPolicy) -> logs.LogGroup:
    """The group, created by the stack (so it has a retention and goes with the stack), and the key policy
    statement that lets CloudWatch Logs encrypt with ``key`` for this one group only (encryption-context
    condition: https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html)."""
    stack = Stack.of(scope)
    key.add_to_resource_policy(iam.PolicyStatement(
        principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
        actions=["kms:Encrypt", "kms:Decrypt", "kms:ReEncryptFrom", "kms:ReEncryptTo", "kms:GenerateDataKey",
                 "kms:DescribeKey"],
        resources=["*"],
        conditions={"ArnEquals": {"kms:EncryptionContext:aws:logs:arn": stack.format_arn(
            service="logs", resource="log-group", resource_name=log_group_name,
            arn_format=ArnFormat.COLON_RESOURCE_NAME)}}))
    return logs.LogGroup(scope, id_, log_group_name=log_group_name, encryption_key=key, retention=retention,
                         removal_policy=removal_policy)
