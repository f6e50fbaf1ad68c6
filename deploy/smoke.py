"""One decision through InvokeEndpoint, and the proof that the endpoint runs the image just deployed.

An endpoint can be InService on an older configuration (a blue/green update rolled back on an alarm), so the
status alone proves nothing: the answer's record must name the digest the stack pinned.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

from botocore.exceptions import ClientError

from constructs_lib.serving_endpoint import endpoint_log_group_name

from . import DeployError

SMOKE_DECISION = {
    "decision": {
        "id": "deploy-smoke",
        "state": "The customer cannot receive a password reset email.",
        "question": "Which queue should handle this request?",
        "options": [{"id": "account_access", "description": "Account access support."},
                    {"id": "billing", "description": "Billing support."}],
    }
}
# A fresh endpoint may answer 503 while its one request slot is busy with a first load: a few retries.
ATTEMPTS = 5


@dataclass(frozen=True)
class SmokeResult:
    answer: dict

    @property
    def record(self) -> dict:
        """The reproducibility record: what produced the answer."""
        return {"model_sha256": self.answer["model"]["sha256"],
                "llama_cpp_build": self.answer["model"]["llama_cpp_build"],
                "template_version": self.answer["prompt"]["template_version"],
                "options_sha256": self.answer["prompt"]["options_sha256"],
                "image_digest": self.answer["model"]["image_digest"],
                "hardware": self.answer["model"]["hardware"]}


def smoke(runtime, *, endpoint_name: str, expected_digest: str,
          sleep: Callable[[float], None] = time.sleep) -> SmokeResult:
    """Send ``SMOKE_DECISION`` to ``endpoint_name``; fail unless it answers and names ``expected_digest``."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            response = runtime.invoke_endpoint(EndpointName=endpoint_name, ContentType="application/json",
                                               Accept="application/json", Body=json.dumps(SMOKE_DECISION).encode())
            break
        except ClientError as exc:
            error = exc.response.get("Error", {})
            overloaded = exc.response.get("OriginalStatusCode") == 503 or "503" in str(error.get("Message", ""))
            if attempt == ATTEMPTS or not (overloaded or error.get("Code") == "ThrottlingException"):
                raise DeployError(f"the smoke decision to {endpoint_name} failed: {exc}; the adapter's log: "
                                  f"{endpoint_log_group_name(endpoint_name)}") from None
            sleep(2.0 * attempt)
    try:
        result = SmokeResult(json.loads(response["Body"].read()))
        served = result.record["image_digest"]  # every field of the record must be there
    except (ValueError, KeyError, TypeError) as exc:
        raise DeployError(f"{endpoint_name} answered the smoke decision without a reproducibility record ({exc!r})") from None
    if served != expected_digest:
        raise DeployError(f"{endpoint_name} answers from image {served}, not {expected_digest} that was just deployed: "
                          "the update did not take (a blue/green rollback keeps the old configuration InService); "
                          "see the endpoint's events and alarms")
    return result
