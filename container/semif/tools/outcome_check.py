"""`semif-eval check`: do saved thresholds still hold on decisions people have since labeled?

    semif-eval check LABELED.jsonl --thresholds report.json [--scoring label] [--target-accuracy 0.9] [--json]
    semif-eval check LABELED.jsonl --thresholds calibration.json --budget 0.1
    semif-eval check LABELED.jsonl --thresholds '{"min_probability": 0.8, "min_margin": 0.1}' --budget 0.1

LABELED.jsonl holds past answers, one JSON object a line, as the adapter answered them (and `semif-batch`
wrote them): a SemIf result (`option_ids`, `probabilities`) or response (`results`), a System One answer
(`answers` object) or an OpenAI Decisions answer (`answers` list); each with a `label` added: the option id
a person judged right (a string for a line that holds one decision, or {decision id: option id}; `true` /
`false` for a yes/no question). The saved thresholds are applied as they are (nothing is re-fitted) to each
answer's `probabilities` (as served: calibrated where the server calibrates), and the check fails when the
accepted decisions are wrong more often than the budget allows beyond sampling noise:

    error among accepted > budget + 2·SE,   SE = sqrt(budget·(1 − budget) / accepted)

Exit status: 0 the thresholds hold (or nothing was accepted to judge), 1 they drifted, 2 bad arguments
or input (the message names the line and the field).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..serving.postprocess.policy import Policy, PolicyError, decide

# Below this many accepted decisions the normal approximation behind 2·SE is rough: the verdict says so.
FEW_ACCEPTED = 30


class CheckError(ValueError):
    """Input the check cannot use; ``field`` names what is wrong (`label`, `probabilities`, `--budget`, …)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Thresholds:
    """What a saved file says to apply, and the error budget the accepted decisions must stay within."""

    policy: Policy
    budget: float
    source: str  # semif-eval report | semif-batch report | calibration file | policy
    target_accuracy: Optional[float] = None
    recorded: Optional[dict] = None  # the figures the file reported for the cut-point (report files)
    provisional: bool = False


@dataclass(frozen=True)
class LabeledDecision:
    line: int
    decision_id: str
    option_ids: list[str]
    probabilities: list[float]
    label: str
    label_mass: Optional[float] = None
    injection_suspected: Optional[float] = None


# ---- the thresholds file ------------------------------------------------------------------------------


def _budget(budget: Optional[float], target_accuracy: Optional[float], what: str) -> float:
    if budget is not None:
        return budget
    if target_accuracy is not None:
        return 1.0 - target_accuracy
    raise CheckError(f"{what} sets no accuracy: give --budget (the share of accepted decisions allowed to be wrong) "
                     "or --target-accuracy", "--budget")


def _report_entries(doc: dict, scoring: str) -> tuple[str, dict]:
    if "runs" in doc:
        runs = doc["runs"]
        if not isinstance(runs, dict) or scoring not in runs:
            raise CheckError(f"the report has no {scoring!r} run (it has {', '.join(runs) if isinstance(runs, dict) else 'none'}): "
                             "pick one with --scoring", "--scoring")
        return "semif-eval report", runs[scoring]
    return "semif-batch report", doc["evaluation"]


