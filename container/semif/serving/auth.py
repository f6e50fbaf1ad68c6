"""Optional bearer-key check (`SEMIF_API_KEY`) on every route except `/ping`.

Off when no key is set: then an `Authorization` header is ignored, as clients always send one. With a key,
`/invocations` is guarded like `/v1/*`: it serves every contract and chat. SageMaker deployments set no key:
IAM (SigV4 on InvokeEndpoint) guards the endpoint before the container, and SageMaker's health check calls
`/ping` without credentials. Refusals happen before the body is read, so they never take a place in the
model's queue.
"""

from __future__ import annotations

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


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class BearerAuth:
    """Pure ASGI middleware: every request outside ``open_paths`` needs ``Authorization: Bearer <api_key>``."""

    def __init__(self, app, *, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app = app
        self._key = api_key.encode("utf-8")
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        token = bearer_token(header)
        if token is not None and hmac.compare_digest(token.encode("utf-8"), self._key):
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
