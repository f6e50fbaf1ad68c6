"""After scoring: the calibration file and the abstention policy applied to each answer."""

from __future__ import annotations

from typing import Optional

from .calibration import FitKind
from .policy import Policy, decide


class DecisionPostprocessor:
    """Runs after scoring (``DecisionService.postprocessors``): applies the calibration file to each
    distribution's ``option_logits`` (raw logits stay as they are) and the abstention policy of the
    request, else of the calibration file. Sets ``calibration`` and ``action``/``action_reason``/
    ``action_fallback`` on each distribution for the contract to render and the log line to count.

    A fit applies only to the kind of logits it was measured on (scoring, layout, debias: FitKind). An
    answer of another kind keeps its raw probabilities, and its ``calibration`` record says why. The
    file's default policy was chosen for calibrated probabilities, so it never accepts such an answer:
    it takes the policy's fallback (review, or abstain). A request's own policy judges what is served."""

    def __init__(self, calibration=None, default_policy: Optional[Policy] = None):
        self.calibration = calibration
        self.default_policy = default_policy
        self.default_policy_is_calibrations = False

    def configure(self, calibration) -> None:
        self.calibration = calibration
        if calibration is not None and calibration.policy is not None:
            self.default_policy = Policy.from_mapping(calibration.policy)
            self.default_policy_is_calibrations = True

    def __call__(self, job, result) -> None:
        n = len(result.distributions)
        decision_ids = list(getattr(job, "decision_ids", None) or []) + [None] * n
        option_hashes = list(getattr(job, "options_sha256", None) or []) + [None] * n
        raw_policy = getattr(job, "policy", None)
        policy = Policy.from_mapping(raw_policy) if raw_policy is not None else self.default_policy
        policy_needs_calibration = raw_policy is None and self.default_policy_is_calibrations
        layout = getattr(result, "layout", "state_first")
        for dist, decision_id, options_hash in zip(result.distributions, decision_ids, option_hashes):
            dist.calibration = None
            unmet: list[str] = []
            if self.calibration is not None:
                debias = getattr(dist, "debias", "none") or "none"
                if (getattr(dist, "second_look", None) or {}).get("decided_by") == "second_look":
                    debias = "second_look"  # logits read after reasoning: no fit was measured on those
                kind = FitKind(dist.scoring, layout, debias)
                probabilities, dist.calibration = self.calibration.calibrate(
                    dist.option_logits, kind=kind, decision_id=decision_id, options_sha256=options_hash
                )
                if probabilities is not None:
                    dist.probabilities = probabilities
                elif policy_needs_calibration:
                    unmet.append(f"uncalibrated: the calibration file's policy judges calibrated answers only, and "
                                 f"it has no fit for {kind}")
            dist.action = dist.action_reason = dist.action_fallback = None
            if policy is not None:
                verdict = decide(dist.probabilities, policy, getattr(dist, "injection_suspected", None),
                                 getattr(dist, "label_mass", None), unmet)
                dist.action, dist.action_reason, dist.action_fallback = verdict.action, verdict.reason, verdict.fallback
