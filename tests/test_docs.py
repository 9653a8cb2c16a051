"""Every Python and shell block of ``docs/*.md`` runs, as ``tests/test_readme.py`` runs
the README's.

A block is named by its page, the heading above it and its language
(``pipelines.md#Reading state/python``), and ``RUNS`` names the test that runs it: a
block that no test runs (a new one, or one under a renamed heading) fails
``test_every_block_of_the_docs_is_run``.

A page reads as one session that goes on from the README's "A pipeline in a few
lines": a block sees the imports of that block and of the Python blocks above it on
its page. What else a block needs (the demo's state under ``demo/`` for the
``volley`` commands, a ``runner``, the re-sent log of the deduplication example) the
test that runs it prepares, in a folder of its own that it changes into, with the
demo's own generators and pipelines. Where the page shows what a block prints, in the
plain block right after it, the printed lines are compared: one for one where they
count deterministic data, and by their shape (numbers and paths aside) where they show
the demo's state at another size, as the ``$ volley ...`` transcripts do."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import io
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.test_readme import README, check_dev
from volley_dagster import EpochRunner, RunSettings
from volley_dagster.cli import build_parser, main
from volley_dagster.columns import POS_OFFSET_BITS
from volley_dagster.demo.events import events_for_file, generate, write_events
from volley_dagster.demo.payments import local_tables, merchant_minutes_pipeline, payments_pipeline
from volley_dagster.demo.refunds import write_refund_logs
from volley_dagster.sources.storage import storage_for

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
RUN_LANGUAGES = ("python", "bash", "sh")  # the blocks that run; plain ones are output and diagrams
# a fenced block, indented as a list item's may be; it ends at a fence of the same indent
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<language>[\w-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
HEADING = re.compile(r"^#{1,6} +(.+?)\s*$", re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    heading: str
    language: str
    text: str
    name: str  # page#heading/language, with #2, #3 after a second or third of one heading
    output: str | None  # the plain block right after it: what it prints
    section: tuple[str, ...]  # the plain blocks of its section (the ``$ volley`` transcripts)


def parse_page(path: Path) -> list[Block]:
    text = path.read_text()
    fences = list(FENCE.finditer(text))
    inside = [(m.start(), m.end()) for m in fences]  # a `# comment` in a block is no heading
    headings = [(m.start(), m.group(1)) for m in HEADING.finditer(text)
                if not any(start < m.start() < end for start, end in inside)]

    def heading_at(offset: int) -> str:
        return max(((at, h) for at, h in headings if at < offset), default=(0, ""))[1]

    def body(m: re.Match[str]) -> str:
        indent = len(m.group("indent"))
        return "".join(line[indent:] for line in m.group("body").splitlines(keepends=True))

    blocks: list[Block] = []
    seen: Counter[tuple[str, str]] = Counter()
    for i, m in enumerate(fences):
        language = m.group("language")
        if not language:
            continue
        heading = heading_at(m.start())
        seen[heading, language] += 1
        name = f"{path.name}#{heading}/{language}" + (f"#{seen[heading, language]}" if seen[heading, language] > 1 else "")
        after = fences[i + 1] if i + 1 < len(fences) else None
        output = body(after) if after is not None and not after.group("language") \
            and not text[m.end():after.start()].strip() else None
        section = tuple(body(f) for f in fences if not f.group("language") and heading_at(f.start()) == heading)
        blocks.append(Block(path.name, heading, language, body(m), name, output, section))
    return blocks


BLOCKS = [block for page in PAGES for block in parse_page(page)]
RUNS: dict[str, list[str]] = {}  # block name -> the tests that run it


def runs(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(test: Callable[..., None]) -> Callable[..., None]:
        RUNS.setdefault(name, []).append(test.__name__)
        return test
    return register


def block(name: str) -> Block:
    found = [b for b in BLOCKS if b.name == name]
    assert found, f"docs: no block {name!r} (a heading renamed?); the blocks are {[b.name for b in BLOCKS]}"
    return found[0]


# docs/your-project.md reads as one shell session from a fresh virtualenv, installed from
# the wheel: tests/adoption/test_your_project.py (the deep lane) runs every block of it in order
for _block in BLOCKS:
    if _block.page == "your-project.md" and _block.language in RUN_LANGUAGES:
        RUNS[_block.name] = ["tests/adoption/test_your_project.py::"
                             "test_a_new_user_follows_the_page_from_a_fresh_virtualenv_to_a_downstream_asset"]


def test_every_block_of_the_docs_is_run():
    found = sorted(b.name for b in BLOCKS if b.language in RUN_LANGUAGES)
    assert len(RUNS) == len(found) and sorted(RUNS) == found, (
        f"blocks no test runs: {sorted(set(found) - set(RUNS))}; tests of blocks that are gone: "
        f"{sorted(set(RUNS) - set(found))}")


# -- running a block ---------------------------------------------------------------


def imports_of(text: str) -> list[str]:
    return [ast.unparse(node) for node in ast.parse(text).body if isinstance(node, (ast.Import, ast.ImportFrom))]


def session(b: Block) -> dict[str, Any]:
    """What a reader of ``b``'s page has imported by then: the README's first block's
    names, then those of each Python block above ``b`` on the page."""
    readme_first = re.findall(r"```python\n(.*?)```", README, flags=re.S)[0]
    lines = imports_of(readme_first)
    for other in BLOCKS:
        if other == b:
            break
        if other.page == b.page and other.language == "python":
            lines += imports_of(other.text)
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(lines), b.name, "exec"), namespace)
    return namespace


def run_python(b: Block, namespace: dict[str, Any]) -> tuple[list[Any], str]:
    """Runs ``b`` in ``namespace``: the value of each of its expression statements (as
    an interactive session would show them), and what it printed."""
    tree = ast.parse(b.text)
    for i, statement in enumerate(tree.body):
        if isinstance(statement, ast.Expr):
            shown = ast.Call(ast.Name("_docs_show", ast.Load()), [statement.value], [])
            tree.body[i] = ast.copy_location(ast.Expr(shown), statement)
    values: list[Any] = []
    namespace["_docs_show"] = values.append
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(ast.fix_missing_locations(tree), b.name, "exec"), namespace)
    return values, printed.getvalue()


def commands(text: str, optional: bool = False) -> list[list[str]]:
    """Each command line of a shell block, without its comment; its ``[--flag value]``
    parts left out, or with ``optional`` given (without the brackets)."""
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    lines = [re.sub(r"\[([^\]]*)\]", r"\1" if optional else "", line) for line in lines]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def transcripts(b: Block) -> list[tuple[list[str], str]]:
    """The ``$ volley ...`` commands the plain blocks of ``b``'s section show, each with
    what it printed."""
    shown = []
    for text in b.section:
        for part in re.split(r"^\$ ", text, flags=re.M)[1:]:
            command, _, output = part.partition("\n")
            shown.append((shlex.split(command), output.strip("\n")))
    return shown


def volley(argv: list[str], cwd: Path) -> str:
    """A ``volley`` command, run in this process (on the session's Spark) as the
    installed script would run it: what it printed, with ``cwd`` written as the docs
    write it (relative)."""
    assert argv[0] in ("volley", ".venv/bin/volley"), f"a docs command this test does not know: {argv}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv[1:]) == 0, argv
    return printed.getvalue().replace(f"{cwd.resolve()}/", "").replace(f"{cwd}/", "")


def shape(text: str) -> list[list[str]]:
    """Each line's words, with every number (``2,000``, ``0.08``, ``2026-01-01``,
    ``00:00:26.217000``, ``0000000001``) as N: what stays the same at another size."""
    return [re.sub(r"\d[\d,]*(\.\d+)?", "N", line).split() for line in text.strip().splitlines()]


# -- the demo's state, for the `volley` commands and the `runner` of a section -------

DEMO_FILES, DEMO_RECORDS, DEMO_KEYS = 3, 300, 20  # every merchant in every epoch, as on the docs' bigger demo


@pytest.fixture(scope="module")
def demo(spark, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``demo/``, as ``volley demo --files 3 --records-per-file 300
    --keys 20 --max-records 300`` leaves it for the ``payments`` and ``merchant_minutes``
    pipelines (the join's aside): their state after three epochs."""
    root = tmp_path_factory.mktemp("docs-demo")
    work = root / "demo"
    generate(work / "events", DEMO_FILES, DEMO_RECORDS, DEMO_KEYS)
    for pipeline in demo_pipelines(work):
        EpochRunner(pipeline, work / "state" / pipeline.name, RunSettings(max_records_per_epoch=DEMO_RECORDS),
                    spark=spark).run_available()
    return root


