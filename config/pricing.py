"""Monthly on-demand cost of each environment's minimum capacity, from documented price constants.

The AWS price list is not reachable at synth (synth is offline), so the hourly prices are constants here,
with the date and region they are for. `app.py` prints the table at synth; docs/how-to/deploy-first-environment.md holds the same
table (a test keeps them equal). Update the constants (and PRICES_AS_OF) when the price page changes:
https://aws.amazon.com/sagemaker/pricing/ → "Real-Time Inference", region US East (N. Virginia).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PRICES_AS_OF = "2026-12-01"
PRICE_REGION = "us-east-1"
HOURS_PER_MONTH = 730
# SageMaker real-time inference, on-demand USD per instance-hour, us-east-1 (Linux). Copied by hand from the
# pricing page; not fetched. The numbers are what the table uses, so check them before quoting a budget.
HOURLY_USD: dict[str, float] = {
    "ml.c6i.large": 0.102,
    "ml.c6i.xlarge": 0.204,
    "ml.c6i.2xlarge": 0.408,
    "ml.c6i.4xlarge": 0.816,
    "ml.c6i.8xlarge": 1.632,
    "ml.g4dn.xlarge": 0.736,
    "ml.g5.xlarge": 1.408,
    "ml.g6.xlarge": 1.1267,
    "ml.g6e.xlarge": 2.6088,
}


def cost_per_thousand_records(instance_type: str, records_per_s: float) -> float:
    """Batch Transform (billed at the inference rate): instance time only, no startup, S3 or transfer;
    price per hour / records per hour × 1,000 (docs/how-to/batch-transform.md)."""
    return HOURLY_USD[instance_type] / (records_per_s * 3600) * 1000


@dataclass(frozen=True)
class CapacityCost:
    environment: str
    endpoint: str
    instance_type: str  # the one SageMaker tries first (the priority-1 pool)
    instances: int
    monthly_usd: Optional[float]  # None: no price constant for this type


def minimum_capacity_costs(settings) -> list[CapacityCost]:
    rows = []
    for env in settings.environments.values():
        for endpoint in (env.decision, env.text):
            if endpoint is None:
                continue
            if endpoint.instance_type:
                instance_type = endpoint.instance_type
            else:
                instance_type = min(endpoint.instance_pools, key=lambda p: p.priority).instance_type
            hourly = HOURLY_USD.get(instance_type)
            monthly = None if hourly is None else round(hourly * HOURS_PER_MONTH * endpoint.min_instances, 2)
            rows.append(CapacityCost(env.name, endpoint.endpoint_name, instance_type, endpoint.min_instances, monthly))
    return rows


def monthly_cost_table(settings) -> str:
    """A Markdown table: what each environment costs a month at its minimum capacity, running around the clock."""
    lines = [f"| environment | endpoint | instance type (priority 1) | min instances | USD / month |",
             "|---|---|---|---|---|"]
    totals: dict[str, float] = {}
    for row in minimum_capacity_costs(settings):
        cost = "no price constant" if row.monthly_usd is None else f"{row.monthly_usd:,.2f}"
        lines.append(f"| {row.environment} | {row.endpoint} | {row.instance_type} | {row.instances} | {cost} |")
        totals[row.environment] = totals.get(row.environment, 0.0) + (row.monthly_usd or 0.0)
    for name, total in totals.items():
        lines.append(f"| {name} | **total** | | | **{total:,.2f}** |")
    return "\n".join(lines)
