"""``volley``: the command line. ``volley demo`` is the README's first command."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.lease import current_holder
from volley_dagster.errors import ConfigError
from volley_dagster.settings import RunSettings
from volley_dagster.sinks import DeltaSink, IcebergSink

if TYPE_CHECKING:
    from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_usage(root: Path) -> int:
    """Bytes on disk under ``root``, each hardlinked file counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def describe_checkpoints(root: Path) -> str:
    log = EpochLog(root)
    lines = [f"{root}/  ({_human(disk_usage(root))} on disk, hardlinks counted once)"]
    lines.append(f"  pipeline.json  lineage {log.lineage().id}" if log.has_identity() else "  pipeline.json")
    for binding in sorted((root / "sinks").glob("*.json")) if (root / "sinks").is_dir() else []:
        chosen = log.sink_binding(binding.stem)
        if chosen is None:
            continue
        lines.append(f"  sinks/{binding.name}  {chosen.choice!r} after {chosen.foreign.describe()}, "
                     f"from this lineage's epoch {chosen.first_epoch}")
    holder = current_holder(root)
    if holder is not None:
        held = "released" if holder.released_at else "held" if holder.is_live(time.time()) else "holder gone"
        lines.append(f"  lease/  {held}: {holder.describe()}")
    for change in log.layout_changes():
        migrated = (f"; migrated to {[a['name'] for a in change.aggregate['accumulators']]}"
                    if change.aggregate is not None else "")
        lines.append(f"  layouts/{change.sequence:010d}.json  from epoch {change.from_epoch}: {change.num_shards} shards "
                     f"(was {change.previous_shards}; epoch {change.snapshot_epoch}'s state rewritten{migrated})")
    for epoch in log.epochs_cut():
        state = "committed" if log.is_committed(epoch) else "cut, not committed"
        lines.append(f"  epochs/{epoch:010d}/  offsets.json{', manifest.json' if log.is_committed(epoch) else ''}  [{state}]")
    for epoch in log.retained_snapshots():
        shards = sorted((root / "snapshots" / f"{epoch:010d}").iterdir())
        sizes = ", ".join(f"{p.name} {_human(disk_usage(p))}" for p in shards)
        lines.append(f"  snapshots/{epoch:010d}/  {sizes}")
    return "\n".join(lines)


def demo(args: argparse.Namespace) -> int:
    from volley_dagster import EpochRunner
    from volley_dagster.demo.merchant_refunds import merchant_refunds_pipeline
    from volley_dagster.demo.payments import local_tables, merchant_minutes_pipeline, payments_pipeline
    from volley_dagster.demo.refunds import refunds_pipeline
    from volley_dagster.demo.velocity import velocity_pipeline

    work = Path(args.workdir).absolute()
    generate_events(args)
    tables = local_tables(work / "tables")
    pipeline = payments_pipeline(work / "events", tables, shards=args.shards)
    runner = EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=args.max_records, keep_epochs=args.keep))
    if not run_and_print(runner):
        return 1
    print_tables(runner)
    print("\ncheckpoint layout:")
    print(describe_checkpoints(runner.log.root))
    demo_windows(merchant_minutes_pipeline(work / "events", tables, shards=args.shards), work, args, runner.spark)
    demo_join(refunds_pipeline(work / "streams", tables, shards=args.shards), work, args, runner.spark)
    demo_chain(merchant_refunds_pipeline(tables), work, args, runner.spark)
    demo_velocity(velocity_pipeline(work / "events", tables, cards=args.keys, shards=args.shards), work, args,
                  runner.spark)
    print(f"\nnext: './dev dagster' serves the Dagster UI at http://127.0.0.1:3000 over {work}; "
          f"'.venv/bin/volley generate --workdir {args.workdir}' appends events for its sensor to cut")
    return 0