def demo_pipelines(work: Path) -> tuple[Any, Any]:
    tables = local_tables(work / "tables")
    return payments_pipeline(work / "events", tables), merchant_minutes_pipeline(work / "events", tables)


def demo_copy(demo: Path, into: Path, pipeline: str) -> Path:
    """``demo/state/<pipeline>`` copied under ``into`` (a test that changes the state
    leaves the demo's for the others); the checkpoint root records no path of its own."""
    root = into / "demo" / "state" / pipeline
    shutil.copytree(demo / "demo" / "state" / pipeline, root)
    return root


# -- docs/pipelines.md -------------------------------------------------------------

JOIN = "pipelines.md#Joining two streams by event time/python"


@runs(JOIN)
def test_the_join_runs_and_writes_the_columns_the_page_names(spark, tmp_path, monkeypatch):
    """Over the demo's payments and refunds; its output columns are the key, the two row
    ids, then each side's own; a row id ``"<epoch>:<position>"`` points at its record:
    position = segment id << 40 | the record's offset in that segment's part of the range."""
    monkeypatch.chdir(tmp_path)
    write_refund_logs("data", 2, 200, merchants=20)
    namespace = session(block(JOIN))
    run_python(block(JOIN), namespace)
    pipeline = namespace["pipeline"]
    runner = EpochRunner(pipeline, "state", spark=spark)  # one epoch: two segments of each source
    assert [(r.epoch, r.figures["join_pairs"] > 0) for r in runner.run_available()] == [(1, True)]
    joined = pipeline.sinks[0].read()
    assert joined.column_names == ["payment_id", "payments_row", "refunds_row", "merchant_id", "amount", "paid_at",
                                   "refund_amount", "refunded_at"]
    segments = set()
    for row in joined.to_pylist():
        for side, time in (("payments", "paid_at"), ("refunds", "refunded_at")):
            if row[f"{side}_row"] is None:
                continue
            epoch, position = map(int, row[f"{side}_row"].split(":"))
            segment = runner.log.offsets(epoch).segments[position >> POS_OFFSET_BITS]
            offset = position & ((1 << POS_OFFSET_BITS) - 1)
            assert segment.partition.startswith(f"{side}/") and offset < segment.records
            record = pq.read_table(Path("data") / side / segment.file).slice(segment.start + offset, 1).to_pylist()[0]
            assert record["payment_id"] == row["payment_id"] and record[time] == row[time]
            segments.add(segment.id)
    assert len(segments) == 4  # each source's two files, numbered across both


