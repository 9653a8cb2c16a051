"""The NumPy kernels of the operators, without Spark: the accumulators folding epoch
partials into state records, and window grouping (sessions merging across epochs).
Each is checked against a plain Python fold of the same values."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import rocksdict
from hypothesis import given, settings
from hypothesis import strategies as st

from volley_dagster.operators.accumulators import StateOverflow, count, first, last, max_, mean, min_, sum_
from volley_dagster.operators.aggregate import STATE_FORMAT, Aggregate, ResolvedAggregate
from volley_dagster.operators.window_state import group_windows, window_dtype

ACCUMULATORS = (("total", sum_("x")), ("n", count("x")), ("low", min_("x")), ("high", max_("x")),
                ("avg", mean("x")), ("first_x", first("x")), ("last_x", last("x")))


def resolved() -> ResolvedAggregate:
    return Aggregate(ACCUMULATORS).recorded(
        {"namespace": 1, "accumulators": [{"kind": k} for k in ("int", None, "int", "int", "int", "int", "int")]})


def partials(values_per_key: list[list[int | None]], first_pos: int) -> pa.Table:
    """What Spark's partial aggregation gives for one epoch: per key, over its values in
    log order (positions ``first_pos`` on)."""
    cols: dict[str, list] = {k: [] for k in ("total:v", "n:n", "low:v", "high:v", "avg:s", "avg:n",
                                             "first_x:v", "first_x:p", "last_x:v", "last_x:p")}
    pos = first_pos
    for values in values_per_key:
        seen = [(p, v) for p, v in enumerate(values, start=pos) if v is not None]
        pos += len(values)
        xs = [v for _, v in seen]
        cols["total:v"].append(sum(xs) if xs else None)
        cols["n:n"].append(len(xs))
        cols["low:v"].append(min(xs) if xs else None)
        cols["high:v"].append(max(xs) if xs else None)
        cols["avg:s"].append(float(sum(xs)) if xs else None)
        cols["avg:n"].append(len(xs))
        cols["first_x:v"].append(seen[0][1] if seen else None)
        cols["first_x:p"].append(seen[0][0] if seen else None)
        cols["last_x:v"].append(seen[-1][1] if seen else None)
        cols["last_x:p"].append(seen[-1][0] if seen else None)
    types = {"avg:s": pa.float64()}
    return pa.table({k: pa.array(v, types.get(k, pa.int64())) for k, v in cols.items()})


def test_accumulators_fold_epochs_like_a_plain_fold_of_the_values():
    aggregate = resolved()
    epochs = [  # three keys; a key may see only nulls, or nothing, in an epoch
        [[3, None, 5], [None], [7]],
        [[1], [4, 2], []],
        [[None, 9], [], [-6, 0]],
    ]
    state = aggregate.blank_rows(3)
    for epoch, values in enumerate(epochs, start=1):
        aggregate.merge(state, partials(values, first_pos=100 * epoch), epoch)
    outputs = {name: array.to_pylist() for (name, _), array in zip(ACCUMULATORS, aggregate.outputs(state), strict=True)}
    for key in range(3):
        xs = [v for values in epochs for v in values[key] if v is not None]
        assert outputs["total"][key] == sum(xs) and outputs["n"][key] == len(xs)
        assert (outputs["low"][key], outputs["high"][key]) == (min(xs), max(xs))
        assert outputs["avg"][key] == pytest.approx(sum(xs) / len(xs))
        assert (outputs["first_x"][key], outputs["last_x"][key]) == (xs[0], xs[-1])
    assert (state["_format"] == STATE_FORMAT).all()


def test_a_key_without_values_stays_null_not_zero():
    aggregate = resolved()
    state = aggregate.blank_rows(1)
    aggregate.merge(state, partials([[None, None]], 0), 1)
    outputs = dict(zip([n for n, _ in ACCUMULATORS], aggregate.outputs(state), strict=True))
    assert outputs["total"].to_pylist() == [None] and outputs["n"].to_pylist() == [0]
    assert outputs["avg"].to_pylist() == [None] and outputs["first_x"].to_pylist() == [None]


def spark_min_max(values: list[float | None]) -> tuple[float | None, float | None]:
    """Spark's min and max of a column: nulls skipped, NaN above every number."""
    xs = np.array([v for v in values if v is not None], dtype=np.float64)
    if not len(xs):
        return None, None
    nan = np.isnan(xs)
    low = float(xs[~nan].min()) if not nan.all() else float("nan")
    return low, float("nan") if nan.any() else float(xs.max())


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.just(float("nan")), st.floats(allow_nan=False, width=64)), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    data=st.data(),
)
def test_float_min_max_fold_any_epoch_cuts_to_sparks_single_aggregate(values, cuts, data):
    """NaN and epoch cuts: folding each epoch's partials (in any order, as window and
    session merges may) gives the min/max of one Spark aggregate over all the values."""
    aggregate = ResolvedAggregate((("low", min_("x")), ("high", max_("x"))), ("float", "float"), 1)
    bounds = [0, *sorted(min(c, len(values)) for c in cuts), len(values)]
    epochs = [values[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    loaded = []
    for epoch, part in enumerate(epochs, start=1):
        low, high = spark_min_max(part)
        rows = aggregate.blank_rows(1)
        aggregate.load(rows, pa.table({"low:v": pa.array([low], pa.float64()),
                                       "high:v": pa.array([high], pa.float64())}), epoch)
        loaded.append(rows)
    state = aggregate.blank_rows(1)
    for i in data.draw(st.permutations(range(len(loaded)))):
        aggregate.combine(state, loaded[i])
    got = tuple(array.to_pylist()[0] for array in aggregate.outputs(state))
    assert [_same(g, e) for g, e in zip(got, spark_min_max(values), strict=True)] == [True, True], got


def _same(got: float | None, expected: float | None) -> bool:
    """Equal, NaN equal to NaN, null only to null."""
    if got is None or expected is None:
        return got is expected
    return got == expected or (np.isnan(got) and np.isnan(expected))


def test_an_int64_sum_that_would_wrap_names_its_rows():
    aggregate = resolved()
    state = aggregate.blank_rows(3)
    aggregate.merge(state, partials([[2**62], [1], [-(2**62)]], 0), 1)
    with pytest.raises(StateOverflow) as overflow:
        aggregate.merge(state, partials([[2**62], [1], [-(2**62) - 1]], 10), 2)
    assert overflow.value.rows.tolist() == [0, 2] and "sum('x')" in overflow.value.aggregate


def test_sessions_merge_when_a_record_bridges_them_and_tumbling_windows_do_not():
    aggregate = ResolvedAggregate((("n", count()),), (None,), 1)
    dtype = window_dtype(aggregate)
    rows = np.zeros(5, dtype=dtype)
    rows["_format"] = STATE_FORMAT
    # key 0: stored sessions [0, 10) and [20, 30); a new record's [8, 22) bridges them.
    # key 1: stored [0, 5); a new record's [3, 9) extends it.
    rows["start"], rows["end"], rows["n:n"] = [0, 20, 8, 0, 3], [10, 30, 22, 5, 9], [2, 3, 1, 4, 1]
    key_index = np.array([0, 0, 0, 1, 1])
    is_new = np.array([False, False, True, False, True])
    merged, keys, end_moved = group_windows(aggregate, rows.copy(), key_index, is_new, sessions=True)
    assert sorted(zip(keys.tolist(), merged["start"].tolist(), merged["end"].tolist(), merged["n:n"].tolist(),
                      strict=True)) == [(0, 0, 30, 6), (1, 0, 9, 5)]
    # the pending index needs a new entry only where a session now ends later than stored
    assert dict(zip(keys.tolist(), end_moved.tolist(), strict=True)) == {0: False, 1: True}
    tumbling, _, _ = group_windows(aggregate, rows.copy(), key_index, is_new, sessions=False)
    assert len(tumbling) == 5  # distinct windows never merge, even when they overlap


@pytest.mark.parametrize("by_epochs", [True, False], ids=["ttl_epochs", "ttl_event_time"])
def test_state_ttl_expires_each_key_as_a_plain_fold_over_random_epochs(tmp_path, by_epochs):
    """30 epochs over 200 keys, each touching a random subset, on a real RocksDB with an
    in-memory expiry index of 7 entries: each epoch's output (updates, and expiries with
    the key's last count) and the state equal a plain per-key fold of the TTL rule."""
    import rocksdict

    from volley_dagster import columns
    from volley_dagster.operators.base import ShardStep
    from volley_dagster.operators.event_time import EventTime
    from volley_dagster.operators.ttl import TOUCHED_PARTIAL, StateTtl
    from volley_dagster.state.keys import namespace_prefix
    from volley_dagster.state.options import RocksDBOptions
    from volley_dagster.state.transaction import ShardTransaction, scan_prefix

    ttl = StateTtl(epochs=3, max_resident_entries=7) if by_epochs else StateTtl(
        duration_us=50, event_time=EventTime("t"), max_resident_entries=7)
    aggregate = Aggregate((("n", count()),), ttl=ttl).recorded({"namespace": 1, "accumulators": [{"kind": None}], "ttl": ttl.layout()})
    rng = np.random.default_rng(5)
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    expected: dict[int, list[int]] = {}  # key -> [count, touched]
    watermark, expired_total = None, 0
    try:
        for epoch in range(1, 31):
            keys = np.unique(rng.choice(200, rng.integers(0, 40)))
            counts = rng.integers(1, 4, len(keys))
            times = epoch * 10 + rng.integers(0, 10, len(keys))  # event time moves ~10 a epoch
            data = pa.table({columns.KEY_GROUP: pa.array(keys % 7, pa.int64()), columns.KEY: pa.array(keys, pa.int64()),
                             columns.ROWS: counts, "n:n": counts, TOUCHED_PARTIAL: times})
            if len(keys):
                watermark = max(watermark or 0, int(times.max()))
            txn = ShardTransaction(db)
            out, stats = aggregate.apply(txn, data, ShardStep(epoch, "int", expire_limit=watermark))
            txn.flush()
            got = {k: (n, e) for k, n, e in zip(*(a.to_pylist() for a in out), strict=True)}
            want = {}
            for k, c, t in zip(keys.tolist(), counts.tolist(), times.tolist(), strict=True):
                old = expected.get(k)
                stamp = epoch if by_epochs else max(old[1], t) if old else t
                expected[k] = [(old[0] if old else 0) + c, stamp]
                want[k] = (expected[k][0], False)
            limit = epoch if by_epochs else watermark
            for k in [k for k, (_, s) in expected.items() if limit is not None and s + ttl.amount <= limit]:
                want[k] = (expected.pop(k)[0], True)
            assert got == want, f"epoch {epoch}"
            assert stats.figures["keys_expired"] == sum(e for _, e in want.values())
            assert stats.figures["expiry_resident"] <= 7
            expired_total += stats.figures["keys_expired"]
        stored = dict(scan_prefix(db, namespace_prefix(1)))
        state, _ = aggregate.decode(list(stored.values()))
        assert sorted(state["n:n"].tolist()) == sorted(v[0] for v in expected.values())
        assert expired_total > 50
    finally:
        db.close()


@pytest.mark.parametrize("slide,max_pending", [(10, None), (5, None), (10, 3)], ids=["tumbling", "sliding", "evicting"])
def test_windows_fire_once_with_every_epochs_partials_whichever_path_they_take(tmp_path, slide, max_pending):
    """40 epochs of random (key, time) records over a real RocksDB, windows of 10 sliding
    by ``slide``, fired at a watermark 8 behind the latest time (so windows span epochs
    and records arrive out of order): each epoch fires exactly the windows a plain fold
    has closed, with all their records. Windows that end after every open one of the
    shard fire straight from their partials (fewer keys touched than the epoch has);
    the rest merge with state. With 3 pending entries in memory the rest are evicted:
    while any is, the latest open end is unknown and every window takes the state path."""
    from volley_dagster import columns
    from volley_dagster.operators.base import ShardStep
    from volley_dagster.operators.window_state import apply_windows
    from volley_dagster.state.options import RocksDBOptions
    from volley_dagster.state.transaction import ShardTransaction

    size, delay = 10, 8
    aggregate = ResolvedAggregate((("n", count()),), (None,), 2)
    rng = np.random.default_rng(11)
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    open_windows: dict[tuple[int, int], int] = {}  # (key, start) -> records
    limit, latest, straight, merged, evicted = None, 0, 0, 0, 0
    try:
        for epoch in range(1, 41):
            n = int(rng.integers(0, 30))
            times = latest - delay + rng.integers(0, 5 * size, n)  # some before the watermark: late
            keys = rng.integers(0, 6, n)
            pairs: dict[tuple[int, int], int] = {}
            for k, t in zip(keys.tolist(), times.tolist(), strict=True):
                for start in range(t - t % slide - size + slide, t + 1, slide):
                    if limit is None or start + size > limit:  # Spark drops a closed window's pairs before the shards
                        pairs[(k, start)] = pairs.get((k, start), 0) + 1
            latest = max([latest, *times.tolist()])
            limit = latest - delay
            rows = sorted(pairs.items())
            data = pa.table({columns.KEY_GROUP: pa.array([k % 3 for (k, _), _ in rows], pa.int64()),
                             columns.KEY: pa.array([k for (k, _), _ in rows], pa.int64()),
                             columns.WINDOW_START: pa.array([s for (_, s), _ in rows], pa.int64()),
                             columns.WINDOW_END: pa.array([s + size for (_, s), _ in rows], pa.int64()),
                             columns.ROWS: pa.array([c for _, c in rows], pa.int64()),
                             "n:n": pa.array([c for _, c in rows], pa.int64())})
            txn = ShardTransaction(db)
            out, stats = apply_windows(aggregate, False, max_pending, txn, data,
                                       ShardStep(epoch, "int", fire_limit=limit))
            txn.flush()
            for pair, c in pairs.items():
                open_windows[pair] = open_windows.get(pair, 0) + c
            due = sorted(p for p in open_windows if p[1] + size <= limit)
            want = [(k, s, s + size, open_windows.pop((k, s))) for k, s in due]
            got = sorted(zip(out[0].to_pylist(), *(pa.array(a).cast(pa.int64()).to_pylist() for a in out[1:]),
                             strict=True))
            assert got == want, f"epoch {epoch}"
            distinct = len({k for k, _ in pairs})
            straight += stats.keys_touched < distinct
            merged += stats.keys_touched > 0
            evicted += stats.figures["pending_evicted_now"]
    finally:
        db.close()
    assert merged > 10 and straight > 5
    assert evicted > 0 if max_pending is not None else evicted == 0
