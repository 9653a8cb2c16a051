"""Crash-safe small-file writes: temp file, fsync, rename (or link), fsync the directory.

A reader sees either no file or the whole file, never a torn one, even after
kill -9 or power loss.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    tmp = _write_temp(path, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def create_bytes_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists; True when this call created it.

    ``link`` fails when the target exists, so of two racing writers exactly one wins.
    """
    tmp = _write_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)
    return True


def dump_json(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n"


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, dump_json(obj))


def create_json_exclusive(path: Path, obj: Any) -> bool:
    return create_bytes_exclusive(path, dump_json(obj))


def read_json(path: Path) -> Any:
    with open(path, "rb") as fh:
        return json.load(fh)


def private_dir(directory: Path) -> bool:
    """Create ``directory`` (0700) if need be; True when it is this user's alone: a folder
    other users can write to could have files swapped between a check and their use."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
