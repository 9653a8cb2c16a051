"""A private PostgreSQL server (Debian's ``postgresql``) on 127.0.0.1, for the Iceberg catalog tests."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.processes import free_ports

PG_INSTALL_HINT = "apt-get install -y postgresql"


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
