"""The interval join's shard side without Spark, on a real RocksDB: random streams of
both sides, cut into random epochs, each epoch folded by ``apply_join`` as a shard task
does (late records left out, as the stage does) and compared with the record-by-record
``tests/join_reference.py``: the pairs, the outer rows, the rows left waiting. Each
epoch runs twice: its first attempt's transaction is dropped unflushed (the attempt
died), and the retry must emit exactly the same rows."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import rocksdict
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import types as T

from tests.join_reference import JoinReference, Row
from volley_dagster import columns
from volley_dagster.errors import ConfigError, SnapshotError, StateLimitError, is_retryable
from volley_dagster.operators.base import ShardStep
from volley_dagster.operators.join import JOIN_NAMESPACES, IntervalJoin, ResolvedJoin, signed_duration_us
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.operators.join_state import JoinBounds, JoinShard, apply_join, decode_index
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.transaction import ShardTransaction, scan_prefix

LAYOUT = ShardLayout(1, 8)
CODEC = RowCodec(("rid", "note"), (T.LongType(), T.StringType()))


def _table(rows: list[Row], kind: str) -> pa.Table:
    """One shard's input, as the stage routes it: key, key group, row id, side, time, columns."""
    keys = [k for _, k, _, _ in rows]
    groups = [(k if kind == "int" else len(k)) % 8 for k in keys]
    return pa.table({
        columns.KEY: pa.array(keys, pa.int64() if kind == "int" else pa.string()),
        columns.KEY_GROUP: pa.array(groups, pa.int32()),
        columns.POS: pa.array(range(len(rows)), pa.int64()),  # positions restart each epoch: ids are epoch:position
        columns.JOIN_SIDE: pa.array([s for s, *_ in rows], pa.int8()),
        columns.JOIN_TIME: pa.array([t for _, _, t, _ in rows], pa.int64()),
        columns.JOIN_ROW: pa.array([json.dumps({"rid": r, "note": f"n{r}"}) for *_, r in rows], pa.string()),
        columns.ROWS: pa.array([1] * len(rows), pa.int32()),
    })


@st.composite
def epochs(draw: st.DrawFn, kind: str) -> list[list[Row]]:
    pool = draw(st.lists(st.integers(-3, 5) if kind == "int" else st.text("abc", max_size=3), min_size=1, max_size=4,
                         unique=True))
    n = draw(st.integers(0, 60))
    clock, records = 0, []
    for rid in range(n):
        clock += draw(st.integers(0, 5))
        records.append((draw(st.integers(0, 1)), draw(st.sampled_from(pool)), clock - draw(st.integers(0, 12)), rid))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    bounds = [0, *cuts, n]
    return [records[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), legacy=st.booleans())
def test_each_epoch_equals_the_reference_and_a_retry_emits_the_same(tmp_path_factory, data, legacy):
    """``legacy``: before each epoch the shard is rewritten in the layout before
    2026-12-08 (each row's text and bound under keys of their own), which the epoch
    must upgrade as it goes, to the same rows."""
    kind = data.draw(st.sampled_from(["int", "str"]), label="kind")
    how = data.draw(st.sampled_from(["inner", "left", "right", "full"]), label="how")
    lower = data.draw(st.integers(-8, 4), label="lower")
    upper = data.draw(st.integers(lower, lower + 10), label="upper")
    lateness = data.draw(st.integers(0, 6), label="out_of_orderness")
    cut = data.draw(epochs(kind), label="epochs")
    reference = JoinReference(lower, upper, how, lateness)
    shard = JoinShard(JoinBounds(lower, upper, _outer(how)), (CODEC, CODEC), None, ("l", "r"))
    db = rocksdict.Rdict(str(tmp_path_factory.mktemp("join") / "db"), RocksDBOptions().build())
    ids: dict[str, int] = {}  # row id -> the record's rid
    try:
        for number, records in enumerate(cut, start=1):
            before = reference.watermark
            pairs, outer, late = reference.run(list(records))
            on_time = [r for r in records if r[3] not in set(late)]
            step = ShardStep(number, kind, watermark_before=before, watermark=reference.watermark, layout=LAYOUT,
                             shard=0)
            ids.update({f"{number}:{position}": r[3] for position, r in enumerate(on_time)})
            if legacy:
                _as_before_2026_12_08(db, shard.bounds)
            first = _emitted(apply_join(shard, ShardTransaction(db), _table(on_time, kind), step)[0], ids)
            txn = ShardTransaction(db)  # the first attempt died unflushed: the retry starts from the same state
            outputs, stats = apply_join(shard, txn, _table(on_time, kind), step)
            txn.flush()
            again = _emitted(outputs, ids)
            assert again == first, f"epoch {number}: a retry emitted other rows"
            assert again == (pairs, outer), f"epoch {number}"
            assert (stats.figures["join_left_rows"], stats.figures["join_right_rows"]) == reference.held()
            assert stats.figures["join_pairs"] == len(pairs) and stats.figures["join_unmatched"] == len(outer)
        _state_is_only_what_waits(db, reference)
    finally:
        db.close()


