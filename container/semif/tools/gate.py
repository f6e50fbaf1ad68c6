"""The release gate: a candidate's `semif-eval` report held against limits, and against a baseline report
(the release that runs now), case by case.

    semif-gate candidate/report.json [--baseline prod/report.json] [--limits limits.json] [--out verdict.json]
    semif-eval DATA.jsonl --url http://127.0.0.1:8080 --baseline prod/report.json --limits limits.json

Both print the same verdict (`compare`), and exit 1 when a limit fails. Without a baseline (a first
release) only the absolute limits apply. Metrics are recomputed from each report's per-case results
(`runs.<scoring>.cases_detail`): on all of the candidate's cases for the absolute limits, and on the cases
both reports share (by id, scored against the candidate's labels) for the limits on the change. The
verdict lists changed cases by id, never their state text. See docs/how-to/release-gate.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..serving.postprocess.calibration import ece
from ..serving.postprocess.policy import Policy, decide


class GateError(ValueError):
    """A report, baseline or limits file the gate cannot use; the message says which and why."""


# ---- limits ---------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyThresholds(_Strict):
    """The abstention policy whose coverage the gate measures (the one the callers apply)."""

    min_probability: float = Field(0.0, ge=0.0, le=1.0)
    min_margin: float = Field(0.0, ge=0.0, le=1.0)
    fallback: str = Field("review", min_length=1, max_length=256)

    def policy(self) -> Policy:
        return Policy(min_probability=self.min_probability, min_margin=self.min_margin, fallback=self.fallback)


class AbsoluteLimits(_Strict):
    """Limits on the candidate alone, over all of its cases. None switches a limit off."""

    min_valid_share: float = Field(1.0, ge=0.0, le=1.0, description="share of cases answered with a distribution")
    min_accuracy: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_ece: Optional[float] = Field(None, ge=0.0, le=1.0)
    min_policy_coverage: Optional[float] = Field(None, ge=0.0, le=1.0, description="share of cases the policy accepts")


class ChangeLimits(_Strict):
    """Limits on the change against the baseline, over the cases both reports share."""

    max_changed_share: Optional[float] = Field(0.05, ge=0.0, le=1.0, description="share of shared cases whose choice changed")
    max_accuracy_drop: Optional[float] = Field(0.02, ge=0.0, le=1.0)
    max_ece_rise: Optional[float] = Field(0.03, ge=0.0, le=1.0)
    max_policy_coverage_drop: Optional[float] = Field(None, ge=0.0, le=1.0)
    min_shared_share: float = Field(0.8, ge=0.0, le=1.0, description="share of the candidate's cases the baseline also has")


class GateLimits(_Strict):
    scoring: Literal["label", "sequence"] = "label"
    policy: Optional[PolicyThresholds] = None
    absolute: AbsoluteLimits = AbsoluteLimits()
    change: ChangeLimits = ChangeLimits()

    @model_validator(mode="after")
    def _coverage_needs_a_policy(self) -> "GateLimits":
        if self.policy is None and (self.absolute.min_policy_coverage is not None or self.change.max_policy_coverage_drop is not None):
            raise ValueError("policy: required when absolute.min_policy_coverage or change.max_policy_coverage_drop is set")
        return self


def parse_limits(raw: Any, source: str = "limits") -> GateLimits:
    """Limits from a mapping (JSON object); GateError naming the field on anything invalid."""
    try:
        return GateLimits.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "limits"
        raise GateError(f"{source}: {where}: {first['msg']}") from None


def load_json_argument(value: str, storage, what: str) -> Any:
    """A JSON object given inline (`{...}`) or as a local path or s3:// URI."""
    text = value if value.lstrip().startswith("{") else storage.read_text(value)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise GateError(f"{what} {value if not value.lstrip().startswith('{') else '(inline)'}: not JSON: {exc}") from None


# ---- the verdict ----------------------------------------------------------------------------------


class Check(BaseModel):
    name: str
    kind: Literal["absolute", "change"]
    measured: Optional[float]
    limit: float
    passed: bool
    detail: str


class ChangedCase(BaseModel):
    id: str
    answer: str
    baseline_choice: Optional[str]
    candidate_choice: Optional[str]
    baseline_probability: Optional[float]
    candidate_probability: Optional[float]
    option_set_changed: bool


