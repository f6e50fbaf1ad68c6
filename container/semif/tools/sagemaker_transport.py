"""Reach a SemIf endpoint on SageMaker, and survive its overload, with any httpx-based client.

`SageMakerTransport` is an httpx transport that sends each POST through boto3 `sagemaker-runtime`
`invoke_endpoint` (SigV4 by boto3). It works with plain `httpx`, and with `httpx2`, which the official
SDKs (`typesafe-sdk`, `openai`) are built on:

    transport = SageMakerTransport("semif-prod-decision", region_name="us-east-1")
    httpx.Client(transport=transport, base_url="https://sagemaker")           # plain httpx
    TypeSafeClient(api_key="unused", base_url="https://sagemaker", transport=transport)
    OpenAI(api_key="unused", base_url="https://sagemaker", http_client=httpx2.Client(transport=transport))

`RetryingTransport` wraps an ordinary HTTP transport with the same retry policy, for a local or
self-hosted adapter. Both retry: HTTP 503 and 429 from the adapter, SageMaker's `ModelError` whose
`OriginalStatusCode` is 503, SageMaker throttling, and connection errors; with exponential backoff and
full jitter, honouring `Retry-After`, within a max-attempts and max-elapsed budget. 4xx are not retried:
the adapter's JSON error comes back as the response, with its status, so each SDK raises its own error.
Every attempt is counted (`RetryStats`), and each response says how many it took (`x-semif-attempts`).

An error response says who refused (`x-semif-error-source`): `container` (the adapter's own JSON error, behind
SageMaker's `ModelError`), `sagemaker` (SageMaker refused or failed the call: IAM, an unknown endpoint,
throttling, its own failures) or `transport` (this transport refused to send it). A call that cannot be
made at all (no AWS credentials, no region) raises `AwsSetupError`, never retried.
"""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import json
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

try:  # the official SDKs' HTTP library; optional for plain-httpx users
    import httpx2
except ImportError:  # pragma: no cover - exercised only without the SDKs installed
    httpx2 = None

ATTEMPTS_HEADER = "x-semif-attempts"
ERROR_SOURCE_HEADER = "x-semif-error-source"
CUSTOM_ATTRIBUTES_HEADER = "x-amzn-sagemaker-custom-attributes"
THROTTLING_CODES = {"ThrottlingException", "Throttling", "TooManyRequestsException", "RequestLimitExceeded"}
UNAVAILABLE_CODES = {"ServiceUnavailable", "ServiceUnavailableException"}


@dataclass(frozen=True)
class RetryPolicy:
    """When to retry, and how long to wait.

    The n-th retry waits ``uniform(0, min(max_delay_s, base_delay_s · 2^(n-1)))`` (full jitter), plus the
    server's ``Retry-After`` when it sent one (capped at ``max_retry_after_s``): the server's delay is a
    floor, and the jitter on top keeps clients that were refused together from returning together.
    A retry whose wait would end past ``max_elapsed_s`` from the first attempt is not made."""

    max_attempts: int = 5
    max_elapsed_s: float = 30.0
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    retry_statuses: frozenset = frozenset({503, 429})
    honour_retry_after: bool = True
    max_retry_after_s: float = 30.0
    retry_connection_errors: bool = True

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.max_elapsed_s <= 0 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("max_elapsed_s must be > 0 and delays >= 0")

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        """The jittered part of the wait before retry number ``retry`` (1-based)."""
        ceiling = min(self.max_delay_s, self.base_delay_s * (2 ** (retry - 1)))
        return rng.uniform(0.0, ceiling)


NO_RETRY = RetryPolicy(max_attempts=1)


class AwsSetupError(RuntimeError):
    """The call to SageMaker could not be made: no AWS credentials, no region, an unknown profile, or another
    botocore error raised before a request left (the botocore exception is ``__cause__``). Retrying cannot
    help, so it is never retried: fix the app's AWS configuration."""


