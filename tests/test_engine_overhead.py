"""The per-request shortcuts (memos, cached plans, skipped work) change no answer: each is checked against the slow way, on the
real embedded model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from semif.serving.engine.context import Engine
from semif.serving.engine.prompt import Outcome, Question
from semif.serving.engine.readout import token_logprobs, tokens_key

ROUTE = Question("Which queue?", (Outcome("billing", "Invoices and refunds."), Outcome("shipping", "Parcels.")))
TEXTS = [
    "hello",
    "<|im_start|>user\nhi<|im_end|>\n",
    "é漢字 🎉 naïve façade " * 20,
    " x" * 600,
    "\n\n\t  trailing space ",
    "a",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("add_bos", [True, False])
def test_right_sized_tokenization_equals_llama_cpp_pythons(engine, text, special, add_bos):
    expected = engine.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
    assert engine._tokenize_bytes(text.encode("utf-8"), add_bos, special) == expected
    # A buffer too small for the answer: llama.cpp says the size it needs and the call is repeated.
    assert engine._tokenize_bytes(text.encode("utf-8"), add_bos, special, n_max=1) == expected
    assert engine._tokenize(text, special=special, add_bos=add_bos) == expected


def test_template_text_is_tokenized_once_however_many_questions_ask(engine):
    engine.plan("A first state.", [ROUTE])
    before = engine._template_tokens.cache_info()
    engine.plan("A second, different state.", [ROUTE, ROUTE, ROUTE])
    after = engine._template_tokens.cache_info()
    assert after.misses == before.misses  # head and tail came from the cache
    assert after.hits >= before.hits + 4  # the head once, the tail once per question


def test_the_memo_key_hashes_the_prefix_once_and_equals_the_full_key(engine):
    first = [[1, 2, 3], [4, 5]]
    second = [[1, 2, 3], [4, 6]]
    for prefix, suffix, labels in [(first, [7], [9, 10]), (first, [8], [9, 10]), (second, [7], [9, 10]),
                                   (first, [7], [9, 11])]:
        assert engine._memo_key(prefix, suffix, labels) == tokens_key(prefix, suffix, labels)
        assert engine._memo_prefix[0] is prefix
    assert engine._memo_key(first, [7], [9, 10]) != engine._memo_key(second, [7], [9, 10])


def test_cloze_log_probabilities_from_a_float32_logsumexp_equal_a_float64_log_softmax(engine):
    plan = engine.plan("The parcel never arrived.", [ROUTE], scoring="sequence")
    segments = [list(s) for s in plan.prefix_segments] + [list(plan.questions[0].suffix_tokens)]
    end = sum(len(s) for s in segments)
    rows, _, _ = engine._forward(segments, list(range(end - 4, end)))
    stacked = np.stack([rows[p] for p in sorted(rows)])
    answer = [int(np.argmax(stacked[0])), 17, 3000, engine.n_vocab - 1]
    as64 = stacked.astype(np.float64)
    peak = as64.max(axis=1, keepdims=True)
    full = as64 - peak - np.log(np.exp(as64 - peak).sum(axis=1, keepdims=True))
    expected = sum(full[i, t] for i, t in enumerate(answer))
    assert abs(float(token_logprobs(stacked, answer).sum()) - expected) < 1e-5


def test_clearing_only_the_caches_metadata_leaves_later_answers_exact(engine, memo_off, snapshots_off, model_path):
    """invalidate() marks the KV cells free without zeroing the buffer: what an earlier request left there
    must not reach a later answer. Compared with a brand-new engine, whose buffer llama.cpp zeroed."""
    state = "A customer was charged twice for one order and wants a refund."
    fresh = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=os.cpu_count() or 2)  # as the session engine (conftest)
    try:
        want = fresh.score(state, [ROUTE]).distributions[0].option_logits
    finally:
        fresh.close()
    engine.score("Something long and different. " * 40, [ROUTE])  # fills cells the next prompt will reuse
    engine.invalidate()
    got = engine.score(state, [ROUTE])
    assert got.cached_tokens == 0
    assert got.distributions[0].option_logits == want



def test_client_text_does_not_fill_the_template_token_cache(engine):
    """Plans tokenize question blocks (client options and descriptions) with special tokens allowed, to see
    whether that changes them: large ones must not be kept. Many distinct large-option requests, most of them
    refused as too long, leave the cache within its bound, and the plans equal those of an emptied cache."""
    from semif.serving.engine.context import (TEMPLATE_TOKENS_CACHE_CHARS, TEMPLATE_TOKENS_CACHE_SIZE,
                                              TEMPLATE_TOKENS_MAX_CHARS, PromptTooLong)

    cache = engine._template_tokens
    refused = 0
    for request in range(40):
        description = f"request {request} " + "a long description of this option, " * 120  # ~4 KB each
        options = tuple(Outcome(f"o{request}_{i}", f"{i}: {description}") for i in range(12 if request % 2 else 2))
        try:
            engine.plan(f"State {request}.", [Question(f"Which option? ({request})", options)])
        except PromptTooLong:
            refused += 1
    assert refused == 20
    held = sum(len(text) for text, _ in cache._entries)
    assert held == cache.total_chars <= TEMPLATE_TOKENS_CACHE_CHARS
    assert len(cache) <= TEMPLATE_TOKENS_CACHE_SIZE
    assert max(len(text) for text, _ in cache._entries) <= TEMPLATE_TOKENS_MAX_CHARS
    # Well below the bound: not one large block was kept (it is the client text, not the limit, that is large).
    assert held < 40 * 2 * 4000

    options = tuple(Outcome(f"x{i}", "a long description of this option, " * 120) for i in range(2))
    question = Question("Which option?", options)
    warm = engine.plan("A state.", [question])
    cache.cache_clear()
    cold = engine.plan("A state.", [question])
    assert [list(s) for s in warm.prefix_segments] == [list(s) for s in cold.prefix_segments]
    assert [q.suffix_tokens for q in warm.questions] == [q.suffix_tokens for q in cold.questions]
    assert cache.total_chars < TEMPLATE_TOKENS_MAX_CHARS  # the cold plan kept its template pieces only
