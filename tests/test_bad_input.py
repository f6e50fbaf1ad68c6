"""Bad input gets a 4xx JSON error naming the field; never a 500; the server keeps serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

GOOD = {
    "decision": {
        "id": "d",
        "state": "The printer on floor 3 is jammed.",
        "question": "Which team?",
        "options": [{"id": "hardware"}, {"id": "network"}],
    }
}


def _post(client, body=None, raw=None, headers=None):
    if raw is not None:
        return client.post("/invocations", content=raw, headers=headers or {"content-type": "application/json"})
    return client.post("/invocations", json=body, headers=headers)


def _assert_error(response, status, field=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"code", "message", "field"}
    assert error["message"]
    if field is not None:
        assert error["field"] == field, error
    return error


@pytest.mark.parametrize(
    "raw, field",
    [
        (b"", "<body>"),
        (b"{not json", "<body>"),
        (b"\xff\xfe\x00garbage", "<body>"),
        (b'{"decision": NaN}', "<body>"),
        (b"[" * 100_000 + b"]" * 100_000, "<body>"),
    ],
)
def test_unparseable_bodies_are_400(client, raw, field):
    _assert_error(_post(client, raw=raw), 400, field)


def _with(**changes):
    decision = dict(GOOD["decision"])
    decision.update(changes)
    return {"decision": decision}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"decision": {}}, "decision.id"),
        (_with(state=""), "decision.state"),
        (_with(state="   "), "decision.state"),
        (_with(state=42), "decision.state"),
        (_with(question=""), "decision.question"),
        (_with(options=[{"id": "only"}]), "decision.options"),
        (_with(options=[{"id": "a"}, {"id": "a"}]), "decision.options"),
        (_with(options=[{"id": "a"}, {"id": ""}]), "decision.options[1].id"),
        (_with(options=[{"id": "a"}, "b"]), "decision.options[1]"),
        (_with(options=[{"id": f"o{i}"} for i in range(256)]), "decision.options"),
        (_with(scoring="magic"), "decision.scoring"),
        ({**GOOD, "surprise": 1}, "surprise"),
        ({"state": "s", "decisions": []}, "decisions"),
        ({"state": "s", "decisions": [GOOD["decision"] | {"state": None}]}, "decisions[0].state"),
        ([1, 2, 3], "<body>"),
        ("just a string", "<body>"),
    ],
)
def test_invalid_requests_are_422_naming_the_field(client, body, field):
    _assert_error(_post(client, body), 422, field)


def test_body_over_the_limit_is_413(client):
    big = _with(state="x" * (2 << 20))
    _assert_error(_post(client, big), 413, "<body>")


def test_prompt_longer_than_the_context_is_413_with_token_counts(client):
    error = _assert_error(_post(client, _with(state="lorem ipsum " * 3_000)), 413)
    assert "tokens" in error["message"]


def test_unknown_body_shape_on_invocations_is_422(client):
    _assert_error(_post(client, {"hello": "world"}), 422, "<body>")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
option = st.fixed_dictionaries({"id": st.text(max_size=6)}, optional={"description": json_values})
decision = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values | st.text(max_size=8),
        "state": json_values | st.text(max_size=40),
        "question": json_values | st.text(max_size=20),
        "options": st.lists(option | json_values, max_size=5) | json_values,
        "scoring": st.sampled_from(["label", "sequence", "x"]) | json_values,
    },
)
bodies = (
    st.fixed_dictionaries({"decision": decision})
    | st.fixed_dictionaries({"state": json_values | st.text(max_size=30), "decisions": st.lists(decision, max_size=3) | json_values})
    | json_values
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies)
def test_generated_bodies_never_get_a_5xx(client, body):
    response = client.post("/invocations", content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    payload = response.json()
    if response.status_code != 200:
        assert {"code", "message", "field"} <= set(payload["error"])


def test_server_keeps_serving_after_bad_input(client):
    for raw in (b"{", b"\x00\x01", b"[]"):
        _post(client, raw=raw)
    assert _post(client, GOOD).status_code == 200
