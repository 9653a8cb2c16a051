"""The deduplication's kernels without Spark, on a real RocksDB: 40 random epochs of
ids with copies inside an epoch and across epochs, event times that move on and
some that arrive late (past ``within`` behind the watermark: dropped as late); each
epoch's verdicts and what stays remembered equal a plain record-by-record fold of the
rule in ``volley_dagster.operators.dedup``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import rocksdict

from volley_dagster.operators.base import ShardStep
from volley_dagster.operators.dedup import SEEN_BY_DEADLINE_NS, SEEN_NS, Deduplication, SeenKeys, decide
from volley_dagster.operators.event_time import EventTime
from volley_dagster.state.keys import ShardLayout, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.transaction import ShardTransaction, scan_prefix

WITHIN = 30


@pytest.mark.parametrize("kind", ["int", "str"])
def test_verdicts_and_memory_equal_a_plain_fold_over_random_epochs(tmp_path, kind):
    dedup = Deduplication(("id",), WITHIN, EventTime("t"))
    layout = ShardLayout(2, 8)  # this DB is shard 1: key groups 4..7
    rng = np.random.default_rng(7)
    db = rocksdict.Rdict(str(tmp_path / "db"), RocksDBOptions().build())
    remembered: dict[object, int] = {}  # the fold: id -> event time of its kept record
    watermark: int | None = None
    forgotten_total = late_total = 0
    try:
        for epoch in range(1, 41):
            n = int(rng.integers(0, 60))
            ids = rng.integers(0, 150, n)
            times = epoch * 10 + rng.integers(-40, 10, n)  # some far behind: late, past the bound
            keys = pa.array(ids, pa.int64()) if kind == "int" else pa.array([f"e-{i}" for i in ids], pa.string())
            key_groups = (ids % 4 + 4).astype(np.int64)
            positions = rng.permutation(n).astype(np.int64) + epoch * 1000  # log order is not row order
            verdicts = decide(dedup, ShardTransaction(db), key_groups, keys, positions, times.astype(np.int64),
                              watermark)
            expected, expected_late, kept_now = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), {}
            for row in np.argsort(positions, kind="stable"):
                key = keys[int(row)].as_py()
                if watermark is not None and int(times[row]) + WITHIN <= watermark:
                    expected_late[row] = True
                elif key in remembered or key in kept_now:
                    expected[row] = True
                else:
                    kept_now[key] = int(times[row])
            assert verdicts.duplicate.tolist() == expected.tolist(), f"epoch {epoch}"
            assert verdicts.late.tolist() == expected_late.tolist(), f"epoch {epoch}"
            late_total += int(expected_late.sum())
            before = watermark
            if n:
                watermark = max(watermark if watermark is not None else -(2**40), int(times.max()))
            txn = ShardTransaction(db)
            seen = SeenKeys(dedup, txn, ShardStep(epoch, kind, watermark_before=before, watermark=watermark,
                                                  layout=layout, shard=1))
            forgotten_total += seen.forget_due()
            kept = np.flatnonzero(verdicts.kept)
            seen.remember(key_groups[kept], keys.take(pa.array(kept)), times[kept].astype(np.int64))
            txn.flush()
            remembered.update(kept_now)
            remembered = {k: t for k, t in remembered.items() if watermark is None or t + WITHIN > watermark}
            stored = [k for k, _ in scan_prefix(db, namespace_prefix(SEEN_NS))]
            by_deadline = [k for k, _ in scan_prefix(db, namespace_prefix(SEEN_BY_DEADLINE_NS))]
            assert len(stored) == len(by_deadline) == len(remembered), f"epoch {epoch}: memory is the bound's"
        assert forgotten_total > 100 and late_total > 50
    finally:
        db.close()