def thresholds_from(doc: Any, *, scoring: str = "label", target_accuracy: Optional[float] = None,
                    budget: Optional[float] = None) -> Thresholds:
    """The policy and budget a saved file gives: a semif-eval or semif-batch report (the cut-point it
    recommends for ``target_accuracy``), a calibration file (its `policy`), or a policy object."""
    if not isinstance(doc, dict):
        raise CheckError("the thresholds file must hold a JSON object", "--thresholds")
    if "runs" in doc or "evaluation" in doc:
        source, run = _report_entries(doc, scoring)
        summary = run.get("thresholds") or {}
        if summary.get("status") == "refused":
            raise CheckError(f"the {source} recommends no thresholds: {summary.get('reason')}", "recommended_thresholds")
        entries = [e for e in run.get("recommended_thresholds") or [] if isinstance(e, dict)]
        if target_accuracy is None:
            reachable = [e for e in entries if e.get("reachable")]
            if len(reachable) != 1:
                listed = ", ".join(f"{e.get('target_accuracy')}" for e in reachable) or "none"
                raise CheckError(f"pick the cut-point with --target-accuracy (reachable in the report: {listed})",
                                 "--target-accuracy")
            entry = reachable[0]
        else:
            matching = [e for e in entries if isinstance(e.get("target_accuracy"), (int, float))
                        and math.isclose(e["target_accuracy"], target_accuracy)]
            if not matching:
                listed = ", ".join(str(e.get("target_accuracy")) for e in entries) or "none"
                raise CheckError(f"the {source} has no threshold for target accuracy {target_accuracy} (it has {listed})",
                                 "--target-accuracy")
            entry = matching[0]
        if not entry.get("reachable") or not isinstance(entry.get("min_probability"), (int, float)):
            raise CheckError(f"the {source} has no cut-point for target accuracy {entry.get('target_accuracy')}: "
                             f"{entry.get('reason', 'not reachable')}", "recommended_thresholds")
        target = float(entry["target_accuracy"])
        recorded = {k: entry.get(k) for k in ("accuracy", "accuracy_se", "coverage", "coverage_se", "n")}
        recorded["basis"] = entry.get("basis", "in-sample")
        return Thresholds(Policy(min_probability=float(entry["min_probability"])), _budget(budget, target, source), source,
                          target_accuracy=target, recorded=recorded, provisional=bool(entry.get("provisional")))
    if doc.get("format") == "semif-calibration":
        if doc.get("policy") is None:
            raise CheckError("the calibration file holds no policy (write one with semif-calibrate --policy)", "policy")
        return Thresholds(_policy(doc["policy"]), _budget(budget, target_accuracy, "a calibration file's policy"),
                          "calibration file", target_accuracy=target_accuracy)
    return Thresholds(_policy(doc), _budget(budget, target_accuracy, "a policy"), "policy", target_accuracy=target_accuracy)


def _policy(raw: Any) -> Policy:
    if isinstance(raw, dict):
        # A request's policy may carry a second-look budget: the answers already hold what it decided.
        raw = {k: v for k, v in raw.items() if k != "second_look"}
    try:
        return Policy.from_mapping(raw)
    except PolicyError as exc:
        raise CheckError(f"not a report, a calibration file or a policy: {exc}", exc.field) from None


# ---- the labeled decisions ----------------------------------------------------------------------------


def parse_labeled(text: str, location: str) -> list[LabeledDecision]:
    """Every labeled decision of a JSON Lines file of answers with `label`; CheckError names the line and
    the field of anything the check cannot use."""
    from .batch import decisions_of, error_code_of

    out: list[LabeledDecision] = []
    # JSON Lines end at "\n" only: a JSON string may hold U+2028, where str.splitlines() would split.
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"{location}:{number}"
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise CheckError(f"{where}: not JSON: {exc}", "line") from None
        if not isinstance(line, dict):
            raise CheckError(f"{where}: not a JSON object", "line")
        code = error_code_of(line)
        if code is not None:
            raise CheckError(f"{where}: an error answer ({code}) holds no decision to check; leave it out", "error")
        if "label" not in line:
            raise CheckError(f"{where}: missing field label (the option id a person judged right)", "label")
        try:
            decisions = decisions_of(line, number)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
            raise CheckError(f"{where}: not an answer record the adapter writes ({type(exc).__name__}: {exc})",
                             _missing_field(exc)) from None
        if not decisions:
            raise CheckError(f"{where}: not an answer record: expected a SemIf result (option_ids, probabilities), "
                             "a SemIf response (results) or an answers field", "option_ids")
        semif_results = line.get("results", [line]) if ("results" in line or "option_ids" in line) else [{}] * len(decisions)
        labels = _labels(line["label"], decisions, where)
        for decision, result in zip(decisions, semif_results):
            if decision.decision_id not in labels:
                continue
            label = labels[decision.decision_id]
            probabilities = _probabilities(decision.probabilities, len(decision.option_ids), where)
            if label not in [str(o) for o in decision.option_ids]:
                raise CheckError(f"{where}: label {label!r} is not one of the options of {decision.decision_id!r} "
                                 f"({', '.join(map(str, decision.option_ids))})", "label")
            injection = result.get("injection_suspected") if isinstance(result, dict) else None
            out.append(LabeledDecision(number, decision.decision_id, [str(o) for o in decision.option_ids], probabilities,
                                       label, label_mass=decision.label_mass,
                                       injection_suspected=injection if isinstance(injection, (int, float)) else None))
    return out


