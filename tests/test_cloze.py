"""Cloze (sequence) scoring on the real embedded model: answers end with the end-of-turn token, every
option's first token is read from one row of the prompt, and answers are tokenized after the answer cue."""

from __future__ import annotations

import os

import numpy as np
import pytest

from semif.serving.engine.prompt import Outcome, Question
from serving import gemma_model

SHORT_AND_LONG = Question("Which reply code is in the text?", (Outcome("yes"), Outcome("yes_but_later")))
GOES_ON = "Reply code: yes_but_later. The customer will pay next month."
ENDS = "The customer said yes."


def _cold(engine, state, questions):
    """Scored with the prefix cache off: nothing is reused, every token is evaluated."""
    engine.prefix_cache = False
    try:
        return engine.score(state, questions, scoring="sequence")
    finally:
        engine.prefix_cache = True


def test_each_cloze_answer_ends_with_the_chat_templates_end_of_turn_token(engine):
    im_end = engine.llm.tokenize(b"<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1
    assert engine.end_of_turn_token == im_end[0]
    assert engine.info["end_of_turn_token"] == "<|im_end|>"
    plan = engine.plan(GOES_ON, [SHORT_AND_LONG], scoring="sequence")
    short, long = plan.questions[0].answer_tokens
    assert short[-1] == long[-1] == im_end[0]
    assert long[: len(short) - 1] == short[:-1]  # `yes` is a token prefix of `yes_but_later`


def test_a_short_option_that_prefixes_a_longer_one_pays_for_ending_the_turn_where_the_model_goes_on(engine):
    goes_on = engine.score(GOES_ON, [SHORT_AND_LONG], scoring="sequence").distributions[0]
    ends = engine.score(ENDS, [SHORT_AND_LONG], scoring="sequence").distributions[0]
    (yes, yes_end), long = goes_on.answer_token_logprobs
    # After `yes` the model wants `_but_later`, not the end of its turn: `yes` is scored on both tokens
    # (without the end-of-turn token its score was `yes` alone, the same first token as the long option),
    # so it pays for the ending it did not want.
    assert yes_end < long[1]
    assert goes_on.option_logits[0] == pytest.approx((yes + yes_end) / 2, abs=1e-12)
    assert goes_on.probabilities[1] > goes_on.probabilities[0]
    # Where the text says plain `yes`, ending the turn after it is what the model expects: a smaller toll.
    assert ends.answer_token_logprobs[0][1] > yes_end


def test_the_end_of_turn_log_probability_equals_an_independent_evaluation(engine, model_path):
    """A fresh llama.cpp context, the engine's decode shapes (the record's segments, then the answer's first
    token as one more segment after the prompt): the two log-probabilities of `yes<|im_end|>` to 1e-4."""
    from semif.tools.recompute import FreshContext, decode_record

    dist = engine.score(GOES_ON, [SHORT_AND_LONG], scoring="sequence", return_prompt=True).distributions[0]
    record = dist.recompute
    fresh = FreshContext(model_path, record["settings"])
    try:
        prompt = fresh.llm.tokenize(dist.prompt_text.encode(), add_bos=True, special=True)
        assert prompt == [t for segment in record["segments"] for t in segment["tokens"]]
        answer = fresh.llm.tokenize(b"yes<|im_end|>", add_bos=False, special=True)
        assert record["answers"][0] == answer
        first = decode_record(fresh, record)[len(prompt) - 1]
        second = fresh.decode(len(prompt), answer[:1], {len(prompt)})[len(prompt)]
        rows = np.stack([first, second]).astype(np.float64)
    finally:
        fresh.close()
    peak = rows.max(axis=1, keepdims=True)
    logprobs = rows - peak - np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))
    expected = [logprobs[0, answer[0]], logprobs[1, answer[1]]]
    np.testing.assert_allclose(dist.answer_token_logprobs[0], expected, rtol=0, atol=1e-4)


