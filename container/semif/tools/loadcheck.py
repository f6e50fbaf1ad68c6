"""`semif-loadcheck`: a bounded load against a local adapter or a SageMaker endpoint, through the
project's client and its retry policy, held against limits.

    semif-loadcheck --url http://127.0.0.1:8080 --clients 4 --duration-s 60
    semif-loadcheck --endpoint semif-staging-decision --region us-east-1 --data s3://bucket/eval/decisions.jsonl \\
        --clients 8 --duration-s 180 --limits '{"max_p95_ms": 2000, "max_failed_share": 0}' --out s3://bucket/reports/staging/

``clients`` threads each send one decision at a time (the labeled cases in turn, or one built-in case,
each state opened by a unique line so that the adapter's label memo and prefix cache see a new state,
as with real traffic; `--repeat-states` sends them as they are) until ``duration_s`` has passed; no request starts after that, and one in flight ends within its retry
budget, so the run stops by itself. It reports throughput (successes per second), p50/p95/p99 of the
successful requests (retries included), the share of attempts answered 503, retry amplification
(attempts per success) and the share of requests that failed after every retry. Exits 1 when a limit
fails, 2 on bad arguments or input, 3 when the target cannot be opened. See docs/how-to/release-gate.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# A decision for a run without --data: short, so each request costs what an adapter's minimum costs.
BUILT_IN_CASE = {
    "id": "loadcheck-route", "category": "route", "decision_id": "loadcheck",
    "state": "The VPN disconnects every ten minutes when I work from home.",
    "question": "Which team should take this ticket?",
    "options": [{"id": "hardware", "description": "Broken or missing laptops and monitors."},
                {"id": "network", "description": "Wi-Fi, VPN and internet connectivity problems."}],
    "answer": "network",
}
# Retry reasons (semif.tools.sagemaker_transport) that mean "the endpoint answered 503".
RETRY_REASONS_503 = ("http_503", "model_error_503", "service_unavailable")


class LoadCheckError(ValueError):
    """Limits or a plan the load check cannot use; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoadPlan(_Strict):
    """How much load, for how long, with which retry budget per request."""

    clients: int = Field(4, ge=1, le=256)
    duration_s: float = Field(60.0, gt=0, le=3600)
    warmup_requests: int = Field(1, ge=0, le=100, description="sent one by one before the clock starts, not counted")
    max_attempts: int = Field(5, ge=1, le=20)
    max_elapsed_s: float = Field(30.0, gt=0, le=600)
    request_timeout_s: float = Field(70.0, gt=0, le=600)
    repeat_states: bool = Field(False, description="send the states as they are (memo and prefix cache may answer)")

    @property
    def bound_s(self) -> float:
        """The longest the measured run can last: a request that starts just before the end may still retry."""
        return self.duration_s + self.max_elapsed_s + self.request_timeout_s


class LoadLimits(_Strict):
    """None switches a limit off."""

    min_successes: int = Field(1, ge=0)
    min_throughput_rps: Optional[float] = Field(None, ge=0)
    max_p50_ms: Optional[float] = Field(None, gt=0)
    max_p95_ms: Optional[float] = Field(None, gt=0)
    max_p99_ms: Optional[float] = Field(None, gt=0)
    max_503_share: Optional[float] = Field(0.2, ge=0, le=1, description="share of attempts answered 503")
    max_attempts_per_success: Optional[float] = Field(1.5, ge=1)
    max_failed_share: Optional[float] = Field(0.01, ge=0, le=1, description="share of requests failed after every retry")


def _validated(model, raw: Any, source: str):
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or source
        raise LoadCheckError(f"{source}: {where}: {first['msg']}") from None


def parse_limits(raw: Any, source: str = "limits") -> LoadLimits:
    return _validated(LoadLimits, raw, source)


def parse_plan(raw: Any, source: str = "plan") -> LoadPlan:
    return _validated(LoadPlan, raw, source)


class LoadCheck(BaseModel):
    name: str
    measured: Optional[float]
    limit: float
    passed: bool


class LoadVerdict(BaseModel):
    passed: bool
    failed: list[str]
    checks: list[LoadCheck]


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class RequestOutcome:
    started_s: float  # since the measured run began
    latency_ms: float
    attempts: int
    status: Any  # 200, the final HTTP status, or an exception name
    ok: bool


