"""OpenAI Decisions (`POST /v1/decisions`) on the real model: wire contract, mapping onto the engine, usage
and cache accounting, errors, `/invocations` dispatch, and the official openai SDK."""

from __future__ import annotations

import math

import numpy as np
import pytest
from semif.serving.config import Settings
from serving import content_free_tokens, start_cold

# The label memo is off here: each answer is compared with the engine's cold evaluation, and usage counts real reuse
# (a memo hit would repeat the first answer).
pytestmark = pytest.mark.usefixtures("memo_off")

INPUT = ("I was charged twice for my March invoice (order #4471) and the refund I was promised last week "
         "still hasn't arrived. Please fix this today or I will dispute the charge.")
PREDICATE = {"type": "predicate", "name": "refund", "instructions": "The customer asks for money back."}
CHOICE = {"type": "choice", "name": "team", "instructions": "Which team should handle this ticket?",
          "choices": [{"value": "billing", "description": "Payments, invoices, refunds"}, {"value": "technical"}, {"value": "sales"}]}
SCORE = {"type": "score", "name": "anger", "instructions": "How frustrated is the customer?",
         "levels": [{"label": "calm"}, {"label": "frustrated"}, {"label": "very angry", "description": "threatens action"}]}


def decide(client, questions, input=INPUT, path="/v1/decisions", model="gpt-6-luna", **extra):
    return client.post(path, json={"model": model, "input": input, "questions": questions, **extra})


def answers_of(response):
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]  # computed now (memo off)
    return response.json()["answers"]


def test_predicate_is_the_engines_probability_of_yes(client, engine):
    from semif.serving.contracts import openai_decisions
    from semif.serving.contracts.base import Limits

    body = decide(client, [PREDICATE]).json()
    assert set(body) == {"answers", "model", "usage"}
    answer = body["answers"][0]
    assert answer == {"type": "predicate", "name": "refund", "probability": answer["probability"]}
    assert body["usage"]["input_tokens_details"]["cached_tokens"] < body["usage"]["input_tokens"]
    job = openai_decisions.parse({"model": "m", "input": INPUT, "questions": [PREDICATE]}, Limits(255, 400))
    start_cold(engine)  # a cold run: the reference the cached runs must equal
    cold = engine.score(job.state_text, job.questions, debias=Settings.debias)  # as the server answers it
    assert cold.cached_tokens == 0 and cold.distributions[0].debias == Settings.debias
    # Every input token (each order read under the default), and the content-free prompt where the default reads one.
    assert cold.evaluated_tokens == cold.input_tokens + content_free_tokens(cold)
    expected = cold.distributions[0].probabilities[0]
    assert math.isclose(answer["probability"], expected, abs_tol=1e-4)


def test_choice_answer_lists_typed_values_in_order_with_confidence(client):
    question = {"type": "choice", "instructions": "Is the claim valid?",
                "choices": [{"value": "yes"}, {"value": True}, {"value": False}, {"value": "unsure"}]}
    answer = answers_of(decide(client, [question]))[0]
    assert answer["name"] is None
    values = [p["value"] for p in answer["probabilities"]]
    assert values == ["yes", True, False, "unsure"] and type(values[0]) is str and type(values[1]) is bool
    probs = [p["probability"] for p in answer["probabilities"]]
    assert math.isclose(sum(probs), 1.0, abs_tol=1e-9)
    assert answer["choice"] == values[int(np.argmax(probs))] and type(answer["choice"]) is type(values[int(np.argmax(probs))])
    assert math.isclose(answer["confidence"], (max(probs) - 1 / 4) / (1 - 1 / 4), abs_tol=1e-9)


def test_score_answer_is_the_expectation_over_level_values(client):
    answer = answers_of(decide(client, [SCORE]))[0]
    assert [(p["label"], p["value"]) for p in answer["probabilities"]] == [("calm", 0), ("frustrated", 1), ("very angry", 2)]
    probs = [p["probability"] for p in answer["probabilities"]]
    assert math.isclose(sum(probs), 1.0, abs_tol=1e-9)
    assert math.isclose(answer["score"], sum(i * p for i, p in enumerate(probs)), abs_tol=1e-9)
    assert 0.0 <= answer["confidence"] <= 1.0


