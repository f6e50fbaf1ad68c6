"""Edge cases that must answer neither 500 nor the wrong thing, each on a real GGUF through real llama.cpp at the
production defaults (flash attention, label memo, prefix snapshots): a model without a chat template, a
label the model scores -inf, a vocabulary without two single-token yes/no labels, a native decision
model whose label tokens are out of range or shared, and a non-ASCII API key.

The models are tiny llama GGUFs with the embedded model's tokenizer (tests/ggufs.py)."""

from __future__ import annotations

import json
import math

import pytest

import ggufs
from serving import make_settings

TICKET = "The customer was charged twice for one order and wants the second charge refunded."
THREE = {"decision": {"id": "route", "state": TICKET, "question": "Which team should handle it?",
                      "options": [{"id": "billing"}, {"id": "shipping"}, {"id": "account"}]}}
NOUL = {"state": TICKET, "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"}}}


def _app_client(engine, **settings):
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    return TestClient(create_app(make_settings(engine.model_path, **settings), engine), raise_server_exceptions=False)


def _engine(path):
    from semif.serving.engine.context import Engine

    return Engine(path, n_ctx=2048, n_threads=2)  # every other setting as shipped


# ---- a GGUF without a chat template --------------------------------------------------------------


@pytest.fixture(scope="module")
def no_template_engine(tmp_path_factory, model_path):
    path = ggufs.tiny_llama(tmp_path_factory.mktemp("gguf") / "no-template.gguf", model_path, chat_template=False)
    engine = _engine(path)
    yield engine
    engine.close()


def test_chat_on_a_model_without_a_chat_template_is_a_501_naming_it_and_decisions_still_work(no_template_engine):
    # What the refusal prevents: llama-cpp-python falls back to llama-2's [INST] format for any such model.
    assert no_template_engine.llm.chat_format == "llama-2"
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    with _app_client(no_template_engine) as http:
        for path, body in (("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
                           ("/invocations", chat)):
            response = http.post(path, json=body)
            assert response.status_code == 501, (path, response.text)
            error = response.json()["error"]
            assert error["code"] == "chat_unsupported" and "tokenizer.chat_template" in error["message"]
        assert http.get("/ping").status_code == 200
        decision = http.post("/invocations", json=THREE)
    assert decision.status_code == 200 and decision.json()["prompt"]["template_version"] == "semif-prompt-v3"


# ---- a label the model scores -inf ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ruled_out_engine(tmp_path_factory, model_path):
    """Rules out (-inf after any prompt) both spellings of `B` and of `Yes` and `No`."""
    ids = ggufs.token_ids(str(model_path), ["B", "ĠB", "Yes", "ĠYes", "No", "ĠNo"])
    path = ggufs.tiny_llama(tmp_path_factory.mktemp("gguf") / "ruled-out.gguf", model_path, ruled_out=ids.values())
    engine = _engine(path)
    yield engine
    engine.close()


def test_the_tiny_model_really_scores_the_ruled_out_label_minus_infinity(ruled_out_engine):
    """The premise, read from llama.cpp's own logits after the engine's prompt."""
    import numpy as np

    from semif.serving.engine.prompt import Outcome, Question

    engine = ruled_out_engine
    question = Question("Which team?", (Outcome("billing"), Outcome("shipping"), Outcome("account")))
    result = engine.score(TICKET, [question], return_prompt=True)
    dist = result.distributions[0]
    assert dist.labels == ["A", "B", "C"] and len(dist.label_variant_ids[1]) == 2
    import llama_cpp

    engine.invalidate()
    llm = engine.llm
    llm.reset()
    tokens = llm.tokenize(dist.prompt_text.encode(), add_bos=False, special=True)
    assert len(tokens) == dist.tokens
    llm.eval(tokens)  # one independent evaluation, logits at its last token
    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(engine.n_vocab,)).copy()
    llm.reset()
    engine.invalidate()
    assert all(row[t] == -np.inf for t in dist.label_variant_ids[1])
    assert all(np.isfinite(row[t]) for v in (dist.label_variant_ids[0], dist.label_variant_ids[2]) for t in v)


