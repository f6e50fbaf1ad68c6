"""Optional bearer-key check (`SEMIF_API_KEY`) on every route except `/ping`.

Off when no key is set: then an `Authorization` header is ignored, as clients always send one. With a key,
`/invocations` is guarded like `/v1/*`: it serves every contract and chat. SageMaker deployments set no key:
IAM (SigV4 on InvokeEndpoint) guards the endpoint before the container, and SageMaker's health check calls
`/ping` without credentials. Refusals happen before the body is read, so they never take a place in the
model's queue.

The key may hold any Unicode text. HTTP carries header values as bytes: the header's token matches when
its bytes are the key in UTF-8 (curl, httpx, browsers) or, for a key of Latin-1 characters only, in
Latin-1 (Python's `http.client` and `requests` encode header text that way). Both comparisons always run,
on sha256 digests, so neither the outcome nor the key's length shows in the time a refusal takes.
"""

from __future__ import annotations

import hashlib
import hmac
import json

OPEN_PATHS = ("/ping",)  # health checks carry no credentials


def auth_error_body(message: str) -> dict:
    """One body that every client family can read: OpenAI (`error.type`), System One
    (`detail.error_type`) and SemIf (`error.code`)."""
    return {
        "error": {"message": message, "type": "authentication_error", "param": None, "code": "invalid_api_key",
                  "field": "authorization"},
        "detail": {"error_type": "authentication_error", "message": message},
    }


def bearer_token(header: bytes) -> bytes | None:
    """The token of ``Authorization: Bearer <token>``, as the bytes sent. Parsed as bytes: decoding first
    (and str.strip, which strips U+00A0) would alter a non-ASCII token before it is compared."""
    scheme, _, token = header.strip(b" \t").partition(b" ")
    token = token.strip(b" \t")
    return token if scheme.lower() == b"bearer" and token else None


def _key_encodings(api_key: str) -> tuple[bytes, bytes]:
    """sha256 of the key's UTF-8 bytes and of its Latin-1 bytes (the UTF-8 digest again when the key has
    characters beyond U+00FF): two comparisons for every key, whatever it holds."""
    utf8 = api_key.encode("utf-8")
    try:
        latin1 = api_key.encode("latin-1")
    except UnicodeEncodeError:
        latin1 = utf8
    return hashlib.sha256(utf8).digest(), hashlib.sha256(latin1).digest()


def token_matches(token: bytes, key_digests: tuple[bytes, bytes]) -> bool:
    """Constant-time check of a token against the key: equal-length digests, every comparison made."""
    digest = hashlib.sha256(token).digest()
    matches = [hmac.compare_digest(digest, expected) for expected in key_digests]
    return any(matches)


class BearerAuth:
    """Pure ASGI middleware: every request outside ``open_paths`` needs ``Authorization: Bearer <api_key>``."""

    def __init__(self, app, *, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app = app
        self._key_digests = _key_encodings(api_key)
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value
                break
        token = bearer_token(header)
        if token is not None and token_matches(token, self._key_digests):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send Authorization: Bearer <key>" if token is None else "invalid API key"
        body = json.dumps(auth_error_body(message)).encode("utf-8")
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="semif"'),
            ],
        })
        await send({"type": "http.response.body", "body": body})