def _aws_setup_error(exc: BaseException, endpoint_name: Optional[str] = None) -> AwsSetupError:
    from botocore.exceptions import NoCredentialsError, NoRegionError, PartialCredentialsError

    where = f"SageMaker endpoint {endpoint_name!r}" if endpoint_name else "SageMaker"
    if isinstance(exc, NoRegionError):
        hint = "pass region_name= (the endpoint's region) or set AWS_DEFAULT_REGION"
    elif isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        hint = ("give the app AWS credentials: its role (instance profile, task or function role), a profile "
                "(AWS_PROFILE), or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    else:
        hint = "check the app's AWS configuration"
    return AwsSetupError(f"cannot call {where}: {type(exc).__name__}: {exc}; {hint}")


class RetryStats:
    """Counts across every request a transport sent (thread-safe): the load test's retry amplification
    is ``attempts / requests``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = 0
        self.attempts = 0
        self.retries = 0
        self.gave_up = 0
        self.slept_s = 0.0
        self.retry_reasons: Counter = Counter()

    def _record(self, *, attempts: int, reasons: list[str], slept_s: float, gave_up: bool) -> None:
        with self._lock:
            self.requests += 1
            self.attempts += attempts
            self.retries += attempts - 1
            self.slept_s += slept_s
            self.gave_up += 1 if gave_up else 0
            self.retry_reasons.update(reasons)

    @property
    def amplification(self) -> float:
        return self.attempts / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "requests": self.requests, "attempts": self.attempts, "retries": self.retries, "gave_up": self.gave_up,
                "amplification": round(self.amplification, 4), "slept_s": round(self.slept_s, 3),
                "retry_reasons": dict(self.retry_reasons),
            }


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds from a `Retry-After` header: delta-seconds or an HTTP date; None if absent or unreadable."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass
class _Attempt:
    """What one attempt produced: a response to return, or an exception to raise if it is the last."""

    response: Any = None
    error: Optional[BaseException] = None
    retry_reason: Optional[str] = None  # None: final, do not retry
    retry_after_s: Optional[float] = None


class _RetryLoop:
    """The retry loop shared by both transports. ``sleep``/``clock``/``rng`` are injectable for tests."""

    def __init__(self, policy: RetryPolicy, stats: Optional[RetryStats], sleep: Callable[[float], None],
                 clock: Callable[[], float], rng: Optional[random.Random]):
        self.policy = policy
        self.stats = stats if stats is not None else RetryStats()
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()

    def run(self, attempt: Callable[[], _Attempt], on_retry: Callable[[_Attempt], None] = lambda a: None):
        policy = self.policy
        started = self._clock()
        reasons: list[str] = []
        slept = 0.0
        n = 0
        while True:
            n += 1
            outcome = attempt()
            wait = None
            if outcome.retry_reason is not None and n < policy.max_attempts:
                with self._rng_lock:
                    wait = policy.backoff_s(n, self._rng)
                if policy.honour_retry_after and outcome.retry_after_s is not None:
                    wait += min(outcome.retry_after_s, policy.max_retry_after_s)
                if self._clock() - started + wait > policy.max_elapsed_s:
                    wait = None
            if wait is None:
                gave_up = outcome.retry_reason is not None
                self.stats._record(attempts=n, reasons=reasons, slept_s=slept, gave_up=gave_up)
                if outcome.error is not None:
                    outcome.error.semif_attempts = n  # type: ignore[attr-defined]
                    raise outcome.error
                outcome.response.headers[ATTEMPTS_HEADER] = str(n)
                return outcome.response
            reasons.append(outcome.retry_reason)
            on_retry(outcome)
            self._sleep(wait)
            slept += wait


def _flavour(request) -> Any:
    """The HTTP library the request came from: responses and errors must be of the same one."""
    if httpx2 is not None and isinstance(request, httpx2.Request):
        return httpx2
    return httpx


def _json_error(lib, status: int, code: str, message: str, request, source: str) -> Any:
    body = json.dumps({"error": {"code": code, "message": message, "field": None}}).encode()
    return lib.Response(status, headers={"content-type": "application/json", ERROR_SOURCE_HEADER: source},
                        content=body, request=request)


def _decoded_body(request) -> bytes:
    """The request body as the container must see it: SageMaker has no Content-Encoding for requests."""
    body = request.read()
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "zstd":
        try:
            from compression import zstd  # Python 3.14+
        except ImportError:
            try:
                from backports import zstd  # type: ignore[no-redef]
            except ImportError:
                raise ValueError("the request body is zstd-compressed and zstd is unavailable; "
                                 "create the SDK client with compression=False") from None
        return zstd.decompress(body)
    return body


class _BothTransports:
    """Base for a transport usable by httpx and httpx2 clients alike (sync and async)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        self.close()

    async def handle_async_request(self, request):
        # boto3 and the retry loop are synchronous; run them off the event loop.
        await request.aread()
        return await asyncio.to_thread(self.handle_request, request)


_BASES: tuple = (_BothTransports, httpx.BaseTransport, httpx.AsyncBaseTransport)
if httpx2 is not None:
    _BASES += (httpx2.BaseTransport, httpx2.AsyncBaseTransport)


def sagemaker_runtime_client(region_name: Optional[str] = None, *, session=None, read_timeout_s: float = 70.0):
    """A `sagemaker-runtime` client without botocore's own retries: the transport retries, and counts."""
    import boto3
    from botocore.config import Config

    from botocore.exceptions import BotoCoreError

    config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, read_timeout=read_timeout_s,
                    connect_timeout=5, tcp_keepalive=True)
    try:
        return (session or boto3.Session()).client("sagemaker-runtime", region_name=region_name, config=config)
    except BotoCoreError as exc:  # NoRegionError, ProfileNotFound, InvalidRegionError
        raise _aws_setup_error(exc) from exc


