"""The SageMaker transport and the retry policy: botocore Stubber behind plain httpx, typesafe-sdk and openai."""

from __future__ import annotations

import io
import json
import random

import boto3
import httpx
import httpx2
import pytest
from botocore.exceptions import EndpointConnectionError
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from semif.tools.client import SemIfClient, SemIfError
from semif.tools.sagemaker_transport import (
    ATTEMPTS_HEADER,
    RetryingTransport,
    RetryPolicy,
    RetryStats,
    SageMakerTransport,
    parse_retry_after,
)

ENDPOINT = "semif-test"
SEMIF_ANSWER = {"id": "route", "option_ids": ["a", "b"], "probabilities": [0.75, 0.25], "choice": "a", "margin": 0.5}
OVERLOADED = {"error": {"code": "overloaded", "message": "1 requests are already waiting for the model", "field": None}}
INVALID = {"error": {"code": "invalid_request", "message": "decision.options: too short", "field": "decision.options"}}


class FakeClock:
    """Sleep advances the clock; nothing really waits."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class UpperBoundRng(random.Random):
    """uniform(a, b) → b: makes full-jitter waits equal to their ceiling, so they can be checked exactly."""

    def uniform(self, a, b):
        return b


def runtime_client():
    return boto3.client("sagemaker-runtime", region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")


def body(payload: dict) -> StreamingBody:
    raw = json.dumps(payload).encode()
    return StreamingBody(io.BytesIO(raw), len(raw))


def add_ok(stubber: Stubber, payload: dict, expected_body=ANY) -> None:
    stubber.add_response(
        "invoke_endpoint",
        {"Body": body(payload), "ContentType": "application/json", "InvokedProductionVariant": "AllTraffic"},
        {"EndpointName": ENDPOINT, "Body": expected_body, "ContentType": "application/json", "Accept": "application/json"},
    )


def add_model_error(stubber: Stubber, status: int, payload: dict) -> None:
    stubber.add_client_error(
        "invoke_endpoint", service_error_code="ModelError", service_message=f"Received server error ({status}) from primary",
        http_status_code=424, modeled_fields={"OriginalStatusCode": status, "OriginalMessage": json.dumps(payload)},
    )


def make_transport(client, clock: FakeClock, **policy) -> SageMakerTransport:
    return SageMakerTransport(ENDPOINT, client=client, retry=RetryPolicy(**policy), sleep=clock.sleep, clock=clock, rng=UpperBoundRng())


def test_plain_httpx_posts_the_body_to_invoke_endpoint_and_returns_its_answer():
    client, clock = runtime_client(), FakeClock()
    request_body = {"decision": {"id": "route", "state": "s", "question": "q", "options": [{"id": "a"}, {"id": "b"}]}}
    with Stubber(client) as stubber:
        add_ok(stubber, SEMIF_ANSWER, expected_body=json.dumps(request_body).encode())
        transport = make_transport(client, clock)
        with httpx.Client(transport=transport, base_url="https://sagemaker") as http:
            response = http.post("/invocations", content=json.dumps(request_body).encode(), headers={"content-type": "application/json"})
        stubber.assert_no_pending_responses()
    assert response.status_code == 200
    assert response.json() == SEMIF_ANSWER
    assert response.headers[ATTEMPTS_HEADER] == "1"
    assert response.headers["x-amzn-invoked-production-variant"] == "AllTraffic"
    assert transport.stats.as_dict()["attempts"] == 1 and clock.sleeps == []


def test_model_error_503_is_retried_with_exponential_backoff_and_counted():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        add_model_error(stubber, 503, OVERLOADED)
        add_model_error(stubber, 503, OVERLOADED)
        add_model_error(stubber, 503, OVERLOADED)
        add_ok(stubber, SEMIF_ANSWER)
        transport = make_transport(client, clock, base_delay_s=0.1, max_delay_s=10.0)
        result = SemIfClient(transport=transport).decide("s", "q", ["a", "b"], id="route")
        stubber.assert_no_pending_responses()
    assert result["choice"] == "a"
    assert result.attempts == 4
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4])  # ceilings of full jitter: base · 2^(n-1)
    stats = transport.stats.as_dict()
    assert stats["requests"] == 1 and stats["attempts"] == 4 and stats["retries"] == 3
    assert stats["retry_reasons"] == {"model_error_503": 3}
    assert stats["amplification"] == 4.0


def test_throttling_is_retried():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        stubber.add_client_error("invoke_endpoint", service_error_code="ThrottlingException", service_message="Rate exceeded", http_status_code=400)
        add_ok(stubber, SEMIF_ANSWER)
        transport = make_transport(client, clock)
        result = SemIfClient(transport=transport).decide("s", "q", ["a", "b"])
    assert result.attempts == 2
    assert transport.stats.retry_reasons == {"throttled": 1}


def test_a_4xx_model_error_is_not_retried_and_carries_the_adapter_json_error():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        add_model_error(stubber, 422, INVALID)
        transport = make_transport(client, clock)
        with pytest.raises(SemIfError) as caught:
            SemIfClient(transport=transport).decide("s", "q", ["a", "b"])
        stubber.assert_no_pending_responses()
    error = caught.value
    assert (error.status, error.code, error.field, error.attempts) == (422, "invalid_request", "decision.options", 1)
    assert error.body == INVALID
    assert not error.retryable
    assert clock.sleeps == []


def test_other_sagemaker_client_errors_are_not_retried():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        stubber.add_client_error("invoke_endpoint", service_error_code="ValidationError", service_message="Endpoint semif-test not found", http_status_code=400)
        transport = make_transport(client, clock)
        with pytest.raises(SemIfError) as caught:
            SemIfClient(transport=transport).decide("s", "q", ["a", "b"])
    assert (caught.value.status, caught.value.code) == (400, "ValidationError")
    assert "not found" in caught.value.message


@pytest.mark.parametrize("code, status, message", [
    ("AccessDeniedException", 400, "User: arn:aws:sts::111111111111:assumed-role/app/x is not authorized to perform: "
                                   "sagemaker:InvokeEndpoint on resource: arn:aws:sagemaker:us-east-1:111111111111:endpoint/semif-test"),
    ("ValidationError", 400, "Endpoint semif-test of account 111111111111 not found."),
    ("InternalFailure", 500, "An internal failure occurred."),
])
def test_sagemakers_own_errors_are_told_apart_from_the_containers(code, status, message):
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        stubber.add_client_error("invoke_endpoint", service_error_code=code, service_message=message, http_status_code=status)
        add_model_error(stubber, status if status != 400 else 422, INVALID)
        transport = make_transport(client, clock)
        semif = SemIfClient(transport=transport)
        with pytest.raises(SemIfError) as by_sagemaker:
            semif.decide("s", "q", ["a", "b"])
        with pytest.raises(SemIfError) as by_container:
            semif.decide("s", "q", ["a", "b"])
        stubber.assert_no_pending_responses()
    refused = by_sagemaker.value
    assert (refused.source, refused.status, refused.code, refused.field) == ("sagemaker", status, code, None)
    assert refused.message == message and not refused.retryable and clock.sleeps == []
    assert by_container.value.source == "container" and by_container.value.code == "invalid_request"


def test_throttling_that_outlasts_the_retries_is_sagemakers_and_retryable():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        for _ in range(2):
            stubber.add_client_error("invoke_endpoint", service_error_code="ThrottlingException",
                                     service_message="Rate exceeded", http_status_code=400)
        with pytest.raises(SemIfError) as caught:
            SemIfClient(transport=make_transport(client, clock, max_attempts=2)).decide("s", "q", ["a", "b"])
    assert (caught.value.source, caught.value.status, caught.value.retryable) == ("sagemaker", 429, True)


def test_an_http_adapters_errors_come_from_the_container():
    def answer(request):
        return httpx.Response(422, json=INVALID)

    with SemIfClient("http://adapter", transport=httpx.MockTransport(answer)) as semif:
        with pytest.raises(SemIfError) as caught:
            semif.decide("s", "q", ["a", "b"])
    assert (caught.value.source, caught.value.field) == ("container", "decision.options")


@pytest.fixture
def no_aws_configuration(monkeypatch, tmp_path):
    """No credentials and no region from anywhere: environment, files, instance metadata."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_SECURITY_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_no_region_raises_aws_setup_error_naming_region_name(no_aws_configuration):
    from botocore.exceptions import NoRegionError

    from semif.tools.client import AwsSetupError

    with pytest.raises(AwsSetupError, match="region_name=") as caught:
        SemIfClient.for_endpoint(ENDPOINT)
    assert isinstance(caught.value.__cause__, NoRegionError)


