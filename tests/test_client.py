"""semif.tools.client against the real adapter: decisions, errors with the adapter's JSON, and retries through
overload forced by a queue of one."""

from __future__ import annotations

import threading

import pytest

from semif.tools.client import SemIfClient, SemIfError, normalize_options
from semif.tools.sagemaker_transport import RetryPolicy, RetryStats

OPTIONS = [{"id": "hardware", "description": "Broken laptops, screens."}, {"id": "network", "description": "Wi-Fi and VPN."},
           {"id": "hr", "description": "Payroll and holidays."}]


def long_state(n: int) -> str:
    # Distinct states: no prefix reuse between requests, so each one keeps the model busy.
    return f"Ticket {n}. " + " ".join(f"Line {i} of ticket {n}: the device fails to connect again." for i in range(4))


def test_options_normalize_from_strings_dicts_and_mappings():
    assert normalize_options(["a", "b"]) == [{"id": "a"}, {"id": "b"}]
    assert normalize_options({"a": "first", "b": None}) == [{"id": "a", "description": "first"}, {"id": "b"}]
    assert normalize_options([{"id": "a", "description": None}]) == [{"id": "a"}]


def busy_state(n: int) -> str:
    # ~700 tokens: a few seconds of compute each, so four simultaneous requests overlap on any machine
    # (with ~70-token states and flash attention on, a loaded CI run once saw them finish one by one).
    return f"Ticket {n}. " + " ".join(f"Line {i} of ticket {n}: the device fails to connect again." for i in range(48))


def test_a_client_needs_an_address_or_a_transport():
    with pytest.raises(ValueError):
        SemIfClient()


def test_decide_and_decide_many_against_the_real_adapter(start_serve):
    server = start_serve()
    with SemIfClient(server.base_url) as client:
        one = client.decide("My laptop screen cracked.", "Which team?", OPTIONS, id="route", policy={"min_probability": 0.0})
        many = client.decide_many("My laptop screen cracked.", [
            {"id": "route", "question": "Which team?", "options": OPTIONS},
            {"id": "urgent", "question": "Is it urgent?", "options": ["yes", "no"]},
        ])
    assert one["id"] == "route" and one["choice"] in {"hardware", "network", "hr"}
    assert one["action"] == "accept" and one.attempts == 1
    assert [r["id"] for r in many["results"]] == ["route", "urgent"]
    assert many["results"][1]["option_ids"] == ["yes", "no"]
    assert all(sum(r["probabilities"]) == pytest.approx(1.0) for r in many["results"])
    assert many.attempts == 1


def test_a_4xx_raises_with_the_adapters_json_error_and_is_not_retried(start_serve):
    server = start_serve()
    stats = RetryStats()
    with SemIfClient(server.base_url, stats=stats) as client:
        with pytest.raises(SemIfError) as caught:
            client.decide("state", "question?", ["only-one"])
    error = caught.value
    assert error.status == 422 and error.field == "decision.options"
    assert error.body["error"]["code"] == error.code
    assert stats.attempts == 1 and stats.retries == 0


@pytest.mark.reliability
def test_overload_from_a_queue_of_one_is_absorbed_by_retries_and_every_retry_matches_a_503(start_serve):
    server = start_serve(SEMIF_MAX_QUEUE=1, SEMIF_RETRY_AFTER_S=1)
    stats = RetryStats()
    n = 4
    results: list = [None] * n
    errors: list = []
    barrier = threading.Barrier(n)
    policy = RetryPolicy(max_attempts=30, max_elapsed_s=120.0, base_delay_s=0.2, max_delay_s=1.0)

    def worker(i: int) -> None:
        with SemIfClient(server.base_url, retry=policy, stats=stats) as client:
            barrier.wait()
            try:
                results[i] = client.decide(busy_state(i), "Which team should take this ticket?", OPTIONS, id=f"t{i}")
            except Exception as exc:  # pragma: no cover - reported by the assertion below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors
    assert all(r is not None and r["choice"] in {"hardware", "network", "hr"} for r in results)
    summary = stats.as_dict()
    assert summary["requests"] == n
    assert summary["retries"] >= 1, "four simultaneous requests against a queue of one must overload it"
    assert summary["attempts"] == sum(r.attempts for r in results)
    assert set(summary["retry_reasons"]) == {"http_503"}
    # every retry waited at least the server's Retry-After (1 s)
    assert summary["slept_s"] >= summary["retries"] * 1.0
    lines = [line for line in server.log_lines() if line.get("route") == "/invocations"]
    refused = [line for line in lines if line.get("status") == 503]
    assert len(refused) == summary["retries"]
    assert all(line.get("error_code") == "overloaded" for line in refused)
    assert sum(1 for line in lines if line.get("status") == 200) == n
