"""Helpers shared by the CDK tests: synthesize the real app as `cdk synth` does.

A plain module (not conftest.py) so tests can import it by a name no other conftest shares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# jsii prints a banner for Node versions it has not tested; it is noise in test output.
os.environ.setdefault("JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


# What the pipeline's image steps would hand the synth: one digest per variant.
CPU_DIGEST = "sha256:" + "c1" * 32
GPU_DIGEST = "sha256:" + "9d" * 32
IMAGE_DIGESTS = {"adapter-image-cpu": CPU_DIGEST, "adapter-image-gpu": GPU_DIGEST}


def cdk_json_context() -> dict:
    return json.loads((REPO / "cdk.json").read_text())["context"]


def synth_real_app(outdir: Path, **context):
    """The app exactly as `cdk synth` builds it (cdk.json context + overrides), cdk-nag included."""
    from aws_cdk import App

    import app as semif_app

    cdk_app = semif_app.build_app(App(outdir=str(outdir), context={**cdk_json_context(), **context}))
    return cdk_app, cdk_app.synth()


def all_stacks(assembly):
    """Every stack artifact, including those in nested (pipeline stage) assemblies."""
    return list(assembly.stacks_recursively)
