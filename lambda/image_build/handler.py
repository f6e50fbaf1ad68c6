"""Custom resource that builds the adapter image with CodeBuild during `cdk deploy`.

Driven by ``custom_resources.Provider``: ``on_event`` starts a build (or decides none is needed),
``is_complete`` polls it and returns the pushed image's digest as ``ImageDigest``.

Resource properties (all strings):
  ProjectName, RepositoryName, RepositoryUri, BaseImage, ImageTag (= hash of every build input),
  SourceLocation (``bucket/key`` of the zipped ``container/`` asset).

A build runs only when no image with ``ImageTag`` exists yet; tags are immutable, so an
unchanged hash always means an unchanged image. Delete is a no-op: images are kept for rollback
and expire through the repository's lifecycle rule.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import boto3

LOG = logging.getLogger()
LOG.setLevel(os.environ.get("LOG_LEVEL", "INFO"))

FAILED_STATES = {"FAILED", "FAULT", "STOPPED", "TIMED_OUT"}


def _codebuild():
    return boto3.client("codebuild")


def _ecr():
    return boto3.client("ecr")


def on_event(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    request = event["RequestType"]
    props = event["ResourceProperties"]
    LOG.info(json.dumps({"request": request, "image_tag": props.get("ImageTag")}))
    if request == "Delete":
        return {"PhysicalResourceId": event["PhysicalResourceId"]}

    physical_id = f"{props['RepositoryName']}:{props['ImageTag']}"
    # Same inputs, same tag: an update that changes nothing the image depends on finds its image.
    if _image_digest(props) is not None:
        return {"PhysicalResourceId": physical_id, "Data": {"BuildId": ""}}

    build = _codebuild().start_build(
        projectName=props["ProjectName"],
        sourceTypeOverride="S3",
        sourceLocationOverride=props["SourceLocation"],
        environmentVariablesOverride=[
            {"name": "BASE_IMAGE", "value": props["BaseImage"], "type": "PLAINTEXT"},
            {"name": "REPOSITORY_URI", "value": props["RepositoryUri"], "type": "PLAINTEXT"},
            {"name": "IMAGE_TAG", "value": props["ImageTag"], "type": "PLAINTEXT"},
        ],
    )["build"]
    LOG.info(json.dumps({"started_build": build["id"]}))
    return {"PhysicalResourceId": physical_id, "Data": {"BuildId": build["id"]}}


def is_complete(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    if event["RequestType"] == "Delete":
        return {"IsComplete": True}
    props = event["ResourceProperties"]
    build_id = (event.get("Data") or {}).get("BuildId", "")
    if build_id:
        build = _codebuild().batch_get_builds(ids=[build_id])["builds"][0]
        status = build["buildStatus"]
        if status == "IN_PROGRESS":
            return {"IsComplete": False}
        if status in FAILED_STATES:
            raise RuntimeError(_failure_message(build))
    digest = _image_digest(props)
    if digest is None:
        raise RuntimeError(
            f"image {props['RepositoryUri']}:{props['ImageTag']} not found after "
            f"{'build ' + build_id if build_id else 'skipping the build'}"
        )
    return {"IsComplete": True, "Data": {"ImageDigest": digest, "ImageUri": f"{props['RepositoryUri']}@{digest}",
                                         "BuildId": build_id}}


def _image_digest(props: dict[str, Any]) -> str | None:
    ecr = _ecr()
    try:
        described = ecr.describe_images(
            repositoryName=props["RepositoryName"], imageIds=[{"imageTag": props["ImageTag"]}]
        )
    except ecr.exceptions.ImageNotFoundException:
        return None
    details = described.get("imageDetails") or []
    return details[0]["imageDigest"] if details else None


def _failure_message(build: dict[str, Any]) -> str:
    failed_phases = [
        f"{p['phaseType']}: {' '.join(c.get('message', '') for c in p.get('contexts', []))}".strip()
        for p in build.get("phases", [])
        if p.get("phaseStatus") in FAILED_STATES
    ]
    logs = build.get("logs", {}).get("deepLink", "(no log link)")
    detail = "; ".join(failed_phases) or "no failed phase reported"
    return f"image build {build['id']} ended {build['buildStatus']} ({detail}). Logs: {logs}"