def _missing_field(exc: Exception) -> str:
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else "line"


def _label_text(value: Any) -> Optional[str]:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    return None


def _labels(raw: Any, decisions: Sequence, where: str) -> dict[str, str]:
    """Decision id → label: a plain label names the line's one decision; an object labels by decision id."""
    if isinstance(raw, dict):
        ids = {d.decision_id for d in decisions}
        out = {}
        for key, value in raw.items():
            if key not in ids:
                raise CheckError(f"{where}: label names decision {key!r}, which the line does not hold "
                                 f"({', '.join(sorted(ids))})", f"label.{key}")
            text = _label_text(value)
            if text is None:
                raise CheckError(f"{where}: label.{key} must be an option id", f"label.{key}")
            out[key] = text
        return out
    text = _label_text(raw)
    if text is None:
        raise CheckError(f"{where}: label must be an option id (or an object of them by decision id)", "label")
    if len(decisions) != 1:
        raise CheckError(f"{where}: the line holds {len(decisions)} decisions: give label as "
                         "{decision id: option id}", "label")
    return {decisions[0].decision_id: text}


def _probabilities(values: Any, n_options: int, where: str) -> list[float]:
    if (not isinstance(values, list) or len(values) != n_options or not values
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1 for v in values)):
        raise CheckError(f"{where}: probabilities must be {n_options} numbers in [0, 1], one per option", "probabilities")
    return [float(v) for v in values]


# ---- the check ----------------------------------------------------------------------------------------


def check(decisions: Sequence[LabeledDecision], thresholds: Thresholds) -> dict:
    """The figures and the verdict: `drifted` when the error rate among accepted decisions exceeds
    budget + 2·SE (SE of a binomial proportion at the budget over the accepted decisions), `holds`
    otherwise, `undetermined` when the thresholds accepted nothing."""
    accepted = wrong = 0
    for d in decisions:
        verdict = decide(d.probabilities, thresholds.policy, injection_suspected=d.injection_suspected, label_mass=d.label_mass)
        if verdict.action != "accept":
            continue
        accepted += 1
        top = max(range(len(d.probabilities)), key=d.probabilities.__getitem__)
        wrong += d.option_ids[top] != d.label
    n = len(decisions)
    budget = thresholds.budget
    se = math.sqrt(budget * (1.0 - budget) / accepted) if accepted else None
    error = wrong / accepted if accepted else None
    limit = budget + 2 * se if se is not None else None
    if not accepted:
        verdict = "undetermined"
    else:
        verdict = "drifted" if error > limit else "holds"
    return {
        "n": n, "accepted": accepted, "coverage": accepted / n if n else None, "wrong": wrong,
        "error_accepted": error, "budget": budget, "se": se, "limit": limit, "verdict": verdict,
        "few_accepted": 0 < accepted < FEW_ACCEPTED,
        "policy": thresholds.policy.as_dict(), "source": thresholds.source, "target_accuracy": thresholds.target_accuracy,
        "recorded": thresholds.recorded, "provisional": thresholds.provisional,
    }


def _pct(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.1%}"


