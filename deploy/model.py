"""The environment's model in its bucket: found by its manifest, or uploaded from the config's ``model_source``.

The upload is ``semif-package-model upload`` itself (checksums, manifest, verification); the decision stack's model
check then refuses any endpoint whose model does not match its manifest, as on every deploy path.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Optional

from botocore.exceptions import ClientError

from constructs_lib.model_check import manifest_key

from . import DeployError

REPO = Path(__file__).resolve().parents[1]


def model_name_version(model_prefix: str) -> tuple[str, str]:
    """``models/<name>/<version>/`` -> (name, version), the layout semif-package-model writes."""
    parts = model_prefix.strip("/").split("/")
    if len(parts) != 3 or parts[0] != "models":
        raise DeployError(f"model_prefix '{model_prefix}' is not 'models/<name>/<version>/', which make deploy uploads to")
    return parts[1], parts[2]


def model_in_bucket(s3, *, bucket: str, model_prefix: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=manifest_key(model_prefix))
        return True
    except ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
            return False
        raise DeployError(f"could not read s3://{bucket}/{manifest_key(model_prefix)}: {exc}") from None


def upload_arguments(gguf: Optional[Path], provenance: Optional[str], *, bucket: str, model_prefix: str,
                     region: str) -> list[str]:
    """``semif-package-model upload`` into ``model_prefix``; no GGUF: the embedded model, with its own provenance."""
    name, version = model_name_version(model_prefix)
    return ["upload", *([str(gguf)] if gguf else []), "--bucket", bucket, "--name", name, "--version", version,
            "--region", region, *(["--source", provenance] if provenance else [])]


def ensure_model(s3, *, bucket: str, model_prefix: str, model_source: Optional[str], region: str,
                 say: Callable[[str], None] = print, upload: Optional[Callable[[list[str]], int]] = None) -> bool:
    """True when the model was uploaded now, False when it was already there. ``upload`` runs
    ``semif-package-model`` with its arguments (its ``main``)."""
    if model_in_bucket(s3, bucket=bucket, model_prefix=model_prefix):
        say(f"s3://{bucket}/{model_prefix} holds a model manifest: no upload")
        return False
    if model_source is None:
        name, version = model_name_version(model_prefix)
        raise DeployError(f"s3://{bucket}/{model_prefix} holds no model and config names no model_source: set "
                          f"model_source, or run semif-package-model upload MODEL.gguf --bucket {bucket} "
                          f"--name {name} --version {version} --region {region}")
    if upload is None:
        from semif.tools.package_model import main as upload
    with tempfile.TemporaryDirectory() as scratch:
        if model_source == "embedded":
            gguf, provenance = None, None
        elif model_source.startswith("s3://"):
            source_bucket, _, key = model_source[len("s3://"):].partition("/")
            gguf = Path(scratch) / Path(key).name
            say(f"downloading {model_source}")
            try:
                s3.download_file(source_bucket, key, str(gguf))
            except ClientError as exc:
                raise DeployError(f"could not download model_source {model_source}: {exc}") from None
            provenance = model_source
        else:
            gguf = (REPO / model_source).resolve()
            if not gguf.is_file():
                raise DeployError(f"model_source {model_source}: no such file ({gguf})")
            provenance = f"file:{gguf.name}"
        arguments = upload_arguments(gguf, provenance, bucket=bucket, model_prefix=model_prefix, region=region)
        say(f"uploading the model to s3://{bucket}/{model_prefix}")
        code = upload(arguments)
    if code != 0:
        raise DeployError(f"semif-package-model {' '.join(arguments)} exited {code}")
    return True
