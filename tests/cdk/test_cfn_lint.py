"""cfn-lint over every synthesized template (dev, prod, pipeline with its stages): 0 errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdk_testing import all_stacks


@pytest.mark.parametrize("assembly_name", ["dev_assembly", "prod_assembly", "pipeline_assembly"])
def test_cfn_lint_finds_no_errors(request, assembly_name):
    from cfnlint.api import lint_file

    _, assembly = request.getfixturevalue(assembly_name)
    errors = []
    for stack in all_stacks(assembly):
        path = Path(stack.template_full_path)
        errors += [f"{path.name}: {m.rule.id} {m.message} (line {m.linenumber})"
                   for m in lint_file(path) if m.rule.id.startswith("E")]
    assert errors == []
