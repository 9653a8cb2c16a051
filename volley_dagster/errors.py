"""Every error the engine raises on purpose derives from ``VolleyError``.

Each names the thing that is wrong (epoch, file, offset, shard, setting) so an
operator can act on the message alone.
"""

from __future__ import annotations

import errno


class VolleyError(Exception):
    """Base class of the engine's deliberate errors."""


class ConfigError(VolleyError):
    """A pipeline, source or runner setting is invalid or inconsistent."""


class EpochOrderError(VolleyError):
    """An epoch was asked for before the epoch it depends on."""


class EpochNotCutError(EpochOrderError):
    """An epoch has no recorded offset range, so there is nothing defined to run."""


class EpochTooLargeError(ConfigError):
    """A cut too large for event positions to tell its records apart (2^40 records or more
    of one file or partition, or 2^23 files or more): nothing was cut; a smaller
    ``max_records_per_epoch`` cuts the same records into several epochs."""


class SourceError(VolleyError):
    """The source log cannot provide exactly the recorded range."""


class SourceUnavailableError(VolleyError):
    """The source cannot be reached now (brokers down, a timeout): retried, unlike a
    ``SourceError``, which re-running cannot fix."""


class SourceNotReadyError(SourceUnavailableError):
    """The source has no records yet to infer its schema from (no files, and no
    ``schema=``): a pipeline of several sources waits for it, and a run is retried."""


class SourceDataLostError(SourceError):
    """Records of a recorded (or about to be cut) range are gone from the source before
    they were read, as retention deletes a Kafka topic's old offsets: the error names
    the lost range; nothing is skipped."""


class SourceChangedError(SourceError):
    """A log file was rewritten after an epoch's range was cut from it (another size, or
    the same size under another version): the recorded range no longer names its records."""


class MalformedRecordError(VolleyError):
    """Records failed to parse or validate under the ``fail`` bad-record policy."""


class SinkLineageError(VolleyError):
    """A sink holds this pipeline's epochs from another checkpoint lineage (the root was
    deleted, replaced or restored from a copy while the tables were kept), or holds an
    epoch of this lineage other than the one it expects. Nothing was committed to it; the
    message names both lineages and the sink's ``on_foreign_lineage`` choices."""


class SinkCommitError(VolleyError):
    """A sink's table library failed to commit an epoch (its error is the cause), or
    lost every commit race; nothing of the epoch is in that table, so a retry is safe."""


class SinkOutcomeUnknownError(VolleyError):
    """An epoch's commit may or may not have happened, and the sink's system could not be
    asked (a Kafka transaction whose commit timed out, the brokers then unreachable): a
    retry is safe, since the next attempt settles the transaction and reads the mark
    back before it writes anything."""


class AggregateOverflowError(VolleyError):
    """An integer aggregate left int64 for some key: state never wraps, so the epoch
    fails naming the aggregate, the keys and the epoch."""


class StateLimitError(VolleyError):
    """An operator's state would grow past the bound its pipeline set (a join's
    ``max_state_rows``): the epoch fails, committing nothing, and the message says how
    to size the bound."""


class ProcessorError(VolleyError):
    """A team's own processor (``Pipeline.process``) raised: the error names the
    processor, the key and the record or timer it was handling, with the user's
    traceback. Nothing is committed; a person fixes the code, and the same recorded
    range runs again."""


class SnapshotError(VolleyError):
    """A state snapshot is missing, pruned or does not match its manifest."""


class StateLayoutError(VolleyError):
    """The checkpoint root was written by an incompatible pipeline layout."""


class SnapshotStorageError(SnapshotError):
    """The snapshot store (S3) failed during an upload, download or delete; nothing
    was committed, so retrying once the store is reachable again is safe."""


class StorageFullError(VolleyError):
    """The disk under the checkpoint root filled up while an epoch wrote state; the
    epoch is not committed, so re-running it once there is room is safe."""


class PipelineBusyError(VolleyError):
    """Another runner holds the pipeline's lease (``checkpoint/lease.py``) and did not
    release it within the wait; the message names the holder. Retrying later is safe."""


class FencedError(VolleyError):
    """A newer runner took the pipeline's lease: this one's fencing token is stale, so
    it stopped before making anything visible. Retrying (with a new lease) is safe."""


class LeaseLapsedError(FencedError):
    """This runner's own lease ran out under it (the process was paused, or its heartbeat
    could not write, for longer than the ttl), whether or not anyone took it over: it
    stopped before its next write. The runner takes a new token and runs the epoch
    again (``PipelineLease.retaking_on_lapse``)."""


class DimensionTableError(VolleyError):
    """A dimension table an enrichment joins cannot be read now: a retry may succeed."""


class DimensionPinRejectedError(DimensionTableError):
    """The pinned version breaks the join's contract (a key on several rows, a column
    missing). It fails every attempt the same way, so none produced output from it: the
    pin is set aside and a retry pins the table as it is then (fixed, one hopes)."""

    def __init__(self, message: str, table: str, version: str) -> None:
        super().__init__(message)
        self.table, self.version = table, version


class DuplicateDimensionKeyError(DimensionPinRejectedError):
    """The pinned version holds a key on several rows, so a join would repeat records."""


class DimensionVersionLostError(DimensionTableError):
    """The version an epoch pinned is gone (vacuumed, expired, a file rewritten): the
    epoch cannot be reproduced from it."""


# The one place that classifies failures. Permanent: errors that name bad input, a
# setting, a lineage, a schema, a corrupt snapshot or state past its bound: the same run fails the same way,
# so a retry only hides them and a person must act. Transient: everything else. Named
# ones: S3 5xx, throttling, timeouts and refused connections (SnapshotStorageError,
# SourceUnavailableError), a lost executor, a catalog lock or commit conflict
# (SinkCommitError), the lease being busy or lost (PipelineBusyError, FencedError), a
# full disk; an error of no known class is transient too, since a retry of an epoch is
# always safe (it commits at most once).
_PERMANENT = (ConfigError, EpochOrderError, SourceError, MalformedRecordError, StateLayoutError, SinkLineageError,
              AggregateOverflowError, DimensionVersionLostError, StateLimitError, ProcessorError)


def is_retryable(exc: BaseException) -> bool:
    """Whether re-running the failed epoch may succeed without a person acting."""
    if isinstance(exc, SnapshotError) and not isinstance(exc, SnapshotStorageError):
        return False  # a corrupt or pruned snapshot stays so
    return not isinstance(exc, _PERMANENT)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC from Python, or RocksDB's IO error for it (rocksdict raises plain Exception)."""
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)
