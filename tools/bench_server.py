"""The real `serve` process for benchmark scripts: started on a free loopback port, ready when /ping is 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

SERVE = Path(sys.executable).with_name("serve")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BenchServer:
    def __init__(self, model: Optional[Path], *, ready_timeout_s: float = 180, log_path: Optional[Path] = None,
                 **env_overrides):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
        env.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(self.port), SEMIF_LOG_LEVEL="WARNING", SEMIF_MODEL_DIR="/nonexistent")
        if model is not None:
            env["SEMIF_MODEL_PATH"] = str(model)
        env.update({k: str(v) for k, v in env_overrides.items()})
        # log_path: the server's JSON log lines (stdout) go there, e.g. to read each request's batch_requests
        self._log = open(log_path, "wb") if log_path is not None else None
        self.proc = subprocess.Popen([str(SERVE), "serve"], env=env, stdout=self._log or subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited: {self.proc.stderr.read().decode()}")
            try:
                if self.http.get("/ping").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("serve did not become ready")

    def post(self, path: str, body: dict) -> tuple[float, dict]:
        """(seconds, JSON answer); anything but 200 stops the benchmark with the adapter's error."""
        started = time.perf_counter()
        response = self.http.post(path, json=body)
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise SystemExit(f"{path} answered {response.status_code}: {response.text[:500]}")
        return elapsed, response.json()

    def invoke_ms(self, body: dict) -> tuple[float, dict]:
        elapsed, answer = self.post("/invocations", body)
        return elapsed * 1000, answer

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
