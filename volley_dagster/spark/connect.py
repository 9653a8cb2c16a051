"""A Spark Connect server for long-lived Spark: Dagster runs (one process each)
connect in about a second instead of starting a local JVM each time.

``volley spark-connect`` (or ``./dev spark-connect``) runs one in the foreground;
point runs at it with ``VOLLEY_SPARK_REMOTE=sc://127.0.0.1:15002``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyspark

from volley_dagster.errors import ConfigError
from volley_dagster.spark.session import default_conf

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


@dataclass
class ConnectServer:
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def connect_command(port: int, master: str, extra_conf: dict[str, str] | None = None) -> list[str]:
    home = Path(pyspark.__file__).parent
    conf = {
        **default_conf(master),
        "spark.master": master,
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        **(extra_conf or {}),
    }
    args = ["bash", str(home / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--name", "volley Spark Connect"]
    for key, value in conf.items():
        args += ["--conf", f"{key}={value}"]
    return args


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def start_connect_server(port: int, master: str = "local[*]", log: Path | None = None,
                         timeout: float = 120.0, extra_conf: dict[str, str] | None = None) -> ConnectServer:
    """Start a server bound to 127.0.0.1:``port`` and wait until it accepts connections."""
    log = log or Path(f"spark-connect-{port}.log")
    env = {
        **os.environ,
        "SPARK_HOME": str(Path(pyspark.__file__).parent),
        "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(connect_command(port, master, extra_conf), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = ConnectServer(f"sc://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"Spark Connect server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        if listening(port):
            return server
        time.sleep(0.5)
    server.stop()
    raise ConfigError(f"Spark Connect server not listening on {port} after {timeout:.0f}s: {log.read_text()[-3000:]}")
