"""The abstention policy: edge cases of the rule, validation, and the action on real results and log lines."""

from __future__ import annotations

import logging

import pytest

from semif.serving.postprocess.policy import Policy, PolicyError, decide, most_severe

POLICY = Policy(min_probability=0.7, min_margin=0.2, fallback="escalate")


def test_a_confident_result_with_a_wide_margin_is_accepted():
    verdict = decide([0.8, 0.15, 0.05], POLICY)
    assert verdict.action == "accept" and verdict.fallback is None


def test_thresholds_are_inclusive():
    assert decide([0.7, 0.3], Policy(min_probability=0.7)).action == "accept"
    assert decide([0.6, 0.4], Policy(min_margin=0.2)).action == "accept"  # margin exactly 0.2
    assert decide([0.6, 0.4], Policy(min_margin=0.2000001)).action == "review"


def test_low_probability_abstains_to_the_fallback_and_says_why():
    verdict = decide([0.5, 0.1, 0.4], POLICY)
    assert verdict.action == "abstain"
    assert verdict.fallback == "escalate"
    assert "probability 0.500 < min_probability 0.7" in verdict.reason
    assert "margin 0.100 < min_margin 0.2" in verdict.reason


def test_a_narrow_margin_alone_is_enough_to_fail():
    verdict = decide([0.72, 0.28], Policy(min_probability=0.7, min_margin=0.5, fallback="abstain"))
    assert verdict.action == "abstain"
    assert "margin" in verdict.reason and "min_probability" not in verdict.reason


def test_the_default_fallback_is_review_by_a_person():
    verdict = decide([0.4, 0.35, 0.25], Policy(min_probability=0.5))
    assert (verdict.action, verdict.fallback) == ("review", None)


def test_an_empty_policy_accepts_everything_including_a_tie():
    assert decide([0.5, 0.5], Policy.from_mapping({})).action == "accept"


def test_ties_have_zero_margin():
    assert decide([0.5, 0.5], Policy(min_margin=0.01)).action == "review"


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"min_probability": 1.5}, "policy.min_probability"),
        ({"min_margin": -0.1}, "policy.min_margin"),
        ({"min_probability": "0.7"}, "policy.min_probability"),
        ({"min_probability": True}, "policy.min_probability"),
        ({"fallback": ""}, "policy.fallback"),
        ({"fallback": 3}, "policy.fallback"),
        ({"threshold": 0.5}, "policy.threshold"),
        ([0.7], "policy"),
    ],
)
def test_invalid_policies_are_refused_naming_the_field(raw, field):
    with pytest.raises(PolicyError) as caught:
        Policy.from_mapping(raw)
    assert caught.value.field == field


def test_most_severe_orders_abstain_over_review_over_accept():
    assert most_severe(["accept", "review"]) == "review"
    assert most_severe(["review", "abstain", "accept"]) == "abstain"
    assert most_severe([]) is None


# ---- through the adapter (in-process, real model) -------------------------------------------------

BATCH = {
    "state": "Order 1142 arrived broken and the customer wants a refund before Friday.",
    "decisions": [
        {"id": "queue", "question": "Which queue?", "options": [{"id": "billing"}, {"id": "shipping"}, {"id": "returns"}]},
        {"id": "urgent", "question": "Is it urgent?", "options": [{"id": "yes"}, {"id": "no"}]},
    ],
}


def test_each_result_carries_the_action_its_probabilities_imply(client):
    policy = {"min_probability": 0.6, "min_margin": 0.1, "fallback": "escalate"}
    response = client.post("/invocations", json={**BATCH, "policy": policy})
    assert response.status_code == 200, response.text
    for result in response.json()["results"]:
        expected = decide(result["probabilities"], Policy.from_mapping(policy))
        assert result["action"] == expected.action
        assert result["action_reason"] == expected.reason
        assert result.get("fallback") == expected.fallback


def test_unreachable_thresholds_make_every_result_abstain_and_the_log_line_says_so(client, caplog):
    with caplog.at_level(logging.INFO, logger="semif.http"):
        response = client.post("/invocations", json={**BATCH, "policy": {"min_probability": 1.0, "fallback": "abstain"}})
    results = response.json()["results"]
    assert [r["action"] for r in results] == ["abstain", "abstain"]
    assert all(r["fallback"] == "abstain" for r in results)
    line = [r for r in caplog.records if r.name == "semif.http" and getattr(r, "route", None) == "/invocations"][-1]
    assert line.action == "abstain"
    assert line.actions == {"abstain": 2}


def test_a_zero_policy_accepts_and_no_policy_adds_no_action(client, caplog):
    single = {"decision": {"id": "d", "state": "The VPN drops.", "question": "Which team?", "options": [{"id": "network"}, {"id": "hr"}]}}
    accepted = client.post("/invocations", json={**single, "policy": {"min_probability": 0}}).json()
    assert accepted["action"] == "accept"
    with caplog.at_level(logging.INFO, logger="semif.http"):
        plain = client.post("/invocations", json=single).json()
    assert "action" not in plain and "calibration" not in plain
    line = [r for r in caplog.records if r.name == "semif.http" and getattr(r, "route", None) == "/invocations"][-1]
    assert not hasattr(line, "action")


@pytest.mark.parametrize(
    "policy, field",
    [({"min_probability": 2}, "policy.min_probability"), ({"bogus": 1}, "policy.bogus"), ({"fallback": ""}, "policy.fallback")],
)
def test_an_invalid_policy_in_the_request_is_a_422_naming_the_field(client, policy, field):
    response = client.post("/invocations", json={**BATCH, "policy": policy})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == field
