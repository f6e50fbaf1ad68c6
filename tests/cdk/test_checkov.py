"""checkov, a second IaC scanner next to cdk-nag, over every synthesized template: no failed check.

Each skip lives in the resource's own template metadata (``Metadata.checkov.skip``) with a reason,
so a reader of the template sees why. checkov runs from its own virtualenv (requirements-checkov.txt:
its pins conflict with the project's), installed by `make setup`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cdk_testing import REPO, all_stacks

CHECKOV = Path(os.environ.get("CHECKOV", REPO / ".venv-checkov" / "bin" / "checkov"))
PINNED = next(line.split("==")[1] for line in (REPO / "requirements-checkov.txt").read_text().splitlines()
              if line.startswith("checkov=="))


@pytest.fixture(scope="module")
def checkov_report(pipeline_assembly):
    """One run over the pipeline assembly: the pipeline stack and every environment's stacks (dev, staging,
    prod), which are the templates a hand deploy gives too (test_app checks that)."""
    assert CHECKOV.exists(), f"{CHECKOV} is missing: run `make setup` (it installs requirements-checkov.txt)"
    _, assembly = pipeline_assembly
    result = subprocess.run(
        [str(CHECKOV), "-d", assembly.directory, "--framework", "cloudformation", "--output", "json",
         "--compact", "--skip-download"],  # offline: no guideline download, no platform calls
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"})
    assert result.returncode in (0, 1), result.stderr[-3000:]
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


def test_checkov_is_the_pinned_version():
    version = subprocess.run([str(CHECKOV), "--version"], capture_output=True, text=True, timeout=120).stdout.strip()
    assert version == PINNED


def test_checkov_finds_no_failed_check_in_any_template(checkov_report, pipeline_assembly):
    failed = [f"{f['check_id']} {f['resource']} ({Path(f['file_path']).name}): {f['check_name']}"
              for report in checkov_report for f in report["results"]["failed_checks"]]
    assert failed == []
    scanned = {Path(f["file_path"]).name for report in checkov_report
               for f in report["results"]["passed_checks"]}
    assert len(scanned) == len(all_stacks(pipeline_assembly[1]))  # every template was read
    assert all(report["summary"]["parsing_errors"] == 0 for report in checkov_report)


def test_every_checkov_skip_is_one_check_on_one_resource_with_a_specific_reason(pipeline_assembly):
    skips = []
    for stack in all_stacks(pipeline_assembly[1]):
        for logical_id, resource in stack.template["Resources"].items():
            for skip in resource.get("Metadata", {}).get("checkov", {}).get("skip", []):
                skips.append((stack.stack_name, logical_id, skip["id"], skip.get("comment", "")))
    assert skips, "the metadata is where skips live"
    for stack_name, logical_id, check_id, comment in skips:
        assert check_id.startswith("CKV_AWS_"), (stack_name, logical_id, check_id)
        assert len(comment) > 60, f"{stack_name}/{logical_id} {check_id}: say why, specifically"
    assert len({(s, r, c) for s, r, c, _ in skips}) == len(skips)
