#!/usr/bin/env python3
"""Write the model manifest's JSON Schema, generated from the adapter's pydantic model, into the model check's asset.

    .venv/bin/python tools/model_manifest_schema.py     # after changing container/semif/serving/engine/manifest.py

The deploy-time model check (lambda/model_check/) runs on the bare Lambda runtime, which has no pydantic: it
validates manifests against this generated schema instead of a second hand-written copy of it.
tests/lambda/test_model_check_handler.py fails when the file and the pydantic model disagree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "lambda" / "model_check" / "manifest_schema.json"


def manifest_schema_text() -> str:
    sys.path.insert(0, str(REPO / "container"))
    from semif.serving.engine.manifest import ModelManifest

    return json.dumps(ModelManifest.model_json_schema(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(manifest_schema_text(), encoding="utf-8")
    print(f"wrote {SCHEMA_PATH.relative_to(REPO)}")