def demo_kafka(args: argparse.Namespace) -> int:
    """The payments pipeline on a Kafka topic, writing its output to another topic too:
    on librdkafka's mock cluster (harness/kafka.py), or ``--bootstrap-servers``."""
    import shutil

    from volley_dagster import EpochRunner
    from volley_dagster.demo.events import EVENT_SCHEMA
    from volley_dagster.demo.kafka import produce_events
    from volley_dagster.demo.payments import local_tables, payments_pipeline
    from volley_dagster.sinks.kafka import KafkaSink
    from volley_dagster.sources.kafka import KafkaSource

    work = Path(args.workdir).absolute() / "kafka"
    cluster = None
    bootstrap = args.bootstrap_servers
    if bootstrap is None:
        try:
            from harness.kafka import start_kafka  # the checkout's, not the package's
        except ModuleNotFoundError:
            print("volley demo --kafka: librdkafka's mock cluster starts from this project's checkout "
                  "(harness/kafka.py), which an installed package does not carry: run `./dev demo --kafka` in "
                  "the checkout, or name a Kafka cluster with --bootstrap-servers HOST:PORT", file=sys.stderr)
            return 2
        cluster = start_kafka()
        bootstrap = cluster.bootstrap_servers
        shutil.rmtree(work, ignore_errors=True)  # a new mock cluster holds none of the topics a last run read
        print(f"Kafka: librdkafka's mock cluster at {bootstrap} (a real cluster: --bootstrap-servers)")
    try:
        produced = produce_events(bootstrap, "payments", args.files, args.records_per_file, args.keys,
                                  seed=args.seed)
        print(f"produced {produced:,} payment events to the topic 'payments'")
        pipeline = payments_pipeline(KafkaSource("payments", bootstrap, EVENT_SCHEMA), local_tables(work / "tables"),
                                     shards=args.shards).sink(KafkaSink("merchant-totals", bootstrap, name="totals"))
        runner = EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=args.max_records, keep_epochs=args.keep))
        if not run_and_print(runner):
            return 1
        print_tables(runner)
        first = {s.partition: s.start for s in runner.log.offsets(1).segments}
        if any(first.values()):  # a partition's earliest record was past offset 0 when epoch 1 was cut
            starts = ", ".join(f"{p}: {o:,}" for p, o in sorted(first.items()))
            print(f"\nThe topic's partitions began at offsets {starts} when epoch 1 was cut: the broker had deleted "
                  f"{sum(first.values()):,} of the {produced:,} events before the pipeline first read it"
                  + (" (librdkafka's mock cluster keeps only the newest few megabytes of each partition)" if cluster is not None else "")
                  + ". A new pipeline starts at each partition's earliest record, as Spark's "
                  "startingOffsets=earliest does; produce fewer (--files, --records-per-file) to read them all.")
        totals = pipeline.sinks[-1]
        assert isinstance(totals, KafkaSink)
        counts: dict[int, int] = {}
        for row in totals.read(pipeline.name):
            counts[row["_epoch"]] = counts.get(row["_epoch"], 0) + 1
        print("\nKafka topic 'merchant-totals' (one transaction per epoch, read_committed): "
              + ", ".join(f"epoch {e}: {n:,} records" for e, n in sorted(counts.items())))
    finally:
        if cluster is not None:
            cluster.stop()
    return 0


def run_and_print(runner: Any) -> bool:
    """Run every waiting epoch, a line each; False when none is committed."""
    print(f"starting Spark ({os.environ.get('VOLLEY_SPARK_MASTER', 'local[*]')}) ...")
    print(f"{'epoch':>5} {'records':>9} {'dead':>5} {'keys':>7} {'new':>7} {'rec/s':>9} {'seconds':>8}  range")
    for r in runner.run_available():
        rng = "; ".join(f"{p or '.'}: {v}" for p, v in r.range.items())
        print(
            f"{r.epoch:>5} {r.records_in:>9,} {r.dead_letters:>5} {r.keys_touched:>7,} {r.new_keys:>7,} "
            f"{r.records_per_second:>9,.0f} {r.durations['total']:>8.2f}  {rng}"
        )
    if not runner.committed_epoch():
        print("no epochs committed")
        return False
    return True


def print_tables(runner: Any) -> None:
    """The demo payments pipeline's Delta and Iceberg tables."""
    pipeline = runner.pipeline
    balances, changes = pipeline.sinks[:2]
    assert isinstance(balances, DeltaSink) and isinstance(changes, IcebergSink)  # the demo pipeline's
    delta = balances.read().sort_by([("total", "descending")])
    print(f"\nDelta table {balances.uri} (upsert, epoch {balances.committed_epoch(pipeline.name)}): "
          f"{delta.num_rows:,} merchants; top 5 by total:")
    print(delta.slice(0, 5).to_pandas().to_string(index=False))
    history = changes.epoch_history(pipeline.name, runner.log.lineage())
    print(f"\nIceberg table {changes.identifier} (append, epoch {changes.committed_epoch(pipeline.name)}): "
          + ", ".join(f"epoch {e}: {rows[0]:,} rows" for e, rows in sorted(history.items())))


