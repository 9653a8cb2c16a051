"""Moving fixed-width state records (NumPy structured arrays) in bulk.

NumPy's indexing syntax copies a structured array's rows field by field: for 240k
records of 42 bytes, ``rows[index]`` takes 16-35 ms where ``np.take`` takes 1.2-1.7,
``rows[index] = values`` 54 ms where ``np.put`` takes 2, ``rows[mask]`` 5.4 ms where
``np.compress`` takes 0.6, and ``np.insert`` 14.5 ms for 60k records into 600k where
two ``np.put`` take 5.6, and ``np.concatenate`` (or a slice assignment) 13 ms for 660k
where a copy of their bytes takes 0.75 (NumPy 2.4). The shard tasks move every touched record
through these, so they use the functions here, never the syntax, on records.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def take(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``rows[index]`` for integer ``index``: a new array."""
    return np.take(rows, index)


def select(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``rows[mask]`` for a boolean ``mask`` as long as ``rows``: a new array."""
    if len(mask) != len(rows):
        raise ValueError(f"a mask of {len(mask)} for {len(rows)} rows")
    return np.compress(mask, rows)


def put(target: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """``target[index] = values``, in place, one value per index (``np.put`` alone would
    repeat too few values)."""
    if len(index) != len(values):
        raise ValueError(f"{len(values)} values for {len(index)} positions")
    np.put(target, index, values)


def concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``np.concatenate(parts)`` of records of one dtype: a new array, copied as bytes."""
    dtypes = {part.dtype for part in parts}
    if len(dtypes) != 1:
        raise ValueError(f"records of {len(dtypes)} layouts: {sorted(map(str, dtypes))}")
    out = np.empty(sum(len(part) for part in parts), dtype=dtypes.pop())
    flat, at = out.view(np.uint8), 0
    for part in parts:
        flat[at:at + part.nbytes] = np.ascontiguousarray(part).view(np.uint8)
        at += part.nbytes
    return out


def insert(rows: np.ndarray, at: np.ndarray, added: np.ndarray) -> np.ndarray:
    """``np.insert(rows, at, added)``: a new array (rows added at one position keep their order)."""
    if len(at) != len(added):
        raise ValueError(f"{len(added)} rows for {len(at)} positions")
    return take(concat([rows, added]), inserted_order(at, len(rows)))


def inserted_order(at: np.ndarray, kept: int) -> np.ndarray:
    """Where each element of ``np.insert(kept_array, at, added)`` comes from, as an index
    into ``kept_array`` followed by ``added``: for arrays moved alike (keys, names)."""
    placed = _placed(at)
    source = np.empty(kept + len(placed), dtype=np.int64)
    old = np.ones(len(source), dtype=bool)
    old[placed] = False
    source[placed] = kept + np.arange(len(placed))
    source[old] = np.arange(kept)
    return source


def _placed(at: np.ndarray) -> np.ndarray:
    """Where each added element lands after ``np.insert`` at ``at`` (stable among equal positions)."""
    at = np.asarray(at, dtype=np.int64)
    placed = np.empty(len(at), dtype=np.int64)
    order = np.argsort(at, kind="stable") if np.any(at[1:] < at[:-1]) else np.arange(len(at))
    placed[order] = at[order] + np.arange(len(at))
    return placed