def print_result(result: dict, labels: str, thresholds_location: str, out=None) -> None:
    out = out or sys.stdout
    target = f", target accuracy {result['target_accuracy']:.0%}" if result["target_accuracy"] is not None else ""
    print(f"semif-eval check: {result['n']} labeled decisions in {labels} against {thresholds_location} "
          f"({result['source']}{target})", file=out)
    print(f"policy: {json.dumps(result['policy'])}" + ("  [provisional thresholds]" if result["provisional"] else ""), file=out)
    recorded = result.get("recorded") or {}
    recorded_coverage = f"; the report recorded {_pct(recorded.get('coverage'))}" if recorded.get("coverage") is not None else ""
    print(f"accepted: {result['accepted']} of {result['n']} (coverage {_pct(result['coverage'])}{recorded_coverage})", file=out)
    if result["accepted"]:
        print(f"error among accepted: {result['wrong']} wrong ({_pct(result['error_accepted'])}); budget {_pct(result['budget'])}, "
              f"SE {_pct(result['se'])} (binomial at the budget, {result['accepted']} accepted), "
              f"limit budget + 2·SE = {_pct(result['limit'])}", file=out)
    note = {"holds": "the accepted decisions stay within the budget",
            "drifted": "the accepted decisions are wrong more often than the budget allows, beyond sampling noise",
            "undetermined": "the thresholds accepted none of these decisions: nothing to judge"}[result["verdict"]]
    print(f"verdict: {result['verdict']}: {note}", file=out)
    if result["few_accepted"]:
        print(f"note: fewer than {FEW_ACCEPTED} accepted decisions: only a large drift shows; label more to see a small one", file=out)


def main(argv: Optional[list[str]] = None) -> int:
    from .gate import GateError, load_json_argument
    from .storage import Storage, StorageError

    parser = argparse.ArgumentParser(
        prog="semif-eval check",
        description="Apply saved thresholds to newly labeled answers; exit 1 when the accepted ones are wrong more "
                    "often than the budget allows beyond its standard error.")
    parser.add_argument("labels", help="JSON Lines: answers as the adapter or semif-batch wrote them, each with a label "
                                       "(the option id a person judged right; {decision id: option id} for several)")
    parser.add_argument("--thresholds", required=True,
                        help="a semif-eval report.json (its recommended_thresholds), a semif-batch report.json, a "
                             "calibration file (its policy), or a policy: a JSON file (local or s3://) or inline JSON")
    parser.add_argument("--scoring", default="label", help="the report's run to take the cut-point from (default: label)")
    parser.add_argument("--target-accuracy", type=float,
                        help="the report's cut-point for this accuracy; the budget is 1 minus it unless --budget is given")
    parser.add_argument("--budget", type=float, help="share of accepted decisions allowed to be wrong (e.g. 0.1)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"semif-eval check: {message}", file=sys.stderr)
        return 2

    for flag, value in (("--budget", args.budget), ("--target-accuracy", args.target_accuracy)):
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            return fail(f"{flag}: {value} is not between 0 and 1")
    storage = Storage()
    try:
        doc = load_json_argument(args.thresholds, storage, "--thresholds")
        thresholds = thresholds_from(doc, scoring=args.scoring, target_accuracy=args.target_accuracy, budget=args.budget)
        text = storage.read_text(args.labels)
        decisions = parse_labeled(text, args.labels)
    except CheckError as exc:
        return fail(f"{exc} [field: {exc.field}]")
    except (GateError, StorageError) as exc:
        return fail(str(exc))
    if not decisions:
        return fail(f"{args.labels}: no labeled decisions")
    result = check(decisions, thresholds)
    if args.json:
        print(json.dumps(result))
    else:
        print_result(result, args.labels, args.thresholds if not args.thresholds.lstrip().startswith("{") else "the policy given")
    return 1 if result["verdict"] == "drifted" else 0


if __name__ == "__main__":
    sys.exit(main())
