"""SageMaker's custom-attributes header (``CustomAttributes`` on InvokeEndpoint)."""

from __future__ import annotations

import re
import uuid
from typing import Mapping, Optional

SAGEMAKER_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"
# A client's request id is echoed in a header and written to every log line: only a short id of safe characters.
MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,%d}" % MAX_REQUEST_ID)


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's `X-Request-Id` (else SageMaker's `X-Amzn-RequestId`) when it is 1 to MAX_REQUEST_ID characters
    of ``A-Z a-z 0-9 . _ : / + = -``; otherwise a generated one (32 hex digits), which the response's
    `X-Request-Id` then carries: an id of any other shape is never echoed nor logged."""
    for name in ("x-request-id", "x-amzn-requestid"):
        value = headers.get(name)
        if value and _REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex


def custom_attribute(header: str, key: str) -> Optional[str]:
    """`CustomAttributes: contract=systemone;trace=1` → `systemone`."""
    for part in header.replace(",", ";").split(";"):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == key and value.strip():
            return value.strip().lower()
    return None
