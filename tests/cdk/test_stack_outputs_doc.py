"""docs/reference/stack-outputs.md against the templates the real app synthesizes: every row's SSM parameter,
CloudFormation output key and export is in its stack, and every output an app can read is in the table.

The output key is what the CloudFormation console's Outputs tab and `describe-stacks` show; apps reading the
page find a value by it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cdk_testing import all_stacks

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference" / "stack-outputs.md"
ENV = "prod"  # prod deploys every stack: shared, image, decision and text


def table_rows(markdown: str, header: str) -> list[list[str]]:
    """The cells of the table whose header row starts with ``header``, backticks stripped."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def published_rows() -> list[dict]:
    rows = table_rows(PAGE.read_text(), "| key | stack (CloudFormation name) | output key |")
    return [{"key": key, "stack": stack.replace("<env>", ENV), "output_key": None if output_key == "none" else output_key,
             "export": None if export == "SSM only" else export.replace("<env>", ENV)}
            for key, stack, output_key, _value, export in rows]


@pytest.fixture(scope="module")
def templates(prod_assembly) -> dict[str, dict]:
    return {stack.stack_name: stack.template for stack in all_stacks(prod_assembly[1])}


def ssm_parameter_names(template: dict) -> set[str]:
    return {r["Properties"]["Name"] for r in template.get("Resources", {}).values()
            if r["Type"] == "AWS::SSM::Parameter"}


def test_the_page_lists_the_published_values():
    rows = published_rows()
    assert len(rows) >= 10 and all(row["stack"].startswith(f"semif-{ENV}-") for row in rows), rows


@pytest.mark.parametrize("row", published_rows(), ids=lambda row: row["key"])
def test_each_row_is_the_ssm_parameter_output_key_and_export_its_stack_publishes(templates, row):
    template = templates[row["stack"]]
    assert f"/semif/{ENV}/{row['key']}" in ssm_parameter_names(template), row
    outputs = template.get("Outputs", {})
    if row["output_key"] is None:  # SSM only: no output names it
        assert not [k for k, o in outputs.items() if row["key"].replace("/", "-") in str(o.get("Export", {}))], row
        return
    assert row["output_key"] in outputs, f"{row['key']}: no output {row['output_key']!r} in {sorted(outputs)}"
    assert outputs[row["output_key"]].get("Export", {}).get("Name") == row["export"], (row, outputs[row["output_key"]])


def test_every_exported_output_of_the_environment_is_on_the_page(templates):
    """An output apps may read (one with a `semif-<env>-…` export) that the table leaves out is a value no one finds."""
    documented = {(row["stack"], row["output_key"]) for row in published_rows()}
    exported = {(name, key) for name, template in templates.items() if name.startswith(f"semif-{ENV}-")
                for key, output in template.get("Outputs", {}).items()
                if re.fullmatch(rf"semif-{ENV}-[a-z0-9-]+", str(output.get("Export", {}).get("Name", "")))}
    assert exported, sorted(templates)
    assert exported <= documented, sorted(exported - documented)


def test_the_outputs_without_ssm_parameter_are_in_their_stacks(templates):
    rows = table_rows(PAGE.read_text(), "| output | stack | value |")
    for output_keys, stack, _value in rows:
        for output_key in re.split(r"`?,\s*`?", output_keys):
            if output_key.endswith("Gpu"):
                continue  # only on a GPU environment's image stack
            template = templates[stack.replace("<env>", ENV)]
            assert output_key in template.get("Outputs", {}), (output_key, stack, sorted(template.get("Outputs", {})))
