"""What a SageMaker endpoint runs on, from the control plane: its endpoint config, the instance type
(or the instance pools, and how many instances each runs now) and the image digests it resolved.

The answers themselves report the CPU or GPU name (`model.hardware`); this adds what only SageMaker
knows. Calls: `sagemaker:DescribeEndpoint` on the endpoint, then `sagemaker:DescribeEndpointConfig` on
its current config (the instance type of a single-type variant is only there).
"""

from __future__ import annotations

from typing import Any, Optional


def _client_error_text(exc) -> str:
    error = getattr(exc, "response", {}).get("Error", {})
    return f"{error.get('Code', type(exc).__name__)}: {error.get('Message', exc)}"


def describe_endpoint_record(sagemaker_client, endpoint_name: str) -> dict:
    """The endpoint's record; never raises for an AWS error (the record then says what failed), so an
    evaluation is not lost to a missing Describe permission."""
    from botocore.exceptions import BotoCoreError, ClientError

    record: dict[str, Any] = {"endpoint_name": endpoint_name}
    try:
        endpoint = sagemaker_client.describe_endpoint(EndpointName=endpoint_name)
    except (ClientError, BotoCoreError) as exc:
        record["error"] = f"DescribeEndpoint: {_client_error_text(exc)}"
        return record
    config_name = endpoint.get("EndpointConfigName")
    record.update(endpoint_arn=endpoint.get("EndpointArn"), endpoint_config_name=config_name,
                  endpoint_status=endpoint.get("EndpointStatus"))
    configured: dict[str, dict] = {}
    if config_name:
        try:
            config = sagemaker_client.describe_endpoint_config(EndpointConfigName=config_name)
            configured = {v["VariantName"]: v for v in config.get("ProductionVariants", [])}
        except (ClientError, BotoCoreError) as exc:
            record["error"] = f"DescribeEndpointConfig: {_client_error_text(exc)}"
    variants = []
    running: set[str] = set()
    for summary in endpoint.get("ProductionVariants", []):
        name = summary.get("VariantName")
        spec = configured.get(name, {})
        pools_now = [{"instance_type": p.get("InstanceType"), "current_instance_count": p.get("CurrentInstanceCount")}
                     for p in summary.get("InstancePools") or []]
        pools_configured = [{"instance_type": p.get("InstanceType"), "priority": p.get("Priority")}
                            for p in spec.get("InstancePools") or []]
        instance_type: Optional[str] = spec.get("InstanceType")
        if pools_now:
            running.update(p["instance_type"] for p in pools_now if (p["current_instance_count"] or 0) > 0)
        elif instance_type:
            running.add(instance_type)
        variants.append({
            "variant_name": name,
            "instance_type": instance_type,
            "instance_pools": pools_configured or None,
            "instance_pools_running": pools_now or None,
            "current_instance_count": summary.get("CurrentInstanceCount"),
            "serverless": bool(summary.get("CurrentServerlessConfig") or spec.get("ServerlessConfig")),
            "resolved_images": sorted({i.get("ResolvedImage") for i in summary.get("DeployedImages") or [] if i.get("ResolvedImage")}),
        })
    record["variants"] = variants
    record["instance_types"] = sorted(running)
    return record