def test_no_credentials_raise_aws_setup_error_at_the_first_call_and_are_not_retried(no_aws_configuration):
    from botocore.exceptions import NoCredentialsError

    from semif.tools.client import AwsSetupError

    clock = FakeClock()
    transport = SageMakerTransport(ENDPOINT, region_name="us-east-1", sleep=clock.sleep, clock=clock)
    with SemIfClient(transport=transport) as semif:
        with pytest.raises(AwsSetupError, match="credentials") as caught:
            semif.decide("s", "q", ["a", "b"])
    assert isinstance(caught.value.__cause__, NoCredentialsError)
    assert ENDPOINT in str(caught.value)
    assert transport.stats.as_dict()["attempts"] == 1 and clock.sleeps == []


def test_max_attempts_stops_retrying_and_returns_the_last_503():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        for _ in range(3):
            add_model_error(stubber, 503, OVERLOADED)
        transport = make_transport(client, clock, max_attempts=3)
        with pytest.raises(SemIfError) as caught:
            SemIfClient(transport=transport).decide("s", "q", ["a", "b"])
        stubber.assert_no_pending_responses()
    assert (caught.value.status, caught.value.code, caught.value.attempts) == (503, "overloaded", 3)
    assert caught.value.retryable
    assert transport.stats.gave_up == 1 and len(clock.sleeps) == 2


