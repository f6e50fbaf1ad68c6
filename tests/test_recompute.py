"""Anyone can recompute an answer: `prompt.recompute` (with `return_prompt`) lists the token segments as the
engine decoded them and the settings that change a logit; a fresh llama.cpp context that decodes them the
same way (semif.tools.recompute, llama-cpp-python only) reproduces `option_logits` to 1e-4, at the shipped
defaults (flash attention on, memo and prefix snapshots on), whether the answer was evaluated, reused a
cached prefix, came back from a restored snapshot or from the label memo."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from semif.tools.recompute import FreshContext, answers_of, main, recompute_logits

TOLERANCE = 1e-4
ROUTE = [{"id": "account_access", "description": "Account access support."},
         {"id": "billing", "description": "Billing support."},
         {"id": "shipping", "description": "Delivery problems."}]
FIVE = [{"id": name} for name in ("low", "medium", "high", "urgent", "unknown")]
LONG_STATE = "\n".join(f"Message {k}: the customer writes again about order {1000 + k} and a refund that never came."
                       for k in range(60))  # over n_batch tokens: its state block is decoded in several calls


def _single(state, question, options, **extra):
    return {"decision": {"id": "d", "state": state, "question": question, "options": options}, "return_prompt": True, **extra}


CASES = {
    "state_first_two_options": _single("The customer cannot receive a password reset email.",
                                       "Which queue should handle this request?", ROUTE[:2]),
    "three_questions_one_state": {
        "state": "Order 1142 arrived broken and the customer wants a refund before Friday.", "return_prompt": True,
        "decisions": [{"id": "queue", "question": "Which queue?", "options": ROUTE},
                      {"id": "urgent", "question": "Is it urgent?", "options": [{"id": "yes"}, {"id": "no"}]},
                      {"id": "level", "question": "How urgent is it?", "options": FIVE}]},
    "options_first": _single("My parcel is two weeks late.", "Which queue should handle this request?", ROUTE,
                             layout="options_first"),
    "debias_reverse": _single("I was charged twice for one order.", "Which queue should handle this request?", ROUTE,
                              debias="reverse"),
    "debias_reverse_both_reads": _single("I was charged twice for one order.", "Which queue should handle this request?",
                                         ROUTE, debias="reverse", reads=2),
    "debias_rotations": _single("I was charged twice for one order.", "Which queue should handle this request?", ROUTE,
                                debias="rotations", reads=3),
    "options_first_debias_reverse": _single("I cannot log in since yesterday.", "Which queue?", ROUTE,
                                            layout="options_first", debias="reverse"),
    "sequence_scoring": _single("The customer cannot receive a password reset email.", "Which queue?", ROUTE,
                                scoring="sequence"),
    "long_state": _single(LONG_STATE, "Which queue should handle this request?", ROUTE),
}


def _answers(body):
    return answers_of(body)  # a batch's records made whole again: its decisions share the state's segments


def _post(client, request):
    response = client.post("/invocations", json=request)
    assert response.status_code == 200, response.text
    return response.json()


# The recomputing context runs half the engine's threads (the engine: one per core): threads are not a
# numerics setting, and these tests would fail if they changed a logit.
RECOMPUTE_THREADS = max(1, (os.cpu_count() or 2) // 2)


@pytest.fixture(scope="module")
def fresh(engine, model_path):
    """A fresh llama.cpp context (not the engine's) with the engine's recorded settings; each recompute
    empties it first."""
    context = FreshContext(model_path, engine.numerics, n_threads=RECOMPUTE_THREADS)
    yield context
    context.close()


def _worst(fresh, model_path, body) -> float:
    worst = 0.0
    for answer in _answers(body):
        logits = recompute_logits(answer["prompt"]["recompute"], model_path, context=fresh)
        worst = max(worst, float(np.max(np.abs(np.subtract(logits, answer["option_logits"])))))
    return worst


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fresh_context_reproduces_option_logits_from_the_recompute_record(client, engine, fresh, model_path, case):
    request = CASES[case]
    first = _post(client, request)
    _post(client, _single("Someone else's question about another state.", "Which queue?", ROUTE[:2]))
    again = _post(client, request)  # memo, cached prefix or restored snapshot: whatever the engine holds now
    record = _answers(first)[0]["prompt"]["recompute"]
    assert record["settings"] == engine.numerics and record["settings"]["flash_attn"] is True
    assert _worst(fresh, model_path, again) <= TOLERANCE, case
    for a, b in zip(_answers(first), _answers(again)):  # the same record and logits, whatever was cached
        assert a["prompt"]["recompute"] == b["prompt"]["recompute"]
        np.testing.assert_allclose(a["option_logits"], b["option_logits"], rtol=0, atol=1e-6)


def test_the_record_survives_each_cache_path(client, engine, fresh, model_path):
    """The same answer evaluated cold, from a cached state prefix, from a restored snapshot and from the memo."""
    request = CASES["long_state"]
    other = _single("A different state that pushes the long one out of the context.", "Which queue?", ROUTE)
    engine.invalidate()
    engine.clear_prefix_snapshots()
    engine._label_memo.clear()
    cold = _post(client, request)
    engine._label_memo.clear()
    cached = _post(client, {**request, "decision": {**request["decision"], "question": "Which team owns this?"}})
    _post(client, other)  # evicts the long state; it was planned twice, so it is snapshotted first
    engine._label_memo.clear()
    restores = engine.prefix_restores
    restored = _post(client, request)
    memo = _post(client, request)
    assert cold["prompt"]["evaluated_tokens"] == cold["prompt"]["tokens"]
    assert 0 < cached["prompt"]["cached_tokens"] < cached["prompt"]["tokens"]
    assert engine.prefix_restores == restores + 1 and restored["prompt"]["evaluated_tokens"] < restored["prompt"]["tokens"]
    assert memo["prompt"]["evaluated_tokens"] == 0
    assert _worst(fresh, model_path, cached) <= TOLERANCE
    assert restored["prompt"]["recompute"] == cold["prompt"]["recompute"] == memo["prompt"]["recompute"]
    logits = recompute_logits(cold["prompt"]["recompute"], model_path, context=fresh)
    for body in (cold, restored, memo):
        np.testing.assert_allclose(logits, body["option_logits"], rtol=0, atol=TOLERANCE)


def test_one_pass_over_the_same_tokens_does_not_reproduce_the_answer(client, fresh, model_path):
    """The segmentation is what makes the record exact: the same tokens decoded in plain n_batch chunks
    from position 0 (what a recompute from prompt.text and label_token_ids does) differ by more than 1e-3."""
    worst = 0.0
    for case in ("state_first_two_options", "long_state"):
        for answer in _answers(_post(client, CASES[case])):
            record = answer["prompt"]["recompute"]
            tokens = [t for segment in record["segments"] for t in segment["tokens"]]
            one_pass = dict(record, segments=[{"pos": 0, "tokens": tokens}])
            assert one_pass["logits_at"][-1] == len(tokens) - 1
            logits = recompute_logits(one_pass, model_path, context=fresh)
            worst = max(worst, float(np.max(np.abs(np.subtract(logits, answer["option_logits"])))))
    print(f"one pass instead of the recorded segments: max |logit difference| {worst:.3g}")
    assert worst > 1e-3


def test_the_cli_passes_an_exact_record_and_fails_a_wrong_one(client, model_path, tmp_path, capsys):
    body = _post(client, {"state": "The customer cannot receive a password reset email.", "return_prompt": True,
                          "decisions": [{"id": "queue", "question": "Which queue?", "options": ROUTE}]})
    good = tmp_path / "answer.json"
    good.write_text(json.dumps(body))
    assert main([str(good), "--model", str(model_path), "--threads", str(RECOMPUTE_THREADS)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["id"] for line in lines] == ["queue"] and lines[0]["max_abs_diff"] <= TOLERANCE

    # One token of the state changed (another record, of the same length): the logits move, the CLI says so.
    # A batch lists the state's segments once, for all its decisions, in its own `prompt`.
    assert body["results"][0]["prompt"]["recompute"]["request_prompt_segments"] == len(body["prompt"]["segments"])
    state = body["prompt"]["segments"][-1]["tokens"]
    middle = next(i for i in range(len(state) // 2, len(state) - 1) if state[i] != state[i + 1])
    state[middle] = state[middle + 1]
    bad = tmp_path / "wrong.json"
    bad.write_text(json.dumps(body))
    assert main([str(bad), "--model", str(model_path), "--threads", str(RECOMPUTE_THREADS)]) == 1

    del body["results"][0]["prompt"]["recompute"]
    bad.write_text(json.dumps(body))
    assert main([str(bad), "--model", str(model_path)]) == 2
