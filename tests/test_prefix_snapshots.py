"""More than one prefix warm: KV snapshots of prefixes in RAM, on the real embedded model.

Each comparison computes both sides: the restored answer on the session-scoped engine, the reference on an engine
of its own that never restores anything (snapshots off, prefix cache off)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from semif.serving.config import Settings, SettingsError
from semif.serving.engine.context import PREFIX_SNAPSHOT_MIN_TOKENS, Engine
from semif.serving.engine.prompt import Outcome, Question

ROUTE = Question(
    "Which team should take this ticket?",
    (Outcome("hardware", "Broken laptops, printers, monitors."), Outcome("network", "Wi-Fi, VPN and internet."),
     Outcome("access", "Passwords, accounts and permissions.")),
)
URGENT = Question("Does the ticket need an answer today?", (Outcome("yes"), Outcome("no")), kind="binary")
TONE = Question("How upset is the writer?", (Outcome("calm"), Outcome("annoyed"), Outcome("angry")), kind="scale")
STATE_A = "Ticket from the third floor. " + "The printer jams every morning, the toner light blinks and pages come out blank. " * 6
STATE_B = "Ticket from a remote worker. " + "The VPN drops every ten minutes on the train and email stops syncing. " * 6
STATE_C = "Ticket from the lab. " + "The shared drive is read-only since Monday and my badge no longer opens the door. " * 6


# The label memo answers a repeated prompt without a forward pass, so neither snapshot nor evaluation would
# run: these tests compare restored prefixes with evaluated ones, the memo stays off for them.
pytestmark = pytest.mark.usefixtures("memo_off")


@pytest.fixture(scope="module")
def reference(model_path):
    """An engine that evaluates every prompt from an empty context: the answers a restore must give.
    The session engine's settings (conftest: the shipped defaults), its caches off."""
    eng = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=os.cpu_count() or 2, label_memo=False,
                 prefix_cache=False, prefix_cache_mb=0)
    yield eng
    eng.close()


def test_a_prefix_restored_from_a_snapshot_gives_the_logits_of_a_freshly_evaluated_one(snapshots_on, reference):
    engine = snapshots_on
    restores = engine.prefix_restores
    # Two busy states alternate, a different question each time: the context holds one of them at a time.
    for state, question in [(STATE_A, ROUTE), (STATE_B, ROUTE), (STATE_A, URGENT), (STATE_B, URGENT)]:
        engine.score(state, [question])
    assert engine.prefix_restores == restores  # a state is snapshotted only once two requests planned it
    assert engine.prefix_snapshot_stats["entries"] >= 1

    restored = engine.score(STATE_A, [TONE])
    assert engine.prefix_restores == restores + 1  # the answer below really came from a restored prefix
    assert restored.state_cached_tokens == restored.state_tokens  # restored tokens count as cached, not evaluated
    assert restored.evaluated_tokens == restored.distributions[0].tokens - restored.state_tokens

    fresh = reference.score(STATE_A, [TONE])
    assert fresh.cached_tokens == 0
    np.testing.assert_allclose(restored.distributions[0].option_logits, fresh.distributions[0].option_logits,
                               atol=1e-6, rtol=0)

    # And back to B, which A's restore evicted: restored as well, and equal to B evaluated from scratch.
    restored_b = engine.score(STATE_B, [TONE])
    assert engine.prefix_restores == restores + 2
    fresh_b = reference.score(STATE_B, [TONE])
    np.testing.assert_allclose(restored_b.distributions[0].option_logits, fresh_b.distributions[0].option_logits,
                               atol=1e-6, rtol=0)


def test_several_questions_after_a_restore_equal_the_same_questions_evaluated_cold(snapshots_on, reference):
    engine = snapshots_on
    for state in (STATE_A, STATE_B, STATE_A, STATE_B):
        engine.score(state, [ROUTE])
    restores = engine.prefix_restores
    warm = engine.score(STATE_A, [URGENT, TONE, ROUTE])
    assert engine.prefix_restores == restores + 1
    cold = reference.score(STATE_A, [URGENT, TONE, ROUTE])
    for got, want in zip(warm.distributions, cold.distributions):
        np.testing.assert_allclose(got.option_logits, want.option_logits, atol=1e-6, rtol=0)


