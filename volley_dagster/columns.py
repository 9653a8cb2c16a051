"""Names of the engine's own columns. They start with ``_volley_`` so they never
collide with a user's columns, and user transforms should keep them
(``where``/``withColumn`` do; a ``select`` must list them)."""

POS = "_volley_pos"  # event position in the epoch: segment id << 40 | the record's offset from the segment's start
ERROR = "_volley_error"  # why a record could not be parsed (null when it parsed)
RAW = "_volley_raw"  # the record's original text, kept for the dead-letter output
KEY = "_volley_key"
KEY_GROUP = "_volley_kg"
SHARD = "_volley_shard"
STATS = "_volley_stats"  # one JSON row per shard task with its statistics
ROWS = "_volley_rows"  # records folded into a key's partial aggregate

POS_OFFSET_BITS = 40  # an epoch reads fewer than 2^40 records of a segment
POS_SEGMENT_BITS = 23  # and has fewer than 2^23 segments: positions stay non-negative int64s
WINDOW_START = "_volley_ws"  # window bounds in microseconds since the Unix epoch
WINDOW_END = "_volley_we"
LATE_TIME = "_volley_time"  # a late row's event time (the side output names it after the time column)
MARKER = "_volley_marker"  # one row per shard, so every shard task runs
PARTITION = "_volley_part"  # the Spark partition a shard's rows go to (spark/partitioning.py)
DEDUP_KEY = "_volley_dkey"  # deduplication: a record's key over the ``on`` columns (int64 or string)
DEDUP_TIME = "_volley_dtime"  # its event time in microseconds
DUPLICATE = "_volley_dup"  # deduplication's verdict: the record repeats a key kept before it
DEDUP_LATE = "_volley_dlate"  # and: the record is late (event time + within at or before the epoch's starting watermark)
DEDUP_RUN = "_volley_drun"  # the keys a shard's probe kept in one key group, as a run (operators/dedup_state.py)
JOIN_SIDE = "_volley_jside"  # an interval join: which side a row is on (0 left, 1 right)
JOIN_TIME = "_volley_jtime"  # its event time in microseconds, from its side's column
JOIN_ROW = "_volley_jrow"  # its side's columns as one JSON text (operators/join_rows.py)
SOURCE = "_volley_source"  # which source of several a record came from, when the pipeline names no column for it


def sql_identifier(column: str) -> str:
    """``column`` quoted for SQL text (Spark's and DataFusion's backticks)."""
    return "`" + column.replace("`", "``") + "`"
