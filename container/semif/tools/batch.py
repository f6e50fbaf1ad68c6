"""`semif-batch`: decide a JSON Lines file offline, on SageMaker Batch Transform or on this machine.

    semif-batch run --endpoint-stack dev --input s3://BUCKET/batch/tickets/in/ [--output s3://…/out/]
                    [--instance-type ml.c6i.8xlarge] [--instance-count 4]
    semif-batch local INPUT.jsonl -o OUTPUT.jsonl [--url http://127.0.0.1:8080 | --model model.gguf]
    semif-batch report OUTPUT.jsonl [--input INPUT.jsonl] [--out DIR]
    semif-batch requests LABELED.jsonl -o REQUESTS.jsonl

Each input line is one request of any decision contract (SemIf, System One, OpenAI Decisions); each output
line answers the input line at the same position, or is that contract's error object. `run` and `local`
send the same mini-batches to the same `/invocations` JSON Lines path (semif/serving/http/jsonlines.py).
See docs/how-to/batch-transform.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from botocore.exceptions import BotoCoreError, ClientError

JSON_LINES = "application/jsonlines"
MIB = 1 << 20
TERMINAL = ("Completed", "Failed", "Stopped")
# Batch Transform's maximum: a 1 MB mini-batch can hold thousands of records. The adapter's
# SEMIF_BATCH_DEADLINE_S (3300 s) answers inside it, with the records it did not reach as error lines.
INVOCATION_TIMEOUT_S = 3600
LOCAL_RECORDS_PER_BATCH = 32


class BatchError(Exception):
    """A problem the user can fix; the message says how."""


# ---- S3 locations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> "S3Location":
        if not uri.startswith("s3://"):
            raise BatchError(f"{uri!r} is not an s3:// URI")
        bucket, _, key = uri[5:].partition("/")
        if not bucket:
            raise BatchError(f"{uri!r} names no bucket")
        return cls(bucket, key)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def child(self, name: str) -> "S3Location":
        return S3Location(self.bucket, self.key.rstrip("/") + "/" + name if self.key else name)


@dataclass(frozen=True)
class StackOutputs:
    """What the decision stack of one environment publishes for transform jobs (SSM, /semif/<env>/…)."""

    env: str
    model_name: str
    role_arn: str
    bucket: str
    instance_type: str

    @staticmethod
    def parameter_names(env: str) -> dict[str, str]:
        return {
            "model_name": f"/semif/{env}/decision/batch-model-name",
            "role_arn": f"/semif/{env}/decision/batch-role-arn",
            "instance_type": f"/semif/{env}/decision/batch-instance-type",
            "bucket": f"/semif/{env}/model-bucket/name",
        }

    @classmethod
    def read(cls, ssm, env: str) -> "StackOutputs":
        names = cls.parameter_names(env)
        found = ssm.get_parameters(Names=list(names.values()))
        values = {p["Name"]: p["Value"] for p in found.get("Parameters", [])}
        missing = [name for name in names.values() if name not in values]
        if missing:
            raise BatchError(f"SSM parameter(s) {', '.join(missing)} not found: deploy the stacks of environment "
                             f"{env!r} (cdk deploy -c env={env} --all) in this account and region")
        return cls(env=env, **{field_: values[name] for field_, name in names.items()})


# Batch Transform's GPU hosts run NVIDIA driver 470 or 535 (TransformResources.TransformAmiVersion:
# al2-ami-sagemaker-batch-gpu-470 / -535, https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TransformResources.html;
# https://docs.aws.amazon.com/sagemaker/latest/dg/inference-gpu-drivers.html). The adapter's GPU image is built on
# the DLC's CUDA 13 runtime, which needs driver 580 or newer (the endpoints pin al2023-ami-sagemaker-inference-gpu-4-1),
# and a Model with SEMIF_REQUIRE_GPU=1 exits rather than fall back to the CPU: no transform host can run it.
GPU_BATCH_REFUSAL = (
    "the batch Model {model} of environment {env!r} is the adapter's GPU image (SEMIF_REQUIRE_GPU=1), built on CUDA 13, "
    "which needs NVIDIA driver 580 or newer; Batch Transform GPU hosts run driver 470 or 535 "
    "(TransformAmiVersion al2-ami-sagemaker-batch-gpu-470/-535) and a CPU host has no GPU, so no transform job can start "
    "it. Decide the file with `semif-batch local --url` against an adapter on a GPU machine, or run the job in an "
    "environment of the cpu variant (docs/how-to/batch-transform.md#gpu-environments)"
)


def refuse_unrunnable_model(sagemaker, outputs: "StackOutputs") -> None:
    """Before anything is written or started: the batch Model must be one a transform host can run."""
    described = sagemaker.describe_model(ModelName=outputs.model_name)
    containers = [described.get("PrimaryContainer") or {}, *(described.get("Containers") or [])]
    if any((c.get("Environment") or {}).get("SEMIF_REQUIRE_GPU") == "1" for c in containers):
        raise BatchError(GPU_BATCH_REFUSAL.format(model=outputs.model_name, env=outputs.env))


def batch_prefix(job_name: str) -> str:
    """`batch/<job>/`: the only prefixes of the model bucket a transform job's role reads (`in/`) and writes (`out/`)."""
    return f"batch/{job_name}/"


def is_batch_location(location: S3Location, bucket: str, side: str) -> bool:
    parts = location.key.split("/")
    return location.bucket == bucket and len(parts) >= 3 and parts[0] == "batch" and bool(parts[1]) and parts[2] == side


def default_job_name(env: str, now: Optional[float] = None) -> str:
    return time.strftime(f"semif-{env}-%Y%m%d-%H%M%S", time.gmtime(now))[:63]


# ---- S3 input: listing, counting, sharding --------------------------------------------------------


def list_objects(s3, location: S3Location) -> list[tuple[str, int]]:
    """(key, size) of the non-empty objects under a prefix, or the one object a key names."""
    if location.key and not location.key.endswith("/"):
        head = s3.head_object(Bucket=location.bucket, Key=location.key)
        return [(location.key, int(head["ContentLength"]))]
    objects = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=location.key):
        for item in page.get("Contents", []):
            if not item["Key"].endswith("/") and item["Size"] > 0:
                objects.append((item["Key"], int(item["Size"])))
    return sorted(objects)


def iter_object_lines(s3, bucket: str, key: str) -> Iterator[bytes]:
    body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    for line in body.iter_lines():
        if line.strip():
            yield line


def count_records(s3, bucket: str, keys: Sequence[str]) -> int:
    return sum(1 for key in keys for _ in iter_object_lines(s3, bucket, key))


def stage_shards(s3, source_bucket: str, keys: Sequence[str], target: S3Location, shards: int,
                 *, records: int, progress: Callable[[int], None] = lambda n: None) -> list[str]:
    """Copy the records into ``shards`` objects of contiguous lines under ``target`` (blank lines dropped).
    Contiguous, not round-robin: lines that share a state stay next to each other, so they reuse its prefix."""
    shards = max(1, min(shards, records)) if records else 1
    per_shard, extra = divmod(records, shards)
    sizes = [per_shard + (1 if i < extra else 0) for i in range(shards)]
    written: list[str] = []
    lines = (line for key in keys for line in iter_object_lines(s3, source_bucket, key))
    with tempfile.TemporaryDirectory(prefix="semif-batch-") as tmp:
        for index, size in enumerate(sizes):
            path = Path(tmp) / f"part-{index:05d}.jsonl"
            with open(path, "wb") as handle:
                for _ in range(size):
                    handle.write(next(lines).rstrip(b"\r") + b"\n")
            key = target.child(path.name).key
            s3.upload_file(str(path), target.bucket, key, ExtraArgs={"ContentType": JSON_LINES})
            path.unlink()
            written.append(key)
            progress(size)
    return written


# ---- the transform job ----------------------------------------------------------------------------


def transform_job_request(*, job_name: str, model_name: str, input_uri: str, output_uri: str, instance_type: str,
                          instance_count: int, env: str, max_payload_mb: Optional[int] = None,
                          max_concurrent: Optional[int] = None, join_input: bool = False,
                          invocation_timeout_s: int = INVOCATION_TIMEOUT_S, max_retries: int = 1) -> dict:
    """The CreateTransformJob request. MaxPayloadInMB and MaxConcurrentTransforms are left out unless given:
    SageMaker then asks the container's `GET /execution-parameters`, which derives them from its limits."""
    request: dict[str, Any] = {
        "TransformJobName": job_name,
        "ModelName": model_name,
        "BatchStrategy": "MultiRecord",
        "ModelClientConfig": {"InvocationsTimeoutInSeconds": invocation_timeout_s, "InvocationsMaxRetries": max_retries},
        "TransformInput": {
            "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": input_uri}},
            "ContentType": JSON_LINES,
            "CompressionType": "None",
            "SplitType": "Line",
        },
        "TransformOutput": {"S3OutputPath": output_uri, "Accept": JSON_LINES, "AssembleWith": "Line"},
        "TransformResources": {"InstanceType": instance_type, "InstanceCount": instance_count},
        "Tags": [{"Key": "project", "Value": "semif"}, {"Key": "environment", "Value": env}],
    }
    if max_payload_mb is not None:
        request["MaxPayloadInMB"] = max_payload_mb
    if max_concurrent is not None:
        request["MaxConcurrentTransforms"] = max_concurrent
    if join_input:
        # SageMaker joins each input record with its answer ({"SageMakerInput": …, "SageMakerOutput": …}).
        request["DataProcessing"] = {"JoinSource": "Input"}
    return request


@dataclass
class Plan:
    """Where a job reads and writes, and whether the input must be sharded first."""

    job_name: str
    input: S3Location
    output: S3Location
    source: S3Location
    source_keys: list[str]
    stage: bool


def plan_job(s3, outputs: StackOutputs, *, source_uri: str, output_uri: Optional[str], instance_count: int,
             job_name: str) -> Plan:
    source = S3Location.parse(source_uri)
    objects = list_objects(s3, source)
    if not objects:
        raise BatchError(f"no input objects under {source.uri}")
    prefix = batch_prefix(job_name)
    output = S3Location.parse(output_uri) if output_uri else S3Location(outputs.bucket, prefix + "out/")
    if not is_batch_location(output, outputs.bucket, "out"):
        raise BatchError(f"--output {output.uri}: the transform role writes only s3://{outputs.bucket}/batch/<job>/out/; "
                         "copy the answers elsewhere after the job")
    if not output.key.endswith("/"):
        output = S3Location(output.bucket, output.key + "/")
    # Batch Transform hands whole objects to instances: fewer objects than instances leave instances idle.
    ready = is_batch_location(source, outputs.bucket, "in") and source.key.endswith("/") and len(objects) >= instance_count
    staged = S3Location(outputs.bucket, prefix + "in/")
    return Plan(job_name=job_name, input=source if ready else staged, output=output, source=source,
                source_keys=[key for key, _ in objects], stage=not ready)


def job_progress(s3, plan: Plan, n_inputs: int) -> int:
    """Input objects answered so far: Batch Transform writes `<object>.out` when an object is done."""
    done = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=plan.output.bucket, Prefix=plan.output.key):
        done += sum(1 for item in page.get("Contents", []) if item["Key"].endswith(".out"))
    return min(done, n_inputs)


def offer_stop(sagemaker, job_name: str, console, ask: Optional[Callable[[], bool]] = None) -> bool:
    """Ctrl-C during a job: ask (on a terminal) whether to stop it; stop it if so. Returns whether it was stopped."""
    if ask is None:
        def ask() -> bool:
            if not sys.stdin.isatty():
                return True  # no one to ask: an interrupted script should not leave instances running
            from rich.prompt import Confirm

            return Confirm.ask(f"Stop transform job {job_name}?", default=True, console=console)
    if not ask():
        console.print(f"job {job_name} keeps running; follow it with: aws sagemaker describe-transform-job "
                      f"--transform-job-name {job_name}")
        return False
    sagemaker.stop_transform_job(TransformJobName=job_name)
    console.print(f"stop requested for {job_name}")
    return True


# ---- answers: what an output line is --------------------------------------------------------------


def error_code_of(line: Any) -> Optional[str]:
    """The error code of an output line in any contract's error shape, or None for an answer."""
    if not isinstance(line, dict):
        return "not_an_object"
    error = line.get("error")
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "error")
    detail = line.get("detail")
    if isinstance(detail, list) and detail and "answers" not in line:
        return str(detail[0].get("type") or "invalid_request") if isinstance(detail[0], dict) else "invalid_request"
    if isinstance(detail, dict):
        return str(detail.get("code") or detail.get("error_type") or "error")
    return None


@dataclass
class Summary:
    records_in: int = 0
    answers_out: int = 0
    lines_out: int = 0
    errors: Counter = field(default_factory=Counter)
    unparseable: int = 0

    def add_line(self, raw: bytes | str) -> None:
        self.lines_out += 1
        try:
            line = json.loads(raw)
        except ValueError:
            self.unparseable += 1
            self.errors["unparseable_output"] += 1
            return
        code = error_code_of(line)
        if code is None:
            self.answers_out += 1
        else:
            self.errors[code] += 1


def summarize_output(s3, output: S3Location, records_in: int) -> Summary:
    summary = Summary(records_in=records_in)
    for key, _ in list_objects(s3, output):
        if key.endswith(".out"):
            for line in iter_object_lines(s3, output.bucket, key):
                summary.add_line(line)
    return summary


def print_summary(summary: Summary, where: str, console) -> None:
    from rich.table import Table

    table = Table(title="semif-batch summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("records in", str(summary.records_in))
    table.add_row("answers out", str(summary.answers_out))
    table.add_row("error lines", str(sum(summary.errors.values())))
    for code, count in summary.errors.most_common():
        table.add_row(f"  {code}", str(count))
    if summary.lines_out != summary.records_in:
        table.add_row("[red]output lines ≠ records[/red]", str(summary.lines_out))
    table.add_row("output", where)
    console.print(table)


# ---- semif-batch run ------------------------------------------------------------------------------


def run_job(args, *, session=None, console=None, out_console=None, ask_stop: Optional[Callable[[], bool]] = None,
            sleep=time.sleep) -> int:
    """Progress goes to ``console`` (stderr), the summary to ``out_console`` (stdout)."""
    import boto3
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    session = session or boto3.session.Session(region_name=args.region)
    s3, sagemaker, ssm = session.client("s3"), session.client("sagemaker"), session.client("ssm")
    outputs = StackOutputs.read(ssm, args.endpoint_stack)
    refuse_unrunnable_model(sagemaker, outputs)
    job_name = args.job_name or default_job_name(args.endpoint_stack)
    plan = plan_job(s3, outputs, source_uri=args.input, output_uri=args.output, instance_count=args.instance_count,
                    job_name=job_name)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=args.no_progress) as bar:
        task = bar.add_task(f"counting records in {plan.source.uri}", total=None)
        records = count_records(s3, plan.source.bucket, plan.source_keys)
        if records == 0:
            raise BatchError(f"{plan.source.uri} holds no records (non-blank lines)")
        if plan.stage:
            bar.update(task, description=f"sharding into {plan.input.uri}", total=records, completed=0)
            inputs = stage_shards(s3, plan.source.bucket, plan.source_keys, plan.input, args.instance_count,
                                  records=records, progress=lambda n: bar.advance(task, n))
        else:
            inputs = plan.source_keys
        bar.update(task, visible=False)
    request = transform_job_request(
        job_name=job_name, model_name=outputs.model_name, input_uri=plan.input.uri, output_uri=plan.output.uri,
        instance_type=args.instance_type or outputs.instance_type, instance_count=args.instance_count,
        env=args.endpoint_stack, max_payload_mb=args.max_payload_mb, max_concurrent=args.max_concurrent_transforms,
        join_input=args.join_input, invocation_timeout_s=args.invocation_timeout_s,
    )
    sagemaker.create_transform_job(**request)
    console.print(f"transform job [bold]{job_name}[/bold] on model {outputs.model_name}: {records} records in "
                  f"{len(inputs)} object(s), {args.instance_count} × {request['TransformResources']['InstanceType']}")
    if args.no_wait:
        console.print(f"not waiting; output will be under {plan.output.uri}")
        return 0
    status = wait_for_job(sagemaker, s3, plan, len(inputs), console=console, poll_s=args.poll_s,
                          disable=args.no_progress, ask_stop=ask_stop, sleep=sleep)
    if status != "Completed":
        described = sagemaker.describe_transform_job(TransformJobName=job_name)
        console.print(f"[red]job {job_name} ended {status}[/red]: {described.get('FailureReason', '')}")
        return 1
    summary = summarize_output(s3, plan.output, records)
    print_summary(summary, plan.output.uri, out_console or Console())
    return 0 if summary.lines_out == records else 1


def wait_for_job(sagemaker, s3, plan: Plan, n_inputs: int, *, console, poll_s: float, disable: bool = False,
                 ask_stop: Optional[Callable[[], bool]] = None, sleep=time.sleep) -> str:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    stopped = False
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("objects"), TimeElapsedColumn(), console=console, disable=disable) as bar:
        task = bar.add_task(plan.job_name, total=n_inputs)
        while True:
            try:
                status = sagemaker.describe_transform_job(TransformJobName=plan.job_name)["TransformJobStatus"]
                bar.update(task, description=f"{plan.job_name}: {status}", completed=job_progress(s3, plan, n_inputs))
                if status in TERMINAL:
                    return status
                sleep(poll_s)
            except KeyboardInterrupt:
                if stopped:
                    raise
                bar.stop()
                stopped = offer_stop(sagemaker, plan.job_name, console, ask_stop)
                if not stopped:
                    return "Detached"
                bar.start()


# ---- semif-batch local ----------------------------------------------------------------------------


class LocalAdapter:
    """The container contract on this machine: a running adapter (`--url`), or the adapter's ASGI app over
    the engine in-process (the embedded model by default), called through the same HTTP routes."""

    def __init__(self, client, address: str, closer: Callable[[], None] = lambda: None):
        self.client = client
        self.address = address
        self._close = closer

    @classmethod
    def at_url(cls, url: str, *, api_key: Optional[str] = None, timeout_s: float = 900.0) -> "LocalAdapter":
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        return cls(client, url, client.close)

    @classmethod
    def in_process(cls, model_path: Optional[str] = None, *, env: Optional[dict] = None) -> "LocalAdapter":
        from starlette.testclient import TestClient

        from ..serving.http.app import create_app
        from ..serving.config import Settings
        from ..serving.engine.context import Engine

        environment = dict(os.environ if env is None else env)
        environment.setdefault("SEMIF_BATCH_TRANSFORM", "1")  # a transform job's limits, as in its container
        if model_path:
            environment["SEMIF_MODEL_PATH"] = str(model_path)
        settings = Settings.from_env(environment)
        engine = Engine(settings.model_path, n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                        n_threads=settings.n_threads, n_gpu_layers=settings.n_gpu_layers,
                        prefix_cache=settings.prefix_cache, default_scoring=settings.scoring)
        client = TestClient(create_app(settings, engine), raise_server_exceptions=False)
        client.__enter__()

        def close() -> None:
            client.__exit__(None, None, None)
            engine.close()

        return cls(client, f"in-process {settings.model_path.name}", close)

    def execution_parameters(self) -> dict:
        response = self.client.get("/execution-parameters")
        response.raise_for_status()
        return response.json()

    def post(self, payload: bytes) -> tuple[int, bytes, dict]:
        response = self.client.post("/invocations", content=payload, headers={"content-type": JSON_LINES})
        return response.status_code, response.content, dict(response.headers)

    def close(self) -> None:
        self._close()