class SageMakerTransport(*_BASES):
    """Every POST, whatever its path, becomes `invoke_endpoint(EndpointName=endpoint_name, Body=…)`;
    the container dispatches on the body's shape (SageMaker forwards only `/invocations`). A
    `X-Amzn-SageMaker-Custom-Attributes` request header (e.g. `contract=systemone`) is passed on."""

    def __init__(self, endpoint_name: str, *, region_name: Optional[str] = None, client=None,
                 retry: RetryPolicy = RetryPolicy(), stats: Optional[RetryStats] = None,
                 target_variant: Optional[str] = None, inference_component: Optional[str] = None,
                 custom_attributes: Optional[str] = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, rng: Optional[random.Random] = None):
        self.endpoint_name = endpoint_name
        self.client = client if client is not None else sagemaker_runtime_client(region_name)
        self.target_variant = target_variant
        self.inference_component = inference_component
        self.custom_attributes = custom_attributes
        self._loop = _RetryLoop(retry, stats, sleep, clock, rng)

    @property
    def stats(self) -> RetryStats:
        return self._loop.stats

    @property
    def retry(self) -> RetryPolicy:
        return self._loop.policy

    def handle_request(self, request):
        lib = _flavour(request)
        if request.method.upper() != "POST":
            return _json_error(lib, 405, "method_not_allowed",
                               f"{request.method} {request.url.path}: a SageMaker endpoint takes only POST (invoke_endpoint)",
                               request, "transport")
        try:
            body = _decoded_body(request)
        except ValueError as exc:
            return _json_error(lib, 400, "unsupported_content_encoding", str(exc), request, "transport")
        params: dict[str, Any] = {
            "EndpointName": self.endpoint_name,
            "Body": body,
            "ContentType": request.headers.get("content-type", "application/json").split(";")[0].strip() or "application/json",
            "Accept": "application/json",
        }
        attributes = request.headers.get(CUSTOM_ATTRIBUTES_HEADER) or self.custom_attributes
        if attributes:
            params["CustomAttributes"] = attributes
        if self.target_variant:
            params["TargetVariant"] = self.target_variant
        if self.inference_component:
            params["InferenceComponentName"] = self.inference_component
        return self._loop.run(lambda: self._attempt(lib, request, params))

    def _attempt(self, lib, request, params: dict) -> _Attempt:
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                         ConnectTimeoutError, HTTPClientError, ReadTimeoutError)

        try:
            answer = self.client.invoke_endpoint(**params)
        except ClientError as exc:
            return self._client_error(lib, request, exc)
        except ReadTimeoutError as exc:
            # The container may still be computing: retrying would only add load. Not retried.
            return _Attempt(error=lib.ReadTimeout(f"invoke_endpoint timed out: {exc}", request=request))
        except (BotoConnectionError, ConnectTimeoutError) as exc:
            error = lib.ConnectError(f"cannot reach SageMaker: {exc}", request=request)
            reason = "connection_error" if self.retry.retry_connection_errors else None
            return _Attempt(error=error, retry_reason=reason)
        except HTTPClientError as exc:
            # The connection broke after the request left (ConnectionClosedError): it may have been computed.
            return _Attempt(error=lib.ReadError(f"invoke_endpoint failed mid-call: {exc}", request=request))
        except BotoCoreError as exc:  # before anything was sent: NoCredentialsError, PartialCredentialsError, …
            error = _aws_setup_error(exc, self.endpoint_name)
            error.__cause__ = exc
            return _Attempt(error=error)
        headers = {"content-type": answer.get("ContentType") or "application/json"}
        if answer.get("InvokedProductionVariant"):
            headers["x-amzn-invoked-production-variant"] = answer["InvokedProductionVariant"]
        if answer.get("CustomAttributes"):
            headers[CUSTOM_ATTRIBUTES_HEADER] = answer["CustomAttributes"]
        request_id = answer.get("ResponseMetadata", {}).get("RequestId")
        if request_id:
            headers["x-amzn-requestid"] = request_id
        return _Attempt(response=lib.Response(200, headers=headers, content=answer["Body"].read(), request=request))

    def _client_error(self, lib, request, exc) -> _Attempt:
        error = exc.response.get("Error", {})
        code = error.get("Code", "")
        message = error.get("Message", str(exc))
        http_status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 400
        if code == "ModelError":
            # The container answered with an error: pass its status and its JSON body through.
            status = int(exc.response.get("OriginalStatusCode") or 500)
            original = exc.response.get("OriginalMessage") or ""
            try:
                json.loads(original)
                response = lib.Response(status, headers={"content-type": "application/json", ERROR_SOURCE_HEADER: "container"},
                                        content=original.encode(), request=request)
            except ValueError:
                response = _json_error(lib, status, "model_error", original or message, request, "container")
            retryable = status in self.retry.retry_statuses
            return _Attempt(response=response, retry_reason=f"model_error_{status}" if retryable else None)
        # SageMaker's own errors, before or around the container (InvokeEndpoint's ValidationError 400, e.g. an
        # unknown endpoint; AccessDeniedException; InternalFailure 500; ServiceUnavailable 503;
        # ModelNotReadyException 429: https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_runtime_InvokeEndpoint.html#API_runtime_InvokeEndpoint_Errors).
        if code in THROTTLING_CODES or http_status == 429:
            return _Attempt(response=_json_error(lib, 429, "throttled", message, request, "sagemaker"), retry_reason="throttled")
        if code in UNAVAILABLE_CODES or http_status == 503:
            return _Attempt(response=_json_error(lib, 503, "service_unavailable", message, request, "sagemaker"),
                            retry_reason="service_unavailable")
        return _Attempt(response=_json_error(lib, int(http_status), code or "sagemaker_error", message, request, "sagemaker"))