def test_states_seen_once_are_never_snapshotted(snapshots_on):
    """A stream of distinct states (cold single decisions) pays no snapshot copies."""
    engine = snapshots_on
    taken = engine.prefix_snapshots_taken
    for i in range(4):
        engine.score(f"One-off ticket {i}. " + STATE_A, [ROUTE])
    assert engine.prefix_snapshots_taken == taken
    assert engine.prefix_snapshot_stats["entries"] == 0


def test_snapshots_stay_within_their_memory_bound_dropping_the_least_recently_used(snapshots_on):
    engine = snapshots_on
    states = [STATE_A, STATE_B, STATE_C]
    for state in states * 2:  # every state planned twice: all hot
        engine.score(state, [ROUTE])
    one = max(s.data.nbytes for s in engine._prefix_snapshots.values())
    engine.clear_prefix_snapshots()
    engine.prefix_cache_bytes = int(one * 1.5)  # room for one snapshot, not two
    for state in states * 3:
        engine.score(state, [URGENT])
        stats = engine.prefix_snapshot_stats
        assert stats["bytes"] <= stats["limit_bytes"]
        assert stats["entries"] <= 1
    # The one kept is the most recent eviction: the state before the last one.
    (kept,) = engine._prefix_snapshots.values()
    assert engine.plan(states[1], []).prefix_segments == kept.segments


def test_no_snapshot_is_taken_or_restored_when_the_budget_is_zero(snapshots_on, reference):
    engine = snapshots_on
    engine.prefix_cache_bytes = 0
    taken, restores = engine.prefix_snapshots_taken, engine.prefix_restores
    for state in (STATE_A, STATE_B) * 3:
        result = engine.score(state, [ROUTE])
    assert (engine.prefix_snapshots_taken, engine.prefix_restores) == (taken, restores)
    assert result.state_cached_tokens < result.state_tokens  # B was evicted by A each time: evaluated again
    np.testing.assert_allclose(result.distributions[0].option_logits,
                               reference.score(STATE_B, [ROUTE]).distributions[0].option_logits, atol=1e-6, rtol=0)


def test_a_restore_must_spare_enough_evaluation_to_be_worth_it(snapshots_on):
    """A snapshot that would spare fewer than PREFIX_SNAPSHOT_MIN_TOKENS tokens is not restored."""
    engine = snapshots_on
    short_a, short_b = "Printer jams.", "VPN drops."
    for state in (short_a, short_b, short_a, short_b):
        engine.score(state, [ROUTE])
    head = engine.plan(short_a, []).shared_tokens
    assert engine.plan(short_a, []).state_tokens - head < PREFIX_SNAPSHOT_MIN_TOKENS
    restores = engine.prefix_restores
    engine.score(short_a, [URGENT])
    assert engine.prefix_restores == restores


@pytest.mark.parametrize("raw, expected", [("0", 0.0), ("512", 512.0), ("1.5", 1.5), ("", 256.0)])
def test_prefix_cache_mb_is_read_from_the_environment(tmp_path, raw, expected):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    settings = Settings.from_env({"SEMIF_MODEL_PATH": str(model), "SEMIF_PREFIX_CACHE_MB": raw})
    assert settings.prefix_cache_mb == expected


@pytest.mark.parametrize("raw", ["-1", "lots"])
def test_a_bad_prefix_cache_mb_is_refused_naming_the_variable(tmp_path, raw):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(SettingsError, match="SEMIF_PREFIX_CACHE_MB"):
        Settings.from_env({"SEMIF_MODEL_PATH": str(model), "SEMIF_PREFIX_CACHE_MB": raw})
