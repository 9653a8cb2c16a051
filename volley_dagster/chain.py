"""A pipeline of several stateful operators (``Pipeline.stages``): a step after a
stateful operator reads that operator's output rows, in the chain's next stage.

Each stage before the last is a pipeline of its own, run by an ``EpochRunner`` under
``<root>/stages/<k>/`` (its own shards, state namespaces, epoch log and lease). Its
sink is one Parquet file per epoch (``ParquetSink``, the file's existence its commit),
which the next stage's epoch N reads whole (``StageOutput``). The last stage runs at
the root itself: its manifest is the epoch's commit and its sinks are the user's, so
the epoch log, Dagster and the state tools see the pipeline as before. Every stage
runs epoch N in turn, in the same run; a stage that committed N already is not run
again, so a retry after a crash resumes at the first stage that had not (the stages
of Kafka Streams' sub-topologies, joined by files instead of topics).

Each stage keeps its own watermark. One whose operator has an event time is handed
the stage before's: ``W_k[N] = W_{k-1}[N]`` less the most by which the rows stage k-1
emits after epoch N may trail it (``Pipeline.handed_delay_us``), so nothing the stage
before emits on time is late to the next one. Spark 4 passes watermarks between the
stateful operators of one query the same way, which is also why a downstream window
fires an epoch after the one whose rows close it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import pyarrow as pa

from volley_dagster.errors import EpochOrderError
from volley_dagster.io.atomic import create_json_exclusive, read_json
from volley_dagster.pipeline import Pipeline
from volley_dagster.result import EpochResult
from volley_dagster.sinks.parquet import ParquetSink
from volley_dagster.sources import formats
from volley_dagster.sources.file_log import DEFAULT_PARTITION, FileLog
from volley_dagster.sources.offsets import EpochRange, Position, Segment, SourcePosition

if TYPE_CHECKING:
    from volley_dagster.runner import EpochRunner
    from volley_dagster.settings import RunSettings

STAGE_SINK = "next_stage"


@dataclass(frozen=True)
class StagesBefore:
    """What the stages before the last did in an epoch, for the epoch's manifest: the
    range it was cut with from the pipeline's source, and each stage's figures
    (``stage<k>_<figure>``, numbered from 1), which Dagster shows beside the last's."""

    source_range: EpochRange
    figures: dict[str, int]


class StageOutput(FileLog):
    """One stage's output rows as the next stage's log: epoch N's range is the file the
    stage committed for epoch N, whole (never a share of a backlog: the stages run in
    step, epoch by epoch), read with that file's columns (a deploy may change what the
    stage before emits)."""

    def schema(self) -> pa.Schema:
        files = [info for infos in self.partitions().values() for info in infos]
        if not files:
            return super().schema()  # SourceNotReadyError: nothing committed yet
        newest = max(files, key=lambda info: info.path)
        return formats.read_schema(self.format, self.storage.read(newest.path))

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None,
            final: bool = False) -> EpochRange:
        name = ParquetSink.file_name(epoch)
        info = self.storage.stat(name)
        if info is None:
            raise EpochOrderError(f"{self.uri}: no rows of epoch {epoch} ({name}): the stage before has not committed "
                                  "it; run the epoch again, which runs that stage first")
        records, size, version = self._scan(info, newest=False)
        segments = (Segment(0, DEFAULT_PARTITION, name, 0, records, size, version),) if records else ()
        return EpochRange(epoch, {DEFAULT_PARTITION: Position(name, 0, 0)}, {DEFAULT_PARTITION: Position(name, 0, records)},
                          segments)


def stage_settings(settings: RunSettings, index: int) -> RunSettings:
    """Stage ``index``'s settings: the root's, its S3 snapshots in a folder of its own."""
    store = settings.snapshot_store
    return settings if store is None else replace(settings, snapshot_store=store.within(f"stages/{index}"))