def mini_batches(lines: Sequence[bytes], max_bytes: int, max_records: int = 0) -> Iterator[list[bytes]]:
    """Consecutive lines joined up to ``max_bytes`` per body, as Batch Transform's MultiRecord strategy does
    (and at most ``max_records`` lines, when set)."""
    batch: list[bytes] = []
    size = 0
    for line in lines:
        if batch and (size + len(line) + 1 > max_bytes or 0 < max_records <= len(batch)):
            yield batch
            batch, size = [], 0
        batch.append(line)
        size += len(line) + 1
    if batch:
        yield batch


def read_input_lines(path: Path) -> list[bytes]:
    """Non-blank lines, as Batch Transform's Line splitting hands them over."""
    return [line.rstrip(b"\r") for line in path.read_bytes().split(b"\n") if line.strip()]


def answer_mini_batch(adapter: LocalAdapter, batch: list[bytes], *, retries: int = 3,
                      sleep=time.sleep) -> list[bytes]:
    payload = b"\n".join(batch) + b"\n"
    for attempt in range(retries + 1):
        status, content, headers = adapter.post(payload)
        if status != 503 or attempt == retries:
            break
        sleep(float(headers.get("retry-after", "1") or 1))
    if status == 200:
        answers = [line for line in content.split(b"\n") if line]
        if len(answers) != len(batch):
            raise BatchError(f"the adapter answered {len(answers)} lines for {len(batch)} records")
        return answers
    # The mini-batch as a whole was refused (too large, overloaded): every record gets that error object.
    try:
        error = json.loads(content)
    except ValueError:
        error = {"error": {"code": f"http_{status}", "message": content[:200].decode("utf-8", "replace"), "field": None}}
    line = json.dumps(error, ensure_ascii=False).encode()
    return [line] * len(batch)


def run_local(input_path: Path, output_path: Path, adapter: LocalAdapter, *, console=None, disable: bool = False,
              max_payload_mb: Optional[int] = None, max_records: int = LOCAL_RECORDS_PER_BATCH) -> Summary:
    """Answers do not depend on how records are grouped (each is scored on its own); ``max_records`` only keeps
    the progress bar moving. 0 groups exactly as Batch Transform does (by payload size alone)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    lines = read_input_lines(input_path)
    payload_mb = max_payload_mb or int(adapter.execution_parameters()["MaxPayloadInMB"])
    summary = Summary(records_in=len(lines))
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "wb") as out, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=disable,
    ) as bar:
        task = bar.add_task(f"{input_path.name} → {adapter.address}", total=len(lines))
        for batch in mini_batches(lines, payload_mb * MIB, max_records):
            for answer in answer_mini_batch(adapter, batch):
                out.write(answer + b"\n")
                summary.add_line(answer)
            bar.advance(task, len(batch))
    return summary


# ---- semif-batch requests -------------------------------------------------------------------------


def request_from_labeled_row(row: dict) -> dict:
    """A semif-eval labeled row as the SemIf decision the adapter answers (the label stays behind: the
    SemIf schema is strict). The decision id is semif-eval's decision key, so calibration groups alike."""
    from .evaluate import decision_key

    return {"decision": {"id": decision_key(row), "state": row["state"], "question": row["question"],
                         "options": [{k: v for k, v in o.items() if k in ("id", "description")} for o in row["options"]]}}


# ---- semif-batch report ---------------------------------------------------------------------------


@dataclass
class DecisionRecord:
    """One decision answered in an output line, in contract-neutral terms."""

    line: int
    decision_id: str
    option_ids: list[str]
    probabilities: list[float]
    choice: Any
    option_logits: Optional[list[float]] = None
    label_mass: Optional[float] = None
    action: Optional[str] = None
    latency_ms: Optional[float] = None
    tokens: Optional[int] = None

    @property
    def margin(self) -> float:
        ranked = sorted(self.probabilities, reverse=True)
        return ranked[0] - ranked[1] if len(ranked) > 1 else 1.0


