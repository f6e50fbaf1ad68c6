"""Where the operator tools read and write their files: a local path, or an S3 URI (`s3://bucket/key`).

Every object written to S3 carries SSE-KMS (`ServerSideEncryption: aws:kms`, and the key when one is
given), so a bucket whose policy refuses unencrypted or SSE-S3 puts accepts it:

    store = Storage(kms_key_id="arn:aws:kms:us-east-1:111122223333:key/…")   # or None: the bucket's KMS default
    bucket = "s3://semif-staging-models-111111111111-us-east-1"   # a model bucket: semif-<env>-models-<account>-<region>
    rows = store.read_text(f"{bucket}/eval/decisions.jsonl")
    store.write_bytes(store.join(f"{bucket}/reports/staging/", "report.json"), body, "application/json")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONTENT_TYPES = {".json": "application/json", ".jsonl": "application/jsonlines", ".png": "image/png"}


class StorageError(Exception):
    """A location that cannot be read or written; the message names it and says why."""


class MissingObject(StorageError, FileNotFoundError):
    """Nothing at the location (no local file, or no S3 object)."""


def is_s3(location: str) -> bool:
    return str(location).startswith("s3://")


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> "S3Uri":
        if not is_s3(uri):
            raise StorageError(f"{uri!r} is not an s3:// URI")
        bucket, _, key = uri[5:].partition("/")
        if not bucket:
            raise StorageError(f"{uri!r} names no bucket")
        return cls(bucket, key)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def content_type_for(location: str) -> str:
    return CONTENT_TYPES.get(Path(str(location)).suffix.lower(), "application/octet-stream")


class Storage:
    """Local files and S3 objects behind one interface. The S3 client is made on first use, so local
    runs need neither boto3 credentials nor a region."""

    def __init__(self, *, kms_key_id: Optional[str] = None, s3_client=None, region_name: Optional[str] = None):
        self.kms_key_id = kms_key_id
        self._s3 = s3_client
        self._region_name = region_name

    @property
    def s3(self):
        if self._s3 is None:
            import boto3

            self._s3 = boto3.client("s3", region_name=self._region_name)
        return self._s3

    @staticmethod
    def join(base: str, name: str) -> str:
        """`name` inside the folder or prefix `base`."""
        base = str(base)
        if is_s3(base):
            return base if base.endswith("/") and not name else base.rstrip("/") + "/" + name
        return str(Path(base) / name)

    def read_bytes(self, location: str) -> bytes:
        location = str(location)
        if not is_s3(location):
            try:
                return Path(location).read_bytes()
            except FileNotFoundError:
                raise MissingObject(f"{location}: no such file") from None
            except OSError as exc:
                raise StorageError(f"{location}: {exc.strerror or exc}") from None
        from botocore.exceptions import BotoCoreError, ClientError

        uri = S3Uri.parse(location)
        if not uri.key or uri.key.endswith("/"):
            raise StorageError(f"{location} names a prefix, not an object")
        try:
            return self.s3.get_object(Bucket=uri.bucket, Key=uri.key)["Body"].read()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise MissingObject(f"{location}: no such object") from None
            raise StorageError(f"{location}: {code or 'error'}: {exc.response.get('Error', {}).get('Message', exc)}") from None
        except BotoCoreError as exc:
            raise StorageError(f"{location}: {exc}") from None

    def read_text(self, location: str) -> str:
        data = self.read_bytes(location)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StorageError(f"{location}: not UTF-8 text (byte {exc.start})") from None

    def write_bytes(self, location: str, data: bytes, content_type: Optional[str] = None) -> str:
        """Write ``data``; returns the location written. Local parents are created."""
        location = str(location)
        if not is_s3(location):
            path = Path(location)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            except OSError as exc:
                raise StorageError(f"{location}: {exc.strerror or exc}") from None
            return str(path)
        from botocore.exceptions import BotoCoreError, ClientError

        uri = S3Uri.parse(location)
        if not uri.key or uri.key.endswith("/"):
            raise StorageError(f"{location} names a prefix, not an object")
        extra = {"ServerSideEncryption": "aws:kms"}
        if self.kms_key_id:
            extra["SSEKMSKeyId"] = self.kms_key_id
        try:
            self.s3.put_object(Bucket=uri.bucket, Key=uri.key, Body=data,
                               ContentType=content_type or content_type_for(location), **extra)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise StorageError(f"{location}: {error.get('Code', 'error')}: {error.get('Message', exc)}") from None
        except BotoCoreError as exc:
            raise StorageError(f"{location}: {exc}") from None
        return uri.uri

    def write_text(self, location: str, text: str, content_type: Optional[str] = None) -> str:
        return self.write_bytes(location, text.encode("utf-8"), content_type)
