"""A thin client for the SemIf schema, over HTTP or a SageMaker endpoint, with retries.

    with SemIfClient("http://127.0.0.1:8080") as client:                 # local adapter
        result = client.decide("The VPN drops every ten minutes.", "Which team?", ["hardware", "network"])
    with SemIfClient.for_endpoint("semif-prod-decision", region_name="us-east-1") as client:   # SageMaker
        ...
    result["choice"], result["probabilities"], result.attempts

For System One or OpenAI Decisions use the official SDKs with `semif.tools.sagemaker_transport`.

A refusal raises `SemIfError` (``source`` says whether the container or SageMaker refused); a call that cannot
be made (no AWS credentials, no region) raises `AwsSetupError`, at `for_endpoint` or at the first call.

This module and the transport need the package's base install alone (boto3, httpx: `pip install ./container`);
they import nothing of `semif.serving` (tests/test_light_client.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import httpx

from .sagemaker_transport import (
    ATTEMPTS_HEADER,
    ERROR_SOURCE_HEADER,
    AwsSetupError,
    RetryingTransport,
    RetryPolicy,
    RetryStats,
    SageMakerTransport,
)

__all__ = ["AwsSetupError", "SemIfClient", "SemIfError", "SemIfResult", "normalize_options"]

Options = Union[Sequence[str], Sequence[Mapping[str, Any]], Mapping[str, Optional[str]]]


class SemIfError(Exception):
    """The request was refused, or kept being refused (503 or 429 after every retry). ``source`` says who
    refused: ``"container"`` (the adapter's JSON error: ``status``, ``code``, ``message``, ``field``),
    ``"sagemaker"`` (SageMaker's own error before or around the container, e.g. ``AccessDeniedException``, a
    ``ValidationError`` for an unknown endpoint, ``InternalFailure``: ``code`` is SageMaker's, ``field`` is
    None) or ``"transport"`` (the SageMaker transport refused to send it). ``body`` is the whole JSON error."""

    def __init__(self, status: int, body: Any, attempts: int = 1, source: str = "container"):
        error = body.get("error", {}) if isinstance(body, dict) else {}
        error = error if isinstance(error, dict) else {"message": str(error)}
        self.status = status
        self.body = body
        self.source = source
        self.code = error.get("code")
        self.message = error.get("message") or (body if isinstance(body, str) else "")
        self.field = error.get("field")
        self.attempts = attempts
        super().__init__(f"HTTP {status} {self.code} from the {source}: {self.message}"
                         + (f" (field {self.field})" if self.field else ""))

    @property
    def retryable(self) -> bool:
        return self.status in (429, 503)


class SemIfResult(dict):
    """The adapter's JSON answer, plus how many attempts it took (`attempts`)."""

    attempts: int = 1


def normalize_options(options: Options) -> list[dict]:
    if isinstance(options, Mapping):
        return [{"id": key, **({"description": value} if value else {})} for key, value in options.items()]
    normalized = []
    for option in options:
        if isinstance(option, str):
            normalized.append({"id": option})
        else:
            normalized.append({k: v for k, v in dict(option).items() if v is not None})
    return normalized


class SemIfClient:
    def __init__(self, base_url: Optional[str] = None, *, transport=None, retry: RetryPolicy = RetryPolicy(),
                 stats: Optional[RetryStats] = None, timeout_s: float = 70.0, api_key: Optional[str] = None,
                 path: str = "/invocations"):
        """``base_url`` of a running adapter, or a ready ``transport`` (e.g. a `SageMakerTransport`)."""
        if transport is None:
            if base_url is None:
                raise ValueError("give base_url (HTTP) or transport (e.g. SemIfClient.for_endpoint)")
            transport = RetryingTransport(retry=retry, stats=stats)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.transport = transport
        self.path = path
        self._http = httpx.Client(base_url=base_url or "https://sagemaker.invalid", transport=transport,
                                  timeout=timeout_s, headers=headers)

    @classmethod
    def for_endpoint(cls, endpoint_name: str, *, region_name: Optional[str] = None, sagemaker_client=None,
                     retry: RetryPolicy = RetryPolicy(), stats: Optional[RetryStats] = None, **kwargs) -> "SemIfClient":
        transport = SageMakerTransport(endpoint_name, region_name=region_name, client=sagemaker_client, retry=retry, stats=stats)
        return cls(transport=transport, **kwargs)

    @property
    def stats(self) -> Optional[RetryStats]:
        return getattr(self.transport, "stats", None)

    def send(self, body: Mapping[str, Any], *, path: Optional[str] = None) -> SemIfResult:
        response = self._http.post(path or self.path, json=body)
        attempts = int(response.headers.get(ATTEMPTS_HEADER, "1"))
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        if response.status_code != 200:
            # Over HTTP every error is the adapter's; the SageMaker transport names its source.
            raise SemIfError(response.status_code, payload, attempts, response.headers.get(ERROR_SOURCE_HEADER, "container"))
        result = SemIfResult(payload)
        result.attempts = attempts
        return result

    def decide(self, state: str, question: str, options: Options, *, id: str = "decision", scoring: Optional[str] = None,
               policy: Optional[Mapping[str, Any]] = None, return_prompt: bool = False, layout: Optional[str] = None,
               debias: Optional[str] = None, abstain_option: Optional[str] = None) -> SemIfResult:
        """One decision. ``abstain_option``: the option id that escapes a forced choice (debias "content_free"
        keeps its content-free share)."""
        body: dict[str, Any] = {"decision": {"id": id, "state": state, "question": question, "options": normalize_options(options)}}
        if abstain_option is not None:
            body["decision"]["abstain_option"] = abstain_option
        if scoring:
            body["scoring"] = scoring
        if layout:
            body["layout"] = layout
        if debias:
            body["debias"] = debias
        if policy is not None:
            body["policy"] = dict(policy)
        if return_prompt:
            body["return_prompt"] = True
        return self.send(body)

    def decide_many(self, state: str, decisions: Sequence[Mapping[str, Any]], *, scoring: Optional[str] = None,
                    policy: Optional[Mapping[str, Any]] = None) -> SemIfResult:
        """One shared state, several decisions (`{"id", "question", "options"}`); the state is evaluated once."""
        body: dict[str, Any] = {
            "state": state,
            "decisions": [{**d, "options": normalize_options(d["options"])} for d in decisions],
        }
        if scoring:
            body["scoring"] = scoring
        if policy is not None:
            body["policy"] = dict(policy)
        return self.send(body)

    def chat(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 16, temperature: float = 0.0) -> SemIfResult:
        """OpenAI-style `/v1/chat/completions` on the same adapter, where it offers that route."""
        return self.send({"messages": list(messages), "max_tokens": max_tokens, "temperature": temperature}, path="/v1/chat/completions")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SemIfClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
