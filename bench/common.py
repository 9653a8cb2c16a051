"""What every benchmark script shares: the log-size arguments, and where results go."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")


def log_arguments(parser: argparse.ArgumentParser, records: int = 10_000_000, keys: int = 1_000_000,
                  epochs: int = 10, shards: int = 4) -> None:
    """--records, --keys, --epochs (one file each), --shards and --workdir (kept when given)."""
    parser.add_argument("--records", type=int, default=records)
    parser.add_argument("--keys", type=int, default=keys)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--shards", type=int, default=shards)
    parser.add_argument("--workdir", default=None, help="keep the data and state here (default: a temp dir, removed)")


def finish(name: str, report: dict[str, Any], work: Path, keep: bool) -> Path:
    """Write bench/results/<name>.json; remove the work directory unless asked to keep it."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return path


def aggregate_floor(spark: Any, file: str) -> float:
    """Seconds of the stateless floor of one epoch's file: read, group by merchant, collect."""
    import time

    from pyspark.sql import functions as F

    t = time.perf_counter()
    spark.read.parquet(file).groupBy("merchant_id").agg(F.sum("amount"), F.count(F.lit(1))).toArrow()
    return time.perf_counter() - t