def _as_before_2026_12_08(db: rocksdict.Rdict, bounds: JoinBounds) -> None:
    """The shard's waiting rows rewritten as the join kept them before 2026-12-08: an
    index value of the rows' records only, each row's text under ``10 | kg | key | side
    | epoch | position`` and its bound under ``11 | kg | bound | side | epoch | position
    | key``; no leaving entries (17)."""
    entry = np.dtype([("side", "u1"), ("matched", "u1"), ("epoch", "<u4"), ("row", "<i8"), ("time", "<i8")])
    suffix = np.dtype([("side", "u1"), ("epoch", ">u4"), ("row", ">i8")])
    batch = rocksdict.WriteBatch(raw_mode=True)
    for key, _ in scan_prefix(db, (17).to_bytes(2, "big")):
        batch.delete(key)
    for key, value in scan_prefix(db, (9).to_bytes(2, "big")):
        rows, texts = decode_index([value])
        old = np.empty(len(rows), dtype=entry)
        for name in entry.names:
            old[name] = rows[name]
        batch.put(key, old.tobytes())
        for i, text in enumerate(texts.to_pylist()):
            tail = np.array([(rows["side"][i], rows["epoch"][i], rows["row"][i])], dtype=suffix).tobytes()
            batch.put((10).to_bytes(2, "big") + key[2:] + tail, text.encode())
            bound = int(bounds.leaves_at(rows["side"][i:i + 1], rows["time"][i:i + 1])[0])
            ordered = ((bound + (1 << 63)) % (1 << 64)).to_bytes(8, "big")
            batch.put((11).to_bytes(2, "big") + key[2:4] + ordered + tail + key[4:], b"")
    db.write(batch)


def _outer(how: str) -> tuple[bool, bool]:
    return {"inner": (False, False), "left": (True, False), "right": (False, True), "full": (True, True)}[how]


def _emitted(outputs: list[pa.Array],
             ids: dict[str, int]) -> tuple[set[tuple[object, object, object]], set[tuple[object, object, object]]]:
    """(pairs, outer rows) as (key, left rid, right rid); each row id ("<epoch>:<position>")
    must name the record whose columns the row carries."""
    key, left_id, right_id, left, left_note, right, right_note = (a.to_pylist() for a in outputs)
    assert [None if i is None else ids[i] for i in left_id] == left
    assert [None if i is None else ids[i] for i in right_id] == right
    assert left_note == [None if r is None else f"n{r}" for r in left]
    assert right_note == [None if r is None else f"n{r}" for r in right]
    rows = list(zip(key, left, right, strict=True))
    assert len(rows) == len(set(rows)), "a row was emitted twice"
    return ({r for r in rows if None not in r[1:]}, {r for r in rows if None in r[1:]})


def _state_is_only_what_waits(db: rocksdict.Rdict, reference: JoinReference) -> None:
    """Every namespace holds exactly the waiting rows: none leaks after it leaves."""
    left, right = reference.held()
    entries = {ns: list(scan_prefix(db, ns.to_bytes(2, "big"))) for ns in JOIN_NAMESPACES.keyed}
    index, leaving, counts, legacy_rows, legacy_bounds = (entries[ns] for ns in JOIN_NAMESPACES.keyed)
    rows, _ = decode_index([v for _, v in index])
    assert len(rows) == left + right and not legacy_rows and not legacy_bounds
    leaving_rows = sum(int(np.frombuffer(v, "<u4", count=1)[0]) for _, v in leaving)
    assert leaving_rows == left + right  # each waiting row once among the leaving entries
    held = sum(np.frombuffer(v, "<i8").reshape(2) for _, v in counts) if counts else np.zeros(2)
    assert tuple(int(x) for x in held) == (left, right)
    assert len(index) == len({r.key for r in reference.waiting})


