"""Bad input gets a 4xx JSON error naming the field; never a 500; the server keeps serving."""

from __future__ import annotations

import json

import pytest

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
        (b"[" * 100_000 + b"]" * 100_000, "[0][0][0][0][0][0][0][0]…"),  # too deep: the path where it got too deep
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


def test_server_keeps_serving_after_bad_input(client):
    for raw in (b"{", b"\x00\x01", b"[]"):
        _post(client, raw=raw)
    assert _post(client, GOOD).status_code == 200


# ---- input that must never reach a 500 ---------------------------------------------------------------

SYSTEM_ONE = {"model": "jev-latest", "state": "Charged twice.", "questions": {"refund": {"type": "noul", "instructions": "Refund?"}}}
OPENAI = {"model": "gpt-6-luna", "input": "Charged twice.", "questions": [{"type": "predicate", "name": "refund", "instructions": "Refund?"}]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _raw_post(client, path, text: str):
    return client.post(path, content=text.encode("utf-8"), headers={"content-type": "application/json"})


def _field(path: str, response) -> str:
    """The field an error names, in each contract's own shape."""
    body = response.json()
    if path == "/v1/systemone":
        detail = body["detail"]
        return ".".join(str(p) for p in detail[0]["loc"][1:]) if isinstance(detail, list) else detail["field"]
    error = body["error"]
    return error["field"] if path == "/v1/semif" else error["param"]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/systemone", {**SYSTEM_ONE, "state": "locked out \ud800"}, "state"),
        ("/v1/systemone", {**SYSTEM_ONE, "state": {"note \udfff": "x"}}, "state"),
        ("/v1/decisions", {**OPENAI, "input": "\ud800"}, "input"),
        ("/v1/semif", {"decision": {**GOOD["decision"], "state": "a\udbffb"}}, "decision.state"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ],
)
def test_lone_surrogates_get_400_naming_the_field(client, path, body, field):
    # json.dumps writes the lone surrogate as the escape \ud800: valid JSON text, but no UTF-8 string
    response = _raw_post(client, path, json.dumps(body))
    assert response.status_code == 400, response.text
    assert _field(path, response) == field


def _nested(depth: int) -> str:
    """JSON text nested ``depth`` levels, alternating objects and arrays (written by hand: json.dumps
    itself gives up far earlier)."""
    opens = ['{"k":' if i % 2 else "[" for i in range(depth)]
    closes = ["}" if i % 2 else "]" for i in reversed(range(depth))]
    return "".join(opens) + '"deep"' + "".join(closes)


def _with_value(body: dict, key: str, value_json: str) -> str:
    """``body`` as JSON with ``key`` replaced by raw JSON text."""
    return json.dumps({**body, key: "@@"}).replace('"@@"', value_json)


def test_a_system_one_state_nested_1200_deep_gets_400_naming_the_state(client):
    response = _raw_post(client, "/v1/systemone", _with_value(SYSTEM_ONE, "state", _nested(1200)))
    assert response.status_code == 400, response.text
    assert response.json()["detail"]["field"].startswith("state")
    assert response.json()["detail"]["code"] == "too_deep"


def test_an_openai_input_json_nested_1200_deep_gets_400_naming_the_part(client):
    part = '[{"role": "user", "content": [{"type": "input_json", "data": {"x": ' + _nested(1200) + "}}]}]"
    response = _raw_post(client, "/v1/decisions", _with_value(OPENAI, "input", part))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("input[0].content[0].data")


def test_nesting_up_to_the_limit_is_answered(client):
    from semif.serving.http.app import MAX_JSON_DEPTH

    # The body adds one level ({"state": …}); the deepest container then sits at the limit.
    response = _raw_post(client, "/v1/systemone", _with_value(SYSTEM_ONE, "state", _nested(MAX_JSON_DEPTH - 1)))
    assert response.status_code == 200, response.text[:300]
    too_deep = _raw_post(client, "/v1/systemone", _with_value(SYSTEM_ONE, "state", _nested(MAX_JSON_DEPTH)))
    assert too_deep.status_code == 400 and too_deep.json()["detail"]["code"] == "too_deep"


@pytest.mark.parametrize("fallback", [" ", "\t\n"])
def test_a_blank_policy_fallback_is_422_before_the_model_runs(client, engine, monkeypatch, fallback):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the model ran for a request that was invalid from the start")

    monkeypatch.setattr(engine, "execute", must_not_run)
    response = client.post("/v1/semif", json={**GOOD, "policy": {"min_probability": 0.9, "fallback": fallback}})
    _assert_error(response, 422, "policy.fallback")


