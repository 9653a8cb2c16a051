"""Key groups come from Spark's xxhash64, never Python's salted ``hash()``: the
same key lands in the same group and shard in any process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pyspark.sql import functions as F

ROOT = Path(__file__).resolve().parents[2]
KEYS = [0, 1, 42, -7, 2**40, 123456789]
STR_KEYS = ["merchant-1", "é", ""]

SCRIPT = """
import json, sys
from pyspark.sql import functions as F
from volley_dagster.spark.session import get_or_create_spark
spark = get_or_create_spark(master="local[1]")
ints = spark.createDataFrame([(k,) for k in %r], "k long")
strs = spark.createDataFrame([(k,) for k in %r], "k string")
expr = F.pmod(F.xxhash64("k"), F.lit(256))
print(json.dumps([r[0] for r in ints.select(expr).collect()] + [r[0] for r in strs.select(expr).collect()]))
"""


def key_groups(spark):
    expr = F.pmod(F.xxhash64("k"), F.lit(256))
    ints = spark.createDataFrame([(k,) for k in KEYS], "k long").select(expr).collect()
    strs = spark.createDataFrame([(k,) for k in STR_KEYS], "k string").select(expr).collect()
    return [r[0] for r in ints] + [r[0] for r in strs]


def test_same_key_group_in_another_process(spark):
    here = key_groups(spark)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT % (KEYS, STR_KEYS)], env=env, capture_output=True,
                         text=True, timeout=180, check=True)
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert here == there
    assert len(set(here)) > 1 and all(0 <= g < 256 for g in here)
