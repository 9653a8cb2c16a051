"""``state/bulk_rows``: the fast ways of moving structured records do exactly what
NumPy's indexing syntax and ``np.insert``/``np.concatenate`` do, on records laid out as the operators' are (packed,
unaligned fields) and on a memory-mapped mirror written in place."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from volley_dagster.state import bulk_rows

RECORD = np.dtype([("_format", np.uint8), ("start", np.int64), ("n:n", np.int64), ("total:v", np.float64)])


def records(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = np.zeros(n, dtype=RECORD)
    rows["_format"] = rng.integers(0, 255, n)
    rows["start"] = rng.integers(-(2**62), 2**62, n)
    rows["n:n"] = rng.integers(0, 2**40, n)
    rows["total:v"] = rng.normal(size=n)
    return rows


sizes = st.integers(min_value=0, max_value=60)


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_take_select_put_and_insert_equal_numpys_own_syntax(n: int, seed: int, data: st.DataObject) -> None:
    rows = records(n, seed)
    index = np.array(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=80) if n else st.just([])),
                     dtype=np.int64)
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    assert bulk_rows.take(rows, index).tobytes() == rows[index].tobytes()
    assert bulk_rows.select(rows, mask).tobytes() == rows[mask].tobytes()

    distinct = np.unique(index)  # NumPy's syntax and np.put agree on repeated positions too, but
    values = records(len(distinct), seed + 1)  # the operators never repeat one
    ours, theirs = rows.copy(), rows.copy()
    bulk_rows.put(ours, distinct, values)
    theirs[distinct] = values
    assert ours.tobytes() == theirs.tobytes()

    at = np.array(data.draw(st.lists(st.integers(0, n), max_size=30)), dtype=np.int64)  # any order, repeats
    added = records(len(at), seed + 2)
    assert bulk_rows.insert(rows, at, added).tobytes() == np.insert(rows, at, added).tobytes()
    order = bulk_rows.inserted_order(at, n)  # the one order the mirror moves its keys and names by
    assert order.tolist() == np.insert(np.arange(n), at, n + np.arange(len(at))).tolist()
    assert bulk_rows.concat([rows, added, rows[::2]]).tobytes() == np.concatenate([rows, added, rows[::2]]).tobytes()


def test_put_writes_through_a_memory_mapped_mirror(tmp_path) -> None:
    path = tmp_path / "values.npy"
    np.save(path, records(100, 1))
    mapped = np.load(path, mmap_mode="r+")
    bulk_rows.put(mapped, np.array([3, 97]), records(2, 2))
    mapped.flush()
    del mapped
    assert np.load(path)[[3, 97]].tobytes() == records(2, 2).tobytes()


def test_a_length_mismatch_is_refused_not_repeated_or_cut() -> None:
    rows = records(4, 3)
    with pytest.raises(ValueError, match="1 values for 2 positions"):
        bulk_rows.put(rows, np.array([0, 1]), records(1, 4))
    with pytest.raises(ValueError, match="a mask of 3 for 4 rows"):
        bulk_rows.select(rows, np.array([True, False, True]))
    with pytest.raises(ValueError, match="2 rows for 1 positions"):
        bulk_rows.insert(rows, np.array([0]), records(2, 5))
    with pytest.raises(ValueError, match="records of 2 layouts"):
        bulk_rows.concat([rows, np.zeros(1, dtype=[("start", np.int64)])])