@pytest.mark.parametrize("debias", ["none", "reverse", "content_free"])
def test_a_label_at_minus_infinity_in_every_variant_gets_probability_zero_not_nan_or_500(ruled_out_engine, debias):
    from semif.serving.engine.readout import RULED_OUT_LOGIT

    # reverse: both orders (reads 2), whose log-probabilities are averaged; the stop rule may read one.
    request = {**THREE, "debias": debias, "return_prompt": True, **({"reads": 2} if debias == "reverse" else {})}
    with _app_client(ruled_out_engine) as http:
        first = http.post("/invocations", json=request)
        again = http.post("/invocations", json=request)  # the label memo's answer
    assert first.status_code == 200, first.text
    body = first.json()
    assert all(math.isfinite(x) for x in body["option_logits"] + body["probabilities"] + [body["label_mass"]])
    assert sum(body["probabilities"]) == pytest.approx(1.0)
    assert body["choice"] != "shipping" and 0.0 < body["label_mass"] < 1.0
    if debias in ("none", "content_free"):  # exactly 0; the others keep the softmax of their own logits
        assert body["option_logits"][1] == RULED_OUT_LOGIT and body["probabilities"][1] == 0.0
        a, c = body["option_logits"][0], body["option_logits"][2]
        assert body["probabilities"][0] == pytest.approx(1 / (1 + math.exp(c - a)), abs=1e-9)
    else:  # both orders' log-probabilities averaged: the floor of a zero probability, still finite
        assert body["probabilities"][1] < 1e-200
        assert [o["probabilities"][1] for o in body["prompt"]["orders"].values()] == [0.0, 0.0]
    assert again.status_code == 200 and again.json()["probabilities"] == body["probabilities"]
    assert again.json()["prompt"]["evaluated_tokens"] == 0  # answered from the memo, with the same numbers


def test_when_every_label_is_ruled_out_the_answer_is_uniform_with_zero_label_mass(ruled_out_engine):
    with _app_client(ruled_out_engine) as http:
        response = http.post("/v1/systemone", json=NOUL)
        semif = http.post("/invocations", json={"decision": {**THREE["decision"], "options": [{"id": "x"}, {"id": "y"}]},
                                                "policy": {"min_label_mass": 0.01}, "debias": "none"})
        assert http.get("/ping").status_code == 200
    assert response.status_code == 200, response.text
    answer = response.json()["answers"]["refund"]
    assert answer["noul"] == 0.5 and response.json()["x_semif"]["label_mass"]["refund"] == 0.0
    # A two-option decision on this model, read once: A is scored, B is ruled out: B gets 0, A everything.
    assert semif.status_code == 200 and semif.json()["probabilities"] == [1.0, 0.0]


# ---- a vocabulary without two single-token yes/no labels ---------------------------------------------


@pytest.fixture(scope="module")
def one_label_engine(tmp_path_factory, model_path):
    """No chat template (plain layout: labels are written after "Answer:", with a space) and no BPE merge
    that makes a space and a capital letter one token, except ` A`: one letter label, no Yes/No."""
    path = ggufs.tiny_llama(tmp_path_factory.mktemp("gguf") / "one-label.gguf", model_path, chat_template=False,
                            keep_merge=ggufs.drops_space_capitals(except_result="ĠA"))
    engine = _engine(path)
    yield engine
    engine.close()


def test_a_binary_question_without_two_labels_is_a_422_naming_the_question_not_an_index_error(one_label_engine):
    from semif.serving.engine.prompt import Outcome, Question

    assert one_label_engine.labels.letters.texts == ("A",) and len(one_label_engine.labels.binary.texts) == 1
    with _app_client(one_label_engine) as http:
        refused = http.post("/v1/systemone", json=NOUL)
        check = http.post("/invocations", json={**THREE, "scoring": "sequence", "injection_check": True})
        served = http.post("/invocations", json={**THREE, "scoring": "sequence"})
        assert http.get("/ping").status_code == 200
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"][:2] == ["body", "questions"] and detail["type"] == "unsupported_options"
    assert "at most 1 outcomes (yes/no)" in detail["msg"] and "scoring 'sequence'" in detail["msg"]
    assert check.status_code == 422 and check.json()["error"]["field"] == "injection_check"
    assert "two single-token yes/no labels" in check.json()["error"]["message"]
    assert served.status_code == 200
    # what the message suggests works: the binary question under sequence scoring
    binary = Question("Does the customer want money back?", (Outcome("true"), Outcome("false")), kind="binary")
    yes, no = one_label_engine.score(TICKET, [binary], scoring="sequence").distributions[0].probabilities
    assert yes + no == pytest.approx(1.0) and 0.0 < yes < 1.0


