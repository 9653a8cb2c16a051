"""The demo's sensors: the library's (``volley_dagster.dagster.sensors``), one per
pipeline, running from the start and cutting an epoch as soon as events land; the
demo can be served with them stopped (``VOLLEY_DEMO_SENSORS=stopped``), to cut and
run epochs by hand from the UI."""

import os
from dataclasses import replace

from volley_dagster.deploy import Deployment


def with_demo_sensors(deployment: Deployment) -> Deployment:
    running = os.environ.get("VOLLEY_DEMO_SENSORS", "running") != "stopped"
    return replace(deployment, sensor_running=running)
