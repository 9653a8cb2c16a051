"""How often a deployment cuts epochs, as Dagster schedules them: what its freshness
bound follows when the deployment sets none."""

import time
from typing import Optional

from dagster._utils.schedules import cron_string_iterator  # Dagster's own schedule clock

from volley_dagster.deploy import Deployment

FIRES_SAMPLED = 64  # enough to cover a week of an hourly cron, a month of a daily one


def cron_period_s(cron: str, now: Optional[float] = None) -> float:
    """The longest gap between the cron's next fires (``0 9 * * 1-5`` has 3 days over
    a weekend): the longest a record may wait for the schedule."""
    fires = cron_string_iterator(time.time() if now is None else now, cron, "UTC")
    stamps = [next(fires).timestamp() for _ in range(FIRES_SAMPLED)]
    return max(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def freshness_bound_s(deployment: Deployment) -> float:
    cron = deployment.cron if deployment.schedule_running else None
    return deployment.freshness_bound(cron_period_s(cron) if cron else None)