def test_max_elapsed_stops_before_a_wait_that_would_overrun_the_budget():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        for _ in range(3):
            add_model_error(stubber, 503, OVERLOADED)
        # waits would be 1, 2, 4 s; the third would end at 7 s > 5 s
        transport = make_transport(client, clock, max_attempts=10, base_delay_s=1.0, max_delay_s=100.0, max_elapsed_s=5.0)
        with pytest.raises(SemIfError) as caught:
            SemIfClient(transport=transport).decide("s", "q", ["a", "b"])
    assert caught.value.attempts == 3
    assert clock.sleeps == [1.0, 2.0]


def test_connection_errors_are_retried():
    class FlakyRuntime:
        def __init__(self):
            self.calls = 0

        def invoke_endpoint(self, **params):
            self.calls += 1
            if self.calls == 1:
                raise EndpointConnectionError(endpoint_url="https://runtime.sagemaker.us-east-1.amazonaws.com")
            return {"Body": body(SEMIF_ANSWER), "ContentType": "application/json"}

    clock = FakeClock()
    runtime = FlakyRuntime()
    transport = make_transport(runtime, clock)
    result = SemIfClient(transport=transport).decide("s", "q", ["a", "b"])
    assert (result.attempts, runtime.calls) == (2, 2)
    assert transport.stats.retry_reasons == {"connection_error": 1}


def test_connection_errors_that_persist_raise_a_connect_error_of_the_callers_library():
    class DeadRuntime:
        def invoke_endpoint(self, **params):
            raise EndpointConnectionError(endpoint_url="https://runtime.sagemaker.us-east-1.amazonaws.com")

    clock = FakeClock()
    transport = make_transport(DeadRuntime(), clock, max_attempts=2)
    with httpx2.Client(transport=transport, base_url="https://sagemaker") as http:
        with pytest.raises(httpx2.ConnectError):
            http.post("/invocations", json={})
    with httpx.Client(transport=transport, base_url="https://sagemaker") as http:
        with pytest.raises(httpx.ConnectError):
            http.post("/invocations", json={})
    assert transport.stats.as_dict()["attempts"] == 4 and transport.stats.gave_up == 2