def test_answers_come_in_question_order_and_do_not_depend_on_the_others(client):
    mixed = answers_of(decide(client, [PREDICATE, CHOICE, SCORE]))
    reversed_ = answers_of(decide(client, [SCORE, CHOICE, PREDICATE]))
    assert [a["type"] for a in mixed] == ["predicate", "choice", "score"]
    assert [a["name"] for a in reversed_] == ["anger", "team", "refund"]
    alone = [answers_of(decide(client, [q]))[0] for q in (PREDICATE, CHOICE, SCORE)]
    for a, b, c in zip(mixed, reversed(reversed_), alone):
        if a["type"] == "predicate":
            assert math.isclose(a["probability"], b["probability"], abs_tol=1e-4)
            assert math.isclose(a["probability"], c["probability"], abs_tol=1e-4)
        else:
            pa = [p["probability"] for p in a["probabilities"]]
            np.testing.assert_allclose(pa, [p["probability"] for p in b["probabilities"]], atol=1e-4)
            np.testing.assert_allclose(pa, [p["probability"] for p in c["probabilities"]], atol=1e-4)


def test_usage_counts_the_shared_prefix_once_and_reports_real_cache_reuse(client):
    fresh_input = INPUT + " (usage test)"
    first = decide(client, [PREDICATE, CHOICE, SCORE], input=fresh_input).json()["usage"]
    second = decide(client, [PREDICATE, CHOICE, SCORE], input=fresh_input).json()["usage"]
    single = decide(client, [PREDICATE], input=fresh_input).json()["usage"]
    assert first["output_tokens"] == 0 and first["output_tokens_details"] == {"reasoning_tokens": 0}
    assert first["total_tokens"] == first["input_tokens"]
    state_tokens = first["input_tokens_details"]["cached_tokens"] + first["input_tokens_details"]["cache_write_tokens"]
    assert first["input_tokens_details"]["cached_tokens"] < state_tokens  # a new input is not all cached
    assert second["input_tokens_details"]["cached_tokens"] == state_tokens  # the repeat reuses the whole prefix
    assert second["input_tokens_details"]["cache_write_tokens"] == 0
    # three questions cost the state prefix once: less than three single-question requests
    assert first["input_tokens"] < 3 * single["input_tokens"]


def test_message_input_is_rendered_as_a_transcript(client):
    messages = [
        {"role": "system", "content": "Support inbox."},
        {"role": "user", "content": [{"type": "input_text", "text": INPUT}, {"type": "input_json", "data": {"order": 4471}}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Looking into it."}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup_order", "arguments": "{\"order\": 4471}"},
        {"type": "function_call_output", "call_id": "c1", "output": "refund pending"},
        {"type": "message", "role": "developer", "content": "Be strict."},
    ]
    answer = answers_of(decide(client, [PREDICATE], input=messages))[0]
    assert 0.0 <= answer["probability"] <= 1.0


def _error(response, status=400):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": INPUT, "questions": [PREDICATE]}, "model"),
        ({"model": "m", "questions": [PREDICATE]}, "input"),
        ({"model": "m", "input": INPUT, "questions": []}, "questions"),
        ({"model": "m", "input": INPUT, "questions": [{"type": "predicate"}]}, "questions[0].instructions"),
        ({"model": "m", "input": INPUT, "questions": [{"type": "noul", "instructions": "x"}]}, "questions[0].type"),
        ({"model": "m", "input": INPUT, "questions": [{**CHOICE, "choices": [{"value": "a"}]}]}, "questions[0].choices"),
        ({"model": "m", "input": INPUT, "questions": [{**CHOICE, "choices": [{"value": "a"}, {"value": "a"}]}]}, "questions[0].choices[1].value"),
        ({"model": "m", "input": INPUT, "questions": [{**CHOICE, "choices": [{"value": 1}, {"value": "a"}]}]}, "questions[0].choices[0].value"),
        ({"model": "m", "input": INPUT, "questions": [{**SCORE, "levels": [{"label": str(i)} for i in range(11)]}]}, "questions[0].levels"),
        ({"model": "m", "input": [{"type": "function_call_output", "call_id": "x", "output": "y"}], "questions": [PREDICATE]}, "input[0].call_id"),
        ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}], "questions": [PREDICATE]}, "input[0].content[0].type"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}], "questions": [PREDICATE]}, "input[0].role"),
    ],
)
def test_invalid_requests_get_400_invalid_request_error_naming_the_param(client, body, param):
    error = _error(client.post("/v1/decisions", json=body))
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("field, value", [("second_look", {"below_margin": 0.5}), ("policy", {"min_probability": 0.9}),
                                          ("return_prompt", True), ("scoring", "sequence"), ("reads", 2)])
def test_semif_fields_are_refused_naming_the_field_never_ignored(client, field, value):
    error = _error(decide(client, [PREDICATE], **{field: value}))
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    per_question = _error(decide(client, [{**CHOICE, "scoring": "sequence"}]))
    assert per_question["param"] == "questions[0].scoring"
    assert decide(client, [PREDICATE], **{field: None}).status_code == 200  # null: absent, as for every extension
    assert decide(client, [PREDICATE], return_prompt=False).status_code == 200  # asks for nothing


# ---- the abstain option (x_abstain_option) ------------------------------------------------------------