CHAIN = "pipelines.md#Pipelines that feed pipelines/python"


@runs(CHAIN)
def test_the_hourly_refunds_read_the_join_table_and_equal_its_rows_counted(spark, tmp_path, monkeypatch):
    """The join above writes its rows to an append table as well; the second pipeline
    reads that table's commits, and (one epoch, then the end of the stream) its hours
    equal the table's refunds counted by merchant and hour."""
    monkeypatch.chdir(tmp_path)
    write_refund_logs("data", 8, 100, merchants=10)
    namespace = session(block(CHAIN))
    run_python(block(JOIN), namespace)
    run_python(block(CHAIN), namespace)
    EpochRunner(namespace["joined"], "state/refunds", spark=spark).flush()
    hourly = EpochRunner(namespace["hourly"], "state/refund_hours", spark=spark)
    ran = hourly.flush()  # the table's commits, the stream's end with them
    assert ran[-1].end_of_stream and sum(r.records_in for r in ran) == namespace["joined"].sinks[-1].read().num_rows
    log = namespace["joined"].sinks[-1].read().to_pandas()
    refunds = log[log.refund_amount.notna()]
    hour = refunds.refunded_at.dt.floor("h")
    expected = refunds.groupby([refunds.merchant_id, hour]).agg(refunds=("refund_amount", "size"),
                                                                refunded=("refund_amount", "sum"))
    got = namespace["hourly"].sinks[0].read().to_pandas()
    assert sorted((r.merchant_id, r.window_start, r.refunds, round(r.refunded, 6)) for r in got.itertuples()) == \
        sorted((m, h, n, round(t, 6)) for (m, h), n, t in zip(expected.index, expected.refunds, expected.refunded,
                                                              strict=True))