def demo_windows(pipeline, work: Path, args: argparse.Namespace, spark) -> None:
    """The same events through 1-minute tumbling windows: fired windows, late records, watermark."""
    from volley_dagster import EpochRunner
    from volley_dagster.operators.event_time import describe_event_time

    runner = EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=args.max_records, keep_epochs=args.keep), spark=spark)
    print(f"\n{pipeline.name}: 1-minute tumbling windows per merchant, watermark 30 s behind the latest event")
    print(f"{'epoch':>5} {'records':>9} {'fired':>7} {'late':>5} {'rec/s':>9} {'seconds':>8}  watermark")
    for r in runner.run_available():
        mark = describe_event_time(r.watermark) if r.watermark else "-"
        print(f"{r.epoch:>5} {r.records_in:>9,} {r.records_out:>7,} {r.late_records:>5} "
              f"{r.records_per_second:>9,.0f} {r.durations['total']:>8.2f}  {mark}")
    (minutes,) = pipeline.sinks
    print(f"Delta table {minutes.uri} (append): {minutes.read().num_rows:,} closed windows; "
          f"{runner.read_state().num_rows:,} still open")


def demo_join(pipeline, work: Path, args: argparse.Namespace, spark) -> None:
    """Payments joined with their refunds within 30 minutes: pairs, payments never refunded, late refunds."""
    from volley_dagster import EpochRunner

    runner = EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=args.max_records, keep_epochs=args.keep), spark=spark)
    print(f"\n{pipeline.name}: payments joined with their refunds within 30 minutes (left outer, "
          "each side's watermark 1 minute behind its latest event, the join's the lesser)")
    print(f"{'epoch':>5} {'records':>9} {'pairs':>7} {'unrefunded':>10} {'late':>5} {'waiting':>8} {'seconds':>8}")
    for r in runner.run_available():
        waiting = r.figures.get("join_left_rows", 0) + r.figures.get("join_right_rows", 0)
        print(f"{r.epoch:>5} {r.records_in:>9,} {r.figures.get('join_pairs', 0):>7,} "
              f"{r.figures.get('join_unmatched', 0):>10,} {r.late_records:>5} {waiting:>8,} {r.durations['total']:>8.2f}")
    joined = pipeline.sinks[0]
    print(f"Delta table {joined.uri} (upsert by payment and both row ids): {joined.read().num_rows:,} rows")


def demo_chain(pipeline, work: Path, args: argparse.Namespace, spark) -> None:
    """A pipeline fed by another: refunds per merchant per hour, read from the join's Iceberg table."""
    from volley_dagster import EpochRunner

    runner = EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=args.max_records, keep_epochs=args.keep), spark=spark)
    print(f"\n{pipeline.name}: refunds per merchant per hour, read from the join's Iceberg table (a pipeline fed by "
          "another: each epoch reads the snapshots the join appended since the last)")
    print(f"{'epoch':>5} {'records':>9} {'hours':>7} {'late':>5} {'opened':>6} {'seconds':>8}")
    for r in runner.run_available():
        print(f"{r.epoch:>5} {r.records_in:>9,} {r.records_out:>7,} {r.late_records:>5} "
              f"{r.figures.get('windows_opened', 0):>6,} {r.durations['total']:>8.2f}")
    (hours,) = pipeline.sinks
    print(f"Delta table {hours.uri} (append): {hours.read().num_rows:,} merchant hours")


