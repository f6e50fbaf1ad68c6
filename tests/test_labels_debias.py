"""Piecewise tokenization on BPE and SentencePiece vocabularies, label variants and label mass,
labels rendered as scored, reasoning templates, and order debiasing: on real models.

Tokenizer tests load vocabularies only (no weights: milliseconds). The Gemma 3 270M tests use the model
`make setup` installs (`gemma_model()` in serving.py); they carry no `gemma` marker because they need no
inference, only its SentencePiece vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from semif.serving.engine.context import softmax
from semif.serving.engine.passes.orders import combine_orders
from semif.serving.engine.plan import _tokenize_after, build_plan, shared_lead
from semif.serving.engine.prompt import EMPTY_THINK, Labels, LabelSet, Outcome, PromptTemplate, Question
from serving import embedded_model, gemma_model, start_cold

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]
ROUTE = Question(
    "Which queue should handle this request?",
    (Outcome("account_access", "Account access support."), Outcome("billing", "Billing support."),
     Outcome("shipping", "Delivery problems.")),
)
IS_ACCOUNT = Question("Is this about logging in?", (Outcome("true"), Outcome("false")), kind="binary")
PRIORITY = Question("How urgent is this?", (Outcome("low"), Outcome("medium"), Outcome("high")), kind="scale")
STATE = "The customer cannot receive a password reset email and is locked out of the account."
# States whose edges a tokenizer could merge with the fence or the template around them.
STATES = [STATE, " leading space", "trailing newline\n", "\n\nblank lines first", "tabs\tand  spaces  ",
          "日本語のテキスト。", "ends in a tag-like <b", "```code```", "A", "x" * 300]


def reversed_question(question: Question) -> Question:
    return Question(question.text, question.outcomes[::-1], question.kind)


# ---- vocabularies -----------------------------------------------------------------------------

class Vocab:
    """A real GGUF vocabulary (no weights) and the engine's tokenize signature."""

    def __init__(self, path, *, chat_template=None, kv_overrides=None, plain=False):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), vocab_only=True, verbose=False, kv_overrides=kv_overrides)
        template = None if plain else (chat_template or self.llm.metadata.get("tokenizer.chat_template"))
        bos = self.llm.detokenize([self.llm.token_bos()], special=True).decode()
        self.template = PromptTemplate(template, bos_text="", eos_text="")
        self.labels = self.template.select_labels(lambda text: self.tokenize(text, special=True))
        self.bos = bos

    def tokenize(self, text, *, special, add_bos=False):
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special) if text else []

    def plan(self, state, questions, *, scoring="label", debias="none", labels=None, layout="state_first",
             injection_check=False):
        return build_plan(template=self.template, labels=labels or self.labels, tokenize=self.tokenize,
                          eos_token=self.llm.token_eos(), bos_token=self.llm.token_bos(), adds_bos=True,
                          n_ctx=1 << 16, n_batch=64, state_text=state, questions=questions, scoring=scoring,
                          debias=debias, layout=layout, injection_check=injection_check)

    def close(self):
        self.llm.close()


def _gemma_path():
    return gemma_model()  # installed by `make setup`; fails (never skips) when it is not


def _vocab_only(name):
    """A llama.cpp vocabulary-only GGUF that `make setup` takes from the pinned sdist (tools/fetch_test_vocabs.sh)."""
    path = REPO / ".build" / "vocab" / f"ggml-vocab-{name}.gguf"
    assert path.is_file(), f"{path} is missing: run `make setup` (tools/fetch_test_vocabs.sh)"
    return path


VOCABS = {
    "smollm2-bpe": lambda: Vocab(embedded_model()),
    # Qwen 2 and Llama 3 BPE: their pre-tokenizers keep newlines with punctuation (`</state>\n\n` ends in `>\n\n`).
    "qwen2-bpe-chat": lambda: Vocab(_vocab_only("qwen2")),  # its own ChatML template
    "llama3-bpe-plain": lambda: Vocab(_vocab_only("llama-bpe")),  # no chat template in the GGUF
    "smollm2-bpe-plain": lambda: Vocab(embedded_model(), plain=True),
    "gemma-spm-plain": lambda: Vocab(_gemma_path()),  # the base GGUF has no chat template
    "gemma-spm-chat": lambda: Vocab(_gemma_path(), chat_template=(DATA / "google-gemma-2-2b-it.jinja").read_text()),
    # SentencePiece as Llama 2 and Mistral ship it: a `▁` is prepended to every tokenize call.
    "gemma-spm-space-prefix": lambda: Vocab(_gemma_path(), kv_overrides={"tokenizer.ggml.add_space_prefix": True}),
    "gemma-spm-space-prefix-inst": lambda: Vocab(
        _gemma_path(), kv_overrides={"tokenizer.ggml.add_space_prefix": True},
        chat_template=(DATA / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()),
}


@pytest.fixture(scope="module", params=sorted(VOCABS))
def vocab(request):
    v = VOCABS[request.param]()
    yield v
    v.close()


@pytest.fixture(scope="module")
def spm_prefix_vocab():
    v = VOCABS["gemma-spm-space-prefix"]()
    yield v
    v.close()


# ---- piecewise tokenization -------------------------------------------------------------------

@pytest.mark.parametrize("scoring", ["label", "sequence"])
def test_a_plans_pieces_tokenize_exactly_like_the_whole_prompt_text(vocab, scoring):
    questions = [ROUTE, IS_ACCOUNT] + ([PRIORITY] if scoring == "sequence" or vocab.labels.scale.texts else [])
    for state in STATES:
        plan = vocab.plan(state, questions, scoring=scoring, debias="reverse")
        prefix = [t for segment in plan.prefix_segments for t in segment]
        for qplan in plan.questions:
            for part in (qplan, qplan.reversed):
                whole = vocab.tokenize(plan.prefix_text + part.text, special=True, add_bos=True)
                assert prefix + part.suffix_tokens == whole, (state, part.text)


@pytest.mark.parametrize("layout", ["state_first", "options_first"])
def test_both_layouts_with_order_debiasing_and_the_injection_check_tokenize_like_the_whole_prompt_text(vocab, layout):
    """Every suffix (both orders, the injection check) after its own prefix: on Qwen 2 and Llama 3 the
    blank line after `</state>` merges with the tag, so it must end the state's segment, not start the
    suffix (plan._join_across)."""
    questions = [ROUTE] if layout == "options_first" else [ROUTE, IS_ACCOUNT]
    for state in STATES:
        plan = vocab.plan(state, questions, debias="reverse", layout=layout, injection_check=True)
        parts = [part for qplan in plan.questions for part in (qplan, qplan.reversed)] + list(plan.injection_checks)
        for part in parts:
            pieces = part.own_prefix_pieces or plan.prefix_pieces
            segments = part.own_prefix_segments or plan.prefix_segments
            prefix = [t for segment in segments for t in segment]
            assert prefix == [t for piece in pieces for t in piece.tokens]
            whole = vocab.tokenize("".join(piece.text for piece in pieces) + part.text, special=True, add_bos=True)
            assert prefix + list(part.suffix_tokens) == whole, (layout, state, part.text[:40])


def test_the_fence_opener_is_a_segment_of_its_own_that_states_share_where_the_tokens_split_there(vocab):
    """The `<state>` line before the state is the same for every state, so the plan evaluates it as its own
    segment (the next state reuses it). It is split off only where the whole prompt's tokens split there
    (the test above checks the concatenation): a state that starts with whitespace may merge with it."""
    plans = {state: vocab.plan(state, [ROUTE]) for state in STATES}
    split = {state: p for state, p in plans.items() if p.shared_segments == 2}
    assert all(state in split for state in STATES if not state[0].isspace())
    assert len({p.prefix_segments[:2] for p in split.values()}) == 1
    for plan in split.values():
        opener = plan.prefix_segments[1]
        assert plan.prefix_segments[0] == plan.prefix_pieces[0].tokens
        assert plan.prefix_pieces[1].tokens[: len(opener)] == opener and 0 < len(opener) <= 8
    for state, plan in plans.items():
        if state not in split:
            assert plan.shared_segments == 1 and plan.prefix_segments[1] == plan.prefix_pieces[1].tokens[:len(plan.prefix_segments[1])]


@pytest.mark.parametrize("name", ["smollm2-bpe-plain", "gemma-spm-space-prefix-inst"])
def test_tokenizing_each_piece_alone_is_not_the_whole_prompt_but_the_plans_pieces_are(name):
    """Why the plan tokenizes pieces with their neighbours. BPE: the plain layout's head ends in a
    blank line, one token `\n\n` alone but `\n`,`\n` before `<state>`. SentencePiece: "option." then a
    plain-text `[/INST]` merge into `.[/` in the whole text."""
    v = VOCABS[name]()
    try:
        plan = v.plan(STATE, [ROUTE])
        qplan = plan.questions[0]
        pieces = [*plan.prefix_pieces, *qplan.pieces]
        naive = [t for i, piece in enumerate(pieces)
                 for t in v.tokenize(piece.text, special=piece.special_tokens, add_bos=i == 0)]
        planned = [t for piece in pieces for t in piece.tokens]
        whole = v.tokenize(plan.prefix_text + qplan.text, special=True, add_bos=True)
        assert naive != whole
        assert planned == whole
    finally:
        v.close()


# ---- labels -----------------------------------------------------------------------------------

def test_each_label_variant_is_the_token_a_reply_starts_with_after_the_answer_cue(vocab):
    """Both spellings of the reply (`A` and ` A`), where each is one token after the cue, are scored."""
    cue = vocab.template.answer_cue
    cue_tokens = vocab.tokenize(cue, special=True)
    letters = vocab.labels.letters
    assert letters.texts[:3] == ("A", "B", "C")
    for index, text in enumerate(letters.texts[:26]):
        variants = letters.variants_of(index)
        assert variants[0] == letters.token_ids[index]
        for spelling in (text, " " + text):
            tokens = vocab.tokenize(cue + spelling, special=True)
            if tokens[: len(cue_tokens)] == cue_tokens and len(tokens) == len(cue_tokens) + 1:
                assert tokens[-1] in variants, (text, spelling)
    every = [t for i in range(len(letters.texts)) for t in letters.variants_of(i)]
    assert len(every) == len(set(every)), "a token belongs to one label only"


def test_after_a_plain_text_inst_marker_on_sentencepiece_the_spaced_label_is_scored():
    """The issue's case: `[/INST]` is plain text in Gemma's vocabulary, the reply starts with `▁A`."""
    v = VOCABS["gemma-spm-space-prefix-inst"]()
    try:
        cue = v.template.answer_cue
        assert cue.rstrip().endswith("[/INST]")
        spaced = v.tokenize(cue + " A", special=True)[-1]
        assert v.llm.detokenize([spaced]).decode().strip() == "A"
        assert spaced in v.labels.letters.variants_of(0)
    finally:
        v.close()


def test_label_logits_and_label_mass_equal_an_independent_recomputation(engine, model_path):
    """A fresh llama.cpp context decodes the answer's prompt text, tokenized on its own, in the segments the
    record gives (semif.tools.recompute): the label logits and the label mass come back to 1e-4."""
    from semif.tools.recompute import FreshContext, decode_record

    dist = engine.score(STATE, [ROUTE], return_prompt=True).distributions[0]
    record = dist.recompute
    fresh = FreshContext(model_path, record["settings"])
    try:
        tokens = fresh.llm.tokenize(dist.prompt_text.encode("utf-8"), add_bos=True, special=True)
        assert tokens == [t for segment in record["segments"] for t in segment["tokens"]]  # the text as decoded
        row = decode_record(fresh, record)[len(tokens) - 1].astype(np.float64)
    finally:
        fresh.close()
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    assert any(len(v) > 1 for v in dist.label_variant_ids), "SmolLM2 has `A` and ` A` as single tokens"
    expected_logits = [math.log(sum(math.exp(row[t]) for t in v)) for v in dist.label_variant_ids]
    expected_mass = sum(probs[t] for v in dist.label_variant_ids for t in v)
    np.testing.assert_allclose(dist.option_logits, expected_logits, rtol=0, atol=1e-4)
    assert 0.0 < dist.label_mass <= 1.0
    assert math.isclose(dist.label_mass, expected_mass, rel_tol=1e-4, abs_tol=1e-6)


def test_label_mass_is_none_under_sequence_scoring(engine):
    assert engine.score(STATE, [ROUTE], scoring="sequence").distributions[0].label_mass is None


def test_a_binary_question_scored_with_letter_labels_shows_the_letters_and_what_they_mean(engine, memo_off):
    """Where Yes/No are not single tokens the fallback scores A/B: the prompt must say so."""
    letters = engine.labels.letters
    fallback = Labels(letters=letters, binary=LabelSet(letters.texts[:2], letters.token_ids[:2], letters.variants[:2]),
                      scale=engine.labels.scale)
    plan = build_plan(template=engine.template, labels=fallback, tokenize=engine._tokenize,
                      eos_token=engine.llm.token_eos(), bos_token=engine.llm.token_bos(), adds_bos=engine._adds_bos(),
                      n_ctx=engine.n_ctx, n_batch=engine.n_batch, state_text=STATE, questions=[IS_ACCOUNT],
                      scoring="label")
    text = plan.questions[0].text
    assert "A. Yes\nB. No\nReply A or B." in text and "Reply Yes or No" not in text
    assert plan.questions[0].label_token_ids == letters.token_ids[:2]
    dist = engine.execute(plan).distributions[0]
    assert dist.labels == ["A", "B"] and dist.evaluated_tokens > 0
    native = engine.plan(STATE, [IS_ACCOUNT]).questions[0]
    assert native.labels == ("Yes", "No") and "Reply Yes or No." in native.text


def test_a_qwen3_template_renders_with_thinking_disabled():
    template = PromptTemplate((DATA / "Qwen-Qwen3-0.6B.jinja").read_text())
    assert template.thinking == "disabled"
    assert template.answer_cue.endswith("<|im_start|>assistant\n" + EMPTY_THINK)


def test_an_r1_distill_template_gets_its_think_block_closed_before_the_answer_cue():
    """The official R1 distill template opens `<think>\n` in its generation prompt and has no switch."""
    template = PromptTemplate((DATA / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text())
    assert template.thinking == "closed"
    assert template.answer_cue.endswith("<｜Assistant｜>" + EMPTY_THINK)
    assert template.answer_cue.count("<think>") == 1


def test_an_r1_distill_template_with_a_thinking_switch_closes_the_block_itself():
    """llama.cpp's copy of the Qwen-32B distill template honours enable_thinking=False (`<think>\n</think>`)."""
    template = PromptTemplate((DATA / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text())
    assert template.thinking == "disabled"
    assert template.answer_cue.endswith("<｜Assistant｜><think>\n</think>")


def test_a_template_without_reasoning_is_left_as_it_is(engine, memo_off):
    assert engine.template.thinking is None and "<think>" not in engine.template.answer_cue


# ---- order debiasing --------------------------------------------------------------------------

def _computed(result):
    assert all(d.evaluated_tokens > 0 for d in result.distributions)
    return result


def test_debiased_answer_is_the_renormalised_mean_log_probability_of_both_orders(engine, memo_off):
    given = _computed(engine.score(STATE, [ROUTE])).distributions[0]
    back = _computed(engine.score(STATE, [reversed_question(ROUTE)])).distributions[0]
    debiased = _computed(engine.score(STATE, [ROUTE], debias="reverse", reads=2, return_prompt=True)).distributions[0]
    expected = softmax(combine_orders(given.option_logits, back.option_logits[::-1]))
    np.testing.assert_allclose(debiased.probabilities, expected, atol=1e-5)
    np.testing.assert_allclose(debiased.orders["given"]["probabilities"], given.probabilities, atol=1e-5)
    np.testing.assert_allclose(debiased.orders["reversed"]["probabilities"], back.probabilities[::-1], atol=1e-5)
    assert debiased.debias == "reverse"
    # The reversed order is rendered exactly as a client listing the options backwards would send it.
    assert debiased.orders["reversed"]["prompt_text"] == engine.score(
        STATE, [reversed_question(ROUTE)], return_prompt=True).distributions[0].prompt_text


@pytest.mark.parametrize("scoring", ["label", "sequence"])
def test_a_debiased_answer_does_not_depend_on_the_order_the_client_lists_the_options_in(engine, scoring, memo_off):
    """(Choices only: a scale's levels and a yes/no question's outcomes have a meaning in their order.)"""
    forward = _computed(engine.score(STATE, [ROUTE], debias="reverse", scoring=scoring)).distributions[0]
    backward = _computed(engine.score(STATE, [reversed_question(ROUTE)], debias="reverse", scoring=scoring)).distributions[0]
    np.testing.assert_allclose(forward.probabilities, backward.probabilities[::-1], atol=1e-5)
    plain = _computed(engine.score(STATE, [ROUTE], scoring=scoring)).distributions[0]
    plain_back = _computed(engine.score(STATE, [reversed_question(ROUTE)], scoring=scoring)).distributions[0]
    assert not np.allclose(plain.probabilities, plain_back.probabilities[::-1], atol=1e-3), "the model is order-sensitive"


def test_the_reversed_binary_and_scale_questions_say_what_order_they_are_in(engine):
    plan = engine.plan(STATE, [IS_ACCOUNT, PRIORITY], debias="reverse")
    assert "Reply No or Yes." in plan.questions[0].reversed.text
    assert plan.questions[0].reversed.labels == ("No", "Yes")
    first, second, third = plan.questions[1].reversed.labels
    assert f"Levels, from highest to lowest:\n{first}. high\n{second}. medium\n{third}. low" in plan.questions[1].reversed.text
    assert "Levels, from lowest to highest:" in plan.questions[1].text


def test_an_options_first_recap_names_each_label_with_its_key_in_the_order_shown():
    """The evaluation tools' recap styles (template_eval.py): the question again after the state, and with
    ``question_keys`` each label with the key of the option it stands for, reversed orders included. A
    style that does not set it hashes as before (the shipped calibration file stays bound: its own test)."""
    from dataclasses import replace

    from semif.serving.engine.prompt import STYLES

    question = Question("Which queue?", (Outcome("billing", "Charges"), Outcome("access", "Sign in"), Outcome("other")))
    keys = PromptTemplate(None, variant=replace(STYLES["v3"], recap="question_keys"))
    block, _ = keys.options_first_suffix_parts(question, ["A", "B", "C"], [2, 1, 0])
    assert block.endswith("Question: Which queue?\nReply with one letter: A (other), B (access), C (billing).")
    only = PromptTemplate(None, variant=replace(STYLES["v3"], recap="question"))
    assert only.options_first_suffix_parts(question, ["A", "B", "C"])[0].endswith("Question: Which queue?\nReply with one letter: A, B, C.")
    plain = PromptTemplate(None, variant="v3")
    assert "Question:" not in plain.options_first_suffix_parts(question, ["A", "B", "C"])[0]
    assert len({plain.sha256, keys.sha256, only.sha256}) == 3


def test_a_reply_line_in_the_lead_comes_right_after_the_question_in_every_order():
    """The evaluation style ``reply_at="lead"`` (template_eval.py, v3-reply-lead): the reply line after the
    question, before the options, so a later order's block starts with it; hashed apart from v3."""
    from dataclasses import replace

    from semif.serving.engine.prompt import STYLES, render_question_block

    question = Question("Which queue?", (Outcome("billing", "Charges"), Outcome("access", "Sign in")))
    style = replace(STYLES["v3"], reply_at="lead")
    for order in ([0, 1], [1, 0]):
        block = render_question_block(question, ["A", "B"], order, style)
        assert block.startswith("Question: Which queue?\nReply with one letter: A, B.\nOptions:\nA. ")
    assert render_question_block(question, ["A", "B"], None, STYLES["v3"]).endswith("B. Sign in\nReply with one letter: A, B.")
    assert PromptTemplate(None, variant=style).sha256 != PromptTemplate(None, variant="v3").sha256


def test_debiasing_evaluates_the_state_once_and_the_other_order_from_where_it_differs(engine, memo_off):
    """The second order's question block starts as the first one's (the question, the options header): that
    lead is evaluated once; the second read evaluates only what follows it."""
    start_cold(engine)
    plain = engine.plan(STATE, [ROUTE])
    plan = engine.plan(STATE, [ROUTE], debias="reverse", reads=2)
    first, other = plan.questions[0].suffix_tokens, plan.questions[0].reversed.suffix_tokens
    lead = shared_lead(first, other)
    assert engine.llm.detokenize(first[:lead]).decode().strip().startswith(f"Question: {ROUTE.text}\nOptions:")
    result = engine.execute(plan)
    # The prompt counts the lead once, as it counts the state once: a cold request evaluates all of it.
    assert result.evaluated_tokens == result.input_tokens == plan.state_tokens + len(first) + len(other) - lead
    assert result.input_tokens > plain.input_tokens and result.cached_tokens == 0
    assert result.distributions[0].tokens == result.input_tokens


def test_sequence_scoring_is_debiased_too(engine):
    given = _computed(engine.score(STATE, [ROUTE], scoring="sequence")).distributions[0]
    back = _computed(engine.score(STATE, [reversed_question(ROUTE)], scoring="sequence")).distributions[0]
    debiased = _computed(engine.score(STATE, [ROUTE], scoring="sequence", debias="reverse")).distributions[0]
    expected = softmax(combine_orders(given.option_logits, back.option_logits[::-1]))
    np.testing.assert_allclose(debiased.probabilities, expected, atol=1e-5)


def test_an_unknown_debias_mode_is_a_plan_error_naming_the_field(engine):
    from semif.serving.engine.plan import PlanError

    with pytest.raises(PlanError) as caught:
        engine.plan(STATE, [ROUTE], debias="sideways")
    assert caught.value.field == "debias"


# ---- the wire: debias in every contract, label_mass in answers, policy and log line ---------------

SEMIF_BODY = {"decision": {"id": "route", "state": STATE, "question": ROUTE.text,
                           "options": [{"id": o.key, "description": o.description} for o in ROUTE.outcomes]}}
SYSTEMONE_BODY = {"state": STATE, "questions": {"route": {"type": "choice", "instructions": ROUTE.text,
                                                          "criteria": {o.key: o.description for o in ROUTE.outcomes}}}}
OPENAI_BODY = {"model": "gpt-6-luna", "input": STATE, "questions": [
    {"type": "choice", "name": "route", "instructions": ROUTE.text,
     "choices": [{"value": o.key, "description": o.description} for o in ROUTE.outcomes]}]}


def _probabilities(path, payload):
    if path == "/v1/semif":
        return payload["probabilities"]
    if path == "/v1/systemone":
        return list(payload["answers"]["route"]["probabilities"].values())
    return [p["probability"] for p in payload["answers"][0]["probabilities"]]


@pytest.mark.parametrize("path,body", [("/v1/semif", SEMIF_BODY), ("/v1/systemone", SYSTEMONE_BODY),
                                       ("/v1/decisions", OPENAI_BODY)], ids=["semif", "systemone", "openai"])
def test_every_contract_accepts_debias_and_rejects_a_bad_value_naming_the_field(client, engine, path, body):
    # Listed backwards: "reverse" reads the direction whose first id sorts first (the row as ROUTE lists it), so
    # its answer is not this listing's single read even where the stop rule answers from one read.
    sent = _reversed_listing(path, body)
    plain = client.post(path, json={**sent, "debias": "none"})
    debiased = client.post(path, json={**sent, "debias": "reverse"})
    assert plain.status_code == debiased.status_code == 200, debiased.text
    expected = engine.score(STATE, [ROUTE], debias="reverse").distributions[0].probabilities
    keys = [o.key for o in ROUTE.outcomes]
    for payload, equal in ((debiased, True), (plain, False)):
        got = _by_option(path, payload.json(), sent)
        assert np.allclose([got[k] for k in keys], expected, atol=1e-5) is equal, (payload.json(), expected)
    bad = client.post(path, json={**body, "debias": "sideways"})
    assert 400 <= bad.status_code < 500
    assert "debias" in bad.text


def _reversed_listing(path, body):
    if path == "/v1/semif":
        return {"decision": {**body["decision"], "options": body["decision"]["options"][::-1]}}
    if path == "/v1/systemone":
        route = body["questions"]["route"]
        return {**body, "questions": {"route": {**route, "criteria": dict(list(route["criteria"].items())[::-1])}}}
    (route,) = body["questions"]
    return {**body, "questions": [{**route, "choices": route["choices"][::-1]}]}


def _by_option(path, payload, body) -> dict:
    probabilities = _probabilities(path, payload)
    if path == "/v1/semif":
        keys = [o["id"] for o in body["decision"]["options"]]
    elif path == "/v1/systemone":
        keys = list(body["questions"]["route"]["criteria"])
    else:
        keys = [c["value"] for c in body["questions"][0]["choices"]]
    return dict(zip(keys, probabilities))


@pytest.mark.parametrize("path,body", [("/v1/semif", SEMIF_BODY), ("/v1/systemone", SYSTEMONE_BODY),
                                       ("/v1/decisions", OPENAI_BODY)], ids=["semif", "systemone", "openai"])
def test_a_request_that_does_not_send_debias_is_read_under_reverse_so_either_listing_gets_one_answer(
        client, engine, memo_off, path, body):
    """The server default (SEMIF_DEBIAS unset) is reverse: the engine's reverse answer, the same for the
    options listed backwards, and not the backwards listing's single read (the first read is the direction
    whose first id sorts first: ROUTE's listing)."""
    listed = client.post(path, json=body)
    backwards = client.post(path, json=_reversed_listing(path, body))
    assert listed.status_code == backwards.status_code == 200, backwards.text
    expected = dict(zip([o.key for o in ROUTE.outcomes],
                        engine.score(STATE, [ROUTE], debias="reverse").distributions[0].probabilities))
    backwards_route = Question(ROUTE.text, ROUTE.outcomes[::-1])
    single = dict(zip([o.key for o in backwards_route.outcomes],
                      engine.score(STATE, [backwards_route], debias="none").distributions[0].probabilities))
    for payload, sent in ((listed, body), (backwards, _reversed_listing(path, body))):
        got = _by_option(path, payload.json(), sent)
        np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), atol=1e-5)
    assert not np.allclose([single[k] for k in expected], list(expected.values()), atol=1e-4)


def test_semif_reports_label_mass_and_both_orders_when_the_prompt_is_asked_for(client):
    payload = client.post("/v1/semif", json={**SEMIF_BODY, "debias": "reverse", "reads": 2, "return_prompt": True}).json()
    assert 0.0 < payload["label_mass"] <= 1.0
    prompt = payload["prompt"]
    assert prompt["debias"] == "reverse"
    given, back = prompt["orders"]["given"], prompt["orders"]["reversed"]
    combined = softmax(combine_orders(given["option_logits"], back["option_logits"]))
    np.testing.assert_allclose(payload["probabilities"], combined, atol=1e-9)
    assert "A. Delivery problems." in back["prompt_text"] and "A. Account access support." in prompt["text"]
    assert "orders" not in client.post("/v1/semif", json={**SEMIF_BODY, "debias": "reverse"}).json()["prompt"]


def test_min_label_mass_in_a_policy_sends_a_low_mass_answer_to_review(client):
    mass = client.post("/v1/semif", json=SEMIF_BODY).json()["label_mass"]
    strict = client.post("/v1/semif", json={**SEMIF_BODY, "policy": {"min_label_mass": min(1.0, mass + 0.01)}}).json()
    lenient = client.post("/v1/semif", json={**SEMIF_BODY, "policy": {"min_label_mass": max(0.0, mass - 0.01)}}).json()
    assert strict["action"] == "review" and "label mass" in strict["action_reason"]
    assert lenient["action"] == "accept"
    bad = client.post("/v1/semif", json={**SEMIF_BODY, "policy": {"min_label_mass": 1.5}})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "policy.min_label_mass"


def test_the_json_log_line_carries_the_lowest_label_mass_and_the_debias_mode(client, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="semif.http"):
        payload = client.post("/v1/semif", json={**SEMIF_BODY, "debias": "reverse"}).json()
    (record,) = [r for r in caplog.records if r.getMessage() == "request"]
    assert record.label_mass == round(payload["label_mass"], 6)
    assert record.debias == "reverse"


def test_semif_debias_setting_is_validated():
    from semif.serving.config import Settings, SettingsError

    env = {"SEMIF_MODEL_PATH": str(embedded_model())}
    assert Settings.from_env(env).debias == "reverse"
    assert Settings.from_env({**env, "SEMIF_DEBIAS": "content_free"}).debias == "content_free"
    assert Settings.from_env({**env, "SEMIF_DEBIAS": "none"}).debias == "none"
    assert Settings.from_env({**env, "SEMIF_CONTENT_FREE_ENTRIES": "16"}).content_free_entries == 16
    with pytest.raises(SettingsError, match="SEMIF_CONTENT_FREE_ENTRIES"):
        Settings.from_env({**env, "SEMIF_CONTENT_FREE_ENTRIES": "0"})
    with pytest.raises(SettingsError, match="SEMIF_DEBIAS"):
        Settings.from_env({**env, "SEMIF_DEBIAS": "both"})


def test_the_policy_checks_label_mass_only_where_there_is_one():
    from semif.serving.postprocess.policy import Policy, decide

    policy = Policy.from_mapping({"min_label_mass": 0.5})
    assert decide([0.9, 0.1], policy, label_mass=0.49).action == "review"
    assert decide([0.9, 0.1], policy, label_mass=0.5).action == "accept"  # inclusive, like the other thresholds
    assert decide([0.9, 0.1], policy, label_mass=None).action == "accept"  # sequence scoring has no label mass
    assert policy.as_dict()["min_label_mass"] == 0.5


@pytest.mark.parametrize("default", ["reverse", "rotations", "content_free", "none"])
def test_the_server_default_applies_to_label_scoring_and_order_reads_to_the_state_first_layout_only(engine, default):
    """served_debias: a request without `debias` gets the default where it was measured (label scoring,
    state first); cloze scoring reads "none", and so does the options-first layout under a default that reads
    several orders (each would evaluate the state again)."""
    plan = engine.plan(STATE, [ROUTE], default_debias=default)
    assert plan.debias == default
    assert engine.plan(STATE, [ROUTE], scoring="sequence", default_debias=default).debias == "none"
    options_first = engine.plan(STATE, [ROUTE], layout="options_first", default_debias=default).debias
    assert options_first == ("none" if default in ("reverse", "rotations") else default)
    # A request that names a mode gets it whatever the layout.
    assert engine.plan(STATE, [ROUTE], layout="options_first", debias="reverse", default_debias=default).debias == "reverse"
