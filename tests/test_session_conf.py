"""Which address a session's driver takes: loopback only for a local master or one on
this machine's loopback; a master elsewhere leaves it to Spark or to the user's
``spark.driver.host``, which always wins."""

from __future__ import annotations

import pytest

from volley_dagster.spark.session import default_conf, on_loopback


@pytest.mark.parametrize(("master", "loopback"), [
    ("local[*]", True), ("local[2]", True), ("spark://127.0.0.1:7077", True), ("spark://localhost:7077", True),
    ("spark://10.20.0.1:7077", False), ("spark://spark-master.internal:7077", False), ("yarn", False),
    ("k8s://https://10.0.0.1:6443", False),
])
def test_the_driver_is_pinned_to_loopback_only_for_a_master_on_loopback(master: str, loopback: bool) -> None:
    conf = default_conf(master)
    assert on_loopback(master) is loopback
    assert (conf.get("spark.driver.host"), conf.get("spark.driver.bindAddress")) == (
        ("127.0.0.1", "127.0.0.1") if loopback else (None, None))
    assert conf["spark.sql.session.timeZone"] == "UTC"  # the engine's own settings stay
    assert conf["spark.python.unix.domain.socket.enabled"] == "true"  # executor to Python worker: no TCP
    assert conf["spark.python.sql.dataFrameDebugging.enabled"] == "false"  # no call-site round trips per Column call
    assert conf["spark.sql.ui.explainMode"] == "simple"  # the plan text Spark writes at each job: the cheap one
