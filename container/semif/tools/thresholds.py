"""Cut-points (`min_probability`) for target accuracies, reported on decisions they were not chosen on.

A cut-point chosen on some labeled decisions and scored on the same ones is optimistic: it lands just
where those decisions happen to be right. So each cut-point is chosen on all the labeled decisions, and
its accuracy and coverage are the out-of-bag (OOB) bootstrap estimate:

1. draw a bootstrap resample of the decisions (n draws with replacement);
2. choose the cut-point on that resample (the lowest `min_probability` whose accepted decisions reach
   the target accuracy there);
3. score it on the decisions that resample left out (about 37 % of them).

The reported `accuracy` and `coverage` are the mean over resamples, with their bootstrap standard error;
the figures the all-rows cut-point gets on its own rows stay under `in_sample`. Seeded: the same
decisions and seed give the same figures. Below `MIN_DECISIONS` labeled decisions no cut-point is
recommended; below `FIRM_DECISIONS` each is `provisional`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

MIN_DECISIONS = 50
FIRM_DECISIONS = 200
DEFAULT_RESAMPLES = 1000
# Resamples are drawn in blocks, so that a block's (resamples × decisions) arrays stay near this many cells.
_BLOCK_CELLS = 2_000_000


class TooFewDecisions(ValueError):
    """Fewer labeled decisions than a cut-point needs; the message says how many there are and need."""

    def __init__(self, n: int, minimum: int = MIN_DECISIONS):
        super().__init__(f"{n} labeled decisions; a cut-point needs at least {minimum}: label more decisions")
        self.n = n
        self.minimum = minimum


@dataclass(frozen=True)
class Guard:
    """How the reported figures are measured: `resamples` bootstrap resamples drawn with `seed`."""

    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0


def _pick(confidences: np.ndarray, correct: np.ndarray, weights: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``weights`` (how often each decision is drawn): the cut-point whose accepted
    decisions (confidence ≥ it) reach ``target`` accuracy with the most weight, ties of confidence
    accepted together; (cut-points, reached). Equal weight: the higher cut-point, as the curve lists it."""
    order = np.argsort(-confidences, kind="stable")
    ranked = confidences[order]
    last_of_tie = np.r_[ranked[1:] != ranked[:-1], True]
    drawn = np.cumsum(weights[:, order], axis=1)[:, last_of_tie]
    hits = np.cumsum(weights[:, order] * correct[order], axis=1)[:, last_of_tie]
    with np.errstate(invalid="ignore", divide="ignore"):
        reaches = (drawn > 0) & (hits / np.where(drawn > 0, drawn, 1) >= target)
    best = np.where(reaches, drawn, -1)
    index = np.argmax(best, axis=1)  # the first (highest) cut-point among equal weight
    return ranked[last_of_tie][index], best.max(axis=1) > 0


def _in_sample(confidences: np.ndarray, correct: np.ndarray, cut: float) -> dict:
    accepted = confidences >= cut
    return {"accuracy": float(correct[accepted].mean()), "coverage": float(accepted.mean()), "accepted": int(accepted.sum())}