IN_ONE = "pipelines.md#Several stateful operators in one pipeline/python"


@runs(IN_ONE)
def test_the_hours_in_one_pipeline_equal_the_refunds_that_match_a_payment_counted(spark, tmp_path, monkeypatch):
    """One epoch, then the stream's end: every refund that matches its payment within 30
    minutes is counted once, by merchant and hour of refund (read at once, none is late)."""
    monkeypatch.chdir(tmp_path)
    write_refund_logs("data", 8, 100, merchants=10)
    namespace = session(block(IN_ONE))
    run_python(block(IN_ONE), namespace)
    ran = EpochRunner(namespace["hourly_refunds"], "state/hourly_refunds", spark=spark).flush()
    assert all(r.figures["stage1_late_records"] == 0 for r in ran) and ran[-1].end_of_stream
    payments = pq.read_table("data/payments").to_pandas()
    refunds = pq.read_table("data/refunds").to_pandas().merge(payments, on="payment_id")
    refunds = refunds[(refunds.refunded_at >= refunds.paid_at)
                      & (refunds.refunded_at <= refunds.paid_at + pd.Timedelta(minutes=30))]
    hour = refunds.refunded_at.dt.floor("h")
    expected = refunds.groupby([refunds.merchant_id, hour]).agg(refunds=("refund_amount", "size"),
                                                                refunded=("refund_amount", "sum"))
    got = namespace["hourly_refunds"].sinks[0].read().to_pandas()
    assert len(got) > 10
    assert sorted((r.merchant_id, r.window_start, r.refunds, round(r.refunded, 6)) for r in got.itertuples()) == \
        sorted((m, h, n, round(t, 6)) for (m, h), n, t in zip(expected.index, expected.refunds, expected.refunded,
                                                              strict=True))


PROCESS = "pipelines.md#Your own stateful logic/python"


@runs(PROCESS)
def test_the_processor_on_the_page_runs_and_equals_its_reference(spark, tmp_path, monkeypatch):
    """The page's processor over the demo's payments, two epochs and the stream's end:
    its alerts are those the same class gives record by record (``tests/process_reference.py``)."""
    from tests.process_reference import ProcessReference

    monkeypatch.chdir(tmp_path)
    files = generate("data/events", 2, 300, 20, events_per_second=20, disorder_s=5)
    namespace = session(block(PROCESS))
    run_python(block(PROCESS), namespace)
    runner = EpochRunner(namespace["pipeline"], "state", RunSettings(max_records_per_epoch=300), spark=spark)
    results = runner.run_available() + runner.flush()
    reference = ProcessReference(namespace["VelocityAlert"](), "card", "event_time",
                                 ["alert_at_ms", "payments", "total"], 10_000_000)
    expected = []
    for number, name in enumerate(files, start=1):
        rows, _ = reference.run([{"card": r["merchant_id"] % 17, "amount": r["amount"],
                                  "event_time": int(r["event_time"].timestamp() * 1_000_000)}
                                 for r in pq.read_table(Path("data/events") / name).to_pylist()],
                                end_of_stream=number == len(files))
        expected += [(key, *(v.item() if hasattr(v, "item") else v for v in row)) for key, row in rows]
    alerts = namespace["pipeline"].sinks[0].read()
    assert alerts.column_names == ["card", "alert_at_ms", "payments", "total"]
    assert sorted(zip(*(alerts.column(c).to_pylist() for c in alerts.column_names), strict=True)) == sorted(expected)
    assert len(expected) > 10 and results[-1].end_of_stream and runner.read_state().num_rows == 0