def test_state_past_max_state_rows_is_refused_naming_how_to_size_it(tmp_path):
    shard = JoinShard(JoinBounds(0, 100, (False, False)), (CODEC, CODEC), 3, ("orders", "payments"))
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        rows = [(0, 1, 10, 0), (0, 2, 11, 1), (1, 3, 12, 2), (1, 4, 13, 3)]
        step = ShardStep(7, "int", watermark_before=None, watermark=5, layout=LAYOUT, shard=0)
        with pytest.raises(StateLimitError) as failure:
            apply_join(shard, ShardTransaction(db), _table(rows, "int"), step)
        message = str(failure.value)
        assert "epoch 7 shard 0" in message and "max_state_rows=3" in message
        assert "2 of 'orders', 2 of 'payments'" in message and "nothing was committed" in message
        assert "between=" in message and "max_out_of_orderness" in message
        assert not is_retryable(failure.value)  # review J6: retried forever before
    finally:
        db.close()


def test_a_join_is_configured_with_named_errors():
    assert signed_duration_us("-10 minutes", "b") == -600_000_000
    assert signed_duration_us("+30 minutes", "b") == 1_800_000_000
    with pytest.raises(ConfigError, match="lower bound"):
        IntervalJoin("a", "b", "k", "t", "u", 10, -10)
    with pytest.raises(ConfigError, match="how='outer'"):
        IntervalJoin("a", "b", "k", "t", "u", 0, 10, "outer")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="two different sources"):
        IntervalJoin("a", "a", "k", "t", "u", 0, 10)


def _rows(rows: list[tuple[int, int, int, int, str]]) -> pa.Table:
    """(side, key, time, position, note) rows, as the stage routes them: several may share a position."""
    return pa.table({
        columns.KEY: pa.array([k for _, k, *_ in rows], pa.int64()),
        columns.KEY_GROUP: pa.array([k % 8 for _, k, *_ in rows], pa.int32()),
        columns.POS: pa.array([p for *_, p, _ in rows], pa.int64()),
        columns.JOIN_SIDE: pa.array([s for s, *_ in rows], pa.int8()),
        columns.JOIN_TIME: pa.array([t for _, _, t, *_ in rows], pa.int64()),
        columns.JOIN_ROW: pa.array([json.dumps({"rid": p, "note": n}) for *_, p, n in rows], pa.string()),
        columns.ROWS: pa.array([1] * len(rows), pa.int32()),
    })


def test_rows_of_one_record_keep_their_own_ids_and_columns_while_they_wait(tmp_path):
    """A transform that explodes a record (an order into its items) gives the join
    several rows at one position: each waits, matches and leaves as its own row (review
    J1: they shared one id, so the last row's columns overwrote the others', and the
    first to leave deleted the others' columns)."""
    shard = JoinShard(JoinBounds(0, 100, (True, False)), (CODEC, CODEC), None, ("orders", "shipments"))
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())

    def run(epoch: int, rows: list[tuple[int, int, int, int, str]], before: int | None, after: int | None,
            again: bool = True) -> list[tuple[object, ...]]:
        step = ShardStep(epoch, "int", watermark_before=before, watermark=after, layout=LAYOUT, shard=0)
        first = apply_join(shard, ShardTransaction(db), _rows(rows), step)[0] if again else None
        txn = ShardTransaction(db)
        outputs = apply_join(shard, txn, _rows(rows), step)[0]
        txn.flush()
        emitted = sorted(zip(*(a.to_pylist() for a in outputs), strict=True), key=str)
        if first is not None:
            assert sorted(zip(*(a.to_pylist() for a in first), strict=True), key=str) == emitted, "a retry differs"
        return emitted

    try:
        assert run(1, [(0, 1, 20, 7, "pear"), (0, 1, 10, 7, "apple")], None, None) == []
        paired = run(2, [(1, 1, 50, 0, "box")], None, 0)
        assert sorted((left_id, note) for _, left_id, _, _, note, _, _ in paired) == [("1:7", "apple"), ("1:7.1", "pear")]
        assert len({(row[1], row[2]) for row in paired}) == 2, "two pairs, two (left, right) ids"
        assert run(3, [], 0, 115) == []  # the apple leaves (bound 110), matched: no outer row
        late_match = run(4, [(1, 1, 118, 0, "crate")], 115, 115)
        assert [(left_id, note, right_note) for _, left_id, _, _, note, _, right_note in late_match] == \
            [("1:7.1", "pear", "crate")]
        assert run(5, [], 115, 300) == []  # the pear leaves matched; nothing waits
        assert not list(scan_prefix(db, (10).to_bytes(2, "big")))
    finally:
        db.close()


