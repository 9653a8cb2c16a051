"""The Dagster code location: ``dagster dev -w workspace.yaml`` (or ``./dev dagster``).

The demo pipelines (``assets/``), over the demo's resources (``resources/``), with
their sensors (``sensors/``), built by the library a team's own project uses too
(``volley_dagster.dagster.build_definitions``).
"""

from dagster import in_process_executor

from assets import demo_deployments
from resources import demo_checkpoints, demo_spark, demo_tables
from sensors import with_demo_sensors
from volley_dagster.dagster import build_definitions

defs = build_definitions(
    [with_demo_sensors(d) for d in demo_deployments()],
    checkpoints=demo_checkpoints(),
    tables=demo_tables(),
    spark=demo_spark(),
    executor=in_process_executor,  # this location's own default too: one step per run, Spark in the run's process
)