def test_a_name_both_sides_carry_is_prefixed_with_its_source_and_an_underscore():
    """What the join section says of shared names (``IntervalJoin.resolve``)."""
    from pyspark.sql import types as T

    from volley_dagster.operators.join import IntervalJoin

    schema = T.StructType([T.StructField(n, t) for n, t in (
        ("payment_id", T.LongType()), ("amount", T.DoubleType()), ("paid_at", T.TimestampType()),
        ("refunded_at", T.TimestampType()), ("_volley_source", T.StringType()))])
    join = IntervalJoin("payments", "refunds", "payment_id", "paid_at", "refunded_at", 0, 60_000_000,
                        left_columns=("amount", "paid_at"), right_columns=("amount", "refunded_at"))
    assert join.resolve(schema).output_names() == ["payments_row", "refunds_row", "payments_amount", "paid_at",
                                                   "refunds_amount", "refunded_at"]


def test_the_epoch_column_holds_the_partition_key_zero_padded():
    """What the Sinks section and docs/dagster.md say ``epoch_column=`` writes."""
    from volley_dagster.sinks.table import _with_epoch

    tagged = _with_epoch(pa.table({"merchant_id": [7]}), "epoch", 3)
    assert tagged.schema.field("epoch").type == pa.string() and tagged.column("epoch").to_pylist() == ["0000000003"]


KAFKA = "pipelines.md#Kafka/bash"


@runs(KAFKA)
def test_the_kafka_demo_command_exists_with_its_flags():
    for argv in commands(block(KAFKA).text):
        check_dev(argv)