def demo_velocity(pipeline, work: Path, args: argparse.Namespace, spark) -> None:
    """A team's own processor (``Pipeline.process``): an alert when a merchant's card pays five times in a minute."""
    from volley_dagster import EpochRunner

    runner = EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=args.max_records, keep_epochs=args.keep), spark=spark)
    print(f"\n{pipeline.name}: a processor of our own (demo/velocity.py): an alert when a card pays five times "
          "within a minute, each card's recent payments in list state, aged out by event-time timers")
    print(f"{'epoch':>5} {'records':>9} {'alerts':>7} {'timers':>7} {'late':>5} {'state rows':>10} {'seconds':>8}")
    for r in runner.run_available():
        print(f"{r.epoch:>5} {r.records_in:>9,} {r.records_out:>7,} {r.figures.get('process_timers_fired', 0):>7,} "
              f"{r.late_records:>5} {r.figures.get('process_state_rows', 0):>10,} {r.durations['total']:>8.2f}")
    (alerts,) = pipeline.sinks
    print(f"Delta table {alerts.uri} (append): {alerts.read().num_rows:,} alerts")


def _generate(args: argparse.Namespace) -> int:
    generate_events(args)
    return 0


def generate_events(args: argparse.Namespace) -> None:
    from volley_dagster.demo.events import generate
    from volley_dagster.demo.refunds import write_refund_logs

    events = Path(args.workdir).absolute() / "events"
    existing = len(list(events.glob("events-*.parquet"))) if events.exists() else 0
    files = generate(events, args.files, args.records_per_file, args.keys, first_file=existing, seed=args.seed)
    print(f"appended {len(files)} files of {args.records_per_file:,} payment events to {events}")
    streams = Path(args.workdir).absolute() / "streams"
    written = len(list((streams / "payments").glob("*.parquet"))) if (streams / "payments").exists() else 0
    write_refund_logs(streams, args.files, args.records_per_file, args.keys, first_file=written, seed=args.seed)
    print(f"appended {args.files} files of payments and of their refunds to {streams}")


def spark_connect(args: argparse.Namespace) -> int:
    from volley_dagster.spark.connect import start_connect_server

    server = start_connect_server(args.port, args.master, Path(f"spark-connect-{args.port}.log").absolute())
    print(f"Spark Connect at {server.url} (log {server.log}); runs use it with VOLLEY_SPARK_REMOTE={server.url}")
    try:
        return server.process.wait()
    except KeyboardInterrupt:
        server.stop()
        return 0


def warm_spark(args: argparse.Namespace) -> int:
    from volley_dagster.spark.warm import find_or_start

    print(find_or_start(owner_pid=args.owner).url)
    return 0


def dagster_instance(args: argparse.Namespace) -> int:
    """Prints the dagster.yaml sections a deployment needs, or merges them into one."""
    from volley_dagster.dagster.instance import instance_settings_yaml, merge_instance_settings

    if args.merge is None:
        print(instance_settings_yaml(warm_launcher=args.warm_launcher), end="")
        return 0
    try:
        changes = merge_instance_settings(args.merge, warm_launcher=args.warm_launcher)
    except (ConfigError, OSError) as exc:
        print(f"volley dagster-instance: {exc}", file=sys.stderr)
        return 1
    if not changes:
        print(f"{args.merge}: has every setting already; nothing changed")
    for change in changes:
        print(f"{args.merge}: {change}")
    if changes:
        print("restart the Dagster daemon and webserver (or dagster dev) to apply them")
    return 0


def inspect_root(args: argparse.Namespace) -> int:
    print(describe_checkpoints(Path(args.checkpoint_root).absolute()))
    return 0


