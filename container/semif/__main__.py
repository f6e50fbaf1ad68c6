"""`serve` (SageMaker runs `docker run IMAGE serve`) and `python -m semif`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from . import __version__
from .config import Settings, SettingsError
from .manifest import ManifestError, sha256_file, verify_model_file

log = logging.getLogger("semif.serve")


def build_app(settings: Settings):
    """Verify the model against its manifest, load it, and return the ASGI app. Raises on bad setup."""
    from .app import create_app
    from .engine import Engine

    started = time.perf_counter()
    digest = sha256_file(settings.model_path)
    manifest = verify_model_file(settings.model_path, sha256=digest)
    engine = Engine(
        settings.model_path,
        n_ctx=settings.n_ctx,
        n_batch=settings.n_batch,
        n_threads=settings.n_threads,
        n_gpu_layers=settings.n_gpu_layers,
        prefix_cache=settings.prefix_cache,
        default_scoring=settings.scoring,
        model_sha256=digest,
    )
    log.info(
        "model loaded",
        extra={
            "model": engine.info,
            "manifest": manifest is not None,
            "labels": len(engine.labels.letters.texts),
            "partial_rewind": engine.partial_rewind,
            "startup_s": round(time.perf_counter() - started, 3),
            "image_digest": settings.image_digest,
            "semif_version": __version__,
        },
    )
    return create_app(settings, engine)


EXAMPLE_DECISION = {
    "decision": {
        "id": "support-route",
        "state": "The customer cannot receive a password reset email.",
        "question": "Which queue should handle this request?",
        "options": [
            {"id": "account_access", "description": "Account access support."},
            {"id": "billing", "description": "Billing support."},
        ],
    }
}


def example_curl(settings: Settings) -> str:
    import json

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    body = json.dumps(EXAMPLE_DECISION)
    return (
        f"\nSemIf adapter ready on http://{host}:{settings.port} (model {settings.model_path.name}). Try:\n\n"
        f"curl -s http://{host}:{settings.port}/invocations -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="serve", description="Serve the SemIf decision adapter (settings from SEMIF_* environment variables)."
    )
    parser.add_argument("command", nargs="?", default="serve", choices=["serve"], help="SageMaker passes 'serve'")
    parser.add_argument("--host", help="overrides SEMIF_HOST")
    parser.add_argument("--port", type=int, help="overrides SEMIF_PORT")
    parser.add_argument("--model", help="overrides SEMIF_MODEL_PATH")
    parser.add_argument("--example", action="store_true", help="print a ready-to-paste curl decision once loaded")
    args = parser.parse_args(argv)

    from .logs import configure

    import os

    env = dict(os.environ)
    if args.host:
        env["SEMIF_HOST"] = args.host
    if args.port is not None:
        env["SEMIF_PORT"] = str(args.port)
    if args.model:
        env["SEMIF_MODEL_PATH"] = args.model
    try:
        settings = Settings.from_env(env)
    except SettingsError as exc:
        print(f"serve: invalid setting: {exc}", file=sys.stderr)
        return 2
    configure(settings.log_level)
    try:
        app = build_app(settings)
    except ManifestError as exc:
        log.error("model does not match its manifest", extra={"error": str(exc), "model_path": str(settings.model_path)})
        print(f"serve: {exc}", file=sys.stderr)
        return 3
    except (ValueError, OSError) as exc:  # llama.cpp refuses truncated or corrupt GGUF files with ValueError
        log.error("cannot load model", extra={"error": str(exc), "model_path": str(settings.model_path)})
        print(f"serve: cannot load model {settings.model_path}: {exc}", file=sys.stderr)
        return 4

    if args.example:
        print(example_curl(settings), file=sys.stderr, flush=True)

    import uvicorn

    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=30,
        limit_concurrency=max(64, settings.max_queue * 4),
        h11_max_incomplete_event_size=16 * 1024,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
