"""Calibration: temperature scaling fitted by NLL, Platt scaling of the top confidence, contextual calibration,
the calibration file, and the metrics that judge probabilities (NLL, Brier, ECE, reliability bins, accuracy/coverage).

Pure numpy; the adapter imports it to apply a calibration file, the CLIs to fit and report.

Calibration file (JSON, written by `semif-calibrate`, loaded by the adapter from `SEMIF_CALIBRATION_PATH`):

    {"format": "semif-calibration", "format_version": 2, "version": "<12 hex of the fitted content>",
     "model_sha256": "...", "model_file": "...",
     "template_version": "semif-prompt-v2", "template_sha256": "...",   (the served prompt template)
     "fits": [{"scoring": "label", "layout": "state_first", "debias": "none",   (what the logits were)
               "global": {"temperature": 1.7, "n": 29},
               "per_decision": {"route": {"temperature": 1.2, "n": 6}, ...},
               "platt": {"a": 0.8, "b": -0.3, "n": 29},   (optional: Platt scaling of the top option's confidence)
               "applied": "temperature" | "platt",        (optional, default "temperature")
               "contextual": {"route": {"options_sha256": "...", "log_prior": [...]}},
               "contextual_temperatures": {"global": {...}, "per_decision": {...}}}, ...],
     "policy": {"min_probability": 0.7, ...} (optional: the adapter's default abstention policy),
     "fit": {... cross-validated report ...}}

A fit applies only to answers whose scoring, layout and debiasing are the ones it was measured on;
any other answer is served uncalibrated, and its record says so (Calibration.calibrate).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..engine.plan import DEBIAS_MODES
from ..engine.prompt import DEFAULT_LAYOUT, LAYOUTS

FORMAT = "semif-calibration"
FORMAT_VERSION = 2
SCORINGS = ("label", "sequence")
APPLIED = ("temperature", "platt")  # what a fit applies outside its contextual priors
ECE_BINS = 15
BETA_MIN, BETA_MAX = 1e-3, 100.0  # inverse temperature range: T in [0.01, 1000]


class CalibrationError(ValueError):
    """A calibration file that cannot be used (wrong model, wrong format, bad values)."""


# ---- probabilities and metrics ------------------------------------------------------------------


def softmax(logits: Sequence[float], temperature: float = 1.0) -> np.ndarray:
    values = np.asarray(logits, dtype=np.float64) / temperature
    values = np.exp(values - values.max())
    return values / values.sum()


def nll(probabilities: Sequence[Sequence[float]], answers: Sequence[int]) -> float:
    """Mean negative log-likelihood of the right answers (natural log; p clipped at 1e-12)."""
    losses = [-math.log(max(float(p[y]), 1e-12)) for p, y in zip(probabilities, answers)]
    return float(np.mean(losses)) if losses else float("nan")


def brier(probabilities: Sequence[Sequence[float]], answers: Sequence[int]) -> float:
    """Mean multi-class Brier score: Σ_k (p_k − 1[k = answer])², averaged over cases (0 is perfect, 2 is worst)."""
    scores = []
    for p, y in zip(probabilities, answers):
        target = np.zeros(len(p))
        target[y] = 1.0
        scores.append(float(np.sum((np.asarray(p, dtype=np.float64) - target) ** 2)))
    return float(np.mean(scores)) if scores else float("nan")


def reliability_bins(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = ECE_BINS) -> list[dict]:
    """Equal-width bins over (0, 1], right-closed as in Guo et al. 2017: bin b holds (b/n, (b+1)/n]."""
    bins = [{"lo": b / n_bins, "hi": (b + 1) / n_bins, "count": 0, "confidence": 0.0, "accuracy": 0.0} for b in range(n_bins)]
    for conf, ok in zip(confidences, correct):
        index = min(max(math.ceil(conf * n_bins) - 1, 0), n_bins - 1)
        bins[index]["count"] += 1
        bins[index]["confidence"] += conf
        bins[index]["accuracy"] += 1.0 if ok else 0.0
    for b in bins:
        if b["count"]:
            b["confidence"] /= b["count"]
            b["accuracy"] /= b["count"]
    return bins


def ece(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = ECE_BINS) -> float:
    """Expected calibration error: Σ_b (|b|/n)·|accuracy(b) − confidence(b)|."""
    n = len(confidences)
    if n == 0:
        return float("nan")
    return float(sum(b["count"] / n * abs(b["accuracy"] - b["confidence"]) for b in reliability_bins(confidences, correct, n_bins)))


def accuracy_coverage(confidences: Sequence[float], correct: Sequence[bool]) -> list[dict]:
    """For each distinct confidence threshold t (highest first): coverage = share of cases with
    confidence ≥ t, accuracy = accuracy of those cases."""
    n = len(confidences)
    order = sorted(range(n), key=lambda i: -confidences[i])
    curve, hits = [], 0
    for rank, i in enumerate(order, start=1):
        hits += 1 if correct[i] else 0
        is_last_of_tie = rank == n or confidences[order[rank]] != confidences[i]
        if is_last_of_tie:
            curve.append({"threshold": float(confidences[i]), "coverage": rank / n, "accuracy": hits / rank, "accepted": rank})
    return curve


def probability_metrics(probabilities: Sequence[Sequence[float]], answers: Sequence[int]) -> dict:
    confidences = [float(max(p)) for p in probabilities]
    correct = [int(np.argmax(p)) == y for p, y in zip(probabilities, answers)]
    return {
        "n": len(answers),
        "accuracy": float(np.mean(correct)) if correct else float("nan"),
        "nll": nll(probabilities, answers),
        "brier": brier(probabilities, answers),
        "ece": ece(confidences, correct),
        "mean_confidence": float(np.mean(confidences)) if confidences else float("nan"),
    }


# ---- temperature scaling ------------------------------------------------------------------------


def _nll_grad(beta: float, groups: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """d/dβ of Σ [logsumexp(β z) − β z_y] = Σ (E_p[z] − z_y); increasing in β (the NLL is convex in β).
    ``groups``: (logits matrix, answers) per option count, so each step is a few matrix operations."""
    total = 0.0
    for z, y in groups:
        scaled = z * beta
        p = np.exp(scaled - scaled.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        total += float(np.sum(p * z) - z[np.arange(len(y)), y].sum())
    return total


def fit_temperature(logits: Sequence[Sequence[float]], answers: Sequence[int]) -> float:
    """The temperature T minimising the NLL of softmax(z / T) on labeled cases. Bisection on the
    gradient in log β; T is clamped to [0.01, 1000] (all-correct, separable data pushes T → 0)."""
    if not logits:
        return 1.0
    by_width: dict[int, tuple[list, list]] = {}
    for z, y in zip(logits, answers):
        rows, ys = by_width.setdefault(len(z), ([], []))
        rows.append(z)
        ys.append(y)
    arrays = [(np.asarray(rows, dtype=np.float64), np.asarray(ys, dtype=np.int64)) for rows, ys in by_width.values()]
    lo, hi = math.log(BETA_MIN), math.log(BETA_MAX)
    if _nll_grad(math.exp(lo), arrays) >= 0:
        return 1.0 / BETA_MIN
    if _nll_grad(math.exp(hi), arrays) <= 0:
        return 1.0 / BETA_MAX
    for _ in range(80):
        mid = (lo + hi) / 2
        if _nll_grad(math.exp(mid), arrays) > 0:
            hi = mid
        else:
            lo = mid
    return 1.0 / math.exp((lo + hi) / 2)


# ---- Platt scaling -------------------------------------------------------------------------------


def confidence_logit(logits: Sequence[float]) -> float:
    """log(p / (1 − p)) of the top option's softmax probability p: log p_top − log Σ_{j≠top} p_j, computed
    from log-probabilities so that a near-certain answer stays finite."""
    values = np.asarray(logits, dtype=np.float64)
    top = int(np.argmax(values))
    others = np.delete(values, top)
    peak = float(others.max())
    return float(values[top] - peak - math.log(float(np.exp(others - peak).sum())))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, 1.0 / (1.0 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1.0 + np.exp(-np.abs(x))))


def platt_targets(correct: Sequence[bool]) -> np.ndarray:
    """Platt's (1999) regularised targets: (N₊ + 1)/(N₊ + 2) for a right answer, 1/(N₋ + 2) for a wrong one,
    so that all-right (or separable) data still gives a finite fit."""
    hits = np.asarray(correct, dtype=bool)
    n_pos, n_neg = int(hits.sum()), int((~hits).sum())
    return np.where(hits, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))


def platt_loss(a: float, b: float, scores: Sequence[float], targets: Sequence[float]) -> float:
    """Σ cross-entropy of σ(a·s + b) against the targets (the quantity fit_platt minimises)."""
    x = a * np.asarray(scores, dtype=np.float64) + b
    t = np.asarray(targets, dtype=np.float64)
    # −[t log σ(x) + (1 − t) log(1 − σ(x))] = log(1 + eˣ) − t·x
    return float(np.sum(np.logaddexp(0.0, x) - t * x))


def fit_platt(logits: Sequence[Sequence[float]], answers: Sequence[int]) -> dict:
    """Platt scaling of the answer's confidence: (a, b) of p_top = σ(a·s + b), s = confidence_logit(logits),
    fitted by Newton's method on the cross-entropy against whether the top option is the right one
    (platt_targets). A multi-class softmax with one slope and one shared bias is temperature scaling again;
    Platt's bias is what moves the confidence independently of the logits' spread."""
    if not logits:
        return {"a": 1.0, "b": 0.0, "n": 0}
    s = np.asarray([confidence_logit(z) for z in logits], dtype=np.float64)
    correct = [int(np.argmax(z)) == y for z, y in zip(logits, answers)]
    t = platt_targets(correct)
    a, b = 1.0, 0.0
    loss = platt_loss(a, b, s, t)
    for _ in range(100):
        p = _sigmoid(a * s + b)
        w = p * (1 - p)
        grad = np.array([np.sum((p - t) * s), np.sum(p - t)])
        hessian = np.array([[np.sum(w * s * s), np.sum(w * s)], [np.sum(w * s), np.sum(w)]]) + 1e-9 * np.eye(2)
        step = np.linalg.solve(hessian, grad)
        scale = 1.0
        while scale > 1e-10:
            trial = platt_loss(a - scale * step[0], b - scale * step[1], s, t)
            if trial <= loss:
                break
            scale /= 2
        else:
            break
        a, b = a - scale * float(step[0]), b - scale * float(step[1])
        improved, loss = loss - trial, trial
        if improved < 1e-12 and float(np.max(np.abs(grad))) < 1e-8:
            break
    return {"a": float(a), "b": float(b), "n": len(logits)}


def platt_confidence(logits: Sequence[float], a: float, b: float) -> float:
    """σ(a·s + b), s = confidence_logit(logits): the top option's Platt-scaled probability."""
    return float(_sigmoid(np.asarray(a * confidence_logit(logits) + b)))


