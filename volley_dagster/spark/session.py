"""The one SparkSession a process runs its epochs on.

Local mode by default; a standalone master URL (``spark://host:7077``) or a
Spark Connect URL (``sc://host:15002``) when configured. Python workers must
run this very interpreter (it has the engine installed), so PYSPARK_PYTHON is
pinned to it unless the user set it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pyspark.sql import SparkSession

from volley_dagster.errors import ConfigError

MIN_JAVA = 17


def java_major_version(java: str | None = None) -> int:
    """The major version of the ``java`` Spark will start, or ConfigError naming the fix."""
    home = os.environ.get("JAVA_HOME")
    java = java or (os.path.join(home, "bin", "java") if home else shutil.which("java"))
    if not java or not os.path.exists(java):
        raise ConfigError(
            f"Spark needs Java {MIN_JAVA}+ and no java was found (JAVA_HOME={home!r}); "
            "on Debian: apt-get install openjdk-17-jre-headless"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        raise ConfigError(f"cannot tell the Java version from {java} -version: {out.strip()!r}")
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 else major


_LOG4J = Path(__file__).with_name("log4j2.properties")


def on_loopback(master: str) -> bool:
    """A local master, or a standalone master on this machine's loopback: the driver
    listens on loopback too. Executors elsewhere reach the driver at the address Spark
    picks, or the ``spark.driver.host`` of the user's configuration."""
    if master.startswith("local"):
        return True
    return urlsplit(master).hostname in ("127.0.0.1", "localhost", "::1")


def executors_share_this_disk(spark: SparkSession) -> bool:
    """Whether the session's tasks run on this machine, so that a file a task writes is
    on the driver's disk too: a local master, reached directly or through a Spark
    Connect server on this machine's loopback (the warm Spark). Unknown counts as no."""
    try:
        if type(spark).__module__.startswith("pyspark.sql.connect"):  # a Spark Connect session: where is its server?
            if urlsplit(f"sc://{spark.client.host}").hostname not in ("127.0.0.1", "localhost", "::1"):
                return False
        return str(spark.conf.get("spark.master", "")).startswith("local")
    except Exception:  # Spark Connect may not expose every static setting
        return False


def default_conf(master: str = "local[*]") -> dict[str, str]:
    """What a session on ``master`` starts with; the user's configuration goes over it."""
    cores = os.cpu_count() or 2
    log4j = f"-Dlog4j2.configurationFile=file:{_LOG4J}"
    loopback = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"} if on_loopback(master) else {}
    return {
        **loopback,
        "spark.driver.extraJavaOptions": log4j,
        "spark.executor.extraJavaOptions": log4j,
        "spark.sql.shuffle.partitions": str(max(4, 2 * cores)),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        # an epoch's files are one scan (spark/read.py): listed on the driver, as a Spark job
        # to list them would cost more than the listing, which past 32 paths it would run
        "spark.sql.sources.parallelPartitionDiscovery.threshold": "1024",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": os.environ.get("VOLLEY_SPARK_DRIVER_MEMORY", "4g"),
        "spark.python.worker.reuse": "true",
        # PySpark 4 wraps every Column function in a capture of its Python call site, for
        # error messages: ten more round trips to the JVM a call (F.col: 13 against 3), 80
        # of the 365 a running aggregate's epoch made, 70 ms of its planning
        "spark.python.sql.dataFrameDebugging.enabled": "false",
        # the plan text Spark writes for its UI at each job and each adaptive re-plan, UI on
        # or off: "formatted" took 5-7 ms a time against 1-2, about 20 ms of a running
        # aggregate's epoch (a user who turns the UI on may set it back)
        "spark.sql.ui.explainMode": "simple",
        # an executor talks to its Python workers over a Unix socket, not loopback TCP, where
        # each task's first small writes wait on a delayed ACK (about 40 ms): a 4-task Python
        # stage 176 against 252 ms with no work in it (./dev bench python_tasks)
        **({"spark.python.unix.domain.socket.enabled": "true"} if hasattr(socket, "AF_UNIX") else {}),
    }


def get_or_create_spark(
    master: str | None = None,
    remote: str | None = None,
    conf: dict[str, Any] | None = None,
    app_name: str = "volley",
) -> SparkSession:
    """The active session if there is one, else a new one on ``master``/``remote``;
    ``conf``: the user's Spark configuration (any ``spark.*`` key), applied last."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
        settings = dict(conf or {})  # the server's own configuration stands; these are the session's
    else:
        version = java_major_version()
        if version < MIN_JAVA:
            raise ConfigError(f"Spark needs Java {MIN_JAVA}+, found Java {version}; set JAVA_HOME to a JDK 17")
        master = master or os.environ.get("VOLLEY_SPARK_MASTER", "local[*]")
        if on_loopback(master):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # bind to loopback unless told otherwise
        builder = builder.master(master)
        settings = {**default_conf(master), **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    return spark
