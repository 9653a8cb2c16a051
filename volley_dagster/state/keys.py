"""Key groups, shard ranges and the byte layout of state keys.

A key hashes (Spark's ``xxhash64``: stable across processes, versions and
machines, unlike Python's ``hash()``) to one of a fixed number of key groups;
shards own contiguous key-group ranges, as in Flink's
``KeyGroupRangeAssignment``, so rescaling moves whole ranges and never rehashes.

A state key is ``namespace (2 bytes) | key group (2 bytes) | encoded key``:
one operator's entries are one contiguous prefix, and inside it one key group's
entries are one contiguous range (what a rescale copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster.errors import ConfigError

DEFAULT_KEY_GROUPS = 256
PREFIX_BYTES = 4
_SIGN_BIT = np.uint64(1 << 63)
_MAX_SLICE = 2**31 - 1


@dataclass(frozen=True)
class ShardLayout:
    """How key groups map to shards: ``shard = key_group * shards // key_groups``."""

    num_shards: int = 4
    num_key_groups: int = DEFAULT_KEY_GROUPS

    def __post_init__(self) -> None:
        if not 1 <= self.num_key_groups <= 0xFFFF:
            raise ConfigError(f"num_key_groups must be in 1..65535, got {self.num_key_groups}")
        if not 1 <= self.num_shards <= self.num_key_groups:
            raise ConfigError(
                f"num_shards must be in 1..num_key_groups ({self.num_key_groups}), got {self.num_shards}"
            )

    def shard_of_group(self, key_group: np.ndarray | int) -> np.ndarray | int:
        return key_group * self.num_shards // self.num_key_groups

    def key_group_range(self, shard: int) -> tuple[int, int]:
        """The ``[start, end)`` key groups owned by ``shard``."""
        start = -(-shard * self.num_key_groups // self.num_shards)
        end = -(-(shard + 1) * self.num_key_groups // self.num_shards)
        return start, end

    def to_dict(self) -> dict[str, int]:
        return {"num_shards": self.num_shards, "num_key_groups": self.num_key_groups}


def key_kind(arrow_type: pa.DataType) -> str:
    """``"int"`` or ``"str"``: the two key encodings state supports."""
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str"
    raise ConfigError(f"key column must be an integer or string, got {arrow_type}")


def _prefixes(namespace: int, key_groups: np.ndarray) -> np.ndarray:
    out = np.empty(len(key_groups), dtype=[("ns", ">u2"), ("kg", ">u2")])
    out["ns"] = namespace
    out["kg"] = key_groups
    return out


def encode_keys(namespace: int, key_groups: np.ndarray, keys: pa.Array) -> list[bytes]:
    """State keys for a batch, in bulk (NumPy for ints, Arrow kernels for strings)."""
    kind = key_kind(keys.type)
    if kind == "int":
        rows = np.empty(len(keys), dtype=[("ns", ">u2"), ("kg", ">u2"), ("key", ">u8")])
        rows["ns"] = namespace
        rows["kg"] = key_groups
        # Flip the sign bit so that byte order equals numeric order.
        rows["key"] = keys.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64) ^ _SIGN_BIT
        return rows.view(f"V{rows.itemsize}").tolist()
    prefix = packed_records(_prefixes(namespace, key_groups))
    joined = pc.binary_join_element_wise(prefix, keys.cast(pa.binary()), pa.scalar(b"", pa.binary()))
    return joined.to_pylist()


def in_state_order(key_groups: np.ndarray) -> np.ndarray:
    """The order that puts a batch sorted by key into state-key order (key group, then
    key: what RocksDB takes fastest and ``ShardTransaction.set_many`` keeps as given): a
    stable sort of the key groups alone, NumPy's radix sort on their 16 bits (160k rows:
    0.4 ms, against 22 for Arrow's sort by both columns)."""
    return np.argsort(np.asarray(key_groups).astype(np.uint16), kind="stable")


def packed_records(records: np.ndarray) -> pa.Array:
    """NumPy structured records as Arrow binary values, one each (their bytes as laid
    out: big-endian fields give keys whose byte order is their order), in bulk."""
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(records.dtype.itemsize), len(records),
                                                [None, pa.py_buffer(records.tobytes())]).cast(pa.binary())


def decode_keys(kind: str, state_keys: list[bytes]) -> tuple[np.ndarray, pa.Array]:
    """Key groups and key values back from state keys (scans, restores, rescaling)."""
    if kind == "int":
        rows = np.frombuffer(b"".join(state_keys), dtype=[("ns", ">u2"), ("kg", ">u2"), ("key", ">u8")])
        keys = (rows["key"] ^ _SIGN_BIT).astype(np.uint64).view(np.int64)
        return rows["kg"].astype(np.int64), pa.array(keys, pa.int64())
    arr = pa.array(state_keys, pa.binary())
    prefixes = pc.binary_slice(arr, 0, PREFIX_BYTES).cast(pa.binary(PREFIX_BYTES))
    kg = np.frombuffer(prefixes.buffers()[1], dtype=[("ns", ">u2"), ("kg", ">u2")], count=len(arr))["kg"]
    keys = pc.binary_slice(arr, PREFIX_BYTES, _MAX_SLICE).cast(pa.string())
    return kg.astype(np.int64), keys


def namespace_prefix(namespace: int) -> bytes:
    return int(namespace).to_bytes(2, "big")


_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def string_key_hashes(keys: pa.Array) -> np.ndarray:
    """64-bit FNV-1a of each string's UTF-8 bytes, in bulk: a byte position at a time
    over the keys still that long, so the work is the keys' total bytes plus one NumPy
    step per byte of the longest key. Not a fingerprint: whoever relies on it for
    identity compares the strings too (``state/resident.py``)."""
    arr = keys.cast(pa.large_binary())
    n = len(arr)
    hashes = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    if not n:
        return hashes.view(np.int64)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=n + 1, offset=arr.offset * 8)
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if arr.buffers()[2] is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: the keys at byte j are a prefix
    starts, by_length = offsets[:-1][order], lengths[order]
    h = hashes[order]
    still = np.searchsorted(-by_length, -np.arange(int(by_length[0])), side="left")  # keys longer than j
    with np.errstate(over="ignore"):
        for j, count in enumerate(still.tolist()):
            head = h[:count]
            head ^= data[starts[:count] + j]
            head *= _FNV_PRIME
    hashes[order] = h
    return hashes.view(np.int64)


def key_columns(key_values: pa.Array, key_name: str, key_groups: np.ndarray,
                key_group: str | None) -> tuple[list[pa.Array], list[str]]:
    """The key column of decoded state rows, followed by each row's key group (as
    Spark's ``int``) under the name ``key_group`` when one is given."""
    if key_group is None:
        return [key_values], [key_name]
    return [key_values, pa.array(key_groups.astype(np.int32), pa.int32())], [key_name, key_group]
