"""``<pipeline>_cut_job``: cut the epochs waiting in the source and register them as
partitions, from the command line (``dg launch --job payments_cut_job``) or the UI's
Launchpad, for a project that runs no sensor or wants an epoch now.

The sensor does the same on each tick (with its ``min_records`` and ``max_wait_s``);
this cuts whatever waits. The cut is recorded once (the epoch log's exclusive create:
a sensor cutting at the same moment records the same range or the next), so no pool
is needed; running the epochs is the epochs job's, which the op's log names with the
partition range to launch.
"""

from dagster import JobDefinition, MetadataValue, OpExecutionContext, job, op

from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.epochs import EPOCH_EXECUTOR, PIPELINE_TAG, epochs_job_name, make_runner
from volley_dagster.dagster.resources import CheckpointResource, TablesResource
from volley_dagster.dagster.sensors import committed_elsewhere, register_epochs
from volley_dagster.deploy import Deployment

MAX_CUTS = 1000  # one run cuts at most this many epochs (max_records_per_epoch each); a next run cuts on


def cut_job_name(pipeline: str) -> str:
    return f"{pipeline}_cut_job"


def cut_job(deployment: Deployment) -> JobDefinition:
    name = deployment.name

    @op(name=f"{name}_cut", tags={PIPELINE_TAG: name})
    def cut(context: OpExecutionContext, volley_checkpoints: CheckpointResource, volley_tables: TablesResource) -> None:
        """Cuts every epoch the records waiting in the source fill (up to
        max_records_per_epoch each), registers the cut epochs as partitions, and names
        the run that commits them."""
        runner = make_runner(deployment, volley_checkpoints, volley_tables)
        before = runner.log.last_cut()
        for _ in range(MAX_CUTS):
            if runner.cut_next() is None:
                break
        last_cut, committed = runner.log.last_cut(), runner.committed_epoch()
        new_keys = register_epochs(context.instance, runner, deployment)
        for event in committed_elsewhere(runner, deployment, new_keys):
            context.log_event(event)
        cut_now = f"cut {_epochs(before + 1, last_cut)}" if last_cut > before else "nothing waits to be cut"
        if committed < last_cut:
            first, last = epoch_key(committed + 1), epoch_key(last_cut)
            partitions = f"--partition {first}" if first == last else f"--partition-range {first}...{last}"
            waits = "waits" if first == last else "wait"
            todo = (f"{_epochs(committed + 1, last_cut)} {waits} to run: the sensor requests them, or run "
                    f"`dg launch --job {epochs_job_name(name)} {partitions}`")
        else:
            todo = f"every cut epoch is committed (the last is {committed})"
        context.log.info(f"{name}: {cut_now}; registered {len(new_keys)} partition(s); {todo}")
        context.add_output_metadata({
            "epochs_cut": MetadataValue.int(last_cut - before), "last_cut_epoch": MetadataValue.int(last_cut),
            "committed_epoch": MetadataValue.int(committed), "partitions_registered": MetadataValue.int(len(new_keys)),
            "records_waiting": MetadataValue.int(runner.backlog().records)})

    @job(name=cut_job_name(name), tags={PIPELINE_TAG: name}, executor_def=EPOCH_EXECUTOR,
         description=f"Cut the epochs of {name!r} that the records waiting in its source fill and register them "
                     f"as partitions (what the sensor does on a tick), without running them: then launch "
                     f"{epochs_job_name(name)} or the state asset over those partitions.")
    def cut_epochs() -> None:
        cut()

    return cut_epochs


def _epochs(first: int, last: int) -> str:
    return f"epoch {first}" if first == last else f"epochs {first}..{last}"