# ---- native decision models: label token ids ------------------------------------------------------


@pytest.mark.parametrize("tokens, message", [
    ({"true": 49152, "false": 2838}, "label 'true' has token id 49152, beyond the vocabulary (49152 tokens"),
    ({"true": 9230, "false": 9230}, "labels 'true' and 'false' have the same token id 9230"),
])
def test_a_native_model_whose_label_tokens_are_out_of_range_or_shared_is_refused_at_load(tmp_path, model_path, tokens, message):
    from semif.serving.engine.native import NativeDecisionError

    metadata = {"decision.prompt_template": "<|im_start|>user\n{state}\n{instructions}<|im_end|>\n<|im_start|>assistant\n",
                "decision.tokens": json.dumps(tokens)}
    path = ggufs.tiny_llama(tmp_path / "native.gguf", model_path, metadata=metadata)
    with pytest.raises(NativeDecisionError) as refused:
        _engine(path)
    assert message in str(refused.value)


def test_a_native_model_with_distinct_in_range_label_tokens_loads_and_answers(tmp_path, model_path):
    metadata = {"decision.prompt_template": "<|im_start|>user\n{state}\n{instructions}<|im_end|>\n<|im_start|>assistant\n",
                "decision.tokens": json.dumps({"true": 9230, "false": 2838})}
    engine = _engine(ggufs.tiny_llama(tmp_path / "native.gguf", model_path, metadata=metadata))
    try:
        with _app_client(engine) as http:
            response = http.post("/v1/systemone", json=NOUL)
        assert response.status_code == 200 and 0.0 < response.json()["answers"]["refund"]["noul"] < 1.0
    finally:
        engine.close()


# ---- API keys beyond ASCII ----------------------------------------------------------------------------


LATIN_KEY = "clé-secrète"  # every character in Latin-1
WIDE_KEY = "ключ-🔑-鍵"  # not in Latin-1


def _models_with_authorization(engine, api_key: str, headers: list[bytes]) -> list[int]:
    """GET /v1/models once per raw Authorization value, through the app's full middleware stack. httpx's
    ASGI transport passes header bytes as given (Starlette's TestClient re-encodes them as UTF-8)."""
    import asyncio

    import httpx

    from semif.serving.http.app import create_app

    app = create_app(make_settings(engine.model_path, api_key=api_key), engine)

    async def calls() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://adapter") as http:
            statuses = []
            for header in headers:
                response = await http.get("/v1/models", headers=[(b"authorization", header)])
                if response.status_code == 401:
                    assert response.json()["error"]["code"] == "invalid_api_key"
                statuses.append(response.status_code)
            return statuses

    return asyncio.run(calls())


@pytest.mark.parametrize("key, encodings", [(LATIN_KEY, ("utf-8", "latin-1")), (WIDE_KEY, ("utf-8",))])
def test_a_non_ascii_api_key_is_accepted_as_sent_by_clients_and_a_wrong_one_refused(engine, key, encodings):
    accepted = [b"Bearer " + key.encode(encoding) for encoding in encodings]
    wrong = [b"Bearer " + text.encode("utf-8") for text in (key[:-1], key + "x", key.upper(), "cle-secrete")]
    # A header that is not valid UTF-8 (a lone 0xFF), or a key's UTF-8 bytes read as Latin-1 and sent again.
    odd = [b"Bearer \xff\xfe", b"Bearer " + key.encode("utf-8").decode("latin-1").encode("utf-8")]
    statuses = _models_with_authorization(engine, key, accepted + wrong + odd)
    assert statuses == [200] * len(accepted) + [401] * (len(wrong) + len(odd))


def test_the_key_comparison_is_on_equal_length_digests_whatever_the_token(monkeypatch, engine):
    """Constant time: every check compares two 32-byte digests, both of them, whether the token is right,
    wrong, shorter or longer, so neither the outcome nor the key's length shows in the timing."""
    import hmac

    from semif.serving.http import auth

    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def recording(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    for token in (WIDE_KEY, "x", WIDE_KEY * 40):
        seen.clear()
        _models_with_authorization(engine, WIDE_KEY, [b"Bearer " + token.encode("utf-8")])
        assert seen == [(32, 32), (32, 32)], token