def _percentile(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def _send(client, row: dict, marker: Optional[str] = None) -> tuple[Any, int, bool, Optional[dict]]:
    """(status, attempts, ok, model record) of one decision through the retrying client. A ``marker``
    opens the state, so that neither the label memo nor the state's prefix cache answers it: each
    request pays for a new state, as real traffic does."""
    from .client import SemIfError

    state = f"{marker}\n{row['state']}" if marker else row["state"]
    try:
        result = client.decide(state, row["question"], row["options"], id=str(row.get("decision_id") or row.get("category") or "decision"))
    except SemIfError as exc:
        return exc.status, exc.attempts, False, None
    except Exception as exc:  # connection errors after every retry, timeouts
        return type(exc).__name__, int(getattr(exc, "semif_attempts", 1)), False, None
    return 200, result.attempts, True, result.get("model")


def run_load(make_client: Callable[[Any], Any], rows: Sequence[dict], plan: LoadPlan, *,
             progress: Optional[Callable[[float], None]] = None, stop: Optional[threading.Event] = None) -> dict:
    """Run ``plan`` with one client per thread (``make_client(stats)``, sharing one RetryStats) and
    summarize it. ``progress(elapsed_s)`` is called about five times a second from this thread."""
    from .sagemaker_transport import RetryStats

    stop = stop or threading.Event()
    model_record: dict = {}
    warm = make_client(RetryStats())
    try:
        for k in range(plan.warmup_requests):
            _, _, ok, record = _send(warm, rows[k % len(rows)], None if plan.repeat_states else f"Load check warm-up {k}.")
            if ok and record:
                model_record = record
    finally:
        warm.close()
    stats = RetryStats()
    outcomes: list[RequestOutcome] = []
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + plan.duration_s
    failures: list[BaseException] = []

    def client_loop(index: int) -> None:
        client = make_client(stats)
        nonlocal model_record
        try:
            k = index
            while not stop.is_set() and time.monotonic() < deadline:
                row = rows[k % len(rows)]
                k += plan.clients
                begun = time.monotonic()
                marker = None if plan.repeat_states else f"Load check request {index}-{k}."
                status, attempts, ok, record = _send(client, row, marker)
                outcome = RequestOutcome(started_s=begun - started, latency_ms=(time.monotonic() - begun) * 1000,
                                         attempts=attempts, status=status, ok=ok)
                with lock:
                    outcomes.append(outcome)
                    if ok and record and not model_record:
                        model_record = record
        except BaseException as exc:  # a bug here must not pass silently as "no load"
            failures.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,), name=f"loadcheck-{i}", daemon=True) for i in range(plan.clients)]
    for thread in threads:
        thread.start()
    # Every attempt has a timeout and every retry a budget, so the threads end by plan.bound_s; past it the
    # run is summarized anyway and a thread still waiting is counted, never waited for.
    hard_stop = started + plan.bound_s
    while any(t.is_alive() for t in threads) and time.monotonic() < hard_stop:
        if progress:
            progress(min(time.monotonic() - started, plan.duration_s))
        for thread in threads:
            thread.join(timeout=0.2 / len(threads))
    stop.set()
    elapsed = time.monotonic() - started
    if failures:
        raise failures[0]
    with lock:
        summary = summarize(list(outcomes), stats.as_dict(), elapsed, plan, model_record)
    summary["abandoned_clients"] = sum(t.is_alive() for t in threads)
    return summary


def summarize(outcomes: Sequence[RequestOutcome], stats: dict, elapsed_s: float, plan: LoadPlan, model_record: dict) -> dict:
    successes = [o for o in outcomes if o.ok]
    latencies = [o.latency_ms for o in successes]
    statuses = Counter(str(o.status) for o in outcomes)
    attempts = sum(o.attempts for o in outcomes)
    reasons = stats.get("retry_reasons", {})
    # A 503 that was retried is a retry reason; the one a request gave up on is its final status.
    attempts_503 = sum(reasons.get(r, 0) for r in RETRY_REASONS_503) + statuses.get("503", 0)
    n = len(outcomes)
    return {
        "plan": plan.model_dump(),
        "elapsed_s": round(elapsed_s, 3),
        "requests": n,
        "successes": len(successes),
        "failed": n - len(successes),
        "failed_share": (n - len(successes)) / n if n else None,
        "throughput_rps": len(successes) / elapsed_s if elapsed_s > 0 else None,
        "latency_ms": {"p50": _percentile(latencies, 50), "p95": _percentile(latencies, 95), "p99": _percentile(latencies, 99),
                       "max": max(latencies) if latencies else None, "mean": float(np.mean(latencies)) if latencies else None},
        "attempts": attempts,
        "attempts_503": attempts_503,
        "share_503": attempts_503 / attempts if attempts else None,
        "attempts_per_success": attempts / len(successes) if successes else None,
        "attempts_per_request": attempts / n if n else None,
        "retries": stats.get("retries"),
        "retry_reasons": reasons,
        "gave_up": stats.get("gave_up"),
        "slept_s": stats.get("slept_s"),
        "final_statuses": dict(statuses),
        "model": model_record,
    }


