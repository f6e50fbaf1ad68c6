"""CDK test fixtures: each real app is synthesized once per session, with cdk-nag on.

Synthesis costs seconds on 2 cores, so the dev, prod and pipeline assemblies are shared by the
tests that read them (assertions, cfn-lint, CLI comparison).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cdk_testing import CPU_DIGEST, GPU_DIGEST, IMAGE_DIGESTS, synth_real_app  # noqa: E402  (also puts the repository root on sys.path)


@pytest.fixture(scope="session")
def dev_assembly(tmp_path_factory):
    return synth_real_app(tmp_path_factory.mktemp("dev"), env="dev", **IMAGE_DIGESTS)


@pytest.fixture(scope="session")
def prod_assembly(tmp_path_factory):
    return synth_real_app(tmp_path_factory.mktemp("prod"), env="prod", **IMAGE_DIGESTS)


@pytest.fixture(scope="session")
def pipeline_assembly(tmp_path_factory):
    """The pipeline as its synth step builds it: the image steps' outputs on disk, read by the app."""
    images = tmp_path_factory.mktemp("adapter-images")
    for variant, digest in (("cpu", CPU_DIGEST), ("gpu", GPU_DIGEST)):
        (images / variant).mkdir()
        (images / variant / "image.json").write_text(json.dumps({"imageDigest": digest, "imageTag": "t" * 40}))
    return synth_real_app(tmp_path_factory.mktemp("pipeline"), pipeline="true", **{"adapter-images-dir": str(images)})
