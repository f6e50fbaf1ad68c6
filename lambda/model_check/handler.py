"""CloudFormation custom resource: the model an endpoint serves is in S3 before its SageMaker Model is created.

On Create and Update it reads ``model-manifest.json`` under the model prefix, validates it against the
adapter's manifest schema (``manifest_schema.json``, generated from ``semif.serving.engine.manifest``), and checks with
HeadObject that the object the manifest names exists with the manifest's size and, when S3 reports one, the
S3 SHA-256 checksum ``semif-package-model upload`` recorded. With ``TransformTarball`` (the decision stack, whose
Batch Transform Model reads a ``model.tar.gz``), an uncompressed model's tarball beside the prefix
(``<version>.tar.gz``) is checked the same way. A failure fails the deploy with one line that names what is missing
and the ``semif-package-model`` command that fixes it. Delete is a no-op.

Resource properties: ``Bucket``, ``ModelPrefix`` (``models/<name>/<version>/`` or ``…/model.tar.gz``),
``ManifestKey``, ``TransformTarball`` (``"true"`` or absent). The function answers CloudFormation itself (a PUT to the pre-signed ``ResponseURL``), so it needs
no Provider framework; it answers on every path, errors included, so a deploy never waits for a lost reply.

The pipeline's ``CheckModel-<env>`` step runs the same check before the stage's endpoint stacks exist:

    python3 lambda/model_check/handler.py --bucket B --model-prefix models/<name>/<version>/ --manifest-key K \
        --transform-tarball
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import urllib.request
from pathlib import Path
from typing import Any, Optional

MANIFEST_NAME = "model-manifest.json"
DEFAULT_MODELS_ROOT = "models"
SCHEMA = json.loads(Path(__file__).with_name("manifest_schema.json").read_text(encoding="utf-8"))
# A CloudFormation response body is capped at 4 KiB; the reason is one line well inside it.
MAX_REASON = 1500
_MISSING = {"NoSuchKey", "404", "NotFound"}
# S3 also answers a missing key with 403 when the reader may not list it; a listing of the key tells the two apart.
_DENIED = {"403", "AccessDenied", "Forbidden"}

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)


class ModelCheckFailed(Exception):
    """The model is not deployable; the message is the one line CloudFormation shows."""


# --------------------------------------------------------------------------------------------
# The manifest schema, interpreted: only the keywords pydantic emits for ModelManifest. An unknown keyword is
# an error, so a schema change the interpreter does not understand fails the tests, not a deploy.

_ANNOTATIONS = {"title", "description", "default", "additionalProperties", "$defs"}
_TYPES = {"object": dict, "string": str, "integer": int, "boolean": bool, "null": type(None)}


def schema_problem(value: Any, schema: dict = SCHEMA, path: str = "") -> Optional[str]:
    """The first way ``value`` breaks ``schema``, as ``field 'a.b': why``; None when it conforms."""
    unknown = set(schema) - _ANNOTATIONS - {"$ref", "anyOf", "type", "properties", "required", "minLength",
                                             "minimum", "pattern"}
    if unknown:
        raise ValueError(f"manifest schema uses {sorted(unknown)}, which the model check does not interpret")
    where = f"field '{path or '<root>'}'"
    if "$ref" in schema:
        return schema_problem(value, SCHEMA["$defs"][schema["$ref"].rsplit("/", 1)[-1]], path)
    if "anyOf" in schema:
        problems = [schema_problem(value, option, path) for option in schema["anyOf"]]
        return None if None in problems else problems[0]
    kind = schema.get("type")
    if kind is not None:
        # bool is an int in Python, never in JSON Schema.
        if not isinstance(value, _TYPES[kind]) or (kind == "integer" and isinstance(value, bool)):
            return f"{where}: expected {kind}, got {json.dumps(value)[:40]}"
    if kind == "object":
        for name in schema.get("required", []):
            if name not in value:
                return f"field '{path + '.' if path else ''}{name}': missing"
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                problem = schema_problem(value[name], sub, f"{path + '.' if path else ''}{name}")
                if problem:
                    return problem
    if "minLength" in schema and len(value) < schema["minLength"]:
        return f"{where}: shorter than {schema['minLength']} characters"
    if "minimum" in schema and value < schema["minimum"]:
        return f"{where}: less than {schema['minimum']}"
    if "pattern" in schema and not re.search(schema["pattern"], value):
        return f"{where}: does not match {schema['pattern']}"
    return None


# --------------------------------------------------------------------------------------------
# The check


def upload_command(bucket: str, model_prefix: str, *, model_file: str = "<model.gguf>", force: bool = False) -> str:
    """The `semif-package-model upload` that writes a model where ``model_prefix`` points."""
    tar_gz = model_prefix.endswith(".tar.gz")
    directory = posixpath.dirname(model_prefix) if tar_gz else model_prefix.rstrip("/")
    parts = directory.split("/")
    command = f"semif-package-model upload {model_file} --bucket {bucket}"
    if len(parts) >= 2 and all(parts[-2:]):
        root = "/".join(parts[:-2])
        command += f" --name {parts[-2]} --version {parts[-1]}"
        if root != DEFAULT_MODELS_ROOT:
            command += f" --prefix '{root}'"
    if tar_gz:
        command += " --tar-gz"
    if force:
        command += " --force"
    return command


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", type(exc).__name__))


def _error_message(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Message") or exc)


def _is_missing(s3, exc: Exception, *, bucket: str, key: str) -> bool:
    """Whether a failed read of ``key`` means it is not there; raise ModelCheckFailed when access was denied."""
    from botocore.exceptions import BotoCoreError, ClientError

    code = _error_code(exc)
    if code in _MISSING:
        return True
    if code not in _DENIED:
        return False
    uri = f"s3://{bucket}/{key}"
    message = _error_message(exc)
    try:
        listing = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    except (ClientError, BotoCoreError) as list_exc:
        raise ModelCheckFailed(
            f"access denied reading {uri} (S3: {code}: {message}), and listing it was denied too "
            f"({_error_code(list_exc)}): check that this role may read and list the model prefix and decrypt with "
            "the model bucket's KMS key") from exc
    if any(item.get("Key") == key for item in listing.get("Contents", [])):
        # The object is there: an IAM, bucket-policy or KMS refusal, which no upload fixes.
        cause = ("the model bucket's KMS key refused to decrypt it (check the key policy and the role's kms:Decrypt)"
                 if "kms" in message.lower() else
                 "this role may not read it (check its s3:GetObject grant and the bucket policy)")
        raise ModelCheckFailed(f"access denied reading {uri}, which exists: {cause}; S3 said {code}: {message}") from exc
    return True


def check_model(s3, *, bucket: str, model_prefix: str, manifest_key: str,
                transform_tarball: bool = False) -> dict[str, str]:
    """Raise ModelCheckFailed unless the model at ``model_prefix`` is complete; return what was verified."""
    from botocore.exceptions import BotoCoreError, ClientError

    manifest_uri = f"s3://{bucket}/{manifest_key}"
    try:
        raw = s3.get_object(Bucket=bucket, Key=manifest_key)["Body"].read()
    except ClientError as exc:
        code = _error_code(exc)
        if _is_missing(s3, exc, bucket=bucket, key=manifest_key):
            raise ModelCheckFailed(
                f"no model manifest at {manifest_uri} (S3: {code}): upload the model first with "
                f"`{upload_command(bucket, model_prefix)}` (docs/how-to/deploy-first-environment.md, step 7)") from exc
        raise ModelCheckFailed(f"cannot read {manifest_uri}: S3 {code}: {exc}") from exc
    except BotoCoreError as exc:
        raise ModelCheckFailed(f"cannot read {manifest_uri}: {exc}") from exc

    reupload = lambda file="<model.gguf>": upload_command(bucket, model_prefix, model_file=file, force=True)  # noqa: E731
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelCheckFailed(f"{manifest_uri} is not JSON ({exc}): re-upload with `{reupload()}`") from exc
    problem = schema_problem(manifest)
    if problem:
        raise ModelCheckFailed(f"{manifest_uri} is not a valid model manifest ({problem}): re-upload with "
                               f"`{reupload()}`")

    gguf = manifest["file"]
    stored = manifest.get("stored")
    if model_prefix.endswith(".tar.gz"):
        # SageMaker serves the one tarball; the manifest beside it records what was uploaded.
        object_key = model_prefix
        expected_file = posixpath.basename(model_prefix)
        if stored is not None and stored["file"] != expected_file:
            raise ModelCheckFailed(f"{manifest_uri} describes {stored['file']}, but the endpoint serves "
                                   f"{expected_file}: re-upload with `{reupload(gguf)}`")
        expected_size = stored["size_bytes"] if stored is not None else None
    else:
        if "/" in gguf or not gguf.endswith(".gguf"):
            raise ModelCheckFailed(f"{manifest_uri} names '{gguf}', not a .gguf file beside it, which the endpoint "
                                   f"could not load: re-upload with `{reupload()}`")
        object_key = model_prefix + gguf
        expected_size = manifest["size_bytes"]
        if stored is not None and stored["file"] != gguf:
            stored = None  # a record of some other object: nothing to compare the GGUF's checksum with
    object_uri = f"s3://{bucket}/{object_key}"

    try:
        head = s3.head_object(Bucket=bucket, Key=object_key, ChecksumMode="ENABLED")
    except ClientError as exc:
        code = _error_code(exc)
        if _is_missing(s3, exc, bucket=bucket, key=object_key):
            raise ModelCheckFailed(f"{manifest_uri} names {posixpath.basename(object_key)}, but {object_uri} is "
                                   f"missing (S3: {code}): re-upload with `{reupload(gguf)}`") from exc
        raise ModelCheckFailed(f"cannot read {object_uri}: S3 {code}: {exc}") from exc
    except BotoCoreError as exc:
        raise ModelCheckFailed(f"cannot read {object_uri}: {exc}") from exc

    size = head.get("ContentLength")
    if expected_size is not None and size != expected_size:
        raise ModelCheckFailed(f"{object_uri} is {size} bytes; {manifest_uri} says {expected_size} (truncated or "
                               f"replaced?): re-upload with `{reupload(gguf)}`")
    reported = head.get("ChecksumSHA256")
    if stored is not None and reported and not _same_checksum(reported, stored["s3_checksum_sha256"]):
        raise ModelCheckFailed(f"{object_uri} has S3 checksum {reported}; {manifest_uri} says "
                               f"{stored['s3_checksum_sha256']} (replaced?): re-upload with `{reupload(gguf)}`")
    verified = {"ModelObject": object_uri, "ModelSha256": manifest["sha256"], "SizeBytes": str(size),
                "ChecksumChecked": "true" if stored is not None and reported else "false"}
    if transform_tarball and not model_prefix.endswith(".tar.gz"):
        verified["TransformObject"] = _check_transform_tarball(s3, bucket=bucket, model_prefix=model_prefix,
                                                               manifest=manifest, manifest_uri=manifest_uri,
                                                               reupload=reupload(gguf))
    return verified


def transform_tarball_key(model_prefix: str) -> str:
    """Batch Transform's ``model.tar.gz`` of an uncompressed model: ``<version>.tar.gz`` beside ``<version>/``
    (constructs_lib/model_check.py names the same key); a ``.tar.gz`` model prefix is its own."""
    if model_prefix.endswith(".tar.gz"):
        return model_prefix
    return model_prefix.rstrip("/") + ".tar.gz"


def _same_checksum(reported: str, recorded: str) -> bool:
    want_b64, _, want_parts = recorded.partition("-")
    got_b64, _, got_parts = reported.partition("-")
    # Real S3 reports a multipart upload's composite checksum as "<b64>-<parts>"; some emulators omit "-<parts>".
    return got_b64 == want_b64 and (not got_parts or got_parts == want_parts)


def _check_transform_tarball(s3, *, bucket: str, model_prefix: str, manifest: dict, manifest_uri: str,
                             reupload: str) -> str:
    """SageMaker Batch Transform reads only a ``model.tar.gz`` (ModelDataUrl): the manifest must record the one
    `semif-package-model upload` wrote beside the prefix, and S3 must hold it as recorded."""
    from botocore.exceptions import BotoCoreError, ClientError

    key = transform_tarball_key(model_prefix)
    uri = f"s3://{bucket}/{key}"
    record = manifest.get("transform_tarball")
    if record is None:
        raise ModelCheckFailed(f"{manifest_uri} records no Batch Transform tarball ({uri}; the batch Model reads "
                               f"it): re-upload with `{reupload}`, which writes it")
    if record["file"] != posixpath.basename(key):
        raise ModelCheckFailed(f"{manifest_uri} records the Batch Transform tarball {record['file']}, but the batch "
                               f"Model reads {uri}: re-upload with `{reupload}`")
    try:
        head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError as exc:
        code = _error_code(exc)
        if _is_missing(s3, exc, bucket=bucket, key=key):
            raise ModelCheckFailed(f"{manifest_uri} records the Batch Transform tarball {record['file']}, but {uri} "
                                   f"is missing (S3: {code}): re-upload with `{reupload}`") from exc
        raise ModelCheckFailed(f"cannot read {uri}: S3 {code}: {exc}") from exc
    except BotoCoreError as exc:
        raise ModelCheckFailed(f"cannot read {uri}: {exc}") from exc
    if head.get("ContentLength") != record["size_bytes"]:
        raise ModelCheckFailed(f"{uri} is {head.get('ContentLength')} bytes; {manifest_uri} says "
                               f"{record['size_bytes']} (truncated or replaced?): re-upload with `{reupload}`")
    reported = head.get("ChecksumSHA256")
    if reported and not _same_checksum(reported, record["s3_checksum_sha256"]):
        raise ModelCheckFailed(f"{uri} has S3 checksum {reported}; {manifest_uri} says "
                               f"{record['s3_checksum_sha256']} (replaced?): re-upload with `{reupload}`")
    return uri


# --------------------------------------------------------------------------------------------
# The custom resource


def s3_client():
    import boto3
    from botocore.config import Config

    # Short timeouts and a few retries: the function (60 s) must answer before Lambda stops it.
    return boto3.client("s3", config=Config(connect_timeout=5, read_timeout=15,
                                            retries={"max_attempts": 3, "mode": "standard"}))


def physical_id(props: dict) -> str:
    """Names the verified model: a new prefix is a new physical id (CloudFormation then deletes the old one, a
    no-op)."""
    return f"s3://{props['Bucket']}/{props['ModelPrefix']}"


def handle(event: dict, s3=None) -> dict:
    """The CloudFormation response body for ``event`` (without the echo fields ``respond`` adds)."""
    request = event["RequestType"]
    props = event.get("ResourceProperties", {})
    if request == "Delete":
        return {"Status": "SUCCESS", "PhysicalResourceId": event["PhysicalResourceId"]}
    target = physical_id(props)
    if request == "Update" and event.get("PhysicalResourceId") == target:
        # The resource already verified this very model: an update that only re-points the function, or the
        # rollback of a failed update. Re-checking could fail the rollback (UPDATE_ROLLBACK_FAILED) for nothing.
        return {"Status": "SUCCESS", "PhysicalResourceId": target, "Reason": "model already verified"}
    if s3 is None:
        s3 = s3_client()
    try:
        verified = check_model(s3, bucket=props["Bucket"], model_prefix=props["ModelPrefix"],
                               manifest_key=props["ManifestKey"],
                               transform_tarball=props.get("TransformTarball") == "true")
    except ModelCheckFailed as exc:
        # A failed Create still needs an id (CloudFormation deletes it on rollback); a failed Update keeps the old.
        return {"Status": "FAILED", "Reason": str(exc),
                "PhysicalResourceId": event.get("PhysicalResourceId") or target}
    return {"Status": "SUCCESS", "PhysicalResourceId": target, "Data": verified,
            "Reason": f"model OK: {verified['ModelObject']}"}


def respond(event: dict, result: dict, timeout_s: float = 20) -> None:
    """PUT the response to CloudFormation's pre-signed URL (which carries no content type)."""
    body = {
        "Status": result["Status"],
        "Reason": " ".join(result.get("Reason", "").split())[:MAX_REASON],
        "PhysicalResourceId": result["PhysicalResourceId"],
        "StackId": event["StackId"],
        "RequestId": event["RequestId"],
        "LogicalResourceId": event["LogicalResourceId"],
        "NoEcho": False,
        "Data": result.get("Data", {}),
    }
    payload = json.dumps(body).encode()
    request = urllib.request.Request(event["ResponseURL"], data=payload, method="PUT",
                                     headers={"Content-Type": "", "Content-Length": str(len(payload))})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 (CloudFormation's https URL)
        answer.read()


def on_event(event: dict, context: Any = None) -> None:
    props = event.get("ResourceProperties", {})
    try:
        result = handle(event)
    except Exception as exc:  # answer CloudFormation whatever happens: a lost reply stalls the deploy for an hour
        LOG.exception("model check crashed")
        result = {"Status": "FAILED", "Reason": f"model check crashed: {type(exc).__name__}: {exc}",
                  "PhysicalResourceId": event.get("PhysicalResourceId") or "model-check-failed"}
    # The pre-signed ResponseURL is a credential: never logged.
    LOG.info(json.dumps({"request": event.get("RequestType"), "bucket": props.get("Bucket"),
                         "model_prefix": props.get("ModelPrefix"), "status": result["Status"],
                         "reason": result.get("Reason", "")}))
    respond(event, result)


def main(argv: Optional[list[str]] = None, s3=None) -> int:
    """The check outside CloudFormation (the pipeline's CheckModel step): exit 0 when the model is deployable,
    1 with the one-line reason on stderr when it is not."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Check that the model an endpoint serves is complete in S3.")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--model-prefix", required=True, help="models/<name>/<version>/ or …/model.tar.gz")
    parser.add_argument("--manifest-key", required=True)
    parser.add_argument("--transform-tarball", action="store_true",
                        help="also check the Batch Transform tarball of an uncompressed model (<version>.tar.gz)")
    args = parser.parse_args(argv)
    try:
        verified = check_model(s3 or s3_client(), bucket=args.bucket, model_prefix=args.model_prefix,
                               manifest_key=args.manifest_key, transform_tarball=args.transform_tarball)
    except ModelCheckFailed as exc:
        print(f"model check failed: {exc}", file=sys.stderr)
        return 1
    print(f"model OK: {verified['ModelObject']} (sha256 {verified['ModelSha256']}, {verified['SizeBytes']} bytes, "
          f"S3 checksum compared: {verified['ChecksumChecked']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