class SideRecord(BaseModel):
    """What produced one side's answers."""

    report: Optional[str] = None
    created: Optional[str] = None
    target: Optional[str] = None
    address: Optional[str] = None
    image_digest: Optional[str] = None
    model_file: Optional[str] = None
    model_sha256: Optional[str] = None
    llama_cpp_build: Optional[str] = None
    llama_cpp_python: Optional[str] = None
    template_version: Optional[str] = None
    template_sha256: Optional[str] = None
    option_set_sha256: list[str] = []
    hardware: dict[str, int] = {}
    n_gpu_layers: Optional[int] = None
    instance_types: list[str] = []
    resolved_images: list[str] = []
    calibration_version: Optional[str] = None
    data_sha256: Optional[str] = None
    cases: int = 0
    endpoint_error: Optional[str] = None


class RecordDifference(BaseModel):
    field: str
    baseline: Any
    candidate: Any


class Verdict(BaseModel):
    passed: bool
    scoring: str
    baseline_present: bool
    failed: list[str]
    checks: list[Check]
    metrics: dict[str, dict[str, Optional[float]]]
    candidate_cases: int
    baseline_cases: Optional[int] = None
    shared_cases: Optional[int] = None
    changed_cases: list[ChangedCase] = []
    option_set_changes: list[str] = []
    only_in_candidate: list[str] = []
    only_in_baseline: list[str] = []
    candidate: SideRecord
    baseline: Optional[SideRecord] = None
    record_differences: list[RecordDifference] = []
    limits: dict


# ---- per-case answers and their metrics -----------------------------------------------------------


@dataclass(frozen=True)
class CaseAnswer:
    id: str
    answer: str
    choice: Optional[str]  # None: no valid answer
    probabilities: Optional[tuple[float, ...]]
    options_sha256: Optional[str]

    @property
    def confidence(self) -> Optional[float]:
        return max(self.probabilities) if self.probabilities else None


def case_answers(report: dict, scoring: str, side: str) -> dict[str, CaseAnswer]:
    """The report's per-case results for ``scoring``, by case id."""
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict):
        raise GateError(f"{side} report: not a semif-eval report (no 'runs')")
    run = report["runs"].get(scoring)
    if run is None:
        raise GateError(f"{side} report: no '{scoring}' run (it has {', '.join(sorted(report['runs'])) or 'none'}); "
                        f"evaluate with --scoring {scoring} or set the limits' scoring")
    detail = run.get("cases_detail")
    if not isinstance(detail, list):
        raise GateError(f"{side} report: runs.{scoring} has no per-case results (cases_detail)")
    answers: dict[str, CaseAnswer] = {}
    for number, case in enumerate(detail):
        try:
            case_id, answer = str(case["id"]), str(case["answer"])
            probabilities = case.get("probabilities")
            valid = case.get("error") is None and probabilities is not None and case.get("predicted") is not None
            parsed = CaseAnswer(id=case_id, answer=answer, choice=str(case["predicted"]) if valid else None,
                                probabilities=tuple(float(p) for p in probabilities) if valid else None,
                                options_sha256=case.get("options_sha256"))
        except (KeyError, TypeError, ValueError):
            raise GateError(f"{side} report: runs.{scoring}.cases_detail[{number}] lacks id, answer or probabilities") from None
        if case_id in answers:
            raise GateError(f"{side} report: case id {case_id!r} appears twice in runs.{scoring}.cases_detail")
        answers[case_id] = parsed
    return answers


def metrics(cases: Sequence[CaseAnswer], policy: Optional[Policy], labels: Optional[dict[str, str]] = None) -> dict[str, Optional[float]]:
    """Accuracy (invalid counts as wrong), ECE over valid answers and, with a policy, its coverage over
    all cases (an invalid answer is never accepted), as `semif-eval` reports them. ``labels`` overrides
    each case's answer (the candidate's labels, when the baseline is scored on the shared cases)."""
    n = len(cases)
    answer = (lambda c: labels[c.id]) if labels else (lambda c: c.answer)
    valid = [c for c in cases if c.choice is not None]
    correct = [c.choice == answer(c) for c in valid]
    out: dict[str, Optional[float]] = {
        "cases": float(n),
        "valid_share": len(valid) / n if n else None,
        "accuracy": sum(correct) / n if n else None,
        "ece": ece([c.confidence for c in valid], correct) if valid else None,
    }
    if policy is not None:
        accepted = [c for c in valid if decide(c.probabilities, policy).action == "accept"]
        out["policy_coverage"] = len(accepted) / n if n else None
        out["policy_accuracy_accepted"] = (sum(c.choice == answer(c) for c in accepted) / len(accepted)) if accepted else None
    return out


