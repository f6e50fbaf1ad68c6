"""The caches against the cold path, at the shipped defaults, on the real embedded model.

The engine keeps three things between requests: the prefix its context holds, KV snapshots of hot
prefixes (SEMIF_PREFIX_CACHE_MB) and the label memo. Whatever they hold, an answer must be the one a
cold evaluation gives. Here one engine runs exactly as `serve` builds it (flash attention, memo,
snapshots, context size: the defaults of Engine and Settings) and every answer it gives is compared
with an engine that caches nothing (prefix cache, memo and snapshots off), to 1e-6 in each logit, the
tolerance of the other exactness tests (the two sides run the same kernels on the same batch shapes,
so they agree bit for bit in practice). Snapshot budgets are counted in snapshots, from a measured
snapshot size, so "room for one" means what it says on any build."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from semif.serving.engine.context import Engine
from semif.serving.engine.prompt import Outcome, Question

from serving import make_settings

# One thread: on a machine shared with other jobs llama.cpp's spinning threads lose more than they win,
# and the thread count changes no kernel's accumulation order (both sides use the same anyway).
THREADS = 1
ATOL = 1e-6

# Hot states: long enough that a snapshot spares far more than PREFIX_SNAPSHOT_MIN_TOKENS, and of about
# the same length, so that one budget is "room for k" for each of them.
STATES = [
    "Ticket from the third floor. " + "The printer jams every morning, the toner light blinks and pages come out blank. " * 4,
    "Ticket from a remote worker. " + "The VPN drops every ten minutes on the train and email stops syncing for hours. " * 4,
    "Ticket from the lab. " + "The shared drive is read-only since Monday and my badge no longer opens the door. " * 4,
]
TEAMS = (Outcome("hardware", "Broken laptops, printers, monitors."), Outcome("network", "Wi-Fi, VPN and internet."),
         Outcome("access", "Passwords, accounts and permissions."))
QUESTIONS = [
    Question("Which team should take this ticket?", TEAMS),
    Question("Does the ticket need an answer today?", (Outcome("yes"), Outcome("no")), kind="binary"),
    Question("How upset is the writer?", (Outcome("calm"), Outcome("annoyed"), Outcome("angry")), kind="scale"),
    Question("What broke first?", (Outcome("device"), Outcome("connection"), Outcome("permission"), Outcome("unclear"))),
    Question("Which team should look at it second?", TEAMS),
    Question("Is more than one person affected?", (Outcome("yes"), Outcome("no")), kind="binary"),
    Question("Would a reboot help?", (Outcome("yes"), Outcome("no")), kind="binary"),
    Question("Which word fits the ticket best?", (Outcome("slow"), Outcome("broken"), Outcome("blocked"))),
]


class _Faults:
    """The llama_cpp module as one engine sees it (``engine._lc``), with chosen functions failing:
    ``raising`` ones raise, ``refusing`` ones return 0 (llama.cpp's "nothing done"). Nothing else
    changes, and no other engine is affected."""

    def __init__(self, module):
        self._module = module
        self.raising: set[str] = set()
        self.refusing: set[str] = set()

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name in self.raising:
            def fail(*args, **kwargs):
                raise OSError(f"{name}: injected failure")
            return fail
        if name in self.refusing:
            return lambda *args, **kwargs: 0
        return value


@pytest.fixture(scope="module")
def hot(model_path):
    """The engine `serve` builds, at every shipped default but the thread count."""
    eng = Engine(model_path, n_threads=THREADS)
    eng._lc = _Faults(eng._lc)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def cold(model_path):
    """Caches nothing: every request starts from an empty context, nothing is remembered."""
    eng = Engine(model_path, n_threads=THREADS, prefix_cache=False, label_memo=False, prefix_cache_mb=0)
    yield eng
    eng.close()


_cold_answers: dict = {}


def _cold_logits(cold, state: int, question: int) -> list[float]:
    """One question about one state from an empty context (the cold engine is deterministic: each
    answer is computed once per module)."""
    key = (state, question)
    if key not in _cold_answers:
        result = cold.score(STATES[state], [QUESTIONS[question]])
        assert result.cached_tokens == 0
        _cold_answers[key] = result.distributions[0].option_logits
    return _cold_answers[key]


def _reset(engine, *, snapshot_bytes: int) -> None:
    """Empty context, memo and snapshots; no injected faults; the given snapshot budget."""
    engine._lc.raising.clear()
    engine._lc.refusing.clear()
    engine.invalidate()
    engine._label_memo.clear()
    engine.clear_prefix_snapshots()
    engine.prefix_cache_bytes = snapshot_bytes


@pytest.fixture(scope="module")
def snapshot_sizes(hot):
    """Bytes of each state prefix's snapshot, measured on the engine: the context brought to exactly the
    prefix, then llama.cpp asked for the size of that sequence's state."""
    sizes = []
    for state in STATES:
        hot.invalidate()
        for segment in hot.plan(state, []).prefix_segments:
            hot._decode(list(segment), set())
        sizes.append(int(hot._lc.llama_state_seq_get_size(hot._ctx, 0)))
    hot.invalidate()
    return sizes


def _room(sizes: list[int], k: int) -> int:
    """A budget with room for k snapshots of any of the states, never for k + 1."""
    budget = k * max(sizes) + min(sizes) // 2
    assert (k + 1) * min(sizes) > budget, f"the states' snapshots differ too much in size for one budget: {sizes}"
    return budget


def _assert_cold(got: list[float], want: list[float], what: str) -> None:
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=what)


