"""Incremental shard snapshots on S3, as Flink's incremental RocksDB checkpoints.

Layout under ``s3://bucket/prefix`` (one pipeline's checkpoint root)::

    sst/<sha256>.sst                                  SSTs, named by content, shared by epochs
    epochs/0000000007/shard-0003/<sha256>-<name>      the small files (MANIFEST-*, CURRENT, OPTIONS-*, ...)
    epochs/0000000007/shard-0003-<attempt>.json       the attempt's manifest, written last: its commit point

SSTs are keyed by content hash, not by RocksDB's file name: two restores of one
snapshot number their next SSTs alike, with different contents. An SST already
in the store is not uploaded again, so an epoch costs what changed since the
last one. Small files carry their hash too, and each attempt writes its own
manifest, so racing attempts of one epoch never overwrite an object another
attempt's manifest references; the epoch manifest on the checkpoint root names
the attempt that won, and retention deletes the others.

A (epoch, shard) snapshot exists exactly when its manifest does. ``prune``
deletes manifests before the SSTs only they referenced, so a crash in between
leaves garbage, never a dangling reference. The runner prunes between epochs,
under its lease, checking its fence before each batch of deletions; ``prune``
never touches epochs newer than the newest it keeps, nor SSTs uploaded after it
listed them or named by a manifest written while it ran (a holder that lost its
lease mid-prune must not delete the new holder's epochs). What remains is the
instant between the fence check and a deletion; ``retain_committed`` re-reads the
committed manifests of the root at prune time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.errors import ConfigError, SnapshotError, SnapshotStorageError
from volley_dagster.io.atomic import private_dir
from volley_dagster.io.s3 import S3Endpoint, S3Location, s3_client
from volley_dagster.state.digests import sha256_file

MANIFEST_VERSION = 1
_MANIFEST_KEY = re.compile(r"^epochs/(\d{10})/shard-(\d{4})(?:-([0-9a-f]+))?\.json$")
_EPOCH_OBJECT = re.compile(r"^epochs/(\d{10})/")
_T = TypeVar("_T")


@dataclass(frozen=True)
class SnapshotFile:
    name: str  # the file's name in the RocksDB checkpoint directory
    size: int
    sha256: str
    key: str  # object key relative to the store root, e.g. "sst/<sha256>.sst"


@dataclass(frozen=True)
class SnapshotManifest:
    epoch: int
    shard: int
    files: tuple[SnapshotFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = {
            "version": MANIFEST_VERSION,
            "epoch": self.epoch,
            "shard": self.shard,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256, "key": f.key} for f in self.files],
        }
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> SnapshotManifest:
        body = json.loads(data)
        if body.get("version") != MANIFEST_VERSION:
            raise SnapshotError(f"unsupported snapshot manifest version {body.get('version')!r}")
        files = tuple(SnapshotFile(f["name"], int(f["size"]), f["sha256"], f["key"]) for f in body["files"])
        return cls(int(body["epoch"]), int(body["shard"]), files)


@dataclass(frozen=True)
class UploadResult:
    manifest: SnapshotManifest
    bytes_uploaded: int
    files_uploaded: int
    files_reused: int  # SSTs the store already held
    total_bytes: int
    seconds: float


@dataclass(frozen=True)
class RestoreResult:
    epoch: int
    shard: int
    path: Path
    bytes_downloaded: int
    files_downloaded: int  # distinct contents: equal files (empty WALs) count once
    files_cached: int  # served from the local cache after a hash check
    seconds: float


@dataclass(frozen=True)
class PruneResult:
    epochs_removed: list[int]
    manifests_deleted: int
    epoch_objects_deleted: int  # small files of removed epochs and of uncommitted attempts
    ssts_deleted: int


class S3SnapshotStore:
    """Shard snapshots of one pipeline under ``uri``. Picklable: Spark ships it to
    executors, where the boto3 client and the cache of known SSTs are rebuilt."""

    def __init__(self, uri: str, endpoint: S3Endpoint | None = None, *, max_workers: int = 8,
                 max_attempts: int = 5) -> None:
        location = S3Location.parse(uri)
        if max_workers < 1 or max_attempts < 1:
            raise ConfigError(f"max_workers and max_attempts must be >= 1, got {max_workers}, {max_attempts}")
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = location.bucket, location.prefix
        self.endpoint = endpoint
        self.max_workers = max_workers
        self.max_attempts = max_attempts
        self._client: Any = None
        self._lock = threading.Lock()
        self._known_ssts: set[str] = set()  # hashes this process saw in the store

    def within(self, folder: str) -> S3SnapshotStore:
        """The same store's ``folder`` under it: a chain's stage keeps its snapshots apart
        (``chain.py``), so one stage's retention never prunes another's."""
        return S3SnapshotStore(f"{self.uri}/{folder}", self.endpoint, max_workers=self.max_workers,
                               max_attempts=self.max_attempts)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_client": None, "_lock": None, "_known_ssts": set()}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """One boto3 client shared by the worker threads (clients are thread-safe;
        creating them through the default session is not, hence the lock)."""
        with self._lock:
            if self._client is None:
                self._client = s3_client(self.endpoint.boto3_options() if self.endpoint else None,
                                         max_attempts=self.max_attempts,
                                         max_pool_connections=max(10, self.max_workers))
            return self._client

    # -- keys ------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(key)}"

    @staticmethod
    def manifest_key(epoch: int, shard: int, attempt: str | None = None) -> str:
        """``attempt`` None: a manifest written before attempts had their own."""
        suffix = f"-{attempt}" if attempt else ""
        return f"epochs/{epoch_key(epoch)}/shard-{shard:04d}{suffix}.json"

    # -- upload ----------------------------------------------------------------------

    def upload(self, epoch: int, shard: int, local_snapshot_dir: Path, *, attempt: str | None = None) -> UploadResult:
        """Upload a RocksDB checkpoint directory, then commit it with the attempt's own
        manifest. On any failure nothing is committed; a re-run skips the SSTs already
        stored. Two attempts of one (epoch, shard) write two manifests, never one over
        the other."""
        started = time.monotonic()
        where = f"epoch {epoch} shard {shard}"
        local = Path(local_snapshot_dir)
        try:
            entries = sorted(os.scandir(local), key=lambda e: e.name)
        except OSError as exc:
            raise SnapshotError(f"{where}: cannot list local snapshot {local}: {exc}") from exc
        if not any(e.name == "CURRENT" for e in entries):
            raise SnapshotError(f"{where}: {local} is not a RocksDB checkpoint (no CURRENT file)")
        for e in entries:
            if not e.is_file(follow_symlinks=False):
                raise SnapshotError(f"{where}: {local / e.name} is not a regular file; snapshots are flat directories")

        results = self._parallel([partial(self._put_file, epoch, shard, Path(e.path)) for e in entries],
                                 what=f"uploading {where} from {local}")
        files = tuple(f for f, _ in results)
        uploaded = [f for f, did in results if did]
        manifest = self._commit(SnapshotManifest(epoch, shard, files), attempt)
        return UploadResult(
            manifest=manifest,
            bytes_uploaded=sum(f.size for f in uploaded),
            files_uploaded=len(uploaded),
            files_reused=len(files) - len(uploaded),
            total_bytes=manifest.total_bytes,
            seconds=time.monotonic() - started,
        )

    def carry_forward(self, from_epoch: int, shard: int, epoch: int, *, from_attempt: str | None = None,
                      attempt: str | None = None) -> UploadResult:
        """Epoch ``epoch`` left the shard as ``from_epoch`` had it: its manifest names the
        same objects, and nothing is uploaded (retention keeps what a kept manifest names)."""
        started = time.monotonic()
        previous = self.manifest(from_epoch, shard, from_attempt)
        manifest = self._commit(SnapshotManifest(epoch, shard, previous.files), attempt)
        return UploadResult(manifest, 0, 0, len(manifest.files), manifest.total_bytes, time.monotonic() - started)

    def _commit(self, manifest: SnapshotManifest, attempt: str | None) -> SnapshotManifest:
        """Write the attempt's manifest: the commit point of its (epoch, shard) snapshot."""
        key = self.manifest_key(manifest.epoch, manifest.shard, attempt)
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=manifest.to_json(),
                                   ContentType="application/json")
        except (BotoCoreError, ClientError) as exc:
            raise SnapshotStorageError(f"epoch {manifest.epoch} shard {manifest.shard}: writing the manifest "
                                       f"{self._url(key)} failed, the snapshot is not committed: {exc}") from exc
        return manifest

    def _put_file(self, epoch: int, shard: int, path: Path) -> tuple[SnapshotFile, bool]:
        """Store one file; True when it was uploaded, False when an equal SST was there."""
        where = f"epoch {epoch} shard {shard}"
        try:
            size = path.stat().st_size
            digest = sha256_file(path)
        except OSError as exc:
            raise SnapshotError(f"{where}: cannot read {path}: {exc}") from exc
        is_sst = path.name.endswith(".sst")
        key = f"sst/{digest}.sst" if is_sst else f"epochs/{epoch_key(epoch)}/shard-{shard:04d}/{digest}-{path.name}"
        entry = SnapshotFile(path.name, size, digest, key)
        try:
            if is_sst and (digest in self._known_ssts or self._stored_size(key) == size):
                self._known_ssts.add(digest)
                return entry, False
            with open(path, "rb") as fh:
                self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=fh, ContentLength=size)
        except (BotoCoreError, ClientError) as exc:
            raise SnapshotStorageError(f"{where}: uploading {path.name} to {self._url(key)} failed: {exc}") from exc
        except OSError as exc:
            raise SnapshotError(f"{where}: cannot read {path}: {exc}") from exc
        if is_sst:
            self._known_ssts.add(digest)
        return entry, True

    def _stored_size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._full(key))["ContentLength"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    # -- restore ---------------------------------------------------------------------

    def manifest(self, epoch: int, shard: int, attempt: str | None = None) -> SnapshotManifest:
        """The committed manifest; SnapshotError when the snapshot was never committed or was pruned."""
        key = self.manifest_key(epoch, shard, attempt)
        data = self._read_manifest(key, f"epoch {epoch} shard {shard}")
        if data is None:
            raise SnapshotError(f"epoch {epoch} shard {shard} has no snapshot: manifest {self._url(key)} "
                                "does not exist (never committed, or pruned)")
        manifest = SnapshotManifest.from_json(data)
        if (manifest.epoch, manifest.shard) != (epoch, shard):
            raise SnapshotError(f"{self._url(key)} describes epoch {manifest.epoch} shard {manifest.shard}, "
                                f"not epoch {epoch} shard {shard}")
        return manifest

    def _read_manifest(self, key: str, where: str) -> bytes | None:
        """A manifest's bytes; None when it does not exist."""
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._full(key))["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise SnapshotStorageError(f"{where}: reading {self._url(key)} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise SnapshotStorageError(f"{where}: reading {self._url(key)} failed: {exc}") from exc

    def restore(self, epoch: int, shard: int, cache_dir: Path, *, attempt: str | None = None) -> RestoreResult:
        """A new directory under ``cache_dir/restores`` that RocksDB opens as the
        snapshot. Files come from ``cache_dir/objects`` (content-addressed) and are
        downloaded only when missing; each file is hashed once laid out in the new
        directory, and one that does not match (a damaged cache entry) is downloaded
        again. ``cache_dir`` must be this user's alone. Returns the directory (``path``)
        with what the restore cost."""
        started = time.monotonic()
        manifest = self.manifest(epoch, shard, attempt)
        cache_dir = Path(cache_dir)
        if not private_dir(cache_dir):
            raise SnapshotError(f"snapshot cache {cache_dir} is not a folder this user alone can write; restores "
                                "would trust files others can swap: use a private folder (snapshot_cache=)")
        objects = cache_dir / "objects"
        objects.mkdir(exist_ok=True)
        distinct = list({f.sha256: f for f in manifest.files}.values())  # equal files (empty WALs) fetched once
        fetched = self._parallel([partial(self._fetch, manifest, f, objects) for f in distinct],
                                 what=f"restoring epoch {epoch} shard {shard}")

        restores = cache_dir / "restores"
        restores.mkdir(exist_ok=True)
        name = f"{epoch_key(epoch)}-shard-{shard:04d}-{uuid.uuid4().hex[:12]}"
        tmp = restores / f".{name}.tmp"
        tmp.mkdir()
        try:
            _lay_out(manifest.files, objects, tmp)
            damaged = {f.sha256: f for f in manifest.files if sha256_file(tmp / f.name) != f.sha256}
            for f in damaged.values():  # a cache entry changed since it was stored: fetch it again
                (objects / f.sha256).unlink(missing_ok=True)
                fetched.append(self._fetch(manifest, f, objects))
            if damaged:
                again = [f for f in manifest.files if f.sha256 in damaged]
                _lay_out(again, objects, tmp)
                still = [f.name for f in again if sha256_file(tmp / f.name) != f.sha256]
                if still:
                    raise SnapshotError(f"epoch {epoch} shard {shard}: {still} changed in the cache {objects} "
                                        "while being restored; is another process writing there?")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        target = restores / name
        os.replace(tmp, target)
        downloaded = [n for n in fetched if n is not None]
        return RestoreResult(
            epoch=epoch,
            shard=shard,
            path=target,
            bytes_downloaded=sum(downloaded),
            files_downloaded=len(downloaded),
            files_cached=len(distinct) - len(downloaded),
            seconds=time.monotonic() - started,
        )

    def _fetch(self, manifest: SnapshotManifest, f: SnapshotFile, objects: Path) -> int | None:
        """Make ``objects/<sha256>`` hold the file; the bytes downloaded, None on a cache
        hit (of the right size: ``restore`` hashes what it lays out)."""
        where = f"epoch {manifest.epoch} shard {manifest.shard}"
        cached = objects / f.sha256
        if cached.is_file() and cached.stat().st_size == f.size:
            return None
        tmp = objects / f".{f.sha256}.{uuid.uuid4().hex}.tmp"
        h = hashlib.sha256()
        n = 0
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._full(f.key))["Body"]
            with open(tmp, "wb") as out:
                for chunk in body.iter_chunks(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
        except ClientError as exc:
            tmp.unlink(missing_ok=True)
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise SnapshotError(f"{where}: {f.name} is missing from the store ({self._url(f.key)}), "
                                    "though the manifest references it") from None
            raise SnapshotStorageError(f"{where}: downloading {f.name} from {self._url(f.key)} failed: {exc}") from exc
        except BotoCoreError as exc:
            tmp.unlink(missing_ok=True)
            raise SnapshotStorageError(f"{where}: downloading {f.name} from {self._url(f.key)} failed: {exc}") from exc
        if n != f.size or h.hexdigest() != f.sha256:
            tmp.unlink(missing_ok=True)
            raise SnapshotError(f"{where}: downloaded {f.name} ({self._url(f.key)}) is corrupt: {n} bytes with "
                                f"SHA-256 {h.hexdigest()}, the manifest says {f.size} bytes with {f.sha256}")
        os.replace(tmp, cached)
        return n

    # -- retention -------------------------------------------------------------------

    def epochs(self) -> list[int]:
        """Epochs with at least one committed shard snapshot, ascending."""
        return sorted({int(m.group(1)) for k in self._list("epochs/") if (m := _MANIFEST_KEY.match(k))})

    def retain_committed(self, log: EpochLog, committed: int, keep: int,
                         before_delete: Callable[[str], None] | None = None) -> PruneResult:
        """Keep what the root keeps after ``committed``: the last ``keep`` committed epochs
        and, within them, the attempts their state is read from (a rescale's, when one
        rewrote the epoch; else those their manifests name), read now from the root's
        manifests (``EpochLog.retained_epochs``: never from a listing of this machine's
        disk, nor from a view taken before)."""
        retained = log.retained_epochs(committed, keep)
        # an epoch's state as it is read now: a rescale's rewrite where there is one
        winners = {(e, s): snap.attempt for e in retained for s, snap in log.state_shards(e).items()}
        return self.prune(retained, winners, before_delete=before_delete)

    def retain(self, last_k: int) -> PruneResult:
        """Keep the snapshots of the last ``last_k`` committed epochs."""
        if last_k < 1:
            raise ConfigError(f"retain(last_k={last_k}): keep at least the last committed epoch")
        return self.prune(self.epochs()[-last_k:])

    def prune(self, keep_epochs: Iterable[int], winners: Mapping[tuple[int, int], str | None] | None = None, *,
              before_delete: Callable[[str], None] | None = None) -> PruneResult:
        """Delete the epochs older than the newest of ``keep_epochs`` that it does not
        hold: their manifests first, then their small files, then the SSTs no remaining
        manifest references. ``winners`` maps a kept (epoch, shard) to the attempt its
        epoch manifest names: the manifests of the other attempts (retries and racers
        that lost) go too.

        The view is never trusted past what it saw: epochs newer than every kept one
        are another holder's, or uploads in flight, and are never touched; the SSTs
        are listed before the manifests are read, so one uploaded meanwhile is no
        candidate; and right before the SSTs go, the manifests are listed again and
        those written since the view are read, so an SST a newer manifest names stays.
        ``before_delete(what)`` runs before each batch of deletions (the runner checks
        its fence there: a holder whose lease was taken stops before deleting)."""
        keep = set(keep_epochs)
        winners = winners or {}
        horizon = max(keep, default=0)  # nothing newer than the newest kept epoch is this view's to judge
        ssts = self._list("sst/")  # first: an SST uploaded after this listing is never a candidate
        listing = self._list("epochs/")
        manifests = {k: (int(m.group(1)), int(m.group(2))) for k in listing if (m := _MANIFEST_KEY.match(k))}
        attempts = {k: m.group(3) for k in manifests if (m := _MANIFEST_KEY.match(k))}
        drop = {e for e, _ in manifests.values() if e not in keep and e < horizon}
        lost = [k for k, sid in manifests.items() if sid[0] in keep and sid in winners and attempts[k] != winners[sid]]
        dropped_manifests = [k for k, (e, _) in manifests.items() if e in drop] + lost
        remaining = [(*sid, attempts[k]) for k, sid in manifests.items() if sid[0] not in drop and k not in lost]
        kept = self._parallel([partial(self.manifest, *s) for s in remaining], what="reading kept manifests")
        referenced = {f.key for m in kept for f in m.files}  # a carried-forward epoch names an older one's files
        self._delete(dropped_manifests, what="manifests", before=before_delete)
        # Attempts that never committed left small files too; those of epochs
        # newer than every kept one may belong to an upload in flight.
        committed = {e for e, _ in manifests.values()}
        garbage = [k for k in listing if k not in manifests and k not in referenced and (m := _EPOCH_OBJECT.match(k))
                   and ((e := int(m.group(1))) in drop or (e not in committed and e < horizon))]
        self._delete(garbage, what="small files", before=before_delete)

        newer = [k for k in self._list("epochs/") if (m := _MANIFEST_KEY.match(k)) and k not in manifests]
        written_since = self._parallel([partial(self._manifest_at, k) for k in newer], what="reading newer manifests")
        referenced |= {f.key for m in written_since if m is not None for f in m.files}
        orphans = [k for k in ssts if k not in referenced]
        self._delete(orphans, what="unreferenced SSTs", before=before_delete)
        self._known_ssts.difference_update(k[len("sst/"):-len(".sst")] for k in orphans)
        return PruneResult(sorted(drop), len(dropped_manifests), len(garbage), len(orphans))

    def _manifest_at(self, key: str) -> SnapshotManifest | None:
        """The manifest under ``key``; None when it is gone again since it was listed."""
        data = self._read_manifest(key, "retention")
        return None if data is None else SnapshotManifest.from_json(data)

    def _list(self, under: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + under):
                keys.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        except (BotoCoreError, ClientError) as exc:
            raise SnapshotStorageError(f"listing {self._url(under)} failed: {exc}") from exc
        return keys

    def _delete(self, keys: list[str], what: str, before: Callable[[str], None] | None = None) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            if before is not None:
                before(f"deleting {len(batch)} {what} under {self.uri}")
            try:
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": self._full(k)} for k in batch], "Quiet": True})
            except (BotoCoreError, ClientError) as exc:
                raise SnapshotStorageError(f"deleting {len(batch)} {what} under {self.uri} failed: {exc}") from exc
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise SnapshotStorageError(f"deleting {what} under {self.uri} failed for {len(resp['Errors'])} "
                                           f"objects, e.g. {first.get('Key')}: {first.get('Message')}")

    # -- threads ---------------------------------------------------------------------

    def _parallel(self, jobs: list[Callable[[], _T]], what: str) -> list[_T]:
        """Run ``jobs`` on the thread pool, results in order; on the first failure
        cancel what has not started and raise it (project errors pass unchanged)."""
        if not jobs:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.max_workers, len(jobs)), thread_name_prefix="s3-snapshots")
        try:
            futures: list[Future[_T]] = [pool.submit(job) for job in jobs]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                failed.result()  # raises
            return [f.result() for f in futures]
        except (BotoCoreError, ClientError) as exc:
            raise SnapshotStorageError(f"{what} failed: {exc}") from exc
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _lay_out(files: Iterable[SnapshotFile], objects: Path, target: Path) -> None:
    """Put the cached objects in place under their RocksDB names. SSTs are immutable, so
    a hardlink is safe; the small files are copied because opening a DB may rewrite them."""
    for f in files:
        (target / f.name).unlink(missing_ok=True)
        (os.link if f.name.endswith(".sst") else shutil.copyfile)(objects / f.sha256, target / f.name)
