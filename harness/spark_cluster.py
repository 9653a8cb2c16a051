"""A Spark standalone cluster (a master and workers from the pyspark package's own jars)
on 127.0.0.1, or on a veth pair's address with some workers inside a network namespace
(``harness/netns.py``), so that the driver and the master must be reached at an address
other than 127.0.0.1, as on a cluster of several machines."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.netns import VethNamespace
from harness.processes import free_ports, proc_ancestors, proc_cmdline, proc_descendants, tail, wait_ready

EXECUTOR_CLASS = "CoarseGrainedExecutorBackend"


@dataclass
class SparkWorker:
    index: int
    proc: subprocess.Popen[bytes]
    port: int
    webui_port: int
    work_dir: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def executor_pids(self) -> list[int]:
        """The executor JVMs this worker launched (its children running the executor backend)."""
        return [p for p in proc_descendants(self.pid) if EXECUTOR_CLASS in proc_cmdline(p)]

    def alive(self) -> bool:
        return self.proc.poll() is None


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _java_home() -> str:
    """The JAVA_HOME the cluster's JVMs run with: Java 17+, as for the driver."""
    from volley_dagster.spark.session import MIN_JAVA, java_major_version

    version = java_major_version()  # raises ConfigError naming the fix when there is no java
    if version < MIN_JAVA:
        raise RuntimeError(f"the Spark cluster needs Java {MIN_JAVA}+, found Java {version}; set JAVA_HOME to a JDK 17")
    home = os.environ.get("JAVA_HOME")
    if home:
        return home
    return str(Path(shutil.which("java") or "java").resolve().parent.parent)


@dataclass
class SparkCluster:
    """A standalone master and workers on 127.0.0.1, each JVM a foreground child
    started by the pyspark package's own ``bin/spark-class``."""

    root: Path
    master_url: str
    master_proc: subprocess.Popen[bytes]
    master_port: int
    master_webui_port: int
    master_log: Path
    workers: list[SparkWorker]
    env: dict[str, str]
    cores_per_worker: int
    memory: str
    host: str = "127.0.0.1"  # the master's address, and the driver's
    netns: VethNamespace | None = None  # where the workers of ``netns_workers`` run
    netns_workers: frozenset[int] = frozenset()

    @property
    def webui_url(self) -> str:
        return f"http://{self.host}:{self.master_webui_port}"

    def state(self) -> dict[str, Any]:
        """The master's JSON status: workers (with ``state`` ALIVE/DEAD), apps, ..."""
        with urllib.request.urlopen(f"{self.webui_url}/json/", timeout=5) as resp:
            return json.load(resp)

    def alive_worker_ports(self) -> set[int]:
        return {w["port"] for w in self.state()["workers"] if w["state"] == "ALIVE"}

    def wait_alive(self, timeout: float = 90.0) -> None:
        """Until the master reports every live worker of ours ALIVE."""
        wanted = {w.port for w in self.workers if w.alive()}
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            for proc, what, log in [(self.master_proc, "Spark master", self.master_log)] + [
                (w.proc, f"Spark worker {w.index}", w.log) for w in self.workers if w.port in wanted
            ]:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what} exited with {proc.returncode} before the cluster was up:\n{tail(log)}")
            try:
                if wanted <= self.alive_worker_ports():
                    return
            except Exception as exc:  # the master's UI is not up yet
                last = exc
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}:\n{tail(p, 20)}" for p in [self.master_log] + [w.log for w in self.workers])
        raise RuntimeError(
            f"Spark cluster not ready after {timeout:.0f}s: workers on ports {sorted(wanted)} not all ALIVE at "
            f"{self.webui_url}/json/ (last error: {last!r})\n{logs}"
        )

    def worker_of(self, pid: int) -> SparkWorker:
        """The worker whose process tree holds ``pid`` (an executor or one of its Python workers)."""
        chain = [pid] + proc_ancestors(pid)
        for w in self.workers:
            if w.pid in chain:
                return w
        raise LookupError(f"pid {pid} (ancestors {chain[1:]}) runs under none of the workers "
                          f"{[w.pid for w in self.workers]}")

    def kill_worker(self, i: int) -> list[int]:
        """kill -9 worker ``i`` as a machine loss would: the Worker JVM, its executor JVMs
        (children running CoarseGrainedExecutorBackend) and their Python workers, all at
        once. Returns the pids killed."""
        worker = self.workers[i]
        tree = [worker.pid] + proc_descendants(worker.pid)
        executors = [p for p in tree if EXECUTOR_CLASS in proc_cmdline(p)]
        if worker.alive() and not executors:
            raise RuntimeError(f"worker {i} (pid {worker.pid}) runs no executor (no {EXECUTOR_CLASS} child)")
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.proc.wait(timeout=10)
        return tree

    def restart_worker(self, i: int, timeout: float = 90.0) -> SparkWorker:
        """A fresh worker in slot ``i`` (new ports, same work dir), registered and ALIVE."""
        old = self.workers[i]
        if old.alive():
            self.kill_worker(i)
        self.workers[i] = _start_worker(self, i)
        self.wait_alive(timeout)
        return self.workers[i]

    def stop(self) -> None:
        procs = [w.proc for w in self.workers] + [self.master_proc]
        trees = {p.pid: proc_descendants(p.pid) for p in procs}
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for pid in (d for tree in trees.values() for d in tree):  # executors the workers left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_worker(cluster: SparkCluster, i: int) -> SparkWorker:
    port, webui = free_ports(2)
    work_dir = cluster.root / f"worker-{i}"
    (work_dir / "local").mkdir(parents=True, exist_ok=True)
    log = cluster.root / f"worker-{i}-{port}.log"
    inside = cluster.netns if i in cluster.netns_workers else None
    host = inside.ns_address if inside is not None else cluster.host
    env = {
        **cluster.env,
        "SPARK_LOCAL_IP": host,
        "SPARK_LOCAL_HOSTNAME": host,
        "SPARK_WORKER_DIR": str(work_dir),
        "SPARK_LOCAL_DIRS": str(work_dir / "local"),  # executors' shuffle and block files
    }
    args = ["bash", str(spark_home() / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
            cluster.master_url, "--host", host, "--port", str(port), "--webui-port", str(webui),
            "--cores", str(cluster.cores_per_worker), "--memory", cluster.memory, "--work-dir", str(work_dir)]
    if inside is not None:
        args = inside.command(args)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=work_dir, env=env, start_new_session=True)
    return SparkWorker(i, proc, port, webui, work_dir, log)