def test_get_requests_are_refused_because_sagemaker_forwards_only_post():
    transport = make_transport(runtime_client(), FakeClock())
    with httpx.Client(transport=transport, base_url="https://sagemaker") as http:
        response = http.get("/v1/models")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["x-semif-error-source"] == "transport"


def test_custom_attributes_header_is_passed_to_invoke_endpoint():
    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        stubber.add_response(
            "invoke_endpoint", {"Body": body(SEMIF_ANSWER), "ContentType": "application/json"},
            {"EndpointName": ENDPOINT, "Body": ANY, "ContentType": "application/json", "Accept": "application/json",
             "CustomAttributes": "contract=semif"},
        )
        transport = make_transport(client, clock)
        with httpx.Client(transport=transport, base_url="https://sagemaker") as http:
            response = http.post("/x", json={}, headers={"X-Amzn-SageMaker-Custom-Attributes": "contract=semif"})
        stubber.assert_no_pending_responses()
    assert response.status_code == 200


# ---- the official SDKs through the transport ------------------------------------------------------

SYSTEM_ONE_ANSWER = {
    "model": "semif",
    "answers": {
        "billing": {"type": "noul", "noul": 0.8},
        "tone": {"type": "choice", "choice": "angry", "probabilities": {"calm": 0.3, "angry": 0.7}, "confidence": 0.4},
    },
    "usage": {"input_tokens": 42, "output_tokens": 0},
}


def test_typesafe_sdk_reaches_the_endpoint_through_the_transport_and_survives_a_503():
    from typesafe_sdk import Choice, Noul, RetryPolicy as SdkRetry, TypeSafeClient

    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        add_model_error(stubber, 503, OVERLOADED)
        add_ok(stubber, SYSTEM_ONE_ANSWER)
        transport = make_transport(client, clock)
        # The transport retries; the SDK's own retries are off so attempts are not multiplied.
        with TypeSafeClient(api_key="unused", base_url="https://sagemaker", transport=transport,
                            retry=SdkRetry(max_retries=0), compression=False) as sdk:
            result = sdk.system_one(
                state="I was charged twice.",
                questions={"billing": Noul(instructions="Is this about billing?"),
                           "tone": Choice(instructions="Tone?", criteria={"calm": None, "angry": None})},
            )
        stubber.assert_no_pending_responses()
    assert result.nouls["billing"].noul == pytest.approx(0.8)
    assert result.choices["tone"].choice == "angry"
    assert transport.stats.attempts == 2


def test_typesafe_sdk_raises_its_own_error_with_the_adapter_json_on_a_4xx():
    from typesafe_sdk import Noul, RetryPolicy as SdkRetry, TypeSafeAPIError, TypeSafeClient

    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        add_model_error(stubber, 422, INVALID)
        transport = make_transport(client, clock)
        with TypeSafeClient(api_key="unused", base_url="https://sagemaker", transport=transport,
                            retry=SdkRetry(max_retries=0), compression=False) as sdk:
            with pytest.raises(TypeSafeAPIError) as caught:
                sdk.system_one(state="x", questions={"q": Noul(instructions="?")})
    assert caught.value.status == 422
    assert caught.value.body == INVALID
    assert transport.stats.attempts == 1


DECISION_ANSWER = {
    "id": "dec_1",
    "object": "decision",
    "created_at": 1764000000,
    "model": "semif",
    "answers": [{"type": "choice", "name": "tone", "choice": "angry", "confidence": 0.4,
                 "probabilities": [{"value": "calm", "probability": 0.3}, {"value": "angry", "probability": 0.7}]}],
    "usage": {"input_tokens": 42, "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 0},
              "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 42},
}


def test_openai_decisions_reach_the_endpoint_through_the_transport_and_survive_throttling():
    from openai import OpenAI

    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        stubber.add_client_error("invoke_endpoint", service_error_code="ThrottlingException", service_message="Rate exceeded", http_status_code=400)
        add_ok(stubber, DECISION_ANSWER)
        transport = make_transport(client, clock)
        sdk = OpenAI(api_key="unused", base_url="https://sagemaker/v1", max_retries=0, http_client=httpx2.Client(transport=transport))
        decision = sdk.decisions.create(
            model="semif", input="The parcel arrived broken and I am furious.",
            questions=[{"type": "choice", "name": "tone", "choices": ["calm", "angry"]}],
        )
        stubber.assert_no_pending_responses()
    assert decision.answers[0].choice == "angry"
    assert transport.stats.as_dict()["attempts"] == 2


def test_openai_raises_its_own_error_on_a_4xx():
    import openai
    from openai import OpenAI

    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        add_model_error(stubber, 422, INVALID)
        transport = make_transport(client, clock)
        sdk = OpenAI(api_key="unused", base_url="https://sagemaker/v1", max_retries=0, http_client=httpx2.Client(transport=transport))
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            sdk.decisions.create(model="semif", input="x", questions=[{"type": "predicate", "name": "p", "predicate": "?"}])
    assert caught.value.status_code == 422
    assert caught.value.body == INVALID["error"]  # openai unwraps the "error" object


# ---- HTTP retries and the policy itself -----------------------------------------------------------


def test_retrying_transport_honours_retry_after_as_a_floor_under_the_jitter():
    replies = [httpx.Response(503, headers={"retry-after": "2"}, json=OVERLOADED), httpx.Response(200, json=SEMIF_ANSWER)]
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return replies[len(seen) - 1]

    clock = FakeClock()
    transport = RetryingTransport(httpx.MockTransport(handler), retry=RetryPolicy(base_delay_s=0.5), sleep=clock.sleep, clock=clock, rng=UpperBoundRng())
    result = SemIfClient("http://adapter", transport=transport).decide("s", "q", ["a", "b"])
    assert result.attempts == 2
    assert clock.sleeps == [2.5]  # Retry-After 2 s + jitter ceiling 0.5 s
    assert seen[0] == seen[1]  # the same body is sent again


def test_retrying_transport_does_not_retry_4xx():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(422, json=INVALID)

    transport = RetryingTransport(httpx.MockTransport(handler), sleep=lambda s: None)
    with pytest.raises(SemIfError) as caught:
        SemIfClient("http://adapter", transport=transport).decide("s", "q", ["a", "b"])
    assert len(calls) == 1 and caught.value.code == "invalid_request"


def test_full_jitter_waits_lie_between_zero_and_the_capped_exponential():
    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0)
    rng = random.Random(7)
    for retry in range(1, 12):
        ceiling = min(1.0, 0.1 * 2 ** (retry - 1))
        waits = [policy.backoff_s(retry, rng) for _ in range(200)]
        assert all(0.0 <= w <= ceiling for w in waits)
        assert max(waits) > 0.5 * ceiling  # spread over the range, not stuck at 0


def test_parse_retry_after_reads_seconds_and_http_dates():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == pytest.approx(10.0)


def test_stats_are_shared_between_transports():
    stats = RetryStats()
    t1 = RetryingTransport(httpx.MockTransport(lambda r: httpx.Response(200, json={})), stats=stats)
    t2 = RetryingTransport(httpx.MockTransport(lambda r: httpx.Response(200, json={})), stats=stats)
    for transport in (t1, t2):
        with httpx.Client(transport=transport, base_url="http://x") as http:
            http.post("/invocations", json={})
    assert stats.as_dict()["requests"] == 2 and stats.amplification == 1.0


def test_async_clients_go_through_the_same_transport_and_retries():
    import asyncio

    client, clock = runtime_client(), FakeClock()
    with Stubber(client) as stubber:
        add_model_error(stubber, 503, OVERLOADED)
        add_ok(stubber, SEMIF_ANSWER)
        transport = make_transport(client, clock)

        async def call():
            async with httpx2.AsyncClient(transport=transport, base_url="https://sagemaker") as http:
                return await http.post("/invocations", json={"decision": {}})

        response = asyncio.run(call())
        stubber.assert_no_pending_responses()
    assert response.status_code == 200 and response.json() == SEMIF_ANSWER
    assert response.headers[ATTEMPTS_HEADER] == "2"
