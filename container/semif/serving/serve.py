"""`serve` (SageMaker runs `docker run IMAGE serve`) and `python -m semif`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .. import __version__
from .postprocess.calibration import CalibrationError
from .config import Settings, SettingsError, read_build_info
from .engine.manifest import ManifestError, sha256_file, verify_model_file

log = logging.getLogger("semif.serve")


class GpuUnavailable(RuntimeError):
    """SEMIF_REQUIRE_GPU is set but llama.cpp came up without a GPU backend (or offloaded nothing)."""


def build_app(settings: Settings):
    """Verify the model against its manifest, load it, and return the ASGI app. Raises on bad setup."""
    from .http.app import create_app
    from .engine.context import Engine

    started = time.perf_counter()
    digest = sha256_file(settings.model_path)
    manifest = verify_model_file(settings.model_path, sha256=digest)
    calibration = None
    if settings.calibration_path is not None:  # checked before the model loads: a wrong file fails fast
        from .postprocess.calibration import Calibration

        calibration = Calibration.load(settings.calibration_path, model_sha256=digest)
    engine = Engine(
        settings.model_path,
        n_ctx=settings.n_ctx,
        n_batch=settings.n_batch,
        n_threads=settings.n_threads,
        n_gpu_layers=settings.n_gpu_layers,
        prefix_cache=settings.prefix_cache,
        label_memo=settings.label_memo,
        prefix_cache_mb=settings.prefix_cache_mb,
        flash_attn=settings.flash_attn,
        default_scoring=settings.scoring,
        model_sha256=digest,
        n_seq=settings.n_seq if settings.batching else 1,
        content_free_entries=settings.content_free_entries,
    )
    engine.default_debias = settings.debias  # the server default; requests may override it (`debias`)
    # The DLC the image was built FROM, by digest: part of every answer's record, beside the image's own digest.
    engine.info["base_image_digest"] = read_build_info(settings.build_info).get("base_image_digest")
    if calibration is not None:
        try:  # the template is known once the model is loaded (its chat template is part of it)
            calibration.check_served(engine.info)
        except CalibrationError:
            engine.close()
            raise
    if settings.require_gpu and not (engine.info["gpu_offload"] and engine.n_gpu_layers != 0):
        # Without this, a CUDA initialisation failure would load the model on the CPU and /ping would
        # still answer 200: a "GPU" endpoint quietly serving from a few vCPUs.
        engine.close()
        raise GpuUnavailable(
            "SEMIF_REQUIRE_GPU is set but no GPU backend came up (llama_supports_gpu_offload() is false "
            f"or no layers were offloaded); hardware seen: {engine.info['hardware']}"
        )
    log.info(
        "model loaded",
        extra={
            "model": engine.info,
            "manifest": manifest is not None,
            "labels": len(engine.labels.letters.texts),
            "partial_rewind": engine.partial_rewind,
            "prefix_snapshot_limit_bytes": engine.prefix_snapshot_stats["limit_bytes"],
            "n_ctx": engine.n_ctx,
            "n_seq": engine.n_seq,
            "startup_s": round(time.perf_counter() - started, 3),
            "image_digest": settings.image_digest,
            "semif_version": __version__,
        },
    )
    app = create_app(settings, engine)
    if calibration is not None:
        app.state.service.decision_postprocessor.configure(calibration)
        from .engine.plan import served_debias
        from .postprocess.calibration import FitKind

        defaults = FitKind(engine.default_scoring, settings.layout,
                           served_debias(settings.debias, scoring=engine.default_scoring, layout=settings.layout,
                                         native=engine.native is not None))
        log.info("calibration loaded", extra={"calibration_version": calibration.version, "path": str(settings.calibration_path),
                                              "fits": [str(kind) for kind in calibration.fits], "policy": calibration.policy})
        if calibration.fit_for(defaults) is None:
            log.warning("calibration has no fit for the server's defaults: those answers are served uncalibrated",
                        extra={"defaults": str(defaults), "fits": [str(kind) for kind in calibration.fits]})
    return app


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
    from .config import EMBEDDED_MODEL_FILE

    body = json.dumps(EXAMPLE_DECISION)
    text = (
        f"\nSemIf adapter ready on http://{host}:{settings.port} (model {settings.model_path.name}). Try:\n\n"
        f"curl -s http://{host}:{settings.port}/invocations -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'\n"
    )
    if settings.model_path.name == EMBEDDED_MODEL_FILE:
        text += ("\nThe embedded SmolLM2-135M is near chance on real decisions: it may well route this ticket to "
                 "billing.\nServe a GGUF of your own with: SEMIF_MODEL_PATH=/path/to/model.gguf make run\n")
    return text


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
    read_timeout_s = settings.read_timeout_s
    configure(settings.log_level)
    try:
        app = build_app(settings)
    except GpuUnavailable as exc:
        log.error("GPU required but unavailable", extra={"error": str(exc)})
        print(f"serve: {exc}", file=sys.stderr)
        return 6
    except CalibrationError as exc:
        log.error("calibration file refused", extra={"error": str(exc)})
        print(f"serve: invalid SEMIF_CALIBRATION_PATH: {exc}", file=sys.stderr)
        return 5
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

    app.state.service.body_timeout_s = read_timeout_s
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=30,
        # No limit_concurrency: uvicorn counts every open connection (idle keep-alives too) and past the
        # limit answers every request, /ping included, with a plain-text 503. Admission control is the
        # only limit on model work; /ping must answer whatever the number of connections.
        h11_max_incomplete_event_size=16 * 1024,
        http=_header_timeout_protocol(read_timeout_s),
    )
    server = _draining_server_class()(config, app.state.service.admission)
    server.run()
    if not server.started:
        return 1  # could not bind the port (uvicorn logged why)
    log.info("stopped", extra={"drained": server.drained, "drain_s": server.drain_s})
    return 0


DRAIN_TIMEOUT_S = 30.0


def _draining_server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT, first drain: /ping and new requests get 503 while admitted requests
        (queued, computing, streaming) finish; then uvicorn's own shutdown closes the sockets.
        A second signal stops at once. The process exits 0 after a drain."""

        def __init__(self, config, admission):
            super().__init__(config)
            self.admission = admission
            self.drain_started: float | None = None
            self.drained = False
            self.drain_s: float | None = None

        def handle_exit(self, sig, frame) -> None:
            # Not uvicorn's handler: it records the signal and re-raises it after shutdown, so a clean
            # drain would still end as "killed by SIGTERM" (exit 143) instead of 0.
            if self.drain_started is None:
                self.drain_started = time.monotonic()
                self.admission.draining = True
            else:
                self.should_exit = True
                self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.drain_started is not None and not self.should_exit:
                elapsed = time.monotonic() - self.drain_started
                if not self.admission.busy or elapsed > DRAIN_TIMEOUT_S:
                    self.drained = not self.admission.busy
                    self.drain_s = round(elapsed, 3)
                    log.info("drain finished", extra={"drained": self.drained, "drain_s": self.drain_s, "rejected": self.admission.rejected})
                    self.should_exit = True
            return await super().on_tick(counter)

    return _DrainingServer


def _header_timeout_protocol(timeout_s: float):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: uvicorn times out idle
    keep-alive connections but waits forever for headers that never finish (slow-loris)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._responses_sent = 0
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._responses_sent += 1
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self.loop.call_later(timeout_s, self._headers_overdue, self._responses_sent)

        def _headers_overdue(self, responses_then: int) -> None:
            # Still no complete request since the timer was armed: drop the connection.
            if (
                self._responses_sent == responses_then
                and self.conn.their_state is h11.IDLE
                and not self.transport.is_closing()
            ):
                self.transport.close()

    return HeaderTimeoutH11Protocol


if __name__ == "__main__":
    sys.exit(main())
