"""One JSON object per line on stdout. Raw decision state never goes here; its sha256 does."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import sys
import time
from typing import Optional

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("semif")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def state_digest_fields(state_text: str, hash_key: Optional[str] = None) -> dict:
    """How a request's state appears in its log line: ``state_sha256``, or with SEMIF_LOG_HASH_KEY set,
    ``state_hmac_sha256`` (HMAC-SHA256 under that key) and no plain hash, so a short or guessable state
    cannot be confirmed by hashing candidates."""
    data = state_text.encode("utf-8")
    if hash_key:
        return {"state_hmac_sha256": hmac.new(hash_key.encode("utf-8"), data, hashlib.sha256).hexdigest()}
    return {"state_sha256": hashlib.sha256(data).hexdigest()}