def judge(summary: dict, limits: LoadLimits) -> LoadVerdict:
    checks: list[LoadCheck] = []

    def at_most(name: str, measured: Optional[float], limit: Optional[float]) -> None:
        if limit is not None:
            checks.append(LoadCheck(name=name, measured=measured, limit=limit,
                                    passed=measured is not None and not math.isnan(measured) and measured <= limit + 1e-12))

    def at_least(name: str, measured: Optional[float], limit: Optional[float]) -> None:
        if limit is not None:
            checks.append(LoadCheck(name=name, measured=measured, limit=limit,
                                    passed=measured is not None and not math.isnan(measured) and measured >= limit - 1e-12))

    latency = summary["latency_ms"]
    at_least("min_successes", float(summary["successes"]), limits.min_successes)
    at_least("min_throughput_rps", summary["throughput_rps"], limits.min_throughput_rps)
    at_most("max_p50_ms", latency["p50"], limits.max_p50_ms)
    at_most("max_p95_ms", latency["p95"], limits.max_p95_ms)
    at_most("max_p99_ms", latency["p99"], limits.max_p99_ms)
    at_most("max_503_share", summary["share_503"], limits.max_503_share)
    at_most("max_attempts_per_success", summary["attempts_per_success"], limits.max_attempts_per_success)
    at_most("max_failed_share", summary["failed_share"], limits.max_failed_share)
    failed = [c.name for c in checks if not c.passed]
    return LoadVerdict(passed=not failed, failed=failed, checks=checks)


# ---- CLI ------------------------------------------------------------------------------------------