@pytest.mark.parametrize(
    "path, text, key",
    [
        ("/v1/semif", '{"decision": {"id": "a", "id": "b", "state": "s", "question": "q", "options": [{"id": "x"}, {"id": "y"}]}}', "id"),
        ("/v1/systemone", '{"state": "s", "state": "t", "questions": {"q": {"type": "noul", "instructions": "x"}}}', "state"),
        ("/v1/decisions", '{"model": "gpt-6-luna", "input": "s", "questions": [{"type": "predicate", "name": "a", "name": "b", "instructions": "x"}]}', "name"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "max_tokens": 999999}', "max_tokens"),
    ],
)
def test_duplicate_keys_are_400_naming_the_key_not_last_wins(client, path, text, key):
    response = _raw_post(client, path, text)
    assert response.status_code == 400, response.text
    assert _field(path, response) == key
    assert "duplicate" in response.text


LONG = "x" * 5000


@pytest.mark.parametrize(
    "path, body, headers",
    [
        ("/v1/systemone", {**SYSTEM_ONE, "model": LONG}, None),
        ("/v1/decisions", {**OPENAI, "model": LONG}, None),
        ("/v1/decisions", {**OPENAI, "questions": [{"type": LONG, "instructions": "x"}]}, None),
        ("/v1/decisions", {**OPENAI, "input": [{"type": LONG}]}, None),
        ("/v1/systemone", {**SYSTEM_ONE, "questions": {LONG: {"type": LONG}}}, None),
        ("/v1/systemone", {**SYSTEM_ONE, "questions": {LONG: {"type": "noul"}}}, None),
        ("/v1/semif", {**GOOD, LONG: 1}, None),
        ("/v1/semif", {"decision": {**GOOD["decision"], "options": [{"id": LONG[:256]}, {"id": LONG[:256]}]}}, None),
        ("/invocations", GOOD, {"X-Amzn-SageMaker-Custom-Attributes": "contract=" + LONG}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": LONG, "content": "x"}]}, None),
        ("/v1/semif", {"decision": {**GOOD["decision"], "scoring": LONG}}, None),
    ],
)
def test_errors_never_echo_more_than_200_characters_of_input(client, path, body, headers):
    response = client.post(path, json=body, headers=headers)
    assert 400 <= response.status_code < 500, response.text[:300]
    assert "x" * 201 not in response.text


def _options(n: int, description_words: int = 75) -> list:
    return [{"id": f"queue_{i}", "description": " ".join(["detailed routing rule"] * (description_words // 3))} for i in range(n)]


def test_a_semif_batch_whose_third_option_list_is_too_long_names_decisions_2_options(client):
    decisions = [{"id": f"d{i}", "question": "Which queue?", "options": _options(3, 3)} for i in range(2)]
    decisions.append({"id": "big", "question": "Which queue?", "options": _options(60)})
    response = client.post("/v1/semif", json={"state": "A short ticket.", "decisions": decisions})
    error = _assert_error(response, 413, "decisions[2].options")
    assert "big" in error["message"]


def test_a_long_state_is_still_blamed_on_the_state(client):
    decisions = [{"id": "d", "question": "Which team?", "options": [{"id": "a"}, {"id": "b"}]}]
    response = client.post("/v1/semif", json={"state": "lorem ipsum " * 3000, "decisions": decisions})
    _assert_error(response, 413, "state")


def test_system_one_and_openai_name_the_question_whose_prompt_is_too_long(client):
    criteria = {o["id"]: o["description"] for o in _options(60)}
    questions = {"refund": SYSTEM_ONE["questions"]["refund"], "team": {"type": "choice", "instructions": "Queue?", "criteria": criteria}}
    response = client.post("/v1/systemone", json={**SYSTEM_ONE, "questions": questions})
    assert response.status_code == 413, response.text[:300]
    assert response.json()["detail"]["field"] == "questions.team.criteria"
    choices = [{"value": o["id"], "description": o["description"]} for o in _options(60)]
    questions = [OPENAI["questions"][0], {"type": "choice", "name": "team", "instructions": "Queue?", "choices": choices}]
    response = client.post("/v1/decisions", json={**OPENAI, "questions": questions})
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "questions[1].choices" and "'team'" in error["message"]


def test_a_request_over_the_token_budget_is_413_naming_the_questions(engine, model_path):
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app
    from serving import make_settings

    with TestClient(create_app(make_settings(model_path, max_request_tokens=300), engine)) as small_budget:
        decisions = [{"id": f"d{i}", "question": "Which team?", "options": [{"id": "a"}, {"id": "b"}]} for i in range(10)]
        response = small_budget.post("/v1/semif", json={"state": "A short ticket.", "decisions": decisions})
        error = _assert_error(response, 413, "decisions")
        assert error["code"] == "token_budget_exceeded" and "SEMIF_MAX_REQUEST_TOKENS" in error["message"]
        assert small_budget.post("/v1/semif", json={"state": "A short ticket.", "decisions": decisions[:1]}).status_code == 200


def test_a_state_of_a_mebibyte_of_fence_tags_is_refused_without_the_model(client, engine, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the model thread was used for a request refused by its plan")

    monkeypatch.setattr(engine, "execute", must_not_run)
    parts, size, n = ["<state>"], 7, 1
    while size < 1_000_000:
        parts.append(f"<state-{n}>")
        size += len(parts[-1])
        n += 1
    response = client.post("/v1/systemone", json={**SYSTEM_ONE, "state": "".join(parts)})
    assert response.status_code == 413, response.text[:300]
    assert response.json()["detail"]["field"] == "state"


# ---- property-based fuzz over the four request routes ---------------------------------------------
#
# Generators aim near the valid shape of each contract (so that bodies reach deep validation and the
# model) and mix in at every level: lone surrogates, nesting past the depth limit, huge numbers,
# NaN/Infinity, duplicate keys, wrong types and oversized fields. Bodies are serialized by `_dump`,
# which can write what json.dumps cannot (duplicate keys, raw number literals).


class Raw(str):
    """JSON text written verbatim."""


class Pairs(list):
    """An object written from (key, value) pairs: keys may repeat."""


def _dump(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, (dict, Pairs)):
        items = value.items() if isinstance(value, dict) else value
        return "{" + ",".join(json.dumps(k) + ":" + _dump(v) for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dump(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate becomes the escape \ud800


def _strings(value):
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str) and not isinstance(node, Raw):
            yield node
        elif isinstance(node, (dict, Pairs)):
            for k, v in (node.items() if isinstance(node, dict) else node):
                stack += [k, v]
        elif isinstance(node, list):
            stack += node


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

surrogate = st.sampled_from(["\ud800", "\udfff", "\udbff", "\udc00x", "a\ud83d"])
plain_text = st.text(max_size=12)
text = st.one_of(plain_text, plain_text, plain_text, plain_text, st.builds(lambda a, s, b: a + s + b, plain_text, surrogate, plain_text))
oversized = st.sampled_from([257, 4001, 8001, 20_000, 200_001]).map(lambda n: "x" * n)
special_numbers = st.sampled_from(["1e999", "-1e999", "1e-999", "NaN", "Infinity", "-Infinity", "9" * 5000,
                                   "123456789012345678901234567890", "-0", "0.0"]).map(Raw)
deep = st.integers(95, 1300).flatmap(lambda d: st.sampled_from([Raw("[" * d + "]" * d), Raw('{"a":' * d + "1" + "}" * d)]))
scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text | special_numbers
junk = st.recursive(
    st.one_of(scalar, scalar, scalar, scalar, scalar, scalar, deep, oversized),
    lambda children: (st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4)
                      | st.lists(st.tuples(st.sampled_from(["a", "id", "type"]), children), min_size=2, max_size=3).map(Pairs)),
    max_leaves=8,
)


def _route_strategies(junk, text, least: int = 0) -> dict:
    """Body generators per route; ``junk`` is what replaces a field (sometimes), ``text`` what fills one,
    ``least`` the fewest options/questions a list gets."""

    def _either(good):
        return st.one_of(good, good, good, good, good, junk)  # mostly plausible, sometimes anything

    semif_option = st.fixed_dictionaries({"id": _either(st.sampled_from(["a", "b", "c", "billing"]) | text)},
                                         optional={"description": _either(text)})
    semif_decision = st.fixed_dictionaries(
        {"id": _either(st.sampled_from(["d1", "d2"]) | text), "question": _either(st.just("Which team?") | text),
         "options": _either(st.lists(_either(semif_option), min_size=least, max_size=4))},
        optional={"state": _either(st.just("The printer is jammed.") | text | oversized), "scoring": _either(st.sampled_from(["label", "sequence"]))},
    )
    semif_policy = st.fixed_dictionaries({}, optional={
        "min_probability": _either(st.floats(0, 1)), "min_margin": _either(st.floats(0, 1)),
        "fallback": _either(st.sampled_from(["review", "abstain", "escalate", " ", "", "\t"]) | oversized)})
    semif_body = (
        st.fixed_dictionaries({"decision": _either(semif_decision)}, optional={"policy": semif_policy, "return_prompt": _either(st.booleans())})
        | st.fixed_dictionaries({"state": _either(st.just("The printer is jammed.") | text), "decisions": _either(st.lists(semif_decision, min_size=least // 2, max_size=3))},
                                optional={"policy": semif_policy, "scoring": _either(st.sampled_from(["label", "sequence"]))})
    )

    content = text | junk
    so_noul = st.fixed_dictionaries({"type": st.just("noul")}, optional={"instructions": _either(content),
                                    "criteria": _either(st.fixed_dictionaries({}, optional={"true": content, "false": content}))})
    so_choice = st.fixed_dictionaries({"type": st.just("choice"), "criteria": _either(st.dictionaries(text, st.none() | content, max_size=4))},
                                      optional={"instructions": _either(content)})
    so_score = st.fixed_dictionaries({"type": st.just("score"), "criteria": _either(st.lists(content, max_size=4))},
                                     optional={"instructions": _either(content)})
    systemone_body = st.fixed_dictionaries(
        {"state": _either(st.just("Charged twice.") | text | junk), "questions": _either(st.dictionaries(text, _either(so_noul | so_choice | so_score), min_size=least // 2, max_size=3))},
        optional={"model": _either(st.sampled_from(["jev-latest", "other"]) | oversized), "assets": junk},
    )

    oa_part = st.fixed_dictionaries({"type": _either(st.sampled_from(["input_text", "input_json", "input_image"]))},
                                    optional={"text": _either(text), "data": _either(junk)})
    oa_item = st.fixed_dictionaries({"role": _either(st.sampled_from(["user", "system", "assistant", "developer"]))},
                                    optional={"type": _either(st.just("message")), "content": _either(text | st.lists(oa_part, max_size=3))})
    oa_question = st.fixed_dictionaries(
        {"type": _either(st.sampled_from(["predicate", "choice", "score"])), "instructions": _either(st.just("Refund?") | text)},
        optional={"name": _either(text), "choices": _either(st.lists(st.fixed_dictionaries({"value": _either(text | st.booleans())}), max_size=4)),
                  "levels": _either(st.lists(st.fixed_dictionaries({"label": _either(text)}), max_size=4))},
    )
    openai_body = st.fixed_dictionaries(
        {"model": _either(st.just("gpt-6-luna")), "input": _either(text | st.lists(oa_item, max_size=3)), "questions": _either(st.lists(oa_question, min_size=least // 2, max_size=3))},
        optional={"prompt_cache_key": _either(text)},
    )

    no_none_junk = junk.filter(lambda v: v is not None)  # an absent max_tokens means 256 tokens: too slow for a fuzz
    chat_message = st.fixed_dictionaries({"role": _either(st.sampled_from(["user", "system", "assistant", "wizard"])),
                                          "content": _either(text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2))})
    chat_body = st.fixed_dictionaries(
        {"messages": _either(st.lists(chat_message, max_size=3)), "max_tokens": st.integers(-1, 2) | st.integers(-1, 2) | no_none_junk},
        optional={"temperature": _either(st.floats(0, 2)), "stop": _either(text), "stream": _either(st.booleans()), "n": _either(st.integers(0, 2))},
    )

    return {"/v1/semif": semif_body, "/v1/systemone": systemone_body, "/v1/decisions": openai_body, "/v1/chat/completions": chat_body}


# Half the bodies are hostile (junk with surrogates, deep nesting, huge numbers, duplicate keys, oversized
# fields at any level); half are near-valid with only plain wrong values, so that many reach the model.
light_junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | plain_text,
                          lambda children: st.lists(children, max_size=3) | st.dictionaries(plain_text, children, max_size=3),
                          max_leaves=4)
HOSTILE = _route_strategies(junk, text)
PLAUSIBLE = _route_strategies(light_junk, plain_text, least=2)
ROUTES = {path: HOSTILE[path] | PLAUSIBLE[path] for path in HOSTILE}
FUZZ_BODIES = 2000


def _error_shape_ok(path: str, payload: dict) -> bool:
    if path == "/v1/systemone":
        return "detail" in payload
    if path == "/v1/semif":
        return {"code", "message", "field"} <= set(payload["error"])
    return {"message", "type", "param", "code"} <= set(payload["error"])


def test_generated_bodies_on_all_four_routes_never_get_a_5xx_and_the_server_still_decides(client):
    statuses: dict[str, list[int]] = {path: [] for path in ROUTES}

    @settings(max_examples=FUZZ_BODIES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=st.sampled_from(sorted(ROUTES)).flatmap(lambda path: st.tuples(st.just(path), ROUTES[path])))
    def post(case):
        path, body = case
        response = client.post(path, content=_dump(body).encode("utf-8"), headers={"content-type": "application/json"})
        statuses[path].append(response.status_code)
        assert response.status_code < 500, (path, _dump(body)[:500], response.text[:500])
        if response.status_code != 200:
            assert _error_shape_ok(path, response.json()), response.text[:500]
            for value in _strings(body):
                if len(value) > 200:
                    assert value[:201] not in response.text  # at most 200 characters of input echoed

    post()
    counts = {path: len(s) for path, s in statuses.items()}
    assert sum(counts.values()) >= FUZZ_BODIES, counts
    assert all(n >= FUZZ_BODIES // 8 for n in counts.values()), counts
    print("fuzz statuses:", {p: {c: s.count(c) for c in sorted(set(s))} for p, s in statuses.items()})
    assert _post(client, GOOD).status_code == 200


# Option ids hold no control characters and descriptions no U+001E/U+001F: the option-set hash
# (options_sha256) separates ids and descriptions with those two, so two different option sets
# could otherwise hash alike.
def _semif_options(*options) -> dict:
    return {"decision": {**GOOD["decision"], "options": list(options)}}


def _systemone_choice(criteria) -> dict:
    return {**SYSTEM_ONE, "questions": {"team": {"type": "choice", "instructions": "Which team?", "criteria": criteria}}}


def _openai_choice(choices) -> dict:
    return {**OPENAI, "questions": [{"type": "choice", "name": "team", "instructions": "Which team?", "choices": choices}]}


def _openai_score(levels) -> dict:
    return {**OPENAI, "questions": [{"type": "score", "name": "urgency", "instructions": "How urgent?", "levels": levels}]}


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/v1/semif", _semif_options({"id": "hardware"}, {"id": "net\x1fwork"}), 422, "decision.options[1].id"),
        ("/v1/semif", _semif_options({"id": "hardware"}, {"id": "net\nwork"}), 422, "decision.options[1].id"),
        ("/v1/semif", _semif_options({"id": "hardware"}, {"id": "net\x7f"}), 422, "decision.options[1].id"),
        ("/v1/semif", _semif_options({"id": "hardware", "description": "printers\x1e"}, {"id": "network"}), 422,
         "decision.options[0].description"),
        ("/v1/systemone", _systemone_choice({"hardware": None, "net\x1ework": None}), 422, "questions.team.criteria.net\x1ework"),
        ("/v1/systemone", _systemone_choice({"hardware": "printers\x1f", "network": None}), 422, "questions.team.criteria.hardware"),
        ("/v1/systemone", {**SYSTEM_ONE, "questions": {"urgent": {"type": "score", "criteria": ["low", "hi\x1fgh"]}}}, 422,
         "questions.urgent.criteria.1"),
        ("/v1/decisions", _openai_choice([{"value": "hardware"}, {"value": "net\x00work"}]), 400, "questions[0].choices[1].value"),
        ("/v1/decisions", _openai_choice([{"value": "hardware", "description": "a\x1fb"}, {"value": "network"}]), 400,
         "questions[0].choices[0].description"),
        ("/v1/decisions", _openai_score([{"label": "low"}, {"label": "hi\tgh"}]), 400, "questions[0].levels[1].label"),
    ],
    ids=["semif-id-separator", "semif-id-newline", "semif-id-del", "semif-description-separator",
         "systemone-name-separator", "systemone-description-separator", "systemone-level-separator",
         "openai-value-nul", "openai-description-separator", "openai-label-tab"],
)
def test_option_ids_with_control_characters_and_descriptions_with_hash_separators_are_refused(client, path, body, status, field):
    response = _raw_post(client, path, json.dumps(body))
    assert response.status_code == status, response.text
    assert _field(path, response) == field


def test_descriptions_may_hold_newlines_and_ids_without_control_characters_are_answered(client):
    answer = client.post("/v1/semif", json=_semif_options({"id": "hardware", "description": "printers,\nscanners"},
                                                         {"id": "network"}))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choice"] in ("hardware", "network")
