"""Reading answers out of logits: pure functions shared by the scoring core (context.py) and its passes.

No llama.cpp and no state: rows of logits and token ids in, label logits, log-probabilities and keys out."""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np

from .plan import EngineError
from .results import softmax

__all__ = ["RULED_OUT_LOGIT", "label_logits", "log_softmax", "logsumexp", "softmax", "token_logprobs",
           "tokens_digest", "tokens_key"]

# The logit reported for a label the model rules out (-inf in every variant): finite, so that JSON can
# carry it, and far below any real logit, so its probability is exactly 0 (as sequence scoring's floor).
RULED_OUT_LOGIT = -1e30


def logsumexp(values: Sequence[float]) -> float:
    """log Σ exp(values); -inf when every value is -inf (the model rules them all out), never NaN for that."""
    array = np.asarray(values, dtype=np.float64)
    peak = array.max()
    if not np.isfinite(peak):
        return float(peak)  # -inf: all ruled out; +inf or NaN: passed on for label_logits to refuse
    return float(peak + np.log(np.exp(array - peak).sum()))


def log_softmax(logits: Sequence[float]) -> list[float]:
    values = np.asarray(logits, dtype=np.float64)
    return (values - logsumexp(values)).tolist()


def label_logits(row: np.ndarray, variants: Sequence[Sequence[int]]) -> tuple[list[float], float]:
    """(one logit per label: the log-sum-exp of its variants' logits, label mass: the share of the
    whole next-token distribution on all the labels' tokens; one log-sum-exp over the vocabulary row).
    A label at -inf in every variant gets RULED_OUT_LOGIT; when every label is, the mass is 0 and the
    probabilities come out uniform. NaN or +inf logits mean a broken model: an EngineError, not an answer."""
    logits = [logsumexp([float(row[t]) for t in v]) if len(v) > 1 else float(row[v[0]]) for v in variants]
    total = logsumexp(row)
    if any(math.isnan(x) or x == math.inf for x in logits) or not math.isfinite(total):
        raise EngineError(f"the model produced non-finite logits at the answer position (vocabulary log-sum-exp {total}, "
                          f"label logits {[round(x, 3) for x in logits]}); this GGUF cannot be scored")
    mass = float(np.exp(logsumexp(logits) - total)) if logits else 0.0
    return [x if x != -math.inf else RULED_OUT_LOGIT for x in logits], min(1.0, mass)


def token_logprobs(rows: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """log-softmax(rows[i])[tokens[i]] for each i, computed for those entries only: a logsumexp per row
    (exp in float32 on the raw logits, the sum accumulated in float64), not a float64 copy of every row's
    full log-softmax. The float32 exponentials are within 1e-7 relative of float64 ones, far below any
    difference between answers (logits come out of the model as float32)."""
    peak = rows.max(axis=1)
    sums = np.exp(rows - peak[:, None]).sum(axis=1, dtype=np.float64)
    picked = rows[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)].astype(np.float64)
    return picked - peak.astype(np.float64) - np.log(sums)


def tokens_digest(parts: Sequence[Sequence[int]], digest=None):
    """A sha256 fed each token run in turn (a separator after each), for memo keys."""
    digest = digest if digest is not None else hashlib.sha256()
    for part in parts:
        digest.update(np.asarray(part, dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest


def tokens_key(prefix: Sequence[Sequence[int]], suffix: Sequence[int], label_ids: Sequence[int]) -> bytes:
    """The key of one read: its prefix segments, its suffix and the tokens read at its last position."""
    return tokens_digest((suffix, label_ids), tokens_digest(prefix)).digest()