def apply_platt(logits: Sequence[float], a: float, b: float) -> np.ndarray:
    """The distribution softmax(β·z) whose top option has the Platt-scaled probability (platt_confidence):
    one inverse temperature β per answer, found by bisection, so the options keep their order and the pick
    never changes. That probability is clamped to what a softmax of these logits can give the top option:
    at least 1/n (β = 0) and at most its share at β = BETA_MAX·100."""
    values = np.asarray(logits, dtype=np.float64)
    values = values - values.max()
    top = int(np.argmax(values))

    def top_share(beta: float) -> float:
        return float(softmax(values * beta)[top])

    lo, hi = math.log(BETA_MIN * 1e-3), math.log(BETA_MAX * 100)
    target = min(max(platt_confidence(values, a, b), 1.0 / len(values)), top_share(math.exp(hi)))
    if target <= top_share(math.exp(lo)):
        return softmax(values * math.exp(lo))
    for _ in range(100):
        mid = (lo + hi) / 2
        if top_share(math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    return softmax(values * math.exp((lo + hi) / 2))


# ---- contextual calibration (Zhao et al. 2021) ----------------------------------------------------


def contextual_log_prior(content_free_logits: Sequence[Sequence[float]]) -> list[float]:
    """log of the mean content-free distribution over options; subtracting it from the logits
    divides each probability by the model's prior for that option (W = diag(p_cf)⁻¹, b = 0)."""
    mean = np.mean([softmax(z) for z in content_free_logits], axis=0)
    return np.log(np.clip(mean, 1e-12, None)).tolist()


def apply_contextual(logits: Sequence[float], log_prior: Sequence[float]) -> list[float]:
    return (np.asarray(logits, dtype=np.float64) - np.asarray(log_prior, dtype=np.float64)).tolist()


# ---- cross-validation -----------------------------------------------------------------------------


@dataclass
class Case:
    """One labeled decision as scored: its grouping key, answer index and raw option logits."""

    key: str
    answer: int
    logits: list[float]
    log_prior: Optional[list[float]] = None  # contextual calibration prior for its option set


def fit_temperatures(cases: Sequence[Case], *, min_per_decision: int = 5, contextual: bool = False) -> dict:
    """A global temperature and one per decision key that has at least ``min_per_decision`` cases."""

    def logits_of(c: Case) -> list[float]:
        return apply_contextual(c.logits, c.log_prior) if contextual and c.log_prior is not None else c.logits

    fitted = {"global": {"temperature": fit_temperature([logits_of(c) for c in cases], [c.answer for c in cases]), "n": len(cases)}}
    per_decision = {}
    for key in sorted({c.key for c in cases}):
        group = [c for c in cases if c.key == key]
        if len(group) >= min_per_decision:
            per_decision[key] = {"temperature": fit_temperature([logits_of(c) for c in group], [c.answer for c in group]), "n": len(group)}
    fitted["per_decision"] = per_decision
    return fitted


def temperature_for(fitted: dict, key: Optional[str]) -> tuple[float, str]:
    entry = fitted.get("per_decision", {}).get(key) if key is not None else None
    if entry is not None:
        return float(entry["temperature"]), "decision"
    return float(fitted["global"]["temperature"]), "global"


def kfold_indices(n: int, k: int, seed: int = 0) -> list[list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = max(2, min(k, n))
    return [sorted(order[f::k]) for f in range(k)]


def cross_validate(cases: Sequence[Case], *, k: int = 5, seed: int = 0, min_per_decision: int = 5) -> dict:
    """Held-out metrics of raw, temperature-scaled, Platt-scaled, contextual and contextual+temperature
    probabilities. Each fold's temperatures and Platt fit are fitted on the other folds only."""
    methods: dict[str, list] = {"raw": [None] * len(cases), "temperature": [None] * len(cases),
                                "platt": [None] * len(cases)}
    has_prior = bool(cases) and all(c.log_prior is not None for c in cases)
    if has_prior:
        methods["contextual"] = [None] * len(cases)
        methods["contextual+temperature"] = [None] * len(cases)
    folds = kfold_indices(len(cases), k, seed)
    for test in folds:
        held = set(test)
        train = [c for i, c in enumerate(cases) if i not in held]
        plain = fit_temperatures(train, min_per_decision=min_per_decision)
        platt = fit_platt([c.logits for c in train], [c.answer for c in train])
        ctx = fit_temperatures(train, min_per_decision=min_per_decision, contextual=True) if has_prior else None
        for i in test:
            c = cases[i]
            methods["raw"][i] = softmax(c.logits).tolist()
            methods["temperature"][i] = softmax(c.logits, temperature_for(plain, c.key)[0]).tolist()
            methods["platt"][i] = apply_platt(c.logits, platt["a"], platt["b"]).tolist()
            if has_prior:
                shifted = apply_contextual(c.logits, c.log_prior)
                methods["contextual"][i] = softmax(shifted).tolist()
                methods["contextual+temperature"][i] = softmax(shifted, temperature_for(ctx, c.key)[0]).tolist()
    answers = [c.answer for c in cases]
    return {
        "k": len(folds),
        "seed": seed,
        "min_per_decision": min_per_decision,
        "methods": {name: probability_metrics(probs, answers) for name, probs in methods.items()},
        "probabilities": methods,
    }


# ---- the calibration file -------------------------------------------------------------------------


@dataclass(frozen=True)
class FitKind:
    """What kind of logits a fit was measured on. A temperature fitted on one kind means nothing on
    another: label logits and sequence scoring's mean log-probabilities differ in scale, the options-first
    layout shifts the logits, and order debiasing averages two orders' log-probabilities."""

    scoring: str
    layout: str = DEFAULT_LAYOUT
    debias: str = "none"

    def __str__(self) -> str:
        return f"{self.scoring}/{self.layout}/{self.debias}"

    def as_dict(self) -> dict:
        return {"scoring": self.scoring, "layout": self.layout, "debias": self.debias}


def content_version(payload: dict) -> str:
    """12 hex digits of the fitted content and what it is bound to: the same fit gives the same version."""
    fitted = {k: payload[k] for k in ("model_sha256", "template_version", "template_sha256", "fits", "policy") if k in payload}
    return hashlib.sha256(json.dumps(fitted, sort_keys=True).encode()).hexdigest()[:12]


def build_file(*, model_sha256: str, model_file: str, template_version: str, template_sha256: str,
               fits: Sequence[tuple[FitKind, dict]], fit: dict, policy: Optional[dict] = None) -> dict:
    """The file's payload. ``fits``: (what it was measured on, its temperatures and priors) per fit."""
    payload: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_sha256": model_sha256,
        "model_file": model_file,
        "template_version": template_version,
        "template_sha256": template_sha256,
        "fits": [{**kind.as_dict(), **entry} for kind, entry in fits],
    }
    if policy is not None:
        payload["policy"] = policy
    payload["version"] = content_version(payload)
    payload["fit"] = fit
    return payload


def _is_temperature(t: Any) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0


def _check_table(table: Any, where: str) -> None:
    """A temperature table: {"global": {"temperature"}, "per_decision": {key: {"temperature"}}}."""
    if not isinstance(table, dict) or not isinstance(table.get("global"), dict):
        raise CalibrationError(f"{where}: needs a \"global\" temperature")
    per_decision = table.get("per_decision", {})
    if not isinstance(per_decision, dict) or not all(isinstance(e, dict) for e in per_decision.values()):
        raise CalibrationError(f"{where}.per_decision: must map decision ids to {{\"temperature\": …}}")
    for name, entry in [("global", table["global"])] + [(f"per_decision.{k}", e) for k, e in per_decision.items()]:
        if not _is_temperature(entry.get("temperature")):
            raise CalibrationError(f"{where}.{name} has an invalid temperature {entry.get('temperature')!r}")


def _check_fit(raw: Any, index: int, source: str) -> tuple[FitKind, dict]:
    where = f"{source}: fits[{index}]"
    if not isinstance(raw, dict):
        raise CalibrationError(f"{where}: must be an object")
    for name, allowed in (("scoring", SCORINGS), ("layout", LAYOUTS), ("debias", DEBIAS_MODES)):
        if raw.get(name) not in allowed:
            raise CalibrationError(f"{where}.{name} is {raw.get(name)!r}; must be one of {', '.join(allowed)}")
    kind = FitKind(raw["scoring"], raw["layout"], raw["debias"])
    _check_table(raw, where)
    contextual = raw.get("contextual", {})
    if not isinstance(contextual, dict):
        raise CalibrationError(f"{where}.contextual: must map decision ids to priors")
    for key, prior in contextual.items():
        values = prior.get("log_prior") if isinstance(prior, dict) else None
        if (not isinstance(prior, dict) or not isinstance(prior.get("options_sha256"), str) or not isinstance(values, list)
                or not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)):
            raise CalibrationError(f"{where}.contextual.{key}: needs options_sha256 and a list of finite log_prior values")
    if contextual:
        _check_table(raw.get("contextual_temperatures"), f"{where}.contextual_temperatures")
    applied = raw.get("applied", "temperature")
    if applied not in APPLIED:
        raise CalibrationError(f"{where}.applied is {applied!r}; must be one of {', '.join(APPLIED)}")
    platt = raw.get("platt")
    if platt is not None or applied == "platt":
        if not isinstance(platt, dict) or not all(isinstance(platt.get(k), (int, float)) and not isinstance(platt.get(k), bool)
                                                  and math.isfinite(platt[k]) for k in ("a", "b")):
            raise CalibrationError(f"{where}.platt: needs finite \"a\" and \"b\" (p_top = sigmoid(a*s + b))")
    return kind, {k: v for k, v in raw.items() if k not in ("scoring", "layout", "debias")}


