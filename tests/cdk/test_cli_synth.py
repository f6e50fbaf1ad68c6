"""The pinned CDK CLI from npm synthesizes the same stacks as the in-process app.

`npm ci` (run by the Makefile before tests) installs the CLI pinned in package-lock.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from cdk_testing import IMAGE_DIGESTS, REPO, all_stacks


def image_context() -> list[str]:
    return [arg for name, value in IMAGE_DIGESTS.items() for arg in ("-c", f"{name}={value}")]


def test_pinned_cli_is_installed_from_the_lockfile():
    lock = json.loads((REPO / "package-lock.json").read_text())
    pinned = json.loads((REPO / "package.json").read_text())["devDependencies"]["aws-cdk"]
    assert lock["packages"]["node_modules/aws-cdk"]["version"] == pinned
    installed = REPO / "node_modules" / "aws-cdk" / "package.json"
    assert installed.exists(), "run `npm ci` first (the Makefile does)"
    assert json.loads(installed.read_text())["version"] == pinned


def test_npx_cdk_synth_produces_the_same_stacks_offline(tmp_path, dev_assembly):
    assert shutil.which("npx"), "Node.js/npx is required"
    env = {**os.environ, "CDK_DISABLE_CLI_TELEMETRY": "true", "CDK_DISABLE_VERSION_CHECK": "1",
           "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "",
           "AWS_EC2_METADATA_DISABLED": "true"}
    result = subprocess.run(
        ["npx", "--no-install", "cdk", "synth", "-c", "env=dev", *image_context(), "-o", str(tmp_path), "--no-notices", "-q"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = {s.stack_name: s.template for s in all_stacks(dev_assembly[1])}
    by_name = {}
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for artifact in manifest["artifacts"].values():
        if artifact["type"] == "aws:cloudformation:stack":
            name = artifact["properties"].get("stackName")
            by_name[name] = json.loads((tmp_path / artifact["properties"]["templateFile"]).read_text())
    assert sorted(by_name) == sorted(expected)
    for name, template in expected.items():
        assert comparable(by_name[name]) == comparable(template), name


def comparable(template: dict) -> dict:
    """The CLI adds path metadata and the CDKMetadata resource (version reporting); nothing else may differ.

    Asset hashes (and the image tag derived from them) are masked: in a shared working tree,
    container/ may change between the two syntheses.
    """
    resources = {k: {f: v for f, v in r.items() if f != "Metadata"}
                 for k, r in template["Resources"].items() if r["Type"] != "AWS::CDK::Metadata"}
    rest = {k: v for k, v in template.items() if k not in ("Resources", "Conditions")}
    conditions = {k: v for k, v in template.get("Conditions", {}).items() if k != "CDKMetadataAvailable"}
    text = json.dumps({**rest, "Resources": resources, "Conditions": conditions}, sort_keys=True)
    text = re.sub(r"\b[0-9a-f]{64}\b", "<asset-hash>", text)
    text = re.sub(r"\b[0-9a-f]{40}\b", "<image-tag>", text)
    return json.loads(text)
