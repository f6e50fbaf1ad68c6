"""Abstention policy: turn a distribution into a business action.

    {"min_probability": 0.7, "min_margin": 0.2, "min_label_mass": 0.5, "fallback": "escalate"}

A result is **accepted** when its top probability is at least ``min_probability``, its margin
(top minus second probability) is at least ``min_margin`` and, under label scoring, its label mass (the
share of the model's whole next-token distribution on the option labels) is at least ``min_label_mass``. Otherwise the policy's ``fallback`` decides:
``"review"`` (the default) sends the model's choice to a person as a suggestion; any other value
(``"abstain"``, ``"escalate"``, an option id, …) means the model **abstains** and the caller takes the
named fallback path instead of the model's choice. Knows nothing of HTTP or llama.cpp.

``max_injection`` (optional, 0..1): a result whose ``injection_suspected`` (p(yes) of the injection check
on the same state) exceeds it is not accepted either. A policy with ``max_injection`` turns the injection check
on for the request (``needs_injection_check``); a result without a check value fails it (fail safe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

ACTIONS = ("accept", "review", "abstain")
# Most severe first: a batch's log line reports the most severe action of its results.
SEVERITY = {"abstain": 2, "review": 1, "accept": 0}
EPSILON = 1e-9


class PolicyError(ValueError):
    """A policy object is invalid; ``field`` names the offending key."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Policy:
    min_probability: float = 0.0
    min_margin: float = 0.0
    fallback: str = "review"
    max_injection: Optional[float] = None
    min_label_mass: float = 0.0  # checked only where a label mass exists (label scoring)

    @classmethod
    def from_mapping(cls, raw: Any) -> "Policy":
        if not isinstance(raw, Mapping):
            raise PolicyError("policy must be an object", "policy")
        unknown = set(raw) - {"min_probability", "min_margin", "min_label_mass", "fallback", "max_injection"}
        if unknown:
            raise PolicyError(f"unknown policy key(s): {', '.join(sorted(unknown))}", f"policy.{sorted(unknown)[0]}")
        values: dict[str, Any] = {}
        for key in ("min_probability", "min_margin", "min_label_mass", "max_injection"):
            if key in raw and raw[key] is not None:
                value = raw[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise PolicyError(f"{key} must be a number", f"policy.{key}")
                if not 0.0 <= value <= 1.0:
                    raise PolicyError(f"{key}={value} must be between 0 and 1", f"policy.{key}")
                values[key] = float(value)
        if raw.get("fallback") is not None:
            fallback = raw["fallback"]
            if not isinstance(fallback, str) or not fallback.strip() or len(fallback) > 256:
                raise PolicyError("fallback must be a non-empty string of at most 256 characters", "policy.fallback")
            values["fallback"] = fallback
        return cls(**values)

    def as_dict(self) -> dict:
        out = {"min_probability": self.min_probability, "min_margin": self.min_margin, "fallback": self.fallback}
        if self.min_label_mass:
            out["min_label_mass"] = self.min_label_mass
        if self.max_injection is not None:
            out["max_injection"] = self.max_injection
        return out


@dataclass(frozen=True)
class Verdict:
    action: str  # accept | review | abstain
    reason: str
    fallback: Optional[str] = None  # set when the model abstains: the path the caller should take


def top_and_margin(probabilities: Sequence[float]) -> tuple[int, float, float]:
    """(index of the top option, its probability, top minus second probability)."""
    ranked = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])
    top = ranked[0]
    second = probabilities[ranked[1]] if len(ranked) > 1 else 0.0
    return top, float(probabilities[top]), float(probabilities[top] - second)


def decide(probabilities: Sequence[float], policy: Policy, injection_suspected: Optional[float] = None,
           label_mass: Optional[float] = None, unmet: Sequence[str] = ()) -> Verdict:
    """The action for one distribution. Thresholds are inclusive: p == min_probability is accepted, and
    injection_suspected == max_injection too. ``label_mass`` (label scoring only) is checked against
    ``min_label_mass``; None skips that check. ``unmet``: conditions the caller found unmet (each keeps
    the result from being accepted, with that reason)."""
    _, p_top, margin = top_and_margin(probabilities)
    failures = list(unmet)
    # A tolerance of 1e-9 keeps float noise from failing an exact threshold (0.6 − 0.4 = 0.19999999999999996).
    if p_top < policy.min_probability - EPSILON:
        failures.append(f"probability {p_top:.3f} < min_probability {policy.min_probability:g}")
    if margin < policy.min_margin - EPSILON:
        failures.append(f"margin {margin:.3f} < min_margin {policy.min_margin:g}")
    if policy.max_injection is not None:
        if injection_suspected is None:
            failures.append("injection check did not run but the policy sets max_injection")
        elif injection_suspected > policy.max_injection + EPSILON:
            failures.append(f"injection_suspected {injection_suspected:.3f} > max_injection {policy.max_injection:g}")
    if label_mass is not None and label_mass < policy.min_label_mass - EPSILON:
        failures.append(f"label mass {label_mass:.3f} < min_label_mass {policy.min_label_mass:g}")
    if not failures:
        if policy.max_injection is not None:
            return Verdict("accept", f"probability {p_top:.3f}, margin {margin:.3f} and injection_suspected "
                                     f"{injection_suspected:.3f} meet the policy")
        return Verdict("accept", f"probability {p_top:.3f} and margin {margin:.3f} meet the policy")
    reason = "; ".join(failures)
    if policy.fallback == "review":
        return Verdict("review", reason)
    return Verdict("abstain", reason, fallback=policy.fallback)


def needs_injection_check(raw_policy: Any, default_policy: Optional[Policy] = None) -> bool:
    """Whether the policy that will judge a request sets max_injection (so the check must run)."""
    if isinstance(raw_policy, Mapping):
        return raw_policy.get("max_injection") is not None
    return default_policy is not None and default_policy.max_injection is not None


def most_severe(actions: Sequence[str]) -> Optional[str]:
    return max(actions, key=lambda a: SEVERITY[a]) if actions else None


def log_fields(result) -> dict:
    """`action` (most severe of the request's results) and per-action counts, for the JSON log line."""
    actions = [a for a in (getattr(d, "action", None) for d in result.distributions) if a is not None]
    if not actions:
        return {}
    return {"action": most_severe(actions), "actions": {a: actions.count(a) for a in ACTIONS if a in actions}}


def min_label_mass(result) -> Optional[float]:
    """The lowest label mass of a request's results (label scoring), for the JSON log line."""
    masses = [m for m in (getattr(d, "label_mass", None) for d in result.distributions) if m is not None]
    return round(min(masses), 6) if masses else None