def test_a_hot_key_pairs_only_its_new_rows_by_range(tmp_path):
    """Review J5: one key with thousands of rows waiting per side; an epoch's new rows
    pair with exactly the waiting rows in their interval (found by range search, not by
    pairing every waiting row with every other). ``bench/join_hot_key.py`` measures it."""
    n = 3_000
    shard = JoinShard(JoinBounds(-5, 10, (False, False)), (CODEC, CODEC), None, ("l", "r"))
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        waiting = [(1, 1, t, i) for i, t in enumerate(range(0, 3 * n, 3))]  # right rows every 3 us
        waiting += [(0, 1, 100_000 + t, n + i) for i, t in enumerate(range(0, 3 * n, 3))]  # left rows after them all
        txn = ShardTransaction(db)
        first = apply_join(shard, txn, _table(waiting, "int"), ShardStep(1, "int", layout=LAYOUT, shard=0))[0]
        txn.flush()
        assert len(first[0]) == 0
        new = [(0, 1, 600, 0), (1, 1, 100_030, 1)]  # a left row among the right ones, a right row among the left
        outputs, stats = apply_join(shard, ShardTransaction(db), _table(new, "int"),
                                    ShardStep(2, "int", layout=LAYOUT, shard=0))
        left_rid, right_rid = outputs[3].to_pylist(), outputs[5].to_pylist()
        rights = {t for _, _, t, _ in waiting[:n]}
        lefts = {t - 100_000 for _, _, t, _ in waiting[n:]}
        expected = {(0, r) for r in range(n) if 3 * r - 600 in range(-5, 11) and 3 * r in rights} | \
                   {(n + i, 1) for i in range(n) if 100_030 - (100_000 + 3 * i) in range(-5, 11) and 3 * i in lefts}
        assert set(zip(left_rid, right_rid, strict=True)) == expected and stats.figures["join_pairs"] == len(expected)
    finally:
        db.close()


def test_an_index_value_that_does_not_hold_its_rows_is_refused_by_name():
    """A value cut short, or one of the layout before 2026-12-08 read as it is (rows of
    22 bytes, no count, no texts), names the problem and what to do, never reads past."""
    rows = np.zeros(1, dtype=[("side", "u1"), ("matched", "u1"), ("epoch", "<u4"), ("row", "<i8"), ("time", "<i8")])
    with pytest.raises(SnapshotError, match=r"written before 2026-12-08 .*run one, or restore from an earlier epoch"):
        decode_index([rows.tobytes()])
    whole = np.array([1], "<u4").tobytes() + rows.tobytes() + np.array([2], "<u4").tobytes() + b"{}"
    assert decode_index([None, whole])[1].to_pylist() == ["{}"]
    with pytest.raises(SnapshotError, match=r"1 index value\(s\) .* key #0, is 29 bytes\): the snapshot is damaged"):
        decode_index([whole[:-3]])


def test_volley_state_show_reads_waiting_rows_in_either_layout(tmp_path):
    """``decode_state`` (``volley state show``) reads a shard that no epoch has rewritten
    since 2026-12-08 (an older retained epoch's, say) as it reads one in the new layout."""
    join = IntervalJoin("l", "r", "k", "tl", "tr", 0, 10, "left")
    resolved = ResolvedJoin(join, CODEC, CODEC, (CODEC.names, CODEC.names))
    shard = JoinShard(JoinBounds(0, 10, (True, False)), (CODEC, CODEC), None, ("l", "r"))
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    try:
        txn = ShardTransaction(db)
        apply_join(shard, txn, _table([(0, 1, 5, 0), (0, 1, 7, 1), (1, 2, 9, 2), (0, 3, 9, 3)], "int"),
                   ShardStep(1, "int", layout=LAYOUT, shard=0))
        txn.flush()

        def shown() -> list[dict[str, object]]:
            index = list(scan_prefix(db, (9).to_bytes(2, "big")))
            return resolved.decode_state([k for k, _ in index], [v for _, v in index], "int", "k").to_pylist()

        now = shown()
        assert [(r["k"], r["source"], r["row"]) for r in now] == [(1, "l", "1:0"), (1, "l", "1:1"), (2, "r", "1:2"),
                                                                  (3, "l", "1:3")]
        _as_before_2026_12_08(db, shard.bounds)
        assert shown() == now
    finally:
        db.close()
