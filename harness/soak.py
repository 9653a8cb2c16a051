"""An hour of faults with nobody watching (issue 76, point 6): the demo's three pipelines
(the running aggregate, the 1-minute windows, the interval join; ``soak_location.py``)
under a real ``dagster dev``, sensors running, runs on the warm Spark, snapshots and
tables on a real S3 server (SeaweedFS). A file lands in each log every few seconds.
Every 1-3 minutes one fault, drawn at random (seeded):

- ``kill_run_worker``: ``kill -9`` of a run worker holding a pipeline's lease, and
  everything it started;
- ``kill_daemon``: ``kill -9`` of the Dagster daemon (``dagster dev`` then shuts down,
  and the supervisor below starts it again);
- ``kill_dagster_dev``: ``kill -9`` of the whole ``dagster dev`` process group (a
  crashed machine), then a restart as a process supervisor would do it;
- ``kill_spark_executor``: ``kill -9`` of the warm Spark's Python workers mid-stage
  (its JVM when no stage runs);
- ``storage_outage``: the S3 server stopped for 1-5 minutes: neither snapshots nor
  tables can be written;
- ``cancel_run``: a run in flight cancelled through GraphQL, as the UI's Terminate does.

The supervisor restarts ``dagster dev`` whenever it is down, as systemd would; nothing
else acts on the pipelines. At the end landing stops, S3 serves, and the soak waits for
every landed record to be committed, then ``soak_oracle.py`` checks every table exactly,
from the files and the recorded ranges. ``bench/soak.py`` runs it from the command line;
``tests/ui/test_soak.py`` runs 3 minutes of it in the deep lane."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

import psutil
from dagster import DagsterRunStatus

from harness import soak_oracle as oracle
from harness.dagster_dev import DagsterDev, start_dagster_dev
from harness.seaweedfs import SeaweedFS, start_seaweedfs
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.lease import current_holder
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, merchant_minutes_pipeline, payments_pipeline
from volley_dagster.demo.refunds import refunds_pipeline, write_refund_logs
from volley_dagster.spark.warm import read_record

ROOT = Path(__file__).resolve().parents[1]
LOCATION = Path(__file__).with_name("soak_location.py")
BUCKET = "volley-soak"
PIPELINES = ("payments", "merchant_minutes", "refunds")
FAULTS = ("kill_run_worker", "kill_daemon", "kill_dagster_dev", "kill_spark_executor", "storage_outage", "cancel_run")
KEYS, PER_FILE, JOIN_PER_FILE = 200, 1_000, 300
TERMINATE = """
mutation SoakTerminate($runIds: [String!]!) {
  terminateRuns(runIds: $runIds, terminatePolicy: SAFE_TERMINATE) {
    __typename
    ... on TerminateRunsResult { terminateRunResults { __typename } }
  }
}
"""


@dataclass
class SoakReport:
    seconds: float
    files: int  # landed in each log
    faults: Counter[str] = field(default_factory=Counter)
    missed: Counter[str] = field(default_factory=Counter)  # drawn, but nothing to hit then (no run in flight)
    runs: Counter[str] = field(default_factory=Counter)  # every run of the soak, by status
    restarts: int = 0  # of dagster dev, by the supervisor
    longest_wait_s: dict[str, float] = field(default_factory=dict)  # per pipeline: landing -> its epoch committed
    healed_s: float = 0.0  # from the end of landing to every record committed
    human_actions: int = 0  # runs launched by anything but a sensor or a run retry
    verdicts: list[oracle.Verdict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts) and self.human_actions == 0

    def describe(self) -> str:
        lines = [f"soak: {self.seconds / 60:.1f} min, {self.files} files landed in each log, "
                 f"{self.restarts} restarts of dagster dev by the supervisor",
                 "faults injected: " + ", ".join(f"{k} {self.faults[k]}" for k in FAULTS)
                 + (f" (drawn with nothing to hit: {dict(self.missed)})" if self.missed else ""),
                 "runs by status: " + ", ".join(f"{k} {v}" for k, v in sorted(self.runs.items())),
                 "longest wait of a file for its epoch's commit: "
                 + ", ".join(f"{p} {s:.0f} s" for p, s in self.longest_wait_s.items()),
                 f"every record committed {self.healed_s:.0f} s after the last file landed; "
                 f"runs launched by a person: {self.human_actions}"]
        for v in self.verdicts:
            lines.append(f"oracle {v.pipeline}: {'PASS' if v.passed else 'FAIL'}: " + "; ".join(v.checks + v.problems))
        lines.append(f"verdict: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(lines)


class Soak:
    def __init__(self, base: Path, seed: int, land_every_s: float, outage_s: tuple[float, float],
                 say: Callable[[str], None]) -> None:
        self.base, self.rng, self.land_every_s, self.say = base, random.Random(seed), land_every_s, say
        self.outage_s = outage_s
        self.s3: SeaweedFS | None = None
        self.srv: DagsterDev | None = None
        self.landed: list[float] = []  # when file i landed, in every log
        self.stop_landing = threading.Event()
        self.report = SoakReport(0.0, 0)
        self.serving = threading.Lock()

    # -- the world -----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        assert self.s3 is not None
        return {"VOLLEY_SOAK_BASE": str(self.base), "VOLLEY_SOAK_BUCKET": BUCKET,
                "VOLLEY_SOAK_S3_ENDPOINT": self.s3.s3.endpoint_url, "AWS_ACCESS_KEY_ID": self.s3.s3.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.s3.s3.secret_access_key}

    def start_dagster(self) -> None:
        # from the checkout's root: from harness/, its dagster_graphql.py would shadow Dagster's package
        self.srv = start_dagster_dev(LOCATION.with_name("soak_workspace.yaml"), dagster_yaml=ROOT / "dagster.yaml",
                                     overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}},
                                     home=self.base / "dagster_home", env=self.env(), cwd=ROOT)

    def supervise(self) -> None:
        """As systemd would: a ``dagster dev`` that is down is started again."""
        with self.serving:
            if self.srv is not None and self.srv.alive():
                return
            if self.srv is not None:
                self.srv.stop()
            self.say("supervisor: dagster dev is down; starting it again")
            self.start_dagster()
            self.report.restarts += 1

    def land(self) -> None:
        while not self.stop_landing.is_set():
            i = len(self.landed)
            generate(self.base / "events", 1, PER_FILE, KEYS, first_file=i)
            write_refund_logs(self.base / "streams", 1, JOIN_PER_FILE, first_file=i)
            self.landed.append(time.time())
            self.stop_landing.wait(self.land_every_s)

    def runners(self) -> dict[str, EpochRunner]:
        """The pipelines as the soak reads them (their sources and epoch logs; local
        sinks that are never written: nothing here runs an epoch)."""
        tables = local_tables(self.base / "unused-tables")
        return {"payments": EpochRunner(payments_pipeline(self.base / "events", tables), self.base / "state" / "payments"),
                "merchant_minutes": EpochRunner(merchant_minutes_pipeline(self.base / "events", tables),
                                                self.base / "state" / "merchant_minutes"),
                "refunds": EpochRunner(refunds_pipeline(self.base / "streams", tables), self.base / "state" / "refunds")}

    def all_committed(self) -> bool:
        """Every landed record of every pipeline in a committed epoch."""
        return all(r.records_waiting() == 0 and r.committed_epoch() == r.log.last_cut() > 0
                   for r in self.runners().values())

    # -- the faults ----------------------------------------------------------------------

    def lease_holders(self) -> list[int]:
        pids = []
        for p in PIPELINES:
            holder = current_holder(self.base / "state" / p)
            if holder is not None and holder.released_at is None and psutil.pid_exists(holder.pid):
                pids.append(holder.pid)
        return pids

    def wait_target(self, find: Callable[[], list[int]], timeout: float = 90.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = find()
            if found:
                return found
            self.supervise()
            time.sleep(0.5)
        return []

    def inject(self, fault: str) -> bool:
        """One fault; False when there was nothing to hit (no run in flight then)."""
        assert self.srv is not None and self.s3 is not None
        if fault == "kill_run_worker":
            pids = self.wait_target(self.lease_holders)
            for pid in pids[:1]:
                _kill_tree(pid)
            return bool(pids)
        if fault == "kill_daemon":
            pids = [p.pid for p in _descendants(self.srv.proc.pid)
                    if any(name in " ".join(_cmdline(p)) for name in ("dagster._daemon", "dagster-daemon"))]
            for pid in pids[:1]:
                os.kill(pid, signal.SIGKILL)
            return bool(pids)
        if fault == "kill_dagster_dev":
            with self.serving:
                try:
                    os.killpg(self.srv.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.srv.stop()  # stragglers outside the group
            return True
        if fault == "kill_spark_executor":
            pids = self.wait_target(self.spark_workers, 60.0)
            if not pids:
                record = read_record(self.base / "dagster_home" / "warm-spark")
                pids = [record.server_pid] if record is not None and record.server_pid else []
            for pid in pids[:1]:
                _kill_tree(pid)
            return bool(pids)
        if fault == "storage_outage":
            seconds = self.rng.uniform(*self.outage_s)
            self.s3.stop(grace_s=0)
            self.say(f"  S3 down for {seconds:.0f} s")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                self.supervise()
                time.sleep(1)
            self.s3.restart()
            return True
        assert fault == "cancel_run"
        run_ids = self.wait_target(lambda: self.runs_in_flight())  # type: ignore[arg-type,return-value]
        for run_id in run_ids[:1]:
            self.srv.client.execute(TERMINATE, {"runIds": [run_id]})
        return bool(run_ids)

    def spark_workers(self) -> list[int]:
        record = read_record(self.base / "dagster_home" / "warm-spark")
        if record is None or not record.server_pid:
            return []
        return [p.pid for p in _descendants(record.server_pid) if "pyspark" in " ".join(_cmdline(p))
                and "daemon" in " ".join(_cmdline(p))]

    def runs_in_flight(self) -> list[str]:
        assert self.srv is not None
        with self.srv.instance() as instance:
            from dagster import RunsFilter

            records = instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.STARTED]))
            return [r.dagster_run.run_id for r in records]

    # -- the run -------------------------------------------------------------------------

    def run(self, seconds: float, fault_every: tuple[float, float], heal_within_s: float) -> SoakReport:
        started = time.time()
        self.s3 = start_seaweedfs(self.base / "s3", bucket=BUCKET)
        lander = threading.Thread(target=self.land, daemon=True)
        try:
            self.start_dagster()
            lander.start()
            next_fault = time.monotonic() + self.rng.uniform(*fault_every)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                self.supervise()
                if time.monotonic() >= next_fault:
                    fault = self.rng.choice(FAULTS)
                    self.say(f"{datetime.now().isoformat(timespec='seconds')} fault: {fault}")
                    if self.inject(fault):
                        self.report.faults[fault] += 1
                    else:
                        self.report.missed[fault] += 1
                    next_fault = time.monotonic() + self.rng.uniform(*fault_every)
                time.sleep(1)
            self.stop_landing.set()
            lander.join()
            landed_end = time.time()
            deadline = time.monotonic() + heal_within_s
            while not self.all_committed():
                assert time.monotonic() < deadline, f"not every record committed {heal_within_s:.0f} s after landing"
                self.supervise()
                time.sleep(2)
            self.report.healed_s = time.time() - landed_end
            self.wait_runs_ended()
            self.report.seconds = time.time() - started
            self.report.files = len(self.landed)
            self.tally_runs()
            self.report.longest_wait_s = {p: self.longest_wait(p) for p in PIPELINES}
            self.report.verdicts = self.check_tables()
            return self.report
        finally:
            self.stop_landing.set()
            if self.srv is not None:
                self.srv.stop()
            self.s3.stop()

    def wait_runs_ended(self) -> None:
        deadline = time.monotonic() + 300
        while self.runs_in_flight() and time.monotonic() < deadline:
            time.sleep(1)

    def tally_runs(self) -> None:
        assert self.srv is not None
        with self.srv.instance() as instance:
            for record in instance.get_run_records():
                run = record.dagster_run
                self.report.runs[run.status.value] += 1
                tags = run.tags
                if not ({"dagster/sensor_name", "dagster/parent_run_id", "dagster/schedule_name"} & set(tags)):
                    self.report.human_actions += 1

    def longest_wait(self, pipeline: str) -> float:
        """The longest a landed file waited from landing to the commit of the epoch that
        read its last record."""
        log = EpochLog(self.base / "state" / pipeline)
        committed_at: dict[str, float] = {}
        for epoch in range(1, log.last_committed() + 1):
            at = datetime.fromisoformat(log.committed_manifest(epoch).committed_at).timestamp()
            for seg in log.offsets(epoch).segments:
                committed_at[seg.file] = max(committed_at.get(seg.file, 0.0), at)
        prefix = "payments-" if pipeline == "refunds" else "events-"
        waits = [committed_at[name] - landed for i, landed in enumerate(self.landed)
                 if (name := f"{prefix}{i:06d}.parquet") in committed_at]
        return max(waits, default=0.0)

    def recorded(self, pipeline: str) -> list[tuple[int, list[oracle.RecordedSegment]]]:
        return recorded_epochs(self.base / "state" / pipeline)

    def check_tables(self) -> list[oracle.Verdict]:
        assert self.s3 is not None
        endpoint = self.s3.s3
        storage = endpoint.delta_storage_options()
        catalog = {**endpoint.iceberg_properties(), "type": "sql", "uri": f"sqlite:///{self.base / 'iceberg-catalog.db'}",
                   "warehouse": f"s3://{BUCKET}/tables/iceberg"}
        tables = f"s3://{BUCKET}/tables/delta"
        return [
            oracle.check_payments(self.base / "events", [s for _, s in self.recorded("payments")],
                                  oracle.delta_table(f"{tables}/merchant_balances", storage),
                                  oracle.iceberg_table(catalog, "payments.merchant_changes")),
            oracle.check_minutes(self.base / "events", [s for _, s in self.recorded("merchant_minutes")],
                                 oracle.delta_table(f"{tables}/merchant_minutes", storage)),
            oracle.check_refunds(self.base / "streams", self.recorded("refunds"),
                                 oracle.delta_table(f"{tables}/payment_refunds", storage),
                                 oracle.iceberg_table(catalog, "payments.refund_changes")),
        ]


def recorded_epochs(state: Path) -> list[tuple[int, list[oracle.RecordedSegment]]]:
    """Each committed epoch of the checkpoint root ``state`` with its recorded range:
    the oracle's input (the engine reads it; the oracle does not)."""
    log = EpochLog(state)
    epochs = []
    for epoch in range(1, log.last_committed() + 1):
        segments = [oracle.RecordedSegment(s.id, s.partition.split("/")[0] if "/" in s.partition else "", s.file,
                                           s.start, s.end) for s in log.offsets(epoch).segments]
        epochs.append((epoch, segments))
    return epochs


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _kill_tree(pid: int) -> None:
    for victim in [pid] + [p.pid for p in _descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_soak(base: Path, *, minutes: float, seed: int = 76, land_every_s: float = 5.0,
             fault_every_s: tuple[float, float] = (60.0, 180.0), outage_s: tuple[float, float] = (60.0, 300.0),
             heal_within_s: float = 900.0, say: Callable[[str], None] = print) -> SoakReport:
    """``minutes`` of landing and faults (one every ``fault_every_s``, an S3 outage lasting
    ``outage_s``), then every record committed within ``heal_within_s``, then the oracle."""
    base.mkdir(parents=True, exist_ok=True)
    report = Soak(base, seed, land_every_s, outage_s, say).run(minutes * 60, fault_every_s, heal_within_s)
    say(report.describe())
    return report
