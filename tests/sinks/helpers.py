"""What the Delta and Iceberg sink tests share: epoch contexts and the reference
table contents."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from tests.sinks.commit_worker import epoch_output
from volley_dagster.sinks.base import CommitContext

PIPELINE = "payments"
KEY = ("merchant_id",)
ROWS = 200


def ctx(epoch: int, pipeline: str = PIPELINE) -> CommitContext:
    return CommitContext(pipeline, epoch, KEY)


def frame(table: pa.Table) -> pd.DataFrame:
    return table.to_pandas().sort_values(["epoch", "merchant_id"]).reset_index(drop=True)


def reference(mode: str, epochs: range, rows: int = ROWS) -> pd.DataFrame:
    """Append: every epoch's rows; upsert: the last row per key, across epochs."""
    df = pd.concat([epoch_output(e, rows).to_pandas() for e in epochs], ignore_index=True)
    if mode == "upsert":
        df = df.drop_duplicates("merchant_id", keep="last")
    return df.sort_values(["epoch", "merchant_id"]).reset_index(drop=True)