# ---- two hot states, room for one snapshot -----------------------------------------------------------


def _body(state: int, i: int) -> dict:
    return {"decision": {"id": "ticket", "state": STATES[state], "question": f"Question {i}: which team should take this ticket?",
                         "options": [{"id": o.key, "description": o.description} for o in TEAMS]}}


def test_two_hot_states_alternating_with_room_for_one_snapshot_all_answer_200_equal_to_cold(hot, cold, snapshot_sizes, model_path):
    """A B A B …, a different question each time, with room for exactly one snapshot: the snapshot about to
    be restored is then the least recently used one, and saving the other state must not evict it."""
    from starlette.testclient import TestClient

    from semif.serving.http.app import create_app

    order = [0, 1] * 4
    # Both servers calibrate content-free (SEMIF_DEBIAS=content_free), the readout whose priors outlive a
    # request. Every request asks a question of its own: their priors are held first, as a recurring
    # decision's are, so that each request evaluates its state and question only.
    for i in range(len(order)):
        hot.score("A warm-up ticket.", [Question(_body(0, i)["decision"]["question"], TEAMS)], debias="content_free")
    _reset(hot, snapshot_bytes=_room(snapshot_sizes, 1))
    restores, failures = hot.prefix_restores, hot.prefix_snapshot_failures
    settings_ = make_settings(model_path, prefix_cache_mb=hot.prefix_cache_bytes / (1 << 20), debias="content_free")
    with TestClient(create_app(settings_, hot), raise_server_exceptions=False) as warm_client, \
            TestClient(create_app(make_settings(model_path, debias="content_free"), cold),
                       raise_server_exceptions=False) as cold_client:
        responses = []
        for i, state in enumerate(order):
            responses.append(warm_client.post("/invocations", json=_body(state, i)))
            assert hot.prefix_snapshot_stats["bytes"] <= hot.prefix_cache_bytes
        assert [r.status_code for r in responses] == [200] * len(order), [r.text[:200] for r in responses]
        assert all(r.json()["prompt"]["content_free"]["held"] for r in responses)  # the warm-up held every prior
        for i, (state, response) in enumerate(zip(order, responses)):
            want = cold_client.post("/invocations", json=_body(state, i))
            assert want.status_code == 200 and want.json()["prompt"]["cached_tokens"] == 0
            _assert_cold(response.json()["option_logits"], want.json()["option_logits"], f"request {i}")
    # A state is saved when the context leaves it hot (planned twice): A when request 3 leaves it, B when
    # request 4 does. From request 4 on, every request restores its state (an engine that stopped
    # restoring would answer 200 too, by evaluating).
    assert hot.prefix_restores - restores == len(order) - 4
    assert hot.prefix_snapshot_failures == failures  # (the module's engine also runs the failure-injection tests)


# ---- a snapshot copy that fails mid-way --------------------------------------------------------------


def _warm_two_states(hot, cold) -> None:
    """A, A, B, B: both states hot; leaving A for B snapshotted A, and the context holds B."""
    for state, question in [(0, 0), (0, 1), (1, 2), (1, 3)]:
        _assert_cold(hot.score(STATES[state], [QUESTIONS[question]]).distributions[0].option_logits,
                     _cold_logits(cold, state, question), f"warm-up {state}/{question}")
    assert hot.prefix_snapshot_stats["entries"] == 1