def recommend_thresholds(confidences: Sequence[float], correct: Sequence[bool], targets: Sequence[float],
                         guard: Guard = Guard()) -> list[dict]:
    """For each target accuracy: the all-rows cut-point, its out-of-bag accuracy and coverage (with
    standard errors), its in-sample figures, and `provisional` below FIRM_DECISIONS; or `reachable:
    false` with a `reason`. Raises TooFewDecisions below MIN_DECISIONS."""
    n = len(confidences)
    if n < MIN_DECISIONS:
        raise TooFewDecisions(n)
    conf = np.asarray(confidences, dtype=np.float64)
    ok = np.asarray(correct, dtype=bool)
    provisional = n < FIRM_DECISIONS
    out = []
    for target in targets:
        cut, reached = _pick(conf, ok.astype(np.float64), np.ones((1, n)), target)
        if not reached[0]:
            out.append({"target_accuracy": target, "reachable": False, "n": n, "provisional": provisional,
                        "reason": "no cut-point reaches it on these decisions"})
            continue
        oob = _out_of_bag(conf, ok, target, guard)
        entry = {"target_accuracy": target, "reachable": oob is not None, "n": n, "provisional": provisional}
        if oob is None:
            entry["reason"] = (f"unstable: no resample's cut-point accepted any decision it was not chosen on "
                               f"({guard.resamples} resamples)")
            entry["in_sample"] = {"min_probability": float(cut[0]), **_in_sample(conf, ok, float(cut[0]))}
            out.append(entry)
            continue
        entry.update({"min_probability": float(cut[0]), "accuracy": oob["accuracy"], "accuracy_se": oob["accuracy_se"],
                      "coverage": oob["coverage"], "coverage_se": oob["coverage_se"],
                      "accepted": int(round(oob["coverage"] * n)),
                      "in_sample": _in_sample(conf, ok, float(cut[0])),
                      "basis": "out-of-bag", "resamples": guard.resamples, "resamples_reached": oob["reached"],
                      "seed": guard.seed})
        out.append(entry)
    return out


def _out_of_bag(conf: np.ndarray, ok: np.ndarray, target: float, guard: Guard) -> Optional[dict]:
    """The mean and standard error, over resamples, of each resample's cut-point scored on the decisions
    it left out. Coverage counts every resample that reached the target (an empty acceptance is a
    coverage of 0); accuracy, those whose cut-point accepted at least one left-out decision."""
    n = len(conf)
    rng = np.random.default_rng(guard.seed)
    uniform = np.full(n, 1.0 / n)
    block = max(1, _BLOCK_CELLS // n)
    coverages: list[np.ndarray] = []
    accuracies: list[np.ndarray] = []
    reached_total = 0
    for start in range(0, guard.resamples, block):
        weights = rng.multinomial(n, uniform, size=min(block, guard.resamples - start))
        cuts, reached = _pick(conf, ok.astype(np.float64), weights.astype(np.float64), target)
        reached_total += int(reached.sum())
        left_out = (weights == 0)[reached]
        accepted = left_out & (conf[None, :] >= cuts[reached][:, None])
        n_left_out = left_out.sum(axis=1)
        n_accepted = accepted.sum(axis=1)
        keep = n_left_out > 0
        coverages.append(n_accepted[keep] / n_left_out[keep])
        some = n_accepted > 0
        accuracies.append((accepted & ok[None, :]).sum(axis=1)[some] / n_accepted[some])
    coverage = np.concatenate(coverages) if coverages else np.empty(0)
    accuracy = np.concatenate(accuracies) if accuracies else np.empty(0)
    if accuracy.size == 0:
        return None
    return {"accuracy": float(accuracy.mean()), "accuracy_se": float(accuracy.std(ddof=1)) if accuracy.size > 1 else None,
            "coverage": float(coverage.mean()), "coverage_se": float(coverage.std(ddof=1)) if coverage.size > 1 else None,
            "reached": reached_total}


def threshold_summary(n: int, guard: Guard) -> dict:
    """What the run's `thresholds` field says about its `recommended_thresholds` as a whole."""
    if n < MIN_DECISIONS:
        status = "refused"
    else:
        status = "provisional" if n < FIRM_DECISIONS else "ok"
    summary = {"status": status, "n": n, "provisional": status == "provisional", "min_decisions": MIN_DECISIONS,
               "firm_decisions": FIRM_DECISIONS, "basis": "out-of-bag", "resamples": guard.resamples, "seed": guard.seed}
    if status == "refused":
        summary["reason"] = str(TooFewDecisions(n))
    elif status == "provisional":
        summary["reason"] = f"{n} labeled decisions < {FIRM_DECISIONS}: the cut-points are provisional; label more"
    return summary
