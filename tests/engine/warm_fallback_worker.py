"""A Dagster run's view of the warm Spark when no server will start: ``python -m
tests.engine.warm_fallback_worker HOME`` (with ``VOLLEY_WARM_SPARK_MASTER`` set to
something no Spark accepts). Prints what the run logged and the Spark it got."""

import json
import sys

from volley_dagster.dagster.resources import SparkResource

if __name__ == "__main__":
    said: list[str] = []
    spark = SparkResource(warm_home=sys.argv[1]).session(log=said.append)
    print(json.dumps({"log": said, "master": spark.sparkContext.master,
                      "rows": spark.range(3).count()}))
