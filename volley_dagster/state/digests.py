"""What a snapshot's files must be: their sizes and SHA-256 digests, as manifests record
them. A leaf module: the store, the resident mirror and the checkpoint all name it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TypedDict


class FileDigest(TypedDict):
    size: int
    sha256: str


FileDigests = dict[str, FileDigest]  # file name -> its size and digest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