def start_spark_cluster(root: Path, workers: int = 2, cores_per_worker: int = 1, memory: str = "1g",
                        worker_timeout_s: int = 10, timeout: float = 90.0, netns: VethNamespace | None = None,
                        netns_workers: frozenset[int] = frozenset()) -> SparkCluster:
    """A Spark standalone master and ``workers`` workers on 127.0.0.1, from the pyspark
    package's own jars and ``bin/spark-class`` (the pip package has no sbin/start-*.sh),
    each JVM in the foreground as our child, with small heaps. The master declares a
    worker dead after ``worker_timeout_s`` without heartbeats (Spark's default: 60 s);
    the workers get the same setting, as they heartbeat every quarter of it.
    With ``netns``, the master (and the driver) listen on its host-side address, and the
    workers of ``netns_workers`` run inside it.
    Returns once the master's JSON status lists every worker ALIVE."""
    host = netns.host_address if netns is not None else "127.0.0.1"
    root = Path(root)
    conf_dir = root / "conf"  # empty: no spark-env.sh or spark-defaults.conf from elsewhere
    conf_dir.mkdir(parents=True, exist_ok=True)
    home = spark_home()
    env = {
        **os.environ,
        "JAVA_HOME": _java_home(),
        "SPARK_HOME": str(home),
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOCAL_IP": host,
        "SPARK_LOCAL_HOSTNAME": host,
        "SPARK_DAEMON_MEMORY": "512m",
        # both sides: the master's deadline, and the workers' heartbeat interval (timeout / 4)
        "SPARK_MASTER_OPTS": f"-Dspark.worker.timeout={worker_timeout_s} -Dspark.deploy.retainedApplications=10",
        "SPARK_WORKER_OPTS": f"-Dspark.worker.timeout={worker_timeout_s} -Dspark.worker.cleanup.enabled=false",
        "PYSPARK_PYTHON": sys.executable,
    }
    port, webui = free_ports(2)
    log = root / "master.log"
    args = ["bash", str(home / "bin" / "spark-class"), "org.apache.spark.deploy.master.Master",
            "--host", host, "--port", str(port), "--webui-port", str(webui)]
    with open(log, "wb") as fh:
        master = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  cwd=root, env=env, start_new_session=True)
    cluster = SparkCluster(root, f"spark://{host}:{port}", master, port, webui, log, [], env,
                           cores_per_worker, memory, host, netns, netns_workers)
    try:
        wait_ready(lambda: cluster.state()["status"] == "ALIVE", timeout, "Spark master", master, log)
        cluster.workers = [_start_worker(cluster, i) for i in range(workers)]
        cluster.wait_alive(timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster
