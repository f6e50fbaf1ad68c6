"""Several sequences per decode (SEMIF_BATCHING, semif/serving/engine/batching.py) on the real embedded model.

Batched answers are compared with serial ones computed for real on the session-scoped serial engine. They
are not bit-equal: the batch shape changes llama.cpp's kernels and their float accumulation. DRIFT is
the tolerance: tools/bench_batching.py measured at most 0.057 in any probability on SmolLM2-135M over the
29 sample decisions with flash attention on, 4 sequences (docs/benchmarks.md); through `serve`, where
which requests share a decode varies, the tests bound logits instead (SERVE_LOGIT_DRIFT); a mixed-up answer (another question's or another state's)
moves probabilities far more, and the checks below also compare label counts. Which request got which
answer: on the engine, each batched answer's logits lie within the drift of its own serial answer and
farther than the drift from another request's, chosen (and asserted) to lie more than twice the drift
away (the SmolLM2 logits tell states apart where its near-chance probabilities cannot); through `serve`,
where the drift is larger, each request has its own number of options, so another's answer has the wrong
length."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import numpy as np
import pytest

from semif.serving.engine.batching import batchable, execute_batch
from semif.serving.config import Settings, SettingsError
from semif.serving.engine.context import Cancelled, softmax
from semif.serving.engine.prompt import Outcome, Question

from serving import make_settings, start_cold

# The label memo is off here: batched answers are compared with serial evaluations
# (a memo hit would repeat the first answer).
pytestmark = pytest.mark.usefixtures("memo_off")

DRIFT = 0.1  # max |Δp| allowed between a batched and a serial answer (measured max: 0.057, docs/benchmarks.md)
# max |Δ logit| allowed between a batched and a serial answer: at most 0.142 measured on the four STATES with
# ROUTE, flash attention off (the `batched` engine; 2026-12-02, batching.py as of commit dd5781d)
LOGIT_DRIFT = 0.3
# The same through `serve` with 8 concurrent clients, flash attention on (its default) on both sides: at most
# 0.56 over 255 answers of mixed traffic (tools/bench_batching.py --drift-http, 2026-12-06, commit d6481b7,
# results/bench-batching-drift-http.json); it varies with which requests share a decode.
SERVE_LOGIT_DRIFT = 0.8
N_SEQ = 4

ROUTE = Question(
    "Which queue should handle this request?",
    (Outcome("account_access", "Account access support."), Outcome("billing", "Billing support."), Outcome("shipping", "Delivery problems.")),
)
PRIORITY = Question("How urgent is this?", (Outcome("low"), Outcome("medium"), Outcome("high")), kind="scale")
IS_ACCOUNT = Question("Is this about logging in?", (Outcome("true"), Outcome("false")), kind="binary")
TONE = Question("What is the tone?", (Outcome("calm"), Outcome("annoyed"), Outcome("angry"), Outcome("pleased")))
TOPIC = Question("What is it mainly about?", (Outcome("money"), Outcome("access"), Outcome("delivery"), Outcome("other"), Outcome("product")))
REFUND = Question("Does the customer ask for money back?", (Outcome("true"), Outcome("false")), kind="binary")

STATES = [
    "The customer cannot receive a password reset email and is locked out of the account.",
    "My card was charged twice for order 5521 and I want the duplicate refunded.",
    "The parcel was marked delivered yesterday but nothing arrived at my door.",
    "I love the new app update, thanks! Just wondering when dark mode ships.",
]


@pytest.fixture(scope="module")
def batched(model_path):
    """A second engine on the same model whose context has N_SEQ sequences, otherwise the session engine's
    settings (the shipped defaults, flash attention on), label memo off: every compared answer is computed."""
    import os

    from semif.serving.engine.context import Engine

    eng = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=1, label_memo=False, n_seq=N_SEQ)
    yield eng
    eng.close()


def _serial(engine, state, questions, scoring=None):
    start_cold(engine)  # cold: nothing another test left behind is reused
    return engine.score(state, questions, scoring=scoring)


def _max_dp(a, b) -> float:
    assert len(a.distributions) == len(b.distributions)
    worst = 0.0
    for x, y in zip(a.distributions, b.distributions):
        assert x.label_token_ids == y.label_token_ids and len(x.probabilities) == len(y.probabilities)
        worst = max(worst, float(np.max(np.abs(np.subtract(x.probabilities, y.probabilities)))))
    return worst


def _seq_pos_max(engine, seq: int) -> int:
    return int(engine._lc.llama_memory_seq_pos_max(engine._memory, seq))


# ---- the engine ----------------------------------------------------------------------------------


def test_serial_answers_on_a_context_with_several_sequences_equal_the_default_context_exactly(engine, batched):
    for state in STATES[:2]:
        batched.invalidate()
        on_batching_context = batched.score(state, [ROUTE, IS_ACCOUNT])
        alone = _serial(engine, state, [ROUTE, IS_ACCOUNT])
        for x, y in zip(on_batching_context.distributions, alone.distributions):
            assert x.option_logits == y.option_logits  # bit-equal: n_seq_max alone changes no kernel


def test_questions_of_one_request_decode_together_within_drift_of_serial_answers(engine, batched):
    questions = [ROUTE, PRIORITY, IS_ACCOUNT, TONE]
    batched.invalidate()
    waves = batched.batch_stats.waves
    [together] = execute_batch(batched, [batched.plan(STATES[0], questions)])
    alone = _serial(engine, STATES[0], questions)
    assert batched.batch_stats.waves == waves + 1  # all four questions in one decode
    assert _max_dp(together, alone) <= DRIFT
    for dist, question in zip(together.distributions, questions):
        assert len(dist.probabilities) == len(question.outcomes)
        assert abs(sum(dist.probabilities) - 1) < 1e-9
    # the state is evaluated once, then each question's suffix: the same token accounting as serial
    assert together.evaluated_tokens == alone.evaluated_tokens
    assert together.input_tokens == alone.input_tokens and together.cached_tokens == 0


def test_more_questions_than_sequences_run_in_waves_and_evaluate_the_state_once(engine, batched):
    questions = [ROUTE, PRIORITY, IS_ACCOUNT, TONE, TOPIC, REFUND]
    batched.invalidate()
    waves = batched.batch_stats.waves
    [together] = execute_batch(batched, [batched.plan(STATES[1], questions)])
    alone = _serial(engine, STATES[1], questions)
    assert batched.batch_stats.waves == waves + 2
    assert _max_dp(together, alone) <= DRIFT
    assert together.evaluated_tokens == alone.evaluated_tokens  # the second wave reuses the state


def test_requests_with_different_states_share_one_decode_and_each_gets_its_own_answer(engine, batched):
    plans = [batched.plan(state, [q]) for state, q in zip(STATES, [ROUTE, TOPIC, IS_ACCOUNT, TONE])]
    batched.invalidate()
    shared = batched.batch_stats.shared_waves
    results = execute_batch(batched, plans)
    assert batched.batch_stats.shared_waves == shared + 1
    serial = [_serial(engine, state, [q]) for state, q in zip(STATES, [ROUTE, TOPIC, IS_ACCOUNT, TONE])]
    for together, alone in zip(results, serial):
        assert together.batch_requests == len(plans)
        assert _max_dp(together, alone) <= DRIFT
    # The same question on two states, decoded together: each answer is its own state's, told apart by the
    # logits the model computed (the small model's probabilities are too close to chance to tell states apart;
    # its logits are not). The pair is chosen so that the two serial answers lie far more than twice the
    # drift apart, and that is asserted, not assumed: the check below always runs.
    alone = {s: np.asarray(_serial(engine, s, [ROUTE]).distributions[0].option_logits) for s in STATES}
    pair = max(((a, b) for i, a in enumerate(STATES) for b in STATES[i + 1:]),
               key=lambda ab: float(np.max(np.abs(alone[ab[0]] - alone[ab[1]]))))
    own = [alone[s] for s in pair]
    assert np.max(np.abs(own[0] - own[1])) > 2 * LOGIT_DRIFT, "no two states give answers a swap would change"
    batched.invalidate()
    got = [np.asarray(r.distributions[0].option_logits) for r in execute_batch(batched, [batched.plan(s, [ROUTE]) for s in pair])]
    for k in range(2):
        assert np.max(np.abs(got[k] - own[k])) <= LOGIT_DRIFT, f"state {k}: not its own answer"
        assert np.max(np.abs(got[k] - own[1 - k])) > LOGIT_DRIFT, f"state {k}: the other state's answer"


def test_after_a_batch_only_sequence_zero_holds_the_last_state_and_the_next_request_reuses_it(batched):
    plans = [batched.plan(state, [ROUTE, IS_ACCOUNT]) for state in STATES[:2]]
    batched.invalidate()
    execute_batch(batched, plans)
    kept = plans[-1].state_tokens
    assert _seq_pos_max(batched, 0) == kept - 1
    assert [_seq_pos_max(batched, s) for s in range(1, N_SEQ)] == [-1] * (N_SEQ - 1)
    [again] = execute_batch(batched, [batched.plan(STATES[1], [TONE])])
    assert again.state_cached_tokens == kept and again.evaluated_tokens == again.input_tokens - kept


@pytest.fixture(scope="module")
def at_defaults(model_path):
    """An engine with N_SEQ sequences and every other setting as `serve` ships it (flash attention, label
    memo, prefix snapshots), one thread (as `batched`)."""
    from semif.serving.engine.context import Engine

    eng = Engine(model_path, n_threads=1, n_seq=N_SEQ)
    yield eng
    eng.close()


def _cold(engine):
    """Nothing held, remembered or snapshotted: the next answer is evaluated from an empty context."""
    engine.invalidate()
    engine._label_memo.clear()
    engine.clear_prefix_snapshots()


def _assert_equal_logits(got, want):
    for x, y in zip(got.distributions, want.distributions, strict=True):
        np.testing.assert_allclose(x.option_logits, y.option_logits, atol=1e-6, rtol=0)


def test_a_serial_answer_after_a_batch_equals_a_cold_serial_answer(at_defaults):
    """A batch leaves its last state in sequence 0, decoded in a shared batch. The exact serial path (a
    fallback plan of the same batch, a later request, the label memo) must evaluate it again, never reuse it."""
    eng = at_defaults
    _cold(eng)
    *_, cloze = execute_batch(eng, [eng.plan(STATES[1], [TOPIC]), eng.plan(STATES[0], [ROUTE]),
                                       eng.plan(STATES[0], [ROUTE], scoring="sequence")])  # cloze: serial, after the batch
    later = eng.score(STATES[0], [IS_ACCOUNT, TONE])
    remembered = eng.score(STATES[0], [IS_ACCOUNT])  # the memo's answer, from `later`
    assert remembered.evaluated_tokens == 0
    _cold(eng)
    _assert_equal_logits(cloze, eng.score(STATES[0], [ROUTE], scoring="sequence"))
    _cold(eng)
    _assert_equal_logits(later, eng.score(STATES[0], [IS_ACCOUNT, TONE]))
    _assert_equal_logits(remembered, eng.score(STATES[0], [IS_ACCOUNT]))


def test_a_state_decoded_in_a_batch_is_never_snapshotted_for_the_serial_path(at_defaults):
    """State A is hot on the serial path; a batch then decodes it again, beside another state, and leaves it in
    sequence 0; a serial request for B leaves A. A snapshot taken there would hold the batch's KV and be restored for A's next
    serial request."""
    eng = at_defaults
    _cold(eng)
    a, b, other = " ".join([STATES[0]] * 3), STATES[2], STATES[3]  # A long enough to be worth a snapshot
    eng.score(a, [ROUTE])
    eng.score(a, [IS_ACCOUNT])  # A planned twice: hot
    execute_batch(eng, [eng.plan(other, [TONE])])  # sequence 0 now holds another state...
    execute_batch(eng, [eng.plan(STATES[1], [TONE]), eng.plan(a, [TONE])])  # ...then A, decoded beside another
    eng.score(b, [ROUTE])
    restores = eng.prefix_restores
    again = eng.score(a, [PRIORITY])
    restored = eng.prefix_restores - restores
    _cold(eng)
    _assert_equal_logits(again, eng.score(a, [PRIORITY]))
    assert restored == 0  # nothing of A's from the batch to restore: evaluated


def test_sequence_scoring_in_a_batch_takes_the_serial_path(engine, batched):
    batched.invalidate()
    fallbacks = batched.batch_stats.serial_fallbacks
    cloze, label = execute_batch(batched, [batched.plan(STATES[2], [ROUTE], scoring="sequence"), batched.plan(STATES[3], [ROUTE])])
    assert batched.batch_stats.serial_fallbacks == fallbacks + 1
    assert cloze.distributions[0].scoring == "sequence" and label.distributions[0].scoring == "label"
    assert _max_dp(cloze, _serial(engine, STATES[2], [ROUTE], scoring="sequence")) <= DRIFT


def test_a_cancelled_request_stops_between_waves_while_the_others_answer(batched):
    batched.invalidate()
    calls = {"n": 0}

    def cancel_after_first_wave() -> bool:
        calls["n"] += 1
        return calls["n"] > 1

    questions = [ROUTE, PRIORITY, IS_ACCOUNT, TONE, TOPIC]  # two waves of at most N_SEQ questions
    stopped, answered = execute_batch(
        batched, [batched.plan(STATES[0], questions), batched.plan(STATES[1], [ROUTE])], [cancel_after_first_wave, None]
    )
    assert isinstance(stopped, Cancelled) and stopped.done == N_SEQ and stopped.total == len(questions)
    assert len(answered.distributions) == 1 and answered.distributions[0].probabilities


# ---- the collector: which waiting requests decode together -------------------------------------------


@pytest.mark.parametrize("kind", ["sequence", "reverse", "reverse_one_read", "rotations", "injection_check"])
def test_a_request_the_batch_cannot_decode_runs_alone_and_no_batched_answer_waits_for_it(at_defaults, kind):
    """Three requests wait while the model is busy: a batchable one, one the batch cannot decode (cloze,
    order debiasing, the injection check: the serial path) on a long state, and another batchable one. The
    first is answered before the slow one has been computed, and it is not billed for it; the slow one runs
    alone; the last one, which arrived after it, waits for it (arrival order)."""
    import asyncio

    from semif.serving.http.admission import Admission
    from semif.serving.http.batch_collector import BatchCollector

    eng = at_defaults
    _cold(eng)
    long_state = " ".join(STATES[:3] * 3)
    options = {"sequence": dict(scoring="sequence"), "reverse": dict(debias="reverse"),
               # One read plans no other order, but shows the first direction: the serial pass maps it back.
               "reverse_one_read": dict(debias="reverse", reads=1),
               "rotations": dict(debias="rotations", reads=1), "injection_check": dict(injection_check=True)}[kind]
    plans = {"first": eng.plan(STATES[1], [ROUTE]), "slow": eng.plan(long_state, [ROUTE, TONE], **options),
             "after": eng.plan(STATES[2], [IS_ACCOUNT])}
    assert not batchable(eng, plans["slow"]) and batchable(eng, plans["first"])

    async def scenario():
        admission = Admission(max_queue=8, queue_timeout_s=300)
        collector = BatchCollector(admission, eng, n_seq=N_SEQ)
        answered = {}

        async def ask(name):
            result, admitted = await collector.run(plans[name])
            answered[name] = (time.perf_counter(), result, admitted)

        await admission._lock.acquire()  # the model is busy: all three are waiting when it comes free
        tasks = []
        for name in ("first", "slow", "after"):
            tasks.append(asyncio.create_task(ask(name)))
            await asyncio.sleep(0.01)  # arrival order
        assert admission.waiting == 3
        admission._lock.release()
        await asyncio.gather(*tasks)
        admission._executor.shutdown()
        return answered

    answered = asyncio.run(scenario())
    (t_first, first, first_adm), (t_slow, slow, slow_adm), (_, after, after_adm) = (answered[k] for k in ("first", "slow", "after"))
    assert [len(r.distributions) for r in (first, slow, after)] == [1, 2, 1]
    # the batchable request's answer left before the slow request was computed, and its compute time is its own
    assert t_slow - t_first >= 0.5 * slow_adm.compute_ms / 1000, (t_slow - t_first, slow_adm.compute_ms)
    assert first_adm.compute_ms < slow_adm.compute_ms
    # the slow request was a computation of its own, which the request that arrived after it waited for
    assert after_adm.queue_ms >= slow_adm.compute_ms, (after_adm.queue_ms, slow_adm.compute_ms)


# ---- settings and the service --------------------------------------------------------------------


def test_batching_is_off_by_default_and_the_service_then_runs_each_request_alone(model_path, engine):
    from semif.serving.http.app import DecisionService

    settings = Settings.from_env({"SEMIF_MODEL_PATH": str(model_path)})
    assert settings.batching is False
    assert engine.n_seq == 1
    assert DecisionService(settings, engine).batcher is None
    # asked for, but the engine has one sequence: still serial (never a half-configured batcher)
    assert DecisionService(make_settings(model_path, batching=True, n_seq=4), engine).batcher is None


def test_batching_settings_are_read_and_bad_values_name_the_variable(model_path):
    env = {"SEMIF_MODEL_PATH": str(model_path), "SEMIF_BATCHING": "1", "SEMIF_N_SEQ": "8"}
    settings = Settings.from_env(env)
    assert settings.batching and settings.n_seq == 8
    assert Settings.from_env({**env, "SEMIF_N_SEQ": ""}).n_seq == 4
    for bad in ("1", "257", "many"):
        with pytest.raises(SettingsError, match="SEMIF_N_SEQ"):
            Settings.from_env({**env, "SEMIF_N_SEQ": bad})
    with pytest.raises(SettingsError, match="SEMIF_BATCHING"):
        Settings.from_env({**env, "SEMIF_BATCHING": "sometimes"})


# ---- the real `serve` process --------------------------------------------------------------------

OPTIONS = [{"id": "account_access"}, {"id": "billing"}, {"id": "shipping"}]


QUEUES = ["account_access", "billing", "shipping", "returns", "technical", "sales", "privacy", "partners", "other"]


def _body(i: int, n_options: int = 3) -> dict:
    options = [{"id": queue} for queue in QUEUES[:n_options]]
    return {"decision": {"id": f"d{i}", "state": f"Ticket {i}: {STATES[i % len(STATES)]}", "question": "Which queue?",
                         "options": options}}


def _serial_logits(client, engine, bodies) -> list[np.ndarray]:
    """The serial answers' logits, through the same contract, from the in-process app on the session-scoped
    serial engine."""
    answers = []
    for body in bodies:
        start_cold(engine)
        response = client.post("/invocations", json=body)
        assert response.status_code == 200, response.text
        answers.append(np.asarray(response.json()["option_logits"]))
    return answers


def _requests_logged(server) -> list[dict]:
    return [line for line in server.log_lines() if line.get("message") == "request"]


def test_queued_requests_share_a_decode_and_each_gets_its_own_answer(start_serve, model_path, at_defaults):
    # Content-free calibration by default: reads in two orders (the shipped default, reverse) take the serial
    # path, so only a batchable default lets these requests share a decode.
    server = start_serve(SEMIF_BATCHING=1, SEMIF_N_SEQ=N_SEQ, SEMIF_N_THREADS=1, SEMIF_MAX_QUEUE=32,
                         SEMIF_DEBIAS="content_free")
    loaded = [line for line in server.log_lines() if line.get("message") == "model loaded"]
    assert loaded[0]["n_seq"] == N_SEQ
    # Each request has its own number of options (2 to 9): an answer given to the wrong request has the
    # wrong length, whatever the logits. (That each sequence's logits row goes to its own request is checked
    # on the engine, where the drift is smaller: test_requests_with_different_states_share_one_decode_….)
    bodies = [_body(i, n_options=2 + i) for i in range(8)]
    # Serial answers through the same contract, from an engine built as `serve` builds it (flash attention on).
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    with TestClient(create_app(make_settings(model_path, debias="content_free"), at_defaults)) as serial_client:
        serial = []
        for body in bodies:
            _cold(at_defaults)
            response = serial_client.post("/invocations", json=body)
            assert response.status_code == 200, response.text
            serial.append(np.asarray(response.json()["option_logits"]))

    def call(i):
        with httpx.Client(timeout=300) as http:
            return i, http.post(server.base_url + "/invocations", json=bodies[i])

    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(call, range(len(bodies))))
    for i, response in outcomes:
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["id"] == f"d{i}" and answer["option_ids"] == [o["id"] for o in bodies[i]["decision"]["options"]]
        got = np.asarray(answer["option_logits"])
        assert got.shape == serial[i].shape == (2 + i,), f"request {i} got another request's answer"
        own = np.max(np.abs(got - serial[i]))
        assert own <= SERVE_LOGIT_DRIFT, f"request {i}: {own:.3f}"
        np.testing.assert_allclose(answer["probabilities"], softmax(got), rtol=0, atol=1e-9)
    shared = [line["batch_requests"] for line in _requests_logged(server)]
    assert len(shared) == len(bodies)
    assert max(shared) > 1, f"8 concurrent clients never shared a decode: {shared}"


def test_full_queue_still_answers_503_with_retry_after_under_batching(start_serve, client, engine):
    server = start_serve(SEMIF_BATCHING=1, SEMIF_N_SEQ=2, SEMIF_N_THREADS=1, SEMIF_MAX_QUEUE=1, SEMIF_RETRY_AFTER_S=2)
    bodies = [_body(i) for i in range(4)]
    serial = _serial_logits(client, engine, bodies)

    def call(i):
        with httpx.Client(timeout=300) as http:
            return i, http.post(server.base_url + "/invocations", json=bodies[i % 4])

    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(call, range(36)))
    statuses = [r.status_code for _, r in outcomes]
    assert set(statuses) <= {200, 503}
    assert statuses.count(503) > 0, "a queue of 1 under 12 concurrent clients must refuse some requests"
    assert statuses.count(200) > 0
    for i, response in outcomes:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "2"
            assert response.json()["error"]["code"] == "overloaded"
        else:
            assert response.json()["id"] == f"d{i % 4}"
            assert np.max(np.abs(np.subtract(response.json()["option_logits"], serial[i % 4]))) <= SERVE_LOGIT_DRIFT
    logged = _requests_logged(server)
    assert sum(line["status"] == 503 and line["reason"] == "queue_full" for line in logged) == statuses.count(503)


def test_a_request_that_waits_past_the_queue_timeout_gets_503_under_batching(start_serve):
    server = start_serve(SEMIF_BATCHING=1, SEMIF_N_SEQ=2, SEMIF_N_THREADS=1, SEMIF_QUEUE_TIMEOUT_S=0.2)
    # a long cloze-scored request holds the model (sequence scoring takes the serial path inside the batch)
    long_body = {"decision": {**_body(0)["decision"], "state": "The customer explains the problem at length. " * 120},
                 "scoring": "sequence"}
    with cf.ThreadPoolExecutor(max_workers=1) as pool, httpx.Client(timeout=300) as http:
        holder = pool.submit(http.post, server.base_url + "/invocations", json=long_body)
        time.sleep(0.5)
        refused = http.post(server.base_url + "/invocations", json=_body(1))
        assert holder.result().status_code == 200
    assert holder.done()
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert any(line.get("reason") == "queue_timeout" for line in _requests_logged(server))


# ---- the GPU run's model, checked here on the CPU -------------------------------------------------


def test_the_random_weight_gguf_of_the_device_script_loads_and_answers_batched(tmp_path, model_path):
    """tools/gpu/run_device_bench.sh cannot carry a real model; it builds a random-weight one from the
    embedded model's tokenizer. Its smallest shape must load, pick labels and answer on both paths."""
    import subprocess
    import sys

    from semif.serving.engine.context import Engine

    from serving import REPO

    tool = REPO / "tools" / "gpu" / "random_gguf.py"
    tokenizer, model = tmp_path / "tokenizer.json.gz", tmp_path / "random.gguf"
    subprocess.run([sys.executable, str(tool), "tokenizer", "--from", str(model_path), "--out", str(tokenizer)], check=True)
    subprocess.run([sys.executable, str(tool), "model", "--tokenizer", str(tokenizer), "--preset", "tiny",
                    "--n-ctx", "1024", "--out", str(model)], check=True)
    eng = Engine(model, n_ctx=1024, n_threads=1, label_memo=False, n_seq=2)
    try:
        assert eng.info["architecture"] == "llama" and len(eng.labels.letters.texts) >= 26
        serial = eng.score(STATES[0], [ROUTE]).distributions[0].probabilities
        eng.invalidate()
        [batched] = execute_batch(eng, [eng.plan(STATES[0], [ROUTE])])
        assert len(serial) == 3 and abs(sum(serial) - 1) < 1e-9
        assert np.max(np.abs(np.subtract(batched.distributions[0].probabilities, serial))) <= DRIFT
    finally:
        eng.close()