class RetryingTransport(*_BASES):
    """The same retry policy around an HTTP transport (default: `httpx.HTTPTransport()`), for a
    local or self-hosted adapter. Pass an `httpx2.HTTPTransport()` to use it under the official SDKs."""

    def __init__(self, inner=None, *, retry: RetryPolicy = RetryPolicy(), stats: Optional[RetryStats] = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 rng: Optional[random.Random] = None):
        self.inner = inner if inner is not None else httpx.HTTPTransport()
        self._loop = _RetryLoop(retry, stats, sleep, clock, rng)

    @property
    def stats(self) -> RetryStats:
        return self._loop.stats

    def close(self) -> None:
        self.inner.close()

    def handle_request(self, request):
        lib = _flavour(request)
        request.read()  # a read body can be sent again

        def attempt() -> _Attempt:
            try:
                response = self.inner.handle_request(request)
            except (lib.ConnectError, lib.ConnectTimeout, lib.RemoteProtocolError) as exc:
                reason = "connection_error" if self._loop.policy.retry_connection_errors else None
                return _Attempt(error=exc, retry_reason=reason)
            if response.status_code in self._loop.policy.retry_statuses:
                response.read()
                return _Attempt(response=response, retry_reason=f"http_{response.status_code}",
                                retry_after_s=parse_retry_after(response.headers.get("retry-after")))
            return _Attempt(response=response)

        return self._loop.run(attempt, on_retry=lambda outcome: outcome.response is not None and outcome.response.close())
