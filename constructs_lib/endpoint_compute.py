"""Where an endpoint variant runs: one instance type, or prioritized instance pools.

Validated here, at synth, so a bad environment file fails `cdk synth` with a clear message
instead of a CloudFormation rollback twenty minutes into a deploy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

MAX_INSTANCE_POOLS = 5
# ProductionVariant limits (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariant.html),
# as the SageMaker service model of the pinned boto3 states them (tests/cdk/test_endpoint_constructs.py compares):
# ContainerStartupHealthCheckTimeoutInSeconds and ModelDataDownloadTimeoutInSeconds 60 to 3600,
# VariantInstanceProvisionTimeoutInSeconds 300 to 3600, and the InferenceAmiVersion values.
MAX_TIMEOUT_S = 3600
MIN_MODEL_DOWNLOAD_S = 60
MIN_PROVISION_TIMEOUT_S = 300
INFERENCE_AMI_VERSIONS = (
    "al2-ami-sagemaker-inference-gpu-2",
    "al2-ami-sagemaker-inference-gpu-2-1",
    "al2-ami-sagemaker-inference-gpu-3-1",
    "al2-ami-sagemaker-inference-neuron-2",
    "al2023-ami-sagemaker-inference-gpu-4-1",
)
# Container startup health check: SageMaker accepts 60 s; this project requires 600 s, what the llama.cpp DLC's docs
# ask for (loading a GGUF on a cold instance).
MIN_STARTUP_HEALTH_CHECK_S = 600

_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")
# Families with local NVMe instance storage: SageMaker encrypts that storage in hardware and
# rejects a VolumeKmsKeyId (KmsKeyId) for them.
_LOCAL_STORAGE_FAMILY = re.compile(r"^(g4dn|g5|g6|g6e|g5g|p3dn|p4d|p4de|p5|p5e|p5en|inf2|trn1|[a-z]\d+[a-z]*d)$")
_GPU_FAMILY = re.compile(r"^(g\d+[a-z]*|p\d+[a-z]*)$")
# vCPUs by size suffix: the same across the c/m/r/g families SageMaker hosts (xlarge = 4 vCPUs).
VCPUS_BY_SIZE = {"large": 2, "xlarge": 4, "2xlarge": 8, "4xlarge": 16, "8xlarge": 32, "12xlarge": 48,
                 "16xlarge": 64, "24xlarge": 96, "32xlarge": 128, "48xlarge": 192}
# GPUs by size for the g4dn/g5/g6/g6e families (xlarge to 16xlarge carry one GPU); p-families carry 8.
_GPUS_BY_SIZE = {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}


# Positional as well (``InstancePool("ml.g6.xlarge", 1)``): app.py builds pools that way, and the pair reads plainly.
@dataclass(frozen=True)
class InstancePool:
    instance_type: str
    priority: int


@dataclass(frozen=True, kw_only=True)
class EndpointCompute:
    min_instances: int
    max_instances: int
    # Target of ConcurrentRequestsPerModel (in-flight requests per instance) for target tracking.
    target_concurrency: float
    model_download_timeout_s: int
    startup_health_check_timeout_s: int
    instance_type: Optional[str] = None
    instance_pools: Sequence[InstancePool] = field(default_factory=tuple)
    provision_timeout_s: Optional[int] = None
    autoscaling_enabled: bool = True
    inference_ami_version: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "instance_pools", tuple(self.instance_pools))
        problems = self._problems()
        if problems:
            raise ValueError("invalid endpoint compute: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems: list[str] = []
        pools = self.instance_pools
        if self.instance_type and pools:
            problems.append("set either instance_type or instance_pools, never both")
        if not self.instance_type and not pools:
            problems.append("set instance_type or instance_pools")
        if pools:
            if not 1 <= len(pools) <= MAX_INSTANCE_POOLS:
                problems.append(f"instance_pools needs 1 to {MAX_INSTANCE_POOLS} pools, got {len(pools)}")
            priorities = [p.priority for p in pools]
            if len(set(priorities)) != len(priorities):
                problems.append(f"instance pool priorities must be unique, got {priorities}")
            if any(not 1 <= p <= MAX_INSTANCE_POOLS for p in priorities):
                problems.append(f"instance pool priorities must be 1 to {MAX_INSTANCE_POOLS}, got {priorities}")
            types = [p.instance_type for p in pools]
            if len(set(types)) != len(types):
                problems.append(f"instance pool types must be unique, got {types}")
        elif self.provision_timeout_s is not None:
            problems.append("provision_timeout_s applies to instance_pools only")
        if self.provision_timeout_s is not None and not (
                MIN_PROVISION_TIMEOUT_S <= self.provision_timeout_s <= MAX_TIMEOUT_S):
            problems.append(f"provision_timeout_s must be {MIN_PROVISION_TIMEOUT_S} to {MAX_TIMEOUT_S}, "
                            f"got {self.provision_timeout_s}")
        for instance_type in self.instance_types:
            if not _INSTANCE_TYPE.match(instance_type):
                problems.append(f"'{instance_type}' is not a SageMaker instance type (ml.<family>.<size>)")
        if not 1 <= self.min_instances <= self.max_instances:
            problems.append(f"need 1 <= min_instances ({self.min_instances}) <= max_instances ({self.max_instances})")
        if self.target_concurrency <= 0:
            problems.append("target_concurrency must be positive")
        if not MIN_STARTUP_HEALTH_CHECK_S <= self.startup_health_check_timeout_s <= MAX_TIMEOUT_S:
            problems.append(f"startup_health_check_timeout_s must be {MIN_STARTUP_HEALTH_CHECK_S} to {MAX_TIMEOUT_S}")
        if not MIN_MODEL_DOWNLOAD_S <= self.model_download_timeout_s <= MAX_TIMEOUT_S:
            problems.append(f"model_download_timeout_s must be {MIN_MODEL_DOWNLOAD_S} to {MAX_TIMEOUT_S}")
        if self.inference_ami_version is not None and self.inference_ami_version not in INFERENCE_AMI_VERSIONS:
            problems.append(f"inference_ami_version {self.inference_ami_version!r} is not one of "
                            f"{', '.join(INFERENCE_AMI_VERSIONS)}")
        if self.inference_ami_version and not self.has_gpu:
            problems.append("inference_ami_version is for GPU instance types only")
        return problems

    @property
    def instance_types(self) -> tuple[str, ...]:
        return (self.instance_type,) if self.instance_type else tuple(p.instance_type for p in self.pools_by_priority)

    @property
    def pools_by_priority(self) -> tuple[InstancePool, ...]:
        return tuple(sorted(self.instance_pools, key=lambda p: p.priority))

    @property
    def supports_volume_kms_key(self) -> bool:
        """False when any instance type has local NVMe storage (SageMaker refuses a volume key there)."""
        return not any(_LOCAL_STORAGE_FAMILY.match(t.split(".")[1]) for t in self.instance_types)

    @property
    def has_gpu(self) -> bool:
        return all(_GPU_FAMILY.match(t.split(".")[1]) for t in self.instance_types)

    @property
    def min_vcpus(self) -> int:
        """The fewest vCPUs any instance type offers (CPUUtilization is reported as % x vCPUs)."""
        return min(VCPUS_BY_SIZE.get(t.split(".")[2], 4) for t in self.instance_types)

    @property
    def min_gpus(self) -> int:
        """The fewest GPUs any instance type offers (GPU metrics are reported as % x GPUs)."""
        if not self.has_gpu:
            return 0
        return min(8 if t.split(".")[1].startswith("p") else _GPUS_BY_SIZE.get(t.split(".")[2], 1)
                   for t in self.instance_types)