@pytest.mark.parametrize("failure", ["raising", "refusing"])
def test_a_restore_that_fails_answers_from_a_cold_evaluation_and_the_next_restore_works(hot, cold, snapshot_sizes, failure):
    _reset(hot, snapshot_bytes=_room(snapshot_sizes, 2))
    _warm_two_states(hot, cold)
    failures, restores = hot.prefix_snapshot_failures, hot.prefix_restores
    getattr(hot._lc, failure).add("llama_state_seq_set_data")
    answered = hot.score(STATES[0], [QUESTIONS[4]])  # restores A: llama.cpp fails instead
    getattr(hot._lc, failure).clear()
    assert hot.prefix_snapshot_failures == failures + 1 and hot.prefix_restores == restores
    assert answered.state_cached_tokens == 0  # evaluated from an empty context, not from half a restore
    _assert_cold(answered.distributions[0].option_logits, _cold_logits(cold, 0, 4), "after the failed restore")
    # B, saved when the failed request left it, comes back from its snapshot as usual.
    again = hot.score(STATES[1], [QUESTIONS[5]])
    assert hot.prefix_restores == restores + 1 and again.state_cached_tokens == again.state_tokens
    _assert_cold(again.distributions[0].option_logits, _cold_logits(cold, 1, 5), "the next restore")


def test_a_snapshot_save_that_fails_answers_from_a_cold_evaluation(hot, cold, snapshot_sizes):
    _reset(hot, snapshot_bytes=_room(snapshot_sizes, 2))
    for question in (0, 1):  # A hot, held by the context, not yet saved
        hot.score(STATES[0], [QUESTIONS[question]])
    failures = hot.prefix_snapshot_failures
    hot._lc.raising.add("llama_state_seq_get_data")
    answered = hot.score(STATES[1], [QUESTIONS[2]])  # leaving A saves it: llama.cpp fails
    hot._lc.raising.clear()
    assert hot.prefix_snapshot_failures == failures + 1
    assert hot.prefix_snapshot_stats["entries"] == 0
    _assert_cold(answered.distributions[0].option_logits, _cold_logits(cold, 1, 2), "after the failed save")
    _assert_cold(hot.score(STATES[0], [QUESTIONS[5]]).distributions[0].option_logits, _cold_logits(cold, 0, 5), "A again")


# ---- any traffic, any budget ------------------------------------------------------------------------

# Traffic: runs of one or two requests on one state (a run of two makes the state hot at once), each
# request one or two of four questions (a repeated prompt is a label-memo hit).
RUNS = st.lists(
    st.tuples(st.sampled_from(range(len(STATES))), st.integers(min_value=1, max_value=2),
              st.lists(st.sampled_from(range(4)), min_size=1, max_size=2, unique=True)),
    min_size=2, max_size=6,
)
MAX_REQUESTS = 9


def _requests(runs) -> list[tuple[int, list[int]]]:
    out = []
    for state, repeat, questions in runs:
        for r in range(repeat):
            out.append((state, questions if r == 0 else questions[::-1]))
    return out[:MAX_REQUESTS]


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(room=st.integers(min_value=0, max_value=3), runs=RUNS,
       failing=st.sets(st.integers(min_value=0, max_value=MAX_REQUESTS - 1), max_size=2))
# Always run as well: two hot states alternating with room for one (each restore then depends on the
# eviction order), one restore failing on the way.
@example(room=1, runs=[(0, 2, [0]), (1, 2, [1]), (0, 1, [2]), (1, 1, [3]), (0, 1, [1, 0]), (1, 1, [2, 0])], failing={5})
def test_every_answer_under_any_traffic_and_snapshot_budget_equals_a_cold_evaluation(hot, cold, snapshot_sizes, room, runs, failing):
    """Random streams of hot states and questions, with room for 0 to 3 snapshots and restores that fail
    at chosen requests: every answer is the cold one, the snapshots stay within their budget, and their
    byte count is what they hold."""
    _reset(hot, snapshot_bytes=_room(snapshot_sizes, room))
    restores, failures = hot.prefix_restores, hot.prefix_snapshot_failures
    for n, (state, questions) in enumerate(_requests(runs)):
        if n in failing:
            hot._lc.raising.add("llama_state_seq_set_data")
        result = hot.score(STATES[state], [QUESTIONS[q] for q in questions])
        hot._lc.raising.clear()
        for q, dist in zip(questions, result.distributions, strict=True):
            _assert_cold(dist.option_logits, _cold_logits(cold, state, q), f"request {n}: state {state}, question {q}")
        stats = hot.prefix_snapshot_stats
        assert stats["bytes"] <= stats["limit_bytes"] and stats["entries"] <= room
        assert stats["bytes"] == sum(s.data.nbytes for s in hot._prefix_snapshots.values())
    event(f"room {room}: {'restored' if hot.prefix_restores > restores else 'no restore'}")
    if hot.prefix_snapshot_failures > failures:
        event("a restore failed and was answered cold")