def print_summary(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    verdict = report["verdict"]
    title = "PASSED" if verdict["passed"] else f"FAILED: {', '.join(verdict['failed'])}"
    plan = report["plan"]
    table = Table(title=f"Load check, {plan['clients']} clients × {plan['duration_s']:g} s against {report['target']['address']}: {title}")
    for column in ("measure", "value", "limit", "result"):
        table.add_column(column, justify="left" if column in ("measure", "result") else "right")
    checks = {c["name"]: c for c in verdict["checks"]}

    def row(label: str, value: Optional[float], limit_name: Optional[str], digits: int = 1, pct: bool = False) -> None:
        shown = "–" if value is None else (f"{value * 100:.{digits}f}%" if pct else f"{value:.{digits}f}")
        check = checks.get(limit_name or "")
        limit = "" if check is None else (f"{check['limit'] * 100:g}%" if pct else f"{check['limit']:g}")
        result = "" if check is None else ("[green]pass[/green]" if check["passed"] else "[red]FAIL[/red]")
        table.add_row(label, shown, limit, result)

    latency = report["latency_ms"]
    row("requests (successes / all)", report["successes"], "min_successes", 0)
    table.add_row("", f"of {report['requests']}", "", "")
    row("throughput, successes/s", report["throughput_rps"], "min_throughput_rps", 2)
    row("latency p50 ms", latency["p50"], "max_p50_ms")
    row("latency p95 ms", latency["p95"], "max_p95_ms")
    row("latency p99 ms", latency["p99"], "max_p99_ms")
    row("attempts answered 503", report["share_503"], "max_503_share", pct=True)
    row("attempts per success", report["attempts_per_success"], "max_attempts_per_success", 3)
    row("failed after retries", report["failed_share"], "max_failed_share", pct=True)
    console.print(table)
    console.print(f"attempts {report['attempts']} (503: {report['attempts_503']}), retries {report['retries']} "
                  f"{report['retry_reasons']}, final statuses {report['final_statuses']}, elapsed {report['elapsed_s']:.1f} s")


def main(argv: Optional[list[str]] = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .client import SemIfClient
    from .evaluate import parse_rows
    from .gate import load_json_argument
    from .sagemaker_transport import RetryPolicy
    from .storage import Storage, StorageError

    parser = argparse.ArgumentParser(prog="semif-loadcheck", description="A bounded load check with the SemIf client's retry policy.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running adapter, e.g. http://127.0.0.1:8080")
    where.add_argument("--endpoint", help="a SageMaker endpoint name (boto3 credentials)")
    parser.add_argument("--region", help="AWS region of --endpoint")
    parser.add_argument("--api-key", help="bearer key for --url when the adapter sets SEMIF_API_KEY (default: $SEMIF_API_KEY)")
    parser.add_argument("--data", help="labeled JSONL (local or s3://) whose cases are sent in turn; default: one built-in decision")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients, one request in flight each")
    parser.add_argument("--duration-s", type=float, default=60.0, help="no request starts after this many seconds")
    parser.add_argument("--warmup-requests", type=int, default=1, help="sent before the clock starts, not counted")
    parser.add_argument("--max-attempts", type=int, default=5, help="retry budget per request (the client's policy)")
    parser.add_argument("--max-elapsed-s", type=float, default=30.0, help="retry time budget per request")
    parser.add_argument("--request-timeout-s", type=float, default=70.0, help="timeout of one attempt")
    parser.add_argument("--repeat-states", action="store_true",
                        help="send each state as it is; by default a unique first line makes every state new to the adapter's caches")
    parser.add_argument("--limits", help="limits: a JSON file (local or s3://) or inline JSON; default: the built-in limits")
    parser.add_argument("--out", help="folder or s3:// prefix for loadcheck.json")
    parser.add_argument("--kms-key-id", help="KMS key for S3 writes (default: the bucket's default KMS key)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    console = Console(stderr=True, soft_wrap=True)  # one line per message in CI logs
    storage = Storage(kms_key_id=args.kms_key_id)
    try:
        plan = parse_plan({"clients": args.clients, "duration_s": args.duration_s, "warmup_requests": args.warmup_requests,
                           "max_attempts": args.max_attempts, "max_elapsed_s": args.max_elapsed_s,
                           "request_timeout_s": args.request_timeout_s, "repeat_states": args.repeat_states}, "arguments")
        limits = parse_limits(load_json_argument(args.limits, storage, "--limits") if args.limits else {}, "--limits")
        rows = parse_rows(storage.read_text(args.data), args.data) if args.data else [BUILT_IN_CASE]
    except (LoadCheckError, StorageError, ValueError) as exc:
        console.print(f"semif-loadcheck: {exc}")
        return 2
    if not rows:
        console.print(f"semif-loadcheck: {args.data}: no cases")
        return 2
    retry = RetryPolicy(max_attempts=plan.max_attempts, max_elapsed_s=plan.max_elapsed_s)
    endpoint_record = None
    try:
        if args.url:
            import os

            api_key = args.api_key or os.environ.get("SEMIF_API_KEY")

            def make_client(stats):
                return SemIfClient(args.url, retry=retry, stats=stats, timeout_s=plan.request_timeout_s, api_key=api_key)
        else:
            import boto3

            from .endpoint_record import describe_endpoint_record
            from .sagemaker_transport import sagemaker_runtime_client

            endpoint_record = describe_endpoint_record(boto3.client("sagemaker", region_name=args.region), args.endpoint)
            runtime = sagemaker_runtime_client(args.region, read_timeout_s=plan.request_timeout_s)  # boto3 clients are thread-safe

            def make_client(stats):
                return SemIfClient.for_endpoint(args.endpoint, sagemaker_client=runtime, retry=retry, stats=stats)
    except Exception as exc:
        console.print(f"semif-loadcheck: cannot open the target: {exc}")
        return 3
    stop = threading.Event()
    try:
        with Progress(TextColumn("load check"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"), TimeElapsedColumn(),
                      console=console, disable=args.no_progress) as bar:
            task = bar.add_task("load", total=plan.duration_s)
            summary = run_load(make_client, rows, plan, progress=lambda s: bar.update(task, completed=s), stop=stop)
    except KeyboardInterrupt:
        stop.set()
        console.print("semif-loadcheck: interrupted")
        return 130
    verdict = judge(summary, limits)
    report = {"target": {"kind": "url" if args.url else "endpoint", "address": args.url or args.endpoint},
              **summary, "limits": limits.model_dump(), "verdict": verdict.model_dump(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)}
    if endpoint_record is not None:
        report["endpoint"] = endpoint_record
    print_summary(report, Console() if sys.stdout.isatty() else Console(width=160))
    if args.out:
        try:
            console.print(f"wrote {storage.write_text(storage.join(args.out, 'loadcheck.json'), json.dumps(report, indent=2), 'application/json')}")
        except StorageError as exc:
            console.print(f"semif-loadcheck: {exc}")
            return 2
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