def snapshot_store(args: argparse.Namespace, pipeline: str) -> S3SnapshotStore | None:
    """The pipeline's snapshot store, as ``CheckpointResource.snapshot_store`` names it
    (``<uri>/<pipeline>``), so that executors on their own disks find a rewrite there;
    the credentials are boto3's usual environment variables."""
    if not args.snapshot_store:
        return None
    from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
    from volley_dagster.io.s3 import S3Endpoint

    endpoint = None
    if args.s3_endpoint:
        missing = [v for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(v)]
        if missing:
            raise ConfigError(f"--s3-endpoint needs {' and '.join(missing)} set in the environment")
        endpoint = S3Endpoint(args.s3_endpoint, os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    return S3SnapshotStore(f"{args.snapshot_store.rstrip('/')}/{pipeline}", endpoint)


def rescale_root(args: argparse.Namespace) -> int:
    """Rewrite the last committed epoch's state into ``--shards`` shards, from the
    checkpoint root alone (no pipeline code, no Spark), holding the pipeline's lease:
    it waits up to ``--wait`` seconds for a run to finish, and no run commits meanwhile.
    A chain's every stage (``chain.py``)."""
    from volley_dagster.checkpoint.lease import PipelineLease
    from volley_dagster.checkpoint.rescale import rescale
    from volley_dagster.errors import VolleyError

    root = Path(args.checkpoint_root).absolute()
    owner = f"volley rescale (pid {os.getpid()})"
    try:
        log = EpochLog(root)
        name = log.identity().get("pipeline", "") if log.has_identity() else ""
        with PipelineLease(root, owner=owner, wait_s=args.wait, pipeline=name,
                           notify=lambda message: print(f"volley rescale: {message}", file=sys.stderr)) as lease:
            store = snapshot_store(args, name)
            for index in range(_stages_before(root)):  # a chain's earlier stages, each under its own lease too
                stage = EpochLog(root / "stages" / str(index))
                stage_name = stage.identity().get("pipeline", "") if stage.has_identity() else ""
                with PipelineLease(stage.root, owner=owner, wait_s=args.wait, pipeline=stage_name) as held:
                    print(rescale(stage, args.shards, held,
                                  store=store and store.within(f"stages/{index}")).describe())
            result = rescale(log, args.shards, lease, store=store)
    except VolleyError as exc:
        print(f"volley rescale: {exc}", file=sys.stderr)
        return 1
    print(result.describe())
    return 0


def _stages_before(root: Path) -> int:
    """How many stages a chained pipeline's root holds before its last (``chain.py``)."""
    folder = root / "stages"
    return len([p for p in folder.iterdir() if p.name.isdigit()]) if folder.is_dir() else 0


def state_command(args: argparse.Namespace) -> int:
    """``volley state show|diff|export``: the state at a retained epoch, read by Spark tasks."""
    from pyspark.sql import functions as F

    from volley_dagster.checkpoint.state_reader import ReadSettings
    from volley_dagster.errors import VolleyError
    from volley_dagster.spark.delta_export import export_to_delta
    from volley_dagster.spark.session import get_or_create_spark
    from volley_dagster.spark.state_table import CHANGE, StateTables

    root, before = Path(args.checkpoint_root), _stages_before(Path(args.checkpoint_root))
    if args.stage is not None:
        if not 1 <= args.stage <= before + 1:
            print(f"volley state {args.action}: --stage {args.stage}: {root} holds stages 1..{before + 1}",
                  file=sys.stderr)
            return 2
        root = root if args.stage == before + 1 else root / "stages" / str(args.stage - 1)
    try:
        spark = get_or_create_spark(remote=os.environ.get("VOLLEY_SPARK_REMOTE") or None)
        tables = StateTables(spark, root, ReadSettings(verify_checksums=args.verify_checksums))
        pending = getattr(args, "pending", False)
        epoch = args.to_epoch if args.action == "diff" else args.epoch or tables.log.last_committed()
        keys = tables.keys(epoch)
        if args.action == "diff":
            df, what = tables.changes(args.from_epoch, epoch), f"changes from epoch {args.from_epoch} to {epoch}"
        else:
            df = tables.at(epoch, "pending" if pending else "state")
            what = f"{'pending entries' if pending else 'state'} at epoch {epoch}"
            keys = [keys[0], df.columns[2]] if pending else keys  # key, key group, then when
        if getattr(args, "key", None) is not None:
            df = df.where(F.col(keys[0]) == args.key)
        if args.action == "export":
            scheme, _, uri = args.to.partition(":")
            if scheme != "delta" or not uri:
                print(f"volley state export: --to must be delta:<uri>, got {args.to!r}", file=sys.stderr)
                return 2
            done = export_to_delta(df, uri, f"volley state export of {tables.log.root}, {what}")
            print(f"exported the {what} of {tables.log.root}: {done.rows:,} rows in {done.files} files, "
                  f"Delta table {done.uri} version {done.version}")
            return 0
        rows = df.orderBy(*keys).limit(args.limit).toArrow()
        counts = {r[0]: r[1] for r in df.groupBy(CHANGE).count().collect()} if args.action == "diff" else None
        total = sum(counts.values()) if counts is not None else df.count()
        summary = ", ".join(f"{n:,} {c}" for c, n in sorted(counts.items())) if counts else f"{total:,} rows"
        print(f"{tables.log.root}: {what} ({summary}); the first {min(args.limit, total):,} by {', '.join(keys)}:")
        print(rows.to_pandas().to_string(index=False) if rows.num_rows else "(none)")
        if before and args.stage is None:
            print(f"(the last of a chain's {before + 1} stateful stages; --stage 1..{before} shows the others)")
    except VolleyError as exc:
        print(f"volley state {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def migrate_root(args: argparse.Namespace) -> int:
    """``volley migrate <root> --to module:pipeline``: the state rewritten for the new pipeline."""
    import importlib

    from volley_dagster import EpochRunner, Pipeline
    from volley_dagster.errors import VolleyError

    module, _, attr = args.to.partition(":")
    try:
        target = getattr(importlib.import_module(module), attr) if attr else None
    except (ImportError, AttributeError) as exc:
        print(f"volley migrate: cannot load {args.to!r}: {exc}", file=sys.stderr)
        return 2
    pipeline = target() if callable(target) and not isinstance(target, Pipeline) else target
    if not isinstance(pipeline, Pipeline):
        print(f"volley migrate: --to must name a Pipeline, or a function returning one, as module:name; "
              f"{args.to!r} is {type(pipeline).__name__}", file=sys.stderr)
        return 2
    try:
        renames = dict(_pair(r, "--rename", "OLD=NEW") for r in args.rename)
        initial = {k: float(v) for k, v in (_pair(i, "--initial", "NAME=0") for i in args.initial)}
        runner = EpochRunner(pipeline, Path(args.checkpoint_root),
                             RunSettings(snapshot_store=snapshot_store(args, pipeline.name)))
        result = runner.migrate(pipeline, renames=renames, initial=initial, num_shards=args.shards)
    except (VolleyError, ValueError) as exc:
        print(f"volley migrate: {exc}", file=sys.stderr)
        return 1
    print(result.describe())
    return 0


def _pair(text: str, flag: str, form: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"{flag} takes {form}, got {text!r}")
    return name, value


def _store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--snapshot-store", metavar="s3://BUCKET/PREFIX",
                        help="the pipelines' snapshot store (as CheckpointResource.snapshot_store_uri): the rewrite is "
                             "uploaded there too, for executors that keep snapshots on their own disks")
    parser.add_argument("--s3-endpoint", metavar="URL", help="with --snapshot-store: an S3-compatible endpoint "
                        "(credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags; the README's commands are checked against it."""
    parser = argparse.ArgumentParser(prog="volley", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate payment events and run epochs on the embedded defaults")
    d.add_argument("--workdir", default="demo")
    d.add_argument("--files", type=int, default=6)
    d.add_argument("--records-per-file", type=int, default=50_000)
    d.add_argument("--keys", type=int, default=20_000)
    d.add_argument("--max-records", type=int, default=100_000, help="records per epoch at most")
    d.add_argument("--shards", type=int, default=4)
    d.add_argument("--keep", type=int, default=3, help="snapshots of the last K epochs are kept")
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--kafka", action="store_true", help="read the events from a Kafka topic (a mock cluster "
                   "unless --bootstrap-servers) and write the totals to another")
    d.add_argument("--bootstrap-servers", help="with --kafka: a real Kafka cluster")
    d.set_defaults(func=lambda args: demo_kafka(args) if args.kafka else demo(args))
    g = sub.add_parser("generate", help="append payment events to the demo's source log")
    g.add_argument("--workdir", default="demo")
    g.add_argument("--files", type=int, default=1)
    g.add_argument("--records-per-file", type=int, default=50_000)
    g.add_argument("--keys", type=int, default=20_000)
    g.add_argument("--seed", type=int, default=7)
    g.set_defaults(func=_generate)
    c = sub.add_parser("spark-connect", help="run a Spark Connect server on 127.0.0.1 until interrupted")
    c.add_argument("--port", type=int, default=15002)
    c.add_argument("--master", default="local[*]")
    c.set_defaults(func=spark_connect)
    w = sub.add_parser("warm-spark", help="start (or find) the warm Spark Dagster runs use, and print its URL")
    w.add_argument("--owner", type=int, default=None, help="stop it when this process exits (default: dagster dev)")
    w.set_defaults(func=warm_spark)
    di = sub.add_parser("dagster-instance", help="print the dagster.yaml sections a deployment needs (queued runs, "
                                                 "one run per pipeline pool, run retries, run monitoring), or merge "
                                                 "them into a dagster.yaml")
    di.add_argument("--merge", metavar="PATH", help="write them into this dagster.yaml (created when missing), "
                                                    "keeping every other key, and print what changed")
    di.add_argument("--warm-launcher", action="store_true", help="also the warm run launcher (runs forked on the "
                                                                 "daemon's machine, as ./dev dagster runs them)")
    di.set_defaults(func=dagster_instance)
    i = sub.add_parser("inspect", help="show a checkpoint root's epochs and snapshots")
    i.add_argument("checkpoint_root")
    i.set_defaults(func=inspect_root)
    r = sub.add_parser("rescale", help="rewrite a checkpoint root's last committed state into N shards; "
                                      "the next epoch runs with them")
    r.add_argument("checkpoint_root")
    r.add_argument("--shards", type=int, required=True, help="the new number of shards (1..key groups)")
    r.add_argument("--wait", type=float, default=120.0,
                   help="seconds to wait for the pipeline's lease while a run holds it (default 120)")
    _store_options(r)
    r.set_defaults(func=rescale_root)
    m = sub.add_parser("migrate", help="rewrite a checkpoint root's last committed state for a changed pipeline; "
                                       "the next epoch runs it")
    m.add_argument("checkpoint_root")
    m.add_argument("--to", required=True, help="the new pipeline: module:name of a Pipeline or a function returning one")
    m.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="an accumulator renamed")
    m.add_argument("--initial", action="append", default=[], metavar="NAME=0",
                   help="an added sum_ starts from 0 for existing keys (default: null)")
    m.add_argument("--shards", type=int, default=None, help="also rescale to this many shards")
    _store_options(m)
    m.set_defaults(func=migrate_root)
    s = sub.add_parser("state", help="the state at a retained epoch as a table, the changes between two, or an "
                                     "export to Delta").add_subparsers(dest="action", required=True)
    show = s.add_parser("show", help="print the state at an epoch (default: the last committed)")
    diff = s.add_parser("diff", help="print the keys added, changed or removed from epoch N to epoch M")
    export = s.add_parser("export", help="write the state at an epoch to a new Delta table")
    for p in (show, diff, export):
        p.add_argument("checkpoint_root")
        p.add_argument("--key", help="only this key")
        p.add_argument("--verify-checksums", action="store_true",
                       help="hash every snapshot file against its manifest's SHA-256 (default: sizes only)")
        p.add_argument("--stage", type=int, default=None, metavar="K",
                       help="a chain of stateful operators: stage K's state (1: the first; default: the last)")
        p.set_defaults(func=state_command)
    show.add_argument("--pending", action="store_true", help="a window operator's pending entries (a state TTL's: each key's next look) instead")
    diff.add_argument("from_epoch", type=int, metavar="N")
    diff.add_argument("to_epoch", type=int, metavar="M")
    export.add_argument("--to", required=True, help="delta:<folder or s3:// uri>")
    for p in (show, export):
        p.add_argument("--epoch", type=int, default=None)
    for p in (show, diff):
        p.add_argument("--limit", type=int, default=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


_EXIT_STATUS = [1]  # what ``run`` leaves with: main's, once it returned


def _leave() -> None:
    """The process's last exit step: after Python's own shutdown (its threads joined,
    every atexit handler registered since ``run`` began run), skip the C++ libraries'
    static destructors: RocksDB's and Arrow's thread pools, torn down at exit while a
    thread of theirs still ran, aborted the process now and then (``terminate called
    without an active exception``, status 134) after all its work was done."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_EXIT_STATUS[0])


def run() -> None:
    """The ``volley`` command: ``main``, then a clean exit with its status (``_leave``)."""
    atexit.register(_leave)  # the first registered of the command's handlers: it runs last
    try:
        _EXIT_STATUS[0] = main()
    except SystemExit as exc:  # argparse's usage errors, --help
        _EXIT_STATUS[0] = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except KeyboardInterrupt:
        _EXIT_STATUS[0] = 130
        raise
    sys.exit(_EXIT_STATUS[0])


if __name__ == "__main__":
    run()
