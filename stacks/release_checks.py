"""The release checks as pipeline stage checks: the labeled regression gate and the load check on a stage (staging)
after its smoke test, and, once the prod stage after it runs the release, the promotion of the gated report to the
baseline the next release is compared with.

The model bucket of the checked stage holds what they read and write there:

    eval/decisions.jsonl                        the labeled decisions (JSON Lines, KMS), uploaded by the operator
    reports/<stage>/<execution id>/report.json  the gate's report with its verdict under `gate` (and PNGs)
    reports/<stage>/<execution id>/loadcheck.json

and prod's model bucket, which is retained and outlives a torn-down staging, the baseline:

    reports/<prod stage>/report.json            the gated report of the release prod runs now

The steps' commands are in ``stacks.pipeline_steps``; ``app.py`` builds these from the typed config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aws_cdk import Duration

from stacks.pipeline_stack import StageCheck
from stacks.pipeline_steps import (gate_commands, load_check_commands, promote_baseline_commands,
                                   semif_tools_install_commands)

GATE_STEP = "Gate"
LOAD_STEP = "LoadCheck"
PROMOTE_STEP = "PromoteBaseline"
# The stage output (``StageStacks.outputs``) the checks write reports with.
MODEL_KEY_OUTPUT = "model_key_arn"
# One report folder per pipeline execution: a retried stage rewrites its own, and the promotion copies exactly the
# report this execution's gate passed, whichever release ran the stage since.
RELEASE_ID = "#{codepipeline.PipelineExecutionId}"
# Room for the virtualenv and the tools' install, and for the describe calls and the warm-up before the clock starts.
STEP_OVERHEAD_S = 600


def report_prefix(stage: str) -> str:
    return f"reports/{stage}/"


def baseline_key(baseline_stage: str) -> str:
    return f"reports/{baseline_stage}/report.json"


@dataclass(frozen=True)
class ReleaseCheckAccess:
    """What an environment's check role may do in its own model bucket (``SharedStack(check_reads=…)``)."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    lists: tuple[str, ...]

    @classmethod
    def for_stage(cls, *, data_key: str, stage: str) -> "ReleaseCheckAccess":
        """The checked stage: the labeled data, and this stage's reports (the promotion reads the gated one)."""
        return cls(reads=(data_key, report_prefix(stage)), writes=(report_prefix(stage),), lists=())

    @classmethod
    def for_baseline(cls, *, baseline_stage: str) -> "ReleaseCheckAccess":
        """The stage the gate compares with (prod): its baseline, read, written and listed (exactly its key: whether
        a first release is running) in its own bucket, which is kept when the checked stage is torn down."""
        baseline = baseline_key(baseline_stage)
        return cls(reads=(baseline,), writes=(baseline,), lists=(baseline,))

    def __add__(self, other: "ReleaseCheckAccess") -> "ReleaseCheckAccess":
        return ReleaseCheckAccess(reads=self.reads + other.reads, writes=self.writes + other.writes,
                                  lists=self.lists + other.lists)


@dataclass(frozen=True)
class BaselinePlace:
    """Where the baseline lives and who may read it: the baseline stage's model bucket, acted on as that stage's
    check role (``role_arn``) in its region; its decision endpoint tells a first release from a lost baseline."""

    bucket: str
    key: str
    role_arn: str
    region: str
    endpoint_name: str

    def env(self) -> dict[str, str]:
        return {"BASELINE_BUCKET": self.bucket, "BASELINE_KEY": self.key, "BASELINE_ROLE_ARN": self.role_arn,
                "BASELINE_REGION": self.region, "BASELINE_ENDPOINT": self.endpoint_name}


@dataclass(frozen=True)
class LoadPlan:
    clients: int
    duration_s: int
    max_attempts: int
    max_elapsed_s: float
    request_timeout_s: float
    limits_json: str

    @property
    def bound_s(self) -> int:
        """The hard stop: the tool's own bound (the duration, then a request in flight with its retry budget and one
        attempt's timeout), plus as much again for the warm-up request sent before the clock starts."""
        return math.ceil(self.duration_s + 2 * (self.max_elapsed_s + self.request_timeout_s))


def gate_and_load_checks(*, model_bucket: str, data_key: str, endpoint_name: str, stage: str, baseline: BaselinePlace,
                         gate_limits_json: str, load: LoadPlan) -> list[StageCheck]:
    """The gate, then the load check, on ``stage``'s decision endpoint ``endpoint_name``."""
    common = {"MODEL_BUCKET": model_bucket, "EVAL_DATA_KEY": data_key, "ENDPOINT_NAME": endpoint_name,
              "REPORT_PREFIX": report_prefix(stage), "RELEASE_ID": RELEASE_ID}
    outputs = {"MODEL_KEY_ARN": MODEL_KEY_OUTPUT}
    gate = StageCheck(name=GATE_STEP, install_commands=semif_tools_install_commands(), commands=gate_commands(),
                      env={**common, **baseline.env(), "GATE_LIMITS": gate_limits_json},
                      env_from_outputs=outputs, timeout=Duration.hours(1))
    load_check = StageCheck(
        name=LOAD_STEP, install_commands=semif_tools_install_commands(), commands=load_check_commands(),
        env={**common, "LOAD_CLIENTS": str(load.clients), "LOAD_DURATION_S": str(load.duration_s),
             "LOAD_MAX_ATTEMPTS": str(load.max_attempts), "LOAD_MAX_ELAPSED_S": f"{load.max_elapsed_s:g}",
             "LOAD_REQUEST_TIMEOUT_S": f"{load.request_timeout_s:g}", "LOAD_LIMITS": load.limits_json,
             "LOAD_BOUND_S": str(load.bound_s)},
        env_from_outputs=outputs, timeout=Duration.minutes(math.ceil((load.bound_s + 30 + STEP_OVERHEAD_S) / 60)))
    return [gate, load_check]


def promote_check(*, model_bucket: str, stage: str, baseline: BaselinePlace, role_arn: str, region: str) -> StageCheck:
    """In the baseline stage (prod), after its smoke test: ``stage``'s gated report, read as ``stage``'s check role
    (``role_arn``) in its bucket, becomes the baseline in ``baseline``'s bucket, written as prod's check role."""
    return StageCheck(name=PROMOTE_STEP, commands=promote_baseline_commands(), role_arn=role_arn, region=region,
                      env={"MODEL_BUCKET": model_bucket, "REPORT_PREFIX": report_prefix(stage),
                           "RELEASE_ID": RELEASE_ID, **baseline.env()},
                      timeout=Duration.minutes(15))