@runs(KAFKA)
@pytest.mark.deep
def test_the_kafka_demo_runs(tmp_path):
    """``./dev demo --kafka`` as a user runs it (its own process: the mock cluster is the
    checkout's harness/kafka.py, which the installed ``volley`` imports only through
    what ./dev sets), in a folder of its own and on fewer events."""
    (argv,) = commands(block(KAFKA).text)
    assert argv[:2] == ["./dev", "demo"]
    done = subprocess.run([str(ROOT / "dev"), *argv[1:], "--workdir", str(tmp_path), "--files", "2",
                           "--records-per-file", "2000", "--keys", "200", "--max-records", "2000"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    shown = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "librdkafka's mock cluster" in shown and "produced 4,000 payment events to the topic 'payments'" in shown
    epochs = re.findall(r"^ +(\d+) +([\d,]+) +0 ", shown, flags=re.M)  # epoch, records, no dead letters
    assert [(int(e), int(n.replace(",", ""))) for e, n in epochs] == [(1, 2_000), (2, 2_000)]  # every event produced
    assert "the broker had deleted" not in shown  # so none was deleted before the first read
    assert "Kafka topic 'merchant-totals' (one transaction per epoch, read_committed): epoch 1: 200 records, " \
           "epoch 2: 200 records" in shown


READING_STATE = "pipelines.md#Reading state"


@runs(f"{READING_STATE}/python")
def test_reading_state_as_dataframes(demo, monkeypatch, spark):
    b = block(f"{READING_STATE}/python")
    monkeypatch.chdir(demo)
    namespace = session(b)
    namespace["runner"] = EpochRunner(demo_pipelines(demo / "demo")[1], "demo/state/merchant_minutes", spark=spark)
    (state, pending, changes), _ = run_python(b, namespace)
    assert state.columns[:2] == ["merchant_id", "key_group"] and state.columns[-1] == "shard"
    assert state.columns[2:4] == ["window_start", "window_end"] and state.count() > 0
    assert pending.columns == ["merchant_id", "key_group", "window_end", "evicted", "shard"] and pending.count() > 0
    assert {"merchant_id", "key_group", "shard", "change", "old_total", "new_total"} <= set(changes.columns)
    assert {r.change for r in changes.select("change").distinct().collect()} <= {"added", "changed", "removed"}


@runs(f"{READING_STATE}/bash")
def test_the_state_commands_on_the_demo(demo, monkeypatch):
    """The block's commands run; the transcripts below it print what they show, in shape."""
    b = block(f"{READING_STATE}/bash")
    monkeypatch.chdir(demo)
    for argv in commands(b.text):
        assert volley(argv, demo).startswith(("demo/state/payments: ", "exported the state at epoch 2 of demo/"))
    shown = transcripts(b)
    assert [argv[:3] for argv, _ in shown] == [["volley", "state", "show"], ["volley", "state", "diff"],
                                               ["volley", "state", "show"], ["volley", "state", "export"]]
    for argv, output in shown:
        assert shape(volley(argv, demo)) == shape(output), argv


MIGRATION = "pipelines.md#Changing a pipeline without starting over"


@runs(f"{MIGRATION}/python")
def test_migrating_from_python(demo, tmp_path, monkeypatch, spark):
    b = block(f"{MIGRATION}/python")
    root = demo_copy(demo, tmp_path, "payments")
    runner = EpochRunner(demo_pipelines(demo / "demo")[0], root, spark=spark)
    namespace = session(b)
    namespace["runner"] = runner
    (result,), _ = run_python(b, namespace)
    assert result.describe().startswith(f"migrated epoch {DEMO_FILES}'s state ('events' renamed to 'n_events', "
                                        "'spent_since' added (existing keys start from 0), 'avg_amount' removed")
    state = runner.read_state()
    assert state.column_names == ["merchant_id", "total", "n_events", "spent_since"]
    assert set(state.column("spent_since").to_pylist()) == {0}


@runs(f"{MIGRATION}/bash")
def test_migrating_from_the_command_line(demo, tmp_path, monkeypatch):
    """``mypipelines.payments()`` is what the page says: the demo pipeline with the new
    aggregate. The command prints what the transcript shows, in shape."""
    b = block(f"{MIGRATION}/bash")
    demo_copy(demo, tmp_path, "payments")
    work = demo / "demo"
    (tmp_path / "mypipelines.py").write_text(
        "from volley_dagster import count, sum_\n"
        "from volley_dagster.demo.payments import local_tables, payments_pipeline\n\n\n"
        "def payments():\n"
        f"    return payments_pipeline({str(work / 'events')!r}, local_tables({str(work / 'tables')!r})).aggregate(\n"
        "        total=sum_('amount'), n_events=count(), spent_since=sum_('amount'))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for argv in commands(b.text, optional=True):  # [--shards 8] too
            build_parser().parse_args(argv[1:])
        (argv,) = commands(b.text)
        ((shown_argv, shown),) = transcripts(b)
        assert shown_argv == argv
        assert shape(volley(argv, tmp_path)) == shape(shown)
    finally:
        sys.modules.pop("mypipelines", None)


@runs("pipelines.md#Enriching records from a versioned table/python")
def test_the_enrichment_example_prints_what_the_page_shows(spark, tmp_path, monkeypatch):
    b = block("pipelines.md#Enriching records from a versioned table/python")
    monkeypatch.chdir(tmp_path)
    _, printed = run_python(b, session(b))
    assert printed == b.output


@runs("pipelines.md#Expiring idle keys (state TTL)/python")
def test_the_ttl_example_prints_what_the_page_shows(spark, tmp_path, monkeypatch):
    b = block("pipelines.md#Expiring idle keys (state TTL)/python")
    monkeypatch.chdir(tmp_path)
    _, printed = run_python(b, session(b))
    assert printed == b.output


@runs("pipelines.md#Dropping duplicates within a watermark/python")
def test_the_deduplication_example_prints_what_the_page_shows(spark, tmp_path, monkeypatch):
    """Over the log the note below the output describes: 6 files of 2,000 demo events,
    each from the second on re-sending the first 200 of the one before in place of its
    last 200."""
    b = block("pipelines.md#Dropping duplicates within a watermark/python")
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "dedup"
    log = storage_for(base / "events")
    for i in range(6):
        events = events_for_file(i, 2_000, 10_000)
        if i:
            events = pa.concat_tables([events.slice(0, 1_800), events_for_file(i - 1, 2_000, 10_000).slice(0, 200)])
        write_events(log, f"events-{i:06d}.parquet", events)
    namespace = session(b)
    namespace["base"] = base
    _, printed = run_python(b, namespace)
    assert printed == b.output


@runs("pipelines.md#Event-time windows/python")
def test_the_windows_example_fires_every_window_at_the_end(spark, tmp_path, monkeypatch):
    b = block("pipelines.md#Event-time windows/python")
    monkeypatch.chdir(tmp_path)
    generate("data/events", 2, 500, 20)
    namespace = session(b)
    (ran, flushed), _ = run_python(b, namespace)
    assert [r.epoch for r in ran] == [1] and [(r.epoch, r.end_of_stream) for r in flushed] == [(2, True)]
    assert namespace["runner"].read_state().num_rows == 0  # every window fired
    fired = namespace["minutes"].sinks[0].read()
    assert fired.num_rows == sum(r.records_out for r in ran + flushed) > 0
    assert sum(fired.column("events").to_pylist()) == pq.read_table("data/events").num_rows


# -- docs/dagster.md ---------------------------------------------------------------

DAGSTER_ASSET_IN = "dagster.md#Under Dagster/python"


@runs(DAGSTER_ASSET_IN)
def test_the_per_epoch_asset_in_is_an_asset_over_the_epochs():
    """With the names it takes from Dagster, pyarrow and the page (``deployment``):
    an asset partitioned by the pipeline's epochs, reading the table asset; the IO
    manager its comment names exists."""
    from dagster import AssetIn, AssetKey, AssetsDefinition, asset
    from dagster_deltalake import DeltaLakePyarrowIOManager, LocalConfig  # noqa: F401  (the block's comment)

    from volley_dagster.dagster.epochs import epochs_partitions
    from volley_dagster.demo.payments import payments_deployment

    deployment = payments_deployment("events")
    namespace = {"asset": asset, "AssetIn": AssetIn, "AssetKey": AssetKey, "pa": pa,
                 "epochs_partitions": epochs_partitions, "deployment": deployment}
    run_python(block(DAGSTER_ASSET_IN), namespace)
    summary = namespace["epoch_summary"]
    assert isinstance(summary, AssetsDefinition)
    assert summary.partitions_def == epochs_partitions(deployment)
    assert AssetKey(["payments", "delta_changes"]) in summary.keys_by_input_name.values()


def test_the_component_yaml_names_the_component_and_its_attributes():
    (b,) = [b for b in BLOCKS if b.language == "yaml" and b.page == "dagster.md"]  # kubernetes.md's: test_dockerfile
    spec = yaml.safe_load(b.text)
    module, name = spec["type"].rsplit(".", 1)
    component = getattr(importlib.import_module(module), name)
    assert set(spec["attributes"]) <= {f.name for f in dataclasses.fields(component)}


PERFORMANCE = [b.name for b in BLOCKS if b.page == "performance.md" and b.language in RUN_LANGUAGES]


def test_the_performance_commands_exist_with_their_flags():
    """Each bench command of the performance page names a bench script and flags it
    takes; running them is the benches' work (``./dev bench``), not the suite's."""
    assert PERFORMANCE
    for name in PERFORMANCE:
        for argv in commands(block(name).text):
            check_dev(argv)


for _name in PERFORMANCE:
    runs(_name)(test_the_performance_commands_exist_with_their_flags)
