"""The model manifest: one schema shared by the packaging tool and the adapter's startup check.

`model-manifest.json` lies beside the GGUF (in S3 under ``models/<name>/<version>/`` and, after
SageMaker's download, under ``/opt/ml/model``). The adapter verifies it before loading the model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MANIFEST_NAME = "model-manifest.json"
MANIFEST_SCHEMA_VERSION = 1
_CHUNK = 1 << 20


class ManifestError(Exception):
    """The manifest is unreadable, or the model file does not match it."""


class StoredObject(BaseModel):
    """The object that holds the model in S3, as the packaging tool uploaded it.

    For the uncompressed layout it is the GGUF itself; with ``--tar-gz`` it is ``model.tar.gz``.
    ``s3_checksum_sha256`` is what S3's ``HeadObject`` (``ChecksumMode=ENABLED``) must report:
    base64 of the SHA-256 for a single PUT, or S3's composite checksum (SHA-256 of the parts'
    SHA-256 digests, suffixed ``-<parts>``) for a multipart upload of ``part_size_bytes`` parts.
    It is computed from the local bytes in the same pass as ``sha256``, and S3 checks every part
    against it on upload, so a match ties the stored object to the hashed file.
    """

    model_config = ConfigDict(extra="allow")

    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    s3_checksum_sha256: str = Field(min_length=44)
    part_size_bytes: int = Field(ge=0, description="0 = uploaded in one PUT")

    @property
    def part_count(self) -> int:
        """Parts of a multipart upload; 0 for a single PUT."""
        _, _, parts = self.s3_checksum_sha256.partition("-")
        return int(parts) if parts else 0


class ModelManifest(BaseModel):
    model_config = ConfigDict(extra="allow")

    schema_version: int = MANIFEST_SCHEMA_VERSION
    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    architecture: Optional[str] = None
    quantization: Optional[str] = None
    context_length: Optional[int] = None
    has_chat_template: Optional[bool] = None
    source: Optional[str] = None
    created_at: Optional[str] = None
    packer_version: Optional[str] = None
    # Present in the manifest stored in S3 (written by the packaging tool after a verified upload).
    stored: Optional[StoredObject] = None
    # The uncompressed layout only: the same GGUF and manifest as ``model.tar.gz``, for SageMaker Batch Transform
    # (which takes ModelDataUrl, never an uncompressed prefix). It lies beside the version's prefix, not in it
    # (the endpoint downloads everything in the prefix): ``file`` is ``<version>.tar.gz`` next to ``<version>/``.
    transform_tarball: Optional[StoredObject] = None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(exclude_none=True), indent=2, sort_keys=True) + "\n"


def sha256_file(path: str | Path, progress=None) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks. ``progress(n_bytes)`` is called per chunk."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def load_manifest(path: str | Path) -> ModelManifest:
    try:
        raw = Path(path).read_text(encoding="utf-8")
        return ModelManifest.model_validate_json(raw)
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ManifestError(f"invalid manifest {path}: field '{field}': {first['msg']}") from exc


def verify_model_file(gguf_path: str | Path, *, sha256: Optional[str] = None) -> Optional[ModelManifest]:
    """Check the GGUF against the manifest beside it, if there is one.

    Returns the manifest (or None when there is none). Raises ManifestError on any mismatch.
    ``sha256`` lets a caller that already hashed the file skip a second read.
    """
    gguf_path = Path(gguf_path)
    manifest_path = gguf_path.parent / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    manifest = load_manifest(manifest_path)
    if manifest.file != gguf_path.name:
        raise ManifestError(
            f"manifest {manifest_path} describes '{manifest.file}', but the model file is '{gguf_path.name}'"
        )
    size = gguf_path.stat().st_size
    if size != manifest.size_bytes:
        raise ManifestError(
            f"model file {gguf_path} is {size} bytes; manifest says {manifest.size_bytes} (truncated or replaced?)"
        )
    actual = sha256 or sha256_file(gguf_path)
    if actual != manifest.sha256:
        raise ManifestError(f"model file {gguf_path} has sha256 {actual}; manifest says {manifest.sha256}")
    return manifest