def decisions_of(line: dict, number: int) -> list[DecisionRecord]:
    """The decisions an answer line holds: SemIf (single or shared state), System One, OpenAI Decisions."""
    if "results" in line or "option_ids" in line:  # SemIf
        out = []
        for result in line.get("results", [line]):
            out.append(DecisionRecord(
                line=number, decision_id=str(result["id"]), option_ids=list(result["option_ids"]),
                probabilities=list(result["probabilities"]), choice=result.get("choice"),
                option_logits=result.get("option_logits"), label_mass=result.get("label_mass"),
                action=result.get("action"), latency_ms=(result.get("timing") or {}).get("compute_ms"),
                tokens=(result.get("prompt") or {}).get("tokens")))
        return out
    answers = line.get("answers")
    if isinstance(answers, dict):  # System One: {question id: answer}
        out = []
        for qid, answer in answers.items():
            probabilities = answer.get("probabilities")
            if isinstance(probabilities, dict):
                legend = answer.get("legend") or {}  # a score's levels as sent (strings, or objects: keep the index)
                ids = [legend[k] if isinstance(legend.get(k), str) else k for k in probabilities]
                probs = list(probabilities.values())
            else:
                ids, probs = ["true", "false"], [answer["noul"], 1 - answer["noul"]]
            # A choice names its option; a noul or a score counts as its most probable outcome (level).
            choice = answer.get("choice", ids[max(range(len(probs)), key=probs.__getitem__)])
            out.append(DecisionRecord(line=number, decision_id=qid, option_ids=[str(i) for i in ids], probabilities=probs,
                                      choice=choice, option_logits=answer.get("x_option_logits"),
                                      label_mass=answer.get("x_label_mass", answer.get("label_mass"))))
        return out
    if isinstance(answers, list):  # OpenAI Decisions: [answer in question order]
        out = []
        for index, answer in enumerate(answers):
            name = answer.get("name") or f"questions[{index}]"
            if answer.get("type") == "predicate":
                p = answer["probability"]
                ids, probs, choice = ["true", "false"], [p, 1 - p], p >= 0.5
            else:
                entries = answer.get("probabilities") or []
                ids = [str(e["label"] if "label" in e else e.get("value")) for e in entries]
                probs = [e["probability"] for e in entries]
                choice = answer.get("choice", ids[max(range(len(probs)), key=probs.__getitem__)] if probs else None)
            out.append(DecisionRecord(line=number, decision_id=name, option_ids=ids, probabilities=probs, choice=choice,
                                      label_mass=answer.get("label_mass")))
        return out
    return []


def read_json_lines(path: Path) -> list[Any]:
    out = []
    for line in path.read_bytes().split(b"\n"):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append(None)
    return out


def labels_of(row: Any, decisions: list[DecisionRecord]) -> dict[int, str]:
    """Index of decision → labeled answer: `answer` as a string (the line's only decision, as in semif-eval's
    rows) or as an object {decision id: answer}."""
    if not isinstance(row, dict) or "answer" not in row:
        return {}
    answer = row["answer"]
    if isinstance(answer, dict):
        return {i: str(answer[d.decision_id]) for i, d in enumerate(decisions) if d.decision_id in answer}
    if len(decisions) == 1:
        return {0: str(answer)}
    return {}


def build_report(output_path: Path, input_path: Optional[Path] = None, *, folds: int = 5, seed: int = 0,
                 min_per_decision: int = 5) -> tuple[dict, list[DecisionRecord], dict]:
    """The report's numbers; with labels, accuracy and calibration come from semif-eval's own scoring."""
    from .evaluate import CaseOutcome, score_decisions

    lines = read_json_lines(output_path)
    inputs = read_json_lines(input_path) if input_path else None
    if inputs is not None and len(inputs) != len(lines):
        raise BatchError(f"{input_path} has {len(inputs)} records but {output_path} has {len(lines)} lines: "
                         "an output answers the input line at the same position, so they must match")
    summary = Summary(records_in=len(inputs) if inputs is not None else len(lines))
    decisions: list[DecisionRecord] = []
    rows, outcomes = [], []
    for number, line in enumerate(lines, start=1):
        summary.add_line(json.dumps(line))
        if line is None or error_code_of(line) is not None:
            continue
        found = decisions_of(line, number)
        decisions += found
        for index, label in (labels_of(inputs[number - 1], found) if inputs is not None else {}).items():
            d = found[index]
            if label not in d.option_ids:
                continue
            # semif-eval's labeled-row shape (its question text is not in the output; the decision id stands in).
            row = {"id": f"line-{number}", "category": d.decision_id, "decision_id": d.decision_id,
                   "question": d.decision_id, "options": [{"id": o} for o in d.option_ids], "answer": label}
            rows.append(row)
            outcomes.append(CaseOutcome(latency_ms=d.latency_ms or 0.0, option_logits=d.option_logits,
                                        probabilities=d.probabilities, tokens=d.tokens))
    per_decision: dict[str, Counter] = {}
    for d in decisions:
        per_decision.setdefault(d.decision_id, Counter())[json.dumps(d.choice) if not isinstance(d.choice, str) else d.choice] += 1
    with_action = [d for d in decisions if d.action is not None]
    margins = [d.margin for d in decisions]
    masses = [d.label_mass for d in decisions if d.label_mass is not None]
    report: dict[str, Any] = {
        "output": str(output_path),
        "input": str(input_path) if input_path else None,
        "records": summary.records_in,
        "answer_lines": summary.answers_out,
        "error_lines": sum(summary.errors.values()),
        "errors": dict(summary.errors.most_common()),
        "decisions": len(decisions),
        "choices": {k: dict(v.most_common()) for k, v in sorted(per_decision.items())},
        "margin": _distribution(margins),
        "label_mass": _distribution(masses) if masses else None,
        "abstain_share": (sum(1 for d in with_action if d.action == "abstain") / len(with_action)) if with_action else None,
        "actions": dict(Counter(d.action for d in with_action)) if with_action else None,
        "labeled": len(rows),
    }
    if rows:
        report["evaluation"] = score_decisions(rows, outcomes, folds=folds, seed=seed, min_per_decision=min_per_decision,
                                               priors=None, policy=None, targets=(0.8, 0.9, 0.95))
    return report, decisions, {"margins": margins, "label_mass": masses}


