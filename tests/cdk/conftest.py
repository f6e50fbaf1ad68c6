"""CDK test fixtures: each real app is synthesized once per session, with cdk-nag on.

Synthesis costs seconds on 2 cores, so the dev, prod and pipeline assemblies are shared by the
tests that read them (assertions, cfn-lint, CLI comparison).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cdk_testing import synth_real_app  # noqa: E402  (also puts the repository root on sys.path)


@pytest.fixture(scope="session")
def dev_assembly(tmp_path_factory):
    return synth_real_app(tmp_path_factory.mktemp("dev"), env="dev")


@pytest.fixture(scope="session")
def prod_assembly(tmp_path_factory):
    return synth_real_app(tmp_path_factory.mktemp("prod"), env="prod")


@pytest.fixture(scope="session")
def pipeline_assembly(tmp_path_factory):
    return synth_real_app(tmp_path_factory.mktemp("pipeline"), pipeline="true")