def side_record(report: dict, location: Optional[str], cases: int) -> SideRecord:
    record = report.get("reproducibility") or {}
    endpoint = record.get("endpoint") or {}
    hardware = record.get("hardware_seen") or ({record["hardware"]: cases} if record.get("hardware") else {})
    resolved = sorted({image for v in endpoint.get("variants") or [] for image in v.get("resolved_images") or []})
    return SideRecord(
        report=location, created=record.get("created"), target=record.get("target"),
        address=record.get("address") or record.get("model_file"),
        image_digest=record.get("image_digest"), model_file=record.get("model_file"), model_sha256=record.get("model_sha256"),
        llama_cpp_build=record.get("llama_cpp_build"), llama_cpp_python=record.get("llama_cpp_python"),
        template_version=record.get("template_version"), template_sha256=record.get("template_sha256"),
        option_set_sha256=sorted(record.get("option_set_sha256") or []), hardware={str(k): int(v) for k, v in hardware.items()},
        n_gpu_layers=record.get("n_gpu_layers"), instance_types=list(endpoint.get("instance_types") or []),
        resolved_images=resolved, calibration_version=record.get("calibration_version"), data_sha256=record.get("data_sha256"),
        cases=cases, endpoint_error=endpoint.get("error"))


RECORD_FIELDS = ("image_digest", "model_sha256", "llama_cpp_build", "llama_cpp_python", "template_version", "template_sha256",
                 "option_set_sha256", "hardware", "n_gpu_layers", "instance_types", "resolved_images", "calibration_version",
                 "data_sha256")


def _hardware_names(hardware: dict) -> list[str]:
    return sorted(hardware)


def record_differences(baseline: SideRecord, candidate: SideRecord) -> list[RecordDifference]:
    out = []
    for name in RECORD_FIELDS:
        before, after = getattr(baseline, name), getattr(candidate, name)
        if name == "hardware":  # the names matter, not how many answers each gave
            before, after = _hardware_names(before), _hardware_names(after)
        if before != after:
            out.append(RecordDifference(field=name, baseline=before, candidate=after))
    return out


def _at_least(name: str, kind, measured: Optional[float], limit: float, what: str) -> Check:
    passed = measured is not None and not math.isnan(measured) and measured >= limit - 1e-12
    shown = "n/a" if measured is None else f"{measured:.4f}"
    return Check(name=name, kind=kind, measured=measured, limit=limit, passed=passed,
                 detail=f"{what} {shown} {'≥' if passed else '<'} {limit:g}")


def _at_most(name: str, kind, measured: Optional[float], limit: float, what: str) -> Check:
    passed = measured is not None and not math.isnan(measured) and measured <= limit + 1e-12
    shown = "n/a" if measured is None else f"{measured:.4f}"
    return Check(name=name, kind=kind, measured=measured, limit=limit, passed=passed,
                 detail=f"{what} {shown} {'≤' if passed else '>'} {limit:g}")


