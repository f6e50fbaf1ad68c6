"""`semif-calibrate`: fit temperatures (one per decision id, and a global fallback) on labeled data by
minimising NLL, report k-fold cross-validated NLL and ECE before/after, and write the calibration file
the adapter loads from `SEMIF_CALIBRATION_PATH`.

    semif-calibrate data.jsonl --model model.gguf --out calibration.json [--scoring label,sequence]
        [--layout state_first,options_first] [--debias none,reverse,content_free]
    semif-calibrate data.jsonl --url http://127.0.0.1:8080 --out calibration.json

One fit per scoring × layout × debias asked for: each is bound to the kind of logits it was measured on,
and the file to the model and prompt template that produced them (the adapter checks both).

Contextual calibration (Zhao et al. 2021) is measured too; with `--contextual auto` (the default) it goes
into the file only where cross-validation shows it lowers the held-out NLL further than temperature alone.

Platt scaling (the top option's confidence through σ(a·s + b), s its log-odds) is fitted beside the
temperature; both are in the file, and `applied` says which one the adapter uses. With `--method auto` (the
default) that is Platt only where its cross-validated NLL is lower than temperature scaling's and its slope
`a` is positive.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from ..serving.postprocess.calibration import Case, FitKind, build_file, cross_validate, fit_platt, fit_temperatures
from .evaluate import (
    _fmt,
    add_target_arguments,
    content_free_priors,
    decision_key,
    load_rows,
    make_target,
    option_pairs,
    parse_scorings,
    prior_key,
)
from ..serving.config import DEFAULT_DEBIAS
from ..serving.engine.plan import DEBIAS_MODES, served_debias
from ..serving.postprocess.policy import Policy
from ..serving.engine.prompt import LAYOUTS, OPTIONS_FIRST_SUFFIX, options_sha256


def choose_applied(methods: dict, method: str, platt: dict) -> str:
    """Which fit the adapter applies: ``method``, or with "auto" Platt only where its held-out NLL is lower
    and its slope is positive (a fit with a ≤ 0 ranks confidence backwards: a fluke of a few cases)."""
    if method != "auto":
        return method
    wins = methods["platt"]["nll"] < methods["temperature"]["nll"]
    return "platt" if wins and platt["a"] > 0 else "temperature"


def fit_kind(target, rows: list[dict], kind: FitKind, *, folds: int, seed: int, min_per_decision: int, contextual: str,
             method: str = "auto", progress=lambda: None) -> tuple[dict, dict]:
    """(the file's entry for ``kind``, the cross-validation report)."""
    cases, case_rows = [], []
    scoring, options = kind.scoring, {"layout": kind.layout, "debias": kind.debias}
    for row in rows:
        outcome = target.decide(row, scoring, **options)
        progress()
        if outcome.valid and (outcome.layout, outcome.debias) != (kind.layout, kind.debias):
            # A target that ignores what it was asked (an older server) must not yield a fit under the wrong kind.
            raise SystemExit(f"semif-calibrate: asked for layout {kind.layout}, debias {kind.debias}; the target "
                             f"answered with layout {outcome.layout}, debias {outcome.debias}")
        if outcome.valid and outcome.option_logits is not None:
            answer = [o["id"] for o in row["options"]].index(row["answer"])
            cases.append(Case(key=decision_key(row), answer=answer, logits=list(outcome.option_logits)))
            case_rows.append(row)
    if len(cases) < 2:
        raise SystemExit(f"semif-calibrate: only {len(cases)} valid {kind} answers; need at least 2")
    if kind.debias in ("reverse", "rotations"):
        # A contextual prior is measured on one listing and applies where a request's options hash to it, so a
        # listing and its reverse would be calibrated differently; these readouts exist to answer both alike.
        if contextual == "on":
            print(f"semif-calibrate: {kind}: no contextual priors under debias {kind.debias} (they depend on the "
                  "listing); --contextual on applies to the other kinds", file=sys.stderr)
        contextual = "off"
    priors = content_free_priors(target, case_rows, scoring, **options) if contextual != "off" else {}
    for case, row in zip(cases, case_rows):
        case.log_prior = priors.get(prior_key(row))
    cv = cross_validate(cases, k=folds, seed=seed, min_per_decision=min_per_decision)
    entry: dict[str, Any] = fit_temperatures(cases, min_per_decision=min_per_decision)
    methods = cv["methods"]
    entry["platt"] = fit_platt([c.logits for c in cases], [c.answer for c in cases])
    entry["applied"] = choose_applied(methods, method, entry["platt"])
    use_contextual = contextual == "on" or (
        contextual == "auto" and "contextual+temperature" in methods
        and methods["contextual+temperature"]["nll"] < methods["temperature"]["nll"]
    )
    if use_contextual and all(c.log_prior is not None for c in cases):
        entry["contextual_temperatures"] = fit_temperatures(cases, min_per_decision=min_per_decision, contextual=True)
        by_key: dict[str, dict] = defaultdict(dict)
        for case, row in zip(cases, case_rows):
            by_key[case.key][options_sha256(option_pairs(row))] = case.log_prior
        # The adapter applies a prior only to the option set it was measured on; a decision id seen with
        # several option sets (or questions) gets none.
        entry["contextual"] = {key: {"options_sha256": next(iter(sets)), "log_prior": next(iter(sets.values()))}
                               for key, sets in by_key.items() if len(sets) == 1 and _one_question(key, case_rows)}
    report = {"k": cv["k"], "seed": seed, "min_per_decision": min_per_decision, "n": len(cases), "methods": methods,
              "contextual_in_file": "contextual" in entry, "applied": entry["applied"]}
    return entry, report


def _one_question(key: str, rows: list[dict]) -> bool:
    return len({r["question"] for r in rows if decision_key(r) == key}) == 1


def parse_choices(raw: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    values = tuple(dict.fromkeys(v.strip() for v in raw.split(",") if v.strip()))
    for value in values:
        if value not in allowed:
            raise SystemExit(f"semif-calibrate: {flag}: {value!r} is not one of {', '.join(allowed)}")
    if not values:
        raise SystemExit(f"semif-calibrate: {flag}: give at least one of {', '.join(allowed)}")
    return values


def base_template_version(version: str, layout: str) -> str:
    """The server's template version from a plan's (an options-first plan's ends in "+options-first")."""
    if layout == "options_first" and version.endswith(OPTIONS_FIRST_SUFFIX):
        return version[: -len(OPTIONS_FIRST_SUFFIX)]
    return version


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="semif-calibrate", description="Fit a SemIf calibration file on labeled data.")
    add_target_arguments(parser)
    parser.add_argument("--out", default="calibration.json", help="calibration file to write")
    parser.add_argument("--contextual", choices=["auto", "on", "off"], default="auto",
                        help="contextual calibration: where cross-validation shows it helps (auto), always, or never")
    parser.add_argument("--method", choices=["auto", "temperature", "platt"], default="auto",
                        help="what the adapter applies outside contextual priors: Platt scaling where its "
                             "cross-validated NLL is lower than temperature scaling's (auto), or always one of them")
    parser.add_argument("--policy", help="default abstention policy to store in the file (JSON)")
    parser.add_argument("--layout", default="state_first",
                        help="prompt layout(s) to fit, comma-separated: state_first, options_first (default: state_first)")
    parser.add_argument("--debias", default=None,
                        help="debiasing mode(s) to fit, comma-separated: none, reverse, content_free, rotations "
                             f"(default: the server's, {DEFAULT_DEBIAS} for label scoring in the state-first layout, else none)")
    args = parser.parse_args(argv)
    if args.no_contextual:
        args.contextual = "off"

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(stderr=True)
    policy = None
    if args.policy:
        try:
            policy = Policy.from_mapping(json.loads(args.policy)).as_dict()
        except (ValueError, TypeError) as exc:
            console.print(f"semif-calibrate: --policy: {exc}")
            return 2
    rows = load_rows(args.data, args.limit)
    def debiasings(scoring: str, layout: str) -> list[str]:
        if args.debias is None:  # what the server answers a request that does not say (SEMIF_DEBIAS's default)
            return [served_debias(DEFAULT_DEBIAS, scoring=scoring, layout=layout, native=False)]
        return parse_choices(args.debias, DEBIAS_MODES, "--debias")

    kinds = [FitKind(scoring, layout, debias) for scoring in parse_scorings(args.scoring)
             for layout in parse_choices(args.layout, LAYOUTS, "--layout")
             for debias in debiasings(scoring, layout)]
    # content_free and rotations read label probabilities: they have no cloze (sequence) kind to fit.
    skipped = [kind for kind in kinds if kind.scoring == "sequence" and kind.debias in ("content_free", "rotations")]
    kinds = [kind for kind in kinds if kind not in skipped]
    for kind in skipped:
        console.print(f"semif-calibrate: skipping {kind}: debias {kind.debias} needs label scoring")
    target = make_target(args)
    try:
        fitted: dict[FitKind, dict] = {}
        reports: dict[str, dict] = {}
        templates: set[tuple[str, str]] = set()
        with Progress(console=console) as bar:
            for kind in kinds:
                task = bar.add_task(f"fit {kind}", total=len(rows))
                fitted[kind], reports[str(kind)] = fit_kind(
                    target, rows, kind, folds=args.folds, seed=args.seed, min_per_decision=args.min_per_decision,
                    contextual=args.contextual, method=args.method, progress=lambda: bar.advance(task))
                described = target.describe()
                templates.add((base_template_version(described.get("template_version") or "", kind.layout),
                               described.get("template_sha256") or ""))
        record = target.describe()
    finally:
        target.close()
    if not record.get("model_sha256"):
        console.print("semif-calibrate: the target did not report its model sha256")
        return 3
    if len(templates) != 1 or not all(next(iter(templates))):
        console.print(f"semif-calibrate: the target did not report one prompt template (version and sha256): {sorted(templates)}")
        return 3
    template_version, template_sha256 = templates.pop()
    payload = build_file(model_sha256=record["model_sha256"], model_file=record.get("model_file") or "",
                         template_version=template_version, template_sha256=template_sha256,
                         fits=list(fitted.items()),
                         fit={"data_file": args.data, "cross_validation": reports, "target": record}, policy=policy)
    Path(args.out).write_text(json.dumps(payload, indent=2))

    out = Console()
    for kind, report in zip(fitted, reports.values()):
        table = Table(title=f"{kind} (scoring/layout/debias): {report['k']}-fold cross-validation on {report['n']} cases (held-out folds)")
        for column in ("method", "accuracy", "NLL", "Brier", "ECE"):
            table.add_column(column, justify="right" if column != "method" else "left")
        for method, m in report["methods"].items():
            table.add_row(method, _fmt(m["accuracy"], pct=True), _fmt(m["nll"]), _fmt(m["brier"]), _fmt(m["ece"]))
        out.print(table)
        entry = fitted[kind]
        per = ", ".join(f"{k} T={v['temperature']:.3f} (n={v['n']})" for k, v in entry["per_decision"].items()) or "none"
        platt = entry["platt"]
        out.print(f"global T={entry['global']['temperature']:.3f}; per decision: {per}; Platt a={platt['a']:.3f} "
                  f"b={platt['b']:.3f}; applied: {entry['applied']}; contextual in file: {report['contextual_in_file']}")
    out.print(f"wrote {args.out} (version {payload['version']}, model sha256 {payload['model_sha256'][:12]}…)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