@dataclass
class Calibration:
    """A loaded calibration file. Bound to the model and prompt template it was fitted with (checked at
    load: check_served) and, fit by fit, to the kind of logits each was measured on (FitKind)."""

    version: str
    model_sha256: str
    template_version: str
    template_sha256: str
    fits: dict[FitKind, dict]
    policy: Optional[dict] = None
    path: Optional[str] = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, payload: Any, *, source: str = "<calibration>") -> "Calibration":
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise CalibrationError(f"{source}: not a SemIf calibration file (missing \"format\": \"{FORMAT}\")")
        if payload.get("format_version") == 1:
            raise CalibrationError(
                f"{source}: format_version 1 does not say which prompt template, layout or debiasing its temperatures "
                f"were fitted on, so it cannot be checked against this server; refit it with semif-calibrate (format_version {FORMAT_VERSION})"
            )
        if payload.get("format_version") != FORMAT_VERSION:
            raise CalibrationError(f"{source}: format_version {payload.get('format_version')!r} is not supported (want {FORMAT_VERSION})")
        for name in ("model_sha256", "template_sha256"):
            value = payload.get(name)
            if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
                raise CalibrationError(f"{source}: {name} is missing or not a sha256")
        if not isinstance(payload.get("template_version"), str) or not payload["template_version"]:
            raise CalibrationError(f"{source}: template_version is missing")
        raw_fits = payload.get("fits")
        if not isinstance(raw_fits, list) or not raw_fits:
            raise CalibrationError(f"{source}: no fits (\"fits\": [{{\"scoring\", \"layout\", \"debias\", \"global\", …}}])")
        fits: dict[FitKind, dict] = {}
        for index, raw in enumerate(raw_fits):
            kind, entry = _check_fit(raw, index, source)
            if kind in fits:
                raise CalibrationError(f"{source}: fits[{index}]: a second fit for {kind}")
            fits[kind] = entry
        policy = payload.get("policy")
        if policy is not None:
            from .policy import Policy, PolicyError

            try:
                Policy.from_mapping(policy)
            except PolicyError as exc:
                raise CalibrationError(f"{source}: {exc.field}: {exc}") from None
        return cls(version=str(payload.get("version") or content_version(payload)), model_sha256=payload["model_sha256"],
                   template_version=payload["template_version"], template_sha256=payload["template_sha256"], fits=fits,
                   policy=policy, path=source, raw=payload)

    @classmethod
    def load(cls, path: str | Path, *, model_sha256: Optional[str] = None, served: Optional[Mapping[str, Any]] = None) -> "Calibration":
        """Read and validate a file. ``model_sha256``: refuse a file fitted for another model (checked
        before the model loads); ``served``: the engine's ``info``, for the template too (check_served)."""
        path = Path(path)
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CalibrationError(f"{path}: cannot read calibration file: {exc}") from None
        calibration = cls.from_dict(payload, source=str(path))
        if model_sha256 is not None:
            calibration._check_model(model_sha256)
        if served is not None:
            calibration.check_served(served)
        return calibration

    def _check_model(self, model_sha256: str) -> None:
        if self.model_sha256 != model_sha256:
            raise CalibrationError(
                f"{self.path} was fitted for model sha256 {self.model_sha256[:12]}…, but the served model is "
                f"{model_sha256[:12]}…; refit it with `semif-calibrate --model <this model>` or unset SEMIF_CALIBRATION_PATH"
            )

    def check_served(self, info: Mapping[str, Any]) -> None:
        """Refuse a file whose model or prompt template is not the served one (``info``: Engine.info).
        A template change moves every logit, so temperatures fitted under another template do not apply."""
        self._check_model(str(info.get("sha256")))
        served_version, served_sha = info.get("template_version"), info.get("template_sha256")
        if (self.template_version, self.template_sha256) != (served_version, served_sha):
            raise CalibrationError(
                f"{self.path} was fitted with prompt template {self.template_version} (sha256 {self.template_sha256[:12]}…), "
                f"but this server renders {served_version} (sha256 {str(served_sha)[:12]}…); refit it with "
                "`semif-calibrate` against this server or unset SEMIF_CALIBRATION_PATH"
            )

    def fit_for(self, kind: FitKind) -> Optional[dict]:
        return self.fits.get(kind)

    def calibrate(self, logits: Sequence[float], *, kind: FitKind, decision_id: Optional[str],
                  options_sha256: Optional[str]) -> tuple[Optional[list[float]], dict]:
        """(calibrated probabilities, or None when the file has no fit for ``kind``; the record the answer
        carries either way). Contextual calibration applies only to the option set it was measured on."""
        fitted = self.fits.get(kind)
        if fitted is None:
            known = ", ".join(str(k) for k in self.fits)
            return None, {"version": self.version, "method": "none", "fit": None,
                          "reason": f"no fit for {kind} (scoring/layout/debias); this file has {known}"}
        values = list(logits)
        method = "temperature"
        # A contextual prior is keyed on one listing's options_sha256; under reads in several orders it would
        # calibrate a listing and its reverse differently, so a reverse or rotations fit's priors are not used.
        keyed = decision_id is not None and kind.debias not in ("reverse", "rotations")
        contextual = fitted.get("contextual", {}).get(decision_id) if keyed else None
        if contextual is not None and contextual.get("options_sha256") == options_sha256 and len(contextual["log_prior"]) == len(values):
            values = apply_contextual(values, contextual["log_prior"])
            method = "contextual+temperature"
            table = fitted["contextual_temperatures"]
        elif fitted.get("applied") == "platt" and len(values) >= 2:
            a, b = float(fitted["platt"]["a"]), float(fitted["platt"]["b"])
            record = {"version": self.version, "method": "platt", "platt": {"a": a, "b": b}, "fit": kind.as_dict()}
            return apply_platt(values, a, b).tolist(), record
        else:
            table = fitted
        temperature, source = temperature_for(table, decision_id)
        record = {"version": self.version, "method": method, "temperature": temperature, "temperature_source": source,
                  "fit": kind.as_dict()}
        return softmax(values, temperature).tolist(), record


def load_cases(rows: Iterable[dict], logits: Sequence[Sequence[float]], key: Callable[[dict], str]) -> list[Case]:
    cases = []
    for row, z in zip(rows, logits):
        ids = [o["id"] for o in row["options"]]
        cases.append(Case(key=key(row), answer=ids.index(row["answer"]), logits=list(z)))
    return cases