def _difference(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def compare(candidate_report: dict, baseline_report: Optional[dict], limits: GateLimits, *,
            candidate_location: Optional[str] = None, baseline_location: Optional[str] = None) -> Verdict:
    """The gate's verdict on a candidate report, against ``baseline_report`` when there is one."""
    scoring = limits.scoring
    policy = limits.policy.policy() if limits.policy else None
    candidate = case_answers(candidate_report, scoring, "candidate")
    if not candidate:
        raise GateError("candidate report: no cases")
    absolute = limits.absolute
    own = metrics(list(candidate.values()), policy)
    checks = [_at_least("min_valid_share", "absolute", own["valid_share"], absolute.min_valid_share, "valid answers")]
    if absolute.min_accuracy is not None:
        checks.append(_at_least("min_accuracy", "absolute", own["accuracy"], absolute.min_accuracy, "accuracy"))
    if absolute.max_ece is not None:
        checks.append(_at_most("max_ece", "absolute", own["ece"], absolute.max_ece, "ECE"))
    if absolute.min_policy_coverage is not None:
        checks.append(_at_least("min_policy_coverage", "absolute", own["policy_coverage"], absolute.min_policy_coverage,
                                "policy coverage"))
    verdict_metrics: dict[str, dict] = {"candidate": own}
    fields: dict[str, Any] = {}
    candidate_side = side_record(candidate_report, candidate_location, len(candidate))
    if baseline_report is not None:
        baseline = case_answers(baseline_report, scoring, "baseline")
        shared_ids = [i for i in candidate if i in baseline]
        labels = {i: candidate[i].answer for i in shared_ids}
        mine = metrics([candidate[i] for i in shared_ids], policy)
        theirs = metrics([baseline[i] for i in shared_ids], policy, labels=labels)
        verdict_metrics.update(candidate_shared=mine, baseline_shared=theirs)
        change = limits.change
        shared_share = len(shared_ids) / len(candidate)
        checks.append(_at_least("min_shared_share", "change", shared_share, change.min_shared_share,
                                f"cases shared with the baseline ({len(shared_ids)} of {len(candidate)}):"))
        changed = [ChangedCase(id=i, answer=candidate[i].answer, baseline_choice=baseline[i].choice,
                               candidate_choice=candidate[i].choice,
                               baseline_probability=baseline[i].confidence, candidate_probability=candidate[i].confidence,
                               option_set_changed=_option_set_changed(baseline[i], candidate[i]))
                   for i in shared_ids if baseline[i].choice != candidate[i].choice]
        changed_share = len(changed) / len(shared_ids) if shared_ids else None
        verdict_metrics["change"] = {"changed_share": changed_share, "changed": float(len(changed)),
                                     "accuracy_drop": _difference(theirs["accuracy"], mine["accuracy"]),
                                     "ece_rise": _difference(mine["ece"], theirs["ece"])}
        if change.max_changed_share is not None:
            checks.append(_at_most("max_changed_share", "change", changed_share, change.max_changed_share,
                                   f"changed choices ({len(changed)} of {len(shared_ids)}):"))
        if change.max_accuracy_drop is not None:
            checks.append(_at_most("max_accuracy_drop", "change", _difference(theirs["accuracy"], mine["accuracy"]),
                                   change.max_accuracy_drop, "accuracy drop"))
        if change.max_ece_rise is not None:
            checks.append(_at_most("max_ece_rise", "change", _difference(mine["ece"], theirs["ece"]), change.max_ece_rise, "ECE rise"))
        if change.max_policy_coverage_drop is not None:
            drop = _difference(theirs["policy_coverage"], mine["policy_coverage"])
            verdict_metrics["change"]["policy_coverage_drop"] = drop
            checks.append(_at_most("max_policy_coverage_drop", "change", drop, change.max_policy_coverage_drop, "policy coverage drop"))
        baseline_side = side_record(baseline_report, baseline_location, len(baseline))
        fields.update(
            baseline_cases=len(baseline), shared_cases=len(shared_ids), changed_cases=changed,
            option_set_changes=[i for i in shared_ids if _option_set_changed(baseline[i], candidate[i])],
            only_in_candidate=[i for i in candidate if i not in baseline],
            only_in_baseline=[i for i in baseline if i not in candidate],
            baseline=baseline_side, record_differences=record_differences(baseline_side, candidate_side))
    failed = [c.name for c in checks if not c.passed]
    return Verdict(passed=not failed, scoring=scoring, baseline_present=baseline_report is not None, failed=failed, checks=checks,
                   metrics=verdict_metrics, candidate_cases=len(candidate), candidate=candidate_side,
                   limits=limits.model_dump(), **fields)


def _option_set_changed(baseline: CaseAnswer, candidate: CaseAnswer) -> bool:
    return baseline.options_sha256 is not None and candidate.options_sha256 is not None and baseline.options_sha256 != candidate.options_sha256


# ---- output ---------------------------------------------------------------------------------------


def _fmt(value: Optional[float], pct: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * 100:.1f}%" if pct else f"{value:.4f}"


def print_verdict(verdict: Verdict, console=None, *, max_changed: int = 50) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = "PASSED" if verdict.passed else f"FAILED: {', '.join(verdict.failed)}"
    scope = "against the baseline" if verdict.baseline_present else "no baseline: absolute limits only"
    table = Table(title=f"Release gate ({verdict.scoring} scoring, {scope}): {title}")
    for column in ("limit", "kind", "measured", "limit value", "result"):
        table.add_column(column, justify="left" if column in ("limit", "kind", "result") else "right")
    for check in verdict.checks:
        table.add_row(check.name, check.kind, _fmt(check.measured), f"{check.limit:g}",
                      "[green]pass[/green]" if check.passed else f"[red]FAIL[/red] {check.detail}")
    console.print(table)
    if verdict.baseline_present:
        console.print(f"cases: candidate {verdict.candidate_cases}, baseline {verdict.baseline_cases}, shared {verdict.shared_cases}; "
                      f"changed choices {len(verdict.changed_cases)}; option sets changed {len(verdict.option_set_changes)}")
        if verdict.changed_cases:
            changed = Table(title="Changed cases (by id)")
            for column in ("id", "answer", "baseline → candidate", "p baseline", "p candidate", "option set"):
                changed.add_column(column)
            for case in verdict.changed_cases[:max_changed]:
                changed.add_row(case.id, case.answer, f"{case.baseline_choice} → {case.candidate_choice}",
                                _fmt(case.baseline_probability), _fmt(case.candidate_probability),
                                "changed" if case.option_set_changed else "same")
            console.print(changed)
            if len(verdict.changed_cases) > max_changed:
                console.print(f"… and {len(verdict.changed_cases) - max_changed} more (all in the verdict JSON)")
        for name, ids in (("only in the candidate", verdict.only_in_candidate), ("only in the baseline", verdict.only_in_baseline)):
            if ids:
                console.print(f"{len(ids)} cases {name}: {', '.join(ids[:20])}{' …' if len(ids) > 20 else ''}")
    records = Table(title="Record behind each side")
    records.add_column("field")
    if verdict.baseline is not None:
        records.add_column("baseline")
    records.add_column("candidate")
    differing = {d.field for d in verdict.record_differences}
    for name in ("report", "target", "address") + RECORD_FIELDS:
        after = getattr(verdict.candidate, name)
        shown = [_show(getattr(verdict.baseline, name)), _show(after)] if verdict.baseline is not None else [_show(after)]
        label = f"[bold yellow]{name} (differs)[/bold yellow]" if name in differing else name
        records.add_row(label, *shown)
    console.print(records)


def _short(value: Any) -> str:
    """A sha256 as its first 12 hex digits (the verdict JSON keeps them whole)."""
    text = str(value)
    return text[:12] + "…" if re.fullmatch(r"[0-9a-f]{64}", text) else text


def _show(value: Any) -> str:
    if value is None or value == [] or value == {}:
        return "–"
    if isinstance(value, dict):
        return ", ".join(f"{k} ×{v}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_short(v) for v in value)
    return _short(value)


# ---- CLI ------------------------------------------------------------------------------------------


def load_report(location: str, storage, what: str) -> dict:
    from .storage import StorageError

    try:
        report = json.loads(storage.read_text(location))
    except StorageError:
        raise
    except ValueError as exc:
        raise GateError(f"{what} {location}: not JSON: {exc}") from None
    if not isinstance(report, dict):
        raise GateError(f"{what} {location}: not a semif-eval report")
    return report


def load_baseline(location: Optional[str], storage, *, allow_missing: bool) -> tuple[Optional[dict], Optional[str]]:
    """(report, note): a missing baseline is an error unless ``allow_missing`` (a first release)."""
    from .storage import MissingObject

    if not location:
        return None, None
    try:
        return load_report(location, storage, "baseline"), None
    except MissingObject:
        if not allow_missing:
            raise
        return None, f"no baseline at {location}: a first release, gated on the absolute limits alone"


def add_gate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", help="the baseline report.json (local path or s3://): the release that runs now")
    parser.add_argument("--allow-missing-baseline", action="store_true",
                        help="a missing --baseline means a first release: gate on the absolute limits alone")
    parser.add_argument("--limits", help="gate limits: a JSON file (local or s3://) or inline JSON; default: the built-in limits")


def main(argv: Optional[list[str]] = None) -> int:
    from rich.console import Console

    from .storage import Storage, StorageError

    parser = argparse.ArgumentParser(prog="semif-gate", description="Gate a semif-eval report against limits and a baseline report.")
    parser.add_argument("candidate", help="the candidate's report.json (local path or s3://)")
    add_gate_arguments(parser)
    parser.add_argument("--out", help="write the verdict JSON here (local path or s3://)")
    parser.add_argument("--kms-key-id", help="KMS key for S3 writes (default: the bucket's default KMS key)")
    args = parser.parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)  # one line per message in CI logs
    storage = Storage(kms_key_id=args.kms_key_id)
    try:
        limits = parse_limits(load_json_argument(args.limits, storage, "--limits") if args.limits else {}, "--limits")
        candidate = load_report(args.candidate, storage, "candidate")
        baseline, note = load_baseline(args.baseline, storage, allow_missing=args.allow_missing_baseline)
        verdict = compare(candidate, baseline, limits, candidate_location=args.candidate,
                          baseline_location=args.baseline if baseline is not None else None)
    except (GateError, StorageError) as exc:
        console.print(f"semif-gate: {exc}")
        return 2
    if note:
        console.print(note)
    print_verdict(verdict, Console() if sys.stdout.isatty() else Console(width=160))
    if args.out:
        try:
            console.print(f"wrote {storage.write_text(args.out, verdict.model_dump_json(indent=2), 'application/json')}")
        except StorageError as exc:
            console.print(f"semif-gate: {exc}")
            return 2
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