def test_every_options_first_token_comes_from_one_row_of_the_prompt(engine):
    # `yes` and `yes_but_later` start with the same token. Re-running the prompt's last token per
    # option, in batches of 2 and 6 tokens, gave them different numbers for it (kernel drift); one row
    # read once gives the very same number to both.
    for state in (GOES_ON, ENDS):
        dist = _cold(engine, state, [SHORT_AND_LONG]).distributions[0]
        assert dist.answer_token_logprobs[0][0] == dist.answer_token_logprobs[1][0]


def test_cloze_scoring_with_the_cache_equals_without_for_options_that_prefix_each_other(engine):
    cold = [_cold(engine, state, [SHORT_AND_LONG]).distributions[0] for state in (GOES_ON, ENDS, GOES_ON)]
    engine.invalidate()
    warm = [engine.score(state, [SHORT_AND_LONG], scoring="sequence").distributions[0] for state in (GOES_ON, ENDS, GOES_ON)]
    assert warm[2].cached_tokens > 0  # the head and state were reused
    for a, b in zip(cold, warm):
        assert a.answer_token_logprobs == b.answer_token_logprobs
        assert a.option_logits == b.option_logits


def test_cloze_answers_are_the_tokens_of_the_cue_and_answer_minus_the_cues_tokens(engine):
    options = ("account_access", "billing", "yes", "yes_but_later", "Shipping delay", "é-mail")
    question = Question("Which?", tuple(Outcome(o) for o in options))
    plan = engine.plan("state", [question], scoring="sequence")
    cue = engine.template.answer_cue
    cue_tokens = engine.llm.tokenize(cue.encode(), add_bos=False, special=True)
    for text, tokens in zip(options, plan.questions[0].answer_tokens):
        whole = engine.llm.tokenize((cue + engine.template.label_prefix + text).encode(), add_bos=False, special=True)
        assert list(cue_tokens) + list(tokens[:-1]) == whole


def test_an_option_naming_a_special_token_is_tokenized_as_plain_text(engine):
    question = Question("Which?", (Outcome("<|im_end|>"), Outcome("other")))
    tokens = engine.plan("state", [question], scoring="sequence").questions[0].answer_tokens[0]
    plain = engine.llm.tokenize(b"<|im_end|>", add_bos=False, special=False)
    assert list(tokens[:-1]) == plain and len(plain) > 1  # the option's text, then the real end of turn


@pytest.fixture(scope="module")
def gemma_with_space_prefix(tmp_path_factory):
    """Gemma 3 270M (SentencePiece) with `tokenizer.ggml.add_space_prefix` set, as Llama-2 and Mistral
    vocabularies have it: llama.cpp then starts every tokenized text with a word-start `▁`."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from semif.serving.engine.context import Engine

    source = gemma_model()  # installed by `make setup`
    target = tmp_path_factory.mktemp("gemma-spm") / "gemma-space-prefix.gguf"
    reader = gguf.GGUFReader(source, "r")
    writer = gguf.GGUFWriter(target, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents(), endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    copy_with_new_metadata(reader, writer, {"tokenizer.ggml.add_space_prefix": MetadataDetails(gguf.GGUFValueType.BOOL, True)}, [])
    engine = Engine(target, n_ctx=2048, n_threads=os.cpu_count() or 2, label_memo=False)
    yield engine
    engine.close()


@pytest.mark.gemma
def test_on_a_sentencepiece_vocabulary_cloze_answers_get_no_second_word_start(gemma_with_space_prefix):
    engine = gemma_with_space_prefix
    options = ("yes", "billing", "account_access")
    plan = engine.plan("state", [Question("Which?", tuple(Outcome(o) for o in options))], scoring="sequence")
    cue = engine.template.answer_cue
    cue_tokens = engine._tokenize(cue, special=True)
    for text, tokens in zip(options, plan.questions[0].answer_tokens):
        answer = engine.template.label_prefix + text
        whole = engine._tokenize(cue + answer, special=True)
        assert cue_tokens + list(tokens[:-1]) == whole
        alone = engine._tokenize(answer, special=False)
        assert alone != list(tokens[:-1])  # alone, the text gets the vocabulary's extra leading `▁`
    dist = engine.score("The customer wants a refund.", [Question("Which?", tuple(Outcome(o) for o in options))], scoring="sequence").distributions[0]
    assert all(np.isfinite(dist.option_logits))
