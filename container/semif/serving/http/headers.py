"""SageMaker's custom-attributes header (``CustomAttributes`` on InvokeEndpoint)."""

from __future__ import annotations

from typing import Optional

SAGEMAKER_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"


def custom_attribute(header: str, key: str) -> Optional[str]:
    """`CustomAttributes: contract=systemone;trace=1` → `systemone`."""
    for part in header.replace(",", ";").split(";"):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == key and value.strip():
            return value.strip().lower()
    return None