VAGUE = "Hi, I have a question about my account, can someone get back to me?"
ROUTE_OR_ASK = {"type": "choice", "name": "route", "instructions": "Which team should handle this ticket?",
                "choices": [{"value": "billing", "description": "Payments, invoices, refunds"},
                            {"value": "technical", "description": "Bugs, outages"},
                            {"value": "needs_more_info", "description": "The message does not say enough to route it."}]}


def _cold_answer(engine, client, path, body):
    start_cold(engine)  # each answer a cold evaluation: the two contracts' answers compare exactly
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_marked_abstain_option_gives_semifs_answer_for_the_same_decision(client, engine):
    """x_abstain_option reaches the engine as SemIf's abstain_option does: the OpenAI answer equals SemIf's
    marked one, names the kept option by its value, and differs from the unmarked answer."""
    body = {"model": "gpt-6-luna", "input": VAGUE, "debias": "content_free"}
    marked = _cold_answer(engine, client, "/v1/decisions",
                          {**body, "questions": [{**ROUTE_OR_ASK, "x_abstain_option": "needs_more_info"}]})
    plain = _cold_answer(engine, client, "/v1/decisions", {**body, "questions": [ROUTE_OR_ASK]})
    options = [{"id": c["value"], "description": c["description"]} for c in ROUTE_OR_ASK["choices"]]
    semif = _cold_answer(engine, client, "/v1/semif", {
        "decision": {"id": "route", "state": VAGUE, "question": ROUTE_OR_ASK["instructions"], "options": options,
                     "abstain_option": "needs_more_info"}, "debias": "content_free"})
    got = [p["probability"] for p in marked["answers"][0]["probabilities"]]
    assert got == semif["probabilities"]
    assert marked["x_semif"]["content_free"][0]["abstain_kept"] == "needs_more_info"
    assert "abstain_kept" not in plain["x_semif"]["content_free"][0]
    unmarked = [p["probability"] for p in plain["answers"][0]["probabilities"]]
    assert abs(unmarked[2] - got[2]) > 1e-3  # unmarked, the abstain option is divided out like the others


def test_a_marked_abstain_option_alone_asks_for_the_x_semif_record(client):
    """A mark is an extension: it asks for the x_semif record at any debiasing, and under content-free
    calibration the record says which option kept its content-free share."""
    marked = decide(client, [{**ROUTE_OR_ASK, "x_abstain_option": "needs_more_info"}], input=VAGUE)
    assert marked.status_code == 200, marked.text
    assert marked.json()["x_semif"]["debias"] == Settings.debias  # the test server's default
    calibrated = decide(client, [{**ROUTE_OR_ASK, "x_abstain_option": "needs_more_info"}], input=VAGUE,
                        debias="content_free")
    assert calibrated.status_code == 200, calibrated.text
    record = calibrated.json()["x_semif"]
    assert record["debias"] == "content_free"
    assert record["content_free"][0]["abstain_kept"] == "needs_more_info"
    assert "x_semif" not in decide(client, [ROUTE_OR_ASK], input=VAGUE).json()  # a plain request: OpenAI's shape


@pytest.mark.parametrize("question, param, code", [
    ({**ROUTE_OR_ASK, "x_abstain_option": "unknown"}, "questions[0].x_abstain_option", "invalid_request"),
    ({**ROUTE_OR_ASK, "x_abstain_option": 2}, "questions[0].x_abstain_option", "invalid_request"),
    ({**ROUTE_OR_ASK, "x_abstain_option": {"value": "needs_more_info"}}, "questions[0].x_abstain_option", "invalid_request"),
    # A value is named with its JSON type: the string "true" is not the boolean choice true.
    ({**ROUTE_OR_ASK, "choices": [{"value": True}, {"value": False}], "x_abstain_option": "true"},
     "questions[0].x_abstain_option", "invalid_request"),
    ({**PREDICATE, "x_abstain_option": "false"}, "questions[0].x_abstain_option", "invalid_request"),
    ({**SCORE, "x_abstain_option": "calm"}, "questions[0].x_abstain_option", "invalid_request"),
    ({**ROUTE_OR_ASK, "abstain_option": "needs_more_info"}, "questions[0].abstain_option", "unsupported_parameter"),
], ids=["not-a-value", "number", "object", "string-for-boolean", "predicate", "score", "semif-spelling"])
def test_a_bad_abstain_mark_is_a_400_naming_the_param_and_the_server_keeps_serving(client, question, param, code):
    error = _error(decide(client, [PREDICATE, question], input=VAGUE))
    assert error["param"] == param.replace("[0]", "[1]") and error["code"] == code
    assert decide(client, [{**ROUTE_OR_ASK, "x_abstain_option": None}], input=VAGUE).status_code == 200  # null: absent