class StageChain:
    """The stages before a chained pipeline's last one, and what the last one reads."""

    def __init__(self, runner: EpochRunner) -> None:
        from volley_dagster.runner import EpochRunner  # the runner builds its chain

        pipeline, root = runner.pipeline, runner.log.root
        self.stages = pipeline.stages()
        self.root = root
        self.log = runner.log
        self.own = [self._own(k, stage) for k, stage in enumerate(self.stages)]  # each stage as it runs alone
        self.runners = [EpochRunner(own, self.stage_root(k), stage_settings(runner.settings, k), spark=runner._spark)
                        for k, own in enumerate(self.own[:-1])]
        self.last = self.own[-1]

    def stage_root(self, index: int) -> Path:
        return self.root / "stages" / str(index)

    def _name(self, index: int) -> str:
        base = self.stages[-1].name
        return base if index == len(self.stages) - 1 else f"{base[:96]}.{index + 1}"

    def _output(self, index: int) -> Path:
        return self.stage_root(index) / "output" / self._name(index)

    def _own(self, index: int, stage: Pipeline) -> Pipeline:
        """Stage ``index`` as a pipeline of its own: its log the stage before's output,
        its sink the next one's input (the last: the user's sinks)."""
        source = stage.source_given if index == 0 else StageOutput(self._output(index - 1), format="parquet")
        sinks = stage.sinks if index == len(self.stages) - 1 else \
            (ParquetSink(self.stage_root(index) / "output", name=STAGE_SINK),)
        return replace(stage, name=self._name(index), source_given=source, sinks=sinks)

    def run_before_last(self, rng: EpochRange) -> tuple[Pipeline, EpochRange, StagesBefore]:
        """Run epoch ``rng.epoch`` of every stage before the last, each unless it committed
        it already; the last stage, handed its watermark, the range it reads, and what
        the stages before did. First, the stages' files no retry can read again."""
        epoch, handed, figures = rng.epoch, None, {}
        self._prune(epoch - 1, self.runners[0].settings.keep_epochs)
        for index, runner in enumerate(self.runners):
            if not runner.log.is_committed(epoch):
                runner.log.record_offsets(rng if index == 0 else self._input(index, rng))
            stage = self.own[index]
            runner.pipeline = stage if index == 0 or stage.clock is None else stage.with_watermark_handed(handed)
            result = runner.run(epoch)
            # a stage without a clock (process with no time mode) hands on what it was handed
            handed = self._handed(index, result.watermark) if stage.clock is not None else handed
            figures.update({f"stage{index + 1}_{name}": value for name, value in _figures(result).items()})
        last = self.last if self.last.clock is None else self.last.with_watermark_handed(handed)
        return last, self._last_input(rng), StagesBefore(rng, figures)

    def _last_input(self, rng: EpochRange) -> EpochRange:
        """The last stage's range of epoch N, recorded beside N's offsets before its first
        attempt (the first recorded wins), as every stage's is: a root copied or restored
        between the sinks' commit and the manifest reads the same range."""
        path = self.log.epoch_dir(rng.epoch) / "stage_input.json"
        if not path.exists():
            create_json_exclusive(path, self._input(len(self.runners), rng).to_dict())
        return EpochRange.from_dict(read_json(path))

    def _input(self, index: int, rng: EpochRange) -> EpochRange:
        """Stage ``index``'s range of epoch N: the stage before's rows of N, cut when the
        epoch was (its skew guard's wall clock) and ending the stream with it."""
        cut = self.own[index].source_log
        return replace(cut.cut(rng.epoch, {}, None), cut_at_us=rng.cut_at_us, end_of_stream=rng.end_of_stream)

    def _handed(self, index: int, watermark: int | None) -> int | None:
        """What stage ``index`` hands on after an epoch ending at ``watermark``: to the
        next stage with a clock, on that stage's event-time column."""
        later = next((stage for stage in self.stages[index + 1:] if stage.clock is not None), None)
        if watermark is None or later is None or later.clock is None:
            return None
        return watermark - self.stages[index].handed_delay_us(later.clock.time_column)

    def _prune(self, committed: int, keep: int) -> None:
        """The stages' output files of epochs the last stage committed more than ``keep`` ago."""
        for index in range(len(self.runners)):
            for path in self._output(index).glob("epoch-*.parquet"):
                if (number := ParquetSink.epoch_of(path.name)) is not None and number <= committed - keep:
                    path.unlink(missing_ok=True)


def _figures(result: EpochResult) -> dict[str, int]:
    """A stage's figures for the epoch's manifest: what it read, emitted and dropped as
    late or as bad records, how many keys it touched, its watermark, and its operator's own."""
    figures = {"records_in": result.records_in, "records_out": result.records_out, "late_records": result.late_records,
               "dead_letters": result.dead_letters,
               "keys_touched": result.keys_touched, "state_bytes": result.state_bytes, **result.figures}
    if result.watermark is not None:
        figures["watermark"] = result.watermark
    return figures