def _distribution(values: Sequence[float]) -> Optional[dict]:
    import numpy as np

    if not values:
        return None
    array = np.asarray(values, dtype=np.float64)
    return {"n": len(values), "mean": float(array.mean()), "p10": float(np.percentile(array, 10)),
            "p50": float(np.percentile(array, 50)), "p90": float(np.percentile(array, 90))}


def write_report_plots(report: dict, series: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .evaluate import save_figure, write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, values, xlabel in (("margins", series["margins"], "margin (top − second probability)"),
                                 ("label_mass", series["label_mass"], "label_mass (probability on the option labels)")):
        if not values:
            continue  # label_mass is absent from adapters that do not report it
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.hist(values, bins=20, range=(0.0, 1.0), color="#4477aa")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("decisions")
        ax.set_title(f"{name} — {len(values)} decisions, {Path(report['output']).name}", fontsize=10)
        written.append(save_figure(fig, out_dir / f"{name}.png"))
    if "evaluation" in report:
        run = dict(report["evaluation"])
        run["cases_detail"] = []  # no client-side latency in a batch output
        written += write_plots({"runs": {"label": run}, "reproducibility": {"model_file": Path(report["output"]).name}},
                               out_dir, prefix="labeled-")
    return written


def print_report(report: dict, console) -> None:
    from rich.table import Table

    from .evaluate import _fmt

    table = Table(title=f"semif-batch report: {report['output']}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("records", str(report["records"]))
    table.add_row("answer lines", str(report["answer_lines"]))
    table.add_row("error lines", str(report["error_lines"]))
    for code, count in report["errors"].items():
        table.add_row(f"  {code}", str(count))
    table.add_row("decisions", str(report["decisions"]))
    margin = report["margin"] or {}
    table.add_row("margin p10 / p50 / p90", " / ".join(_fmt(margin.get(k)) for k in ("p10", "p50", "p90")))
    mass = report["label_mass"]
    table.add_row("label_mass p50", _fmt(mass["p50"]) if mass else "not reported")
    table.add_row("abstain share", _fmt(report["abstain_share"], pct=True) if report["abstain_share"] is not None
                  else "no policy applied")
    if "evaluation" in report:
        ev = report["evaluation"]
        probs = ev.get("probabilities") or {}
        table.add_row("labeled decisions", str(report["labeled"]))
        table.add_row("accuracy", _fmt(ev["accuracy"], pct=True))
        table.add_row("NLL / Brier / ECE", " / ".join(_fmt(probs.get(k)) for k in ("nll", "brier", "ece")))
    console.print(table)
    choices = Table(title="choices per decision id")
    choices.add_column("decision id")
    choices.add_column("choice")
    choices.add_column("n", justify="right")
    for decision_id, counts in report["choices"].items():
        for choice, n in counts.items():
            choices.add_row(decision_id, choice, str(n))
    console.print(choices)


# ---- command line ---------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="semif-batch", description="Decide JSON Lines files offline (docs/how-to/batch-transform.md).")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="a SageMaker Batch Transform job on the decision stack's model")
    run.add_argument("--endpoint-stack", required=True, metavar="ENV", help="environment whose decision stack serves the model (e.g. dev)")
    run.add_argument("--input", required=True, help="s3:// prefix (or object) of JSON Lines records")
    run.add_argument("--output", help="s3://<model bucket>/batch/<name>/out/ (default: batch/<job>/out/ in the model bucket)")
    run.add_argument("--instance-type", help="default: the decision endpoint's instance type (SSM batch-instance-type)")
    run.add_argument("--instance-count", type=int, default=1, help="instances; the input is sharded into at least this many objects")
    run.add_argument("--job-name", help="default: semif-<env>-<UTC time>")
    run.add_argument("--region", help="AWS region (default: the session's)")
    run.add_argument("--max-payload-mb", type=int, help="override the adapter's MaxPayloadInMB (/execution-parameters)")
    run.add_argument("--max-concurrent-transforms", type=int, help="override the adapter's MaxConcurrentTransforms")
    run.add_argument("--invocation-timeout-s", type=int, default=INVOCATION_TIMEOUT_S,
                     help="per mini-batch; keep above the adapter's SEMIF_BATCH_DEADLINE_S")
    run.add_argument("--join-input", action="store_true", help="JoinSource=Input: SageMaker writes each input record beside its answer")
    run.add_argument("--poll-s", type=float, default=15.0, help="seconds between status checks")
    run.add_argument("--no-wait", action="store_true", help="create the job and return")
    run.add_argument("--no-progress", action="store_true")

    local = commands.add_parser("local", help="the same JSON Lines path on this machine")
    local.add_argument("input", type=Path, help="JSON Lines records")
    local.add_argument("-o", "--output", type=Path, required=True, help="JSON Lines answers, one per record, in order")
    where = local.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running adapter, e.g. http://127.0.0.1:8080 (default: in-process)")
    where.add_argument("--model", help="GGUF file for the in-process adapter (default: SEMIF_* settings, else the embedded model)")
    local.add_argument("--api-key", help="bearer key for --url (default: $SEMIF_API_KEY)")
    local.add_argument("--max-payload-mb", type=int, help="mini-batch size (default: the adapter's /execution-parameters)")
    local.add_argument("--max-records-per-batch", type=int, default=LOCAL_RECORDS_PER_BATCH,
                       help="records per mini-batch, for a live progress bar; 0: by payload size alone, as Batch Transform")
    local.add_argument("--no-progress", action="store_true")

    report = commands.add_parser("report", help="summarise an output file (PNG histograms, report.json)")
    report.add_argument("output", type=Path, help="JSON Lines answers (semif-batch local, or a job's .out object)")
    report.add_argument("--input", type=Path, help="the records, line by line; lines with `answer` add accuracy and calibration")
    report.add_argument("--out", type=Path, default=Path("semif-batch-report"), help="directory for report.json and PNGs")
    report.add_argument("--folds", type=int, default=5)
    report.add_argument("--seed", type=int, default=0)

    requests = commands.add_parser("requests", help="semif-eval labeled rows → SemIf decision records")
    requests.add_argument("labeled", type=Path)
    requests.add_argument("-o", "--output", type=Path, required=True)

    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console(stderr=True)
    try:
        if args.command == "run":
            if args.instance_count < 1:
                raise BatchError("--instance-count must be at least 1")
            return run_job(args, console=console)
        if args.command == "local":
            if not args.input.is_file():
                raise BatchError(f"{args.input}: no such file")
            adapter = (LocalAdapter.at_url(args.url, api_key=args.api_key or os.environ.get("SEMIF_API_KEY"))
                       if args.url else LocalAdapter.in_process(args.model))
            started = time.perf_counter()
            try:
                summary = run_local(args.input, args.output, adapter, console=console, disable=args.no_progress,
                                    max_payload_mb=args.max_payload_mb, max_records=args.max_records_per_batch)
            finally:
                adapter.close()
            console.print(f"{summary.records_in} records in {time.perf_counter() - started:.1f} s")
            print_summary(summary, str(args.output), Console())
            return 0 if summary.lines_out == summary.records_in else 1
        if args.command == "report":
            built, _, series = build_report(args.output, args.input, folds=args.folds, seed=args.seed)
            built["plots"] = write_report_plots(built, series, args.out)
            (args.out / "report.json").write_text(json.dumps(built, indent=2, default=_json_default))
            print_report(built, Console())
            console.print(f"wrote {args.out / 'report.json'} and {', '.join(built['plots']) or 'no plots'}")
            return 0
        rows = [json.loads(line) for line in read_input_lines(args.labeled)]  # "\n" only: U+2028 stays in a string
        with open(args.output, "w") as out:
            for row in rows:
                out.write(json.dumps(request_from_labeled_row(row), ensure_ascii=False) + "\n")
        console.print(f"wrote {len(rows)} SemIf decision records to {args.output}")
        return 0
    except BatchError as exc:
        console.print(f"semif-batch: {exc}")
        return 2
    except (BotoCoreError, ClientError) as exc:  # credentials, permissions, throttling: AWS's own words
        console.print(f"semif-batch: AWS: {exc}")
        return 3


def _json_default(value):
    from .evaluate import _json_default as evaluate_default

    return evaluate_default(value)


if __name__ == "__main__":
    sys.exit(main())