def test_a_boolean_choice_is_marked_with_the_boolean(client):
    question = {"type": "choice", "instructions": "Does the message say which team it needs?",
                "choices": [{"value": True}, {"value": False}, {"value": "unclear"}], "x_abstain_option": False}
    response = decide(client, [question], input=VAGUE, debias="content_free")
    assert response.status_code == 200, response.text
    assert response.json()["x_semif"]["content_free"][0]["abstain_kept"] is False


@pytest.mark.parametrize("first, second", [("true", True), (False, "false"), ("a", "a")])
def test_choices_that_the_prompt_shows_alike_are_refused_naming_the_second(client, first, second):
    error = _error(decide(client, [{**CHOICE, "choices": [{"value": first}, {"value": "other"}, {"value": second}]}]))
    assert error["param"] == "questions[0].choices[2].value" and "choices[0]" in error["message"]


def test_unknown_model_is_a_404_model_not_found_and_the_served_name_works(client, engine):
    error = _error(client.post("/v1/decisions", json={"model": "gpt-4o", "input": INPUT, "questions": [PREDICATE]}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    body = decide(client, [PREDICATE], model=engine.model_path.stem)
    assert body.status_code == 200 and body.json()["model"] == engine.model_path.stem


def test_too_many_questions_is_refused(client):
    error = _error(decide(client, [PREDICATE] * 401))
    assert error["code"] == "too_many_questions"


def test_invocations_dispatches_openai_bodies_by_shape_and_custom_attributes_override(client):
    body = {"model": "gpt-6-luna", "input": INPUT, "questions": [PREDICATE]}
    via = client.post("/invocations", json=body)
    assert via.status_code == 200, via.text
    direct = decide(client, [PREDICATE])
    assert math.isclose(via.json()["answers"][0]["probability"], direct.json()["answers"][0]["probability"], abs_tol=1e-4)
    bad = client.post("/invocations", json={**body, "questions": [{"type": "predicate"}]})
    assert _error(bad)["param"] == "questions[0].instructions"
    forced = client.post("/invocations", json={"model": "m", "state": INPUT, "questions": {"q": {"type": "noul"}}},
                         headers={"X-Amzn-SageMaker-Custom-Attributes": "contract=openai_decisions"})
    assert _error(forced)["param"] == "input"


def test_openai_sdk_decisions_create_parses_every_answer_type_from_the_live_adapter(start_serve):
    import openai
    from openai.types.decision import AnswerAnswerResourceChoice, AnswerAnswerResourcePredicate, AnswerAnswerResourceScore

    server = start_serve()
    sdk = openai.OpenAI(api_key="unused", base_url=server.base_url + "/v1", max_retries=0, timeout=60)
    singles = [sdk.decisions.create(model="gpt-6-luna", input=INPUT, questions=[q]) for q in (PREDICATE, CHOICE, SCORE)]
    mixed = sdk.decisions.create(
        model="gpt-6-luna",
        input=[{"role": "user", "content": INPUT}],
        questions=[PREDICATE, CHOICE, SCORE, {"type": "choice", "instructions": "Valid?", "choices": [{"value": True}, {"value": "unsure"}]}],
        prompt_cache_key="tests",
    )
    assert isinstance(singles[0].answers[0], AnswerAnswerResourcePredicate)
    assert isinstance(singles[1].answers[0], AnswerAnswerResourceChoice) and singles[1].answers[0].choice in ("billing", "technical", "sales")
    assert isinstance(singles[2].answers[0], AnswerAnswerResourceScore)
    assert [type(a) for a in mixed.answers[:3]] == [type(s.answers[0]) for s in singles]
    assert [p.value for p in mixed.answers[3].probabilities] == [True, "unsure"]
    assert mixed.usage.input_tokens_details.cached_tokens + mixed.usage.input_tokens_details.cache_write_tokens > 0
    assert mixed.usage.total_tokens == mixed.usage.input_tokens and mixed.usage.output_tokens == 0
    models = sdk.models.list()
    assert models.data[0].id == mixed.model
    with pytest.raises(openai.BadRequestError):
        sdk.decisions.create(model="m", input=INPUT, questions=[{"type": "score", "instructions": "x", "levels": [{"label": "a"}]}])
    keyed = start_serve(SEMIF_API_KEY="k-123")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=keyed.base_url + "/v1", max_retries=0).decisions.create(
            model="gpt-6-luna", input=INPUT, questions=[PREDICATE])
    ok = openai.OpenAI(api_key="k-123", base_url=keyed.base_url + "/v1", max_retries=0, timeout=60).decisions.create(
        model="gpt-6-luna", input=INPUT, questions=[PREDICATE])
    assert 0.0 <= ok.answers[0].probability <= 1.0
