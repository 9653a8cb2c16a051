"""Old epochs' folders, compacted: one zip file per ``span`` epochs.

A pipeline at a 5-second cadence cuts about 518,000 epochs a month. Each keeps its
folder (``epochs/<key>/offsets.json``, ``manifest.json``, dimension pins) for audit
and for ``volley inspect``; once an epoch is past retention, nothing writes it again,
so its folder moves into ``epochs/archive/<first>-<last>.zip`` with the files it held
(members ``<key>/offsets.json``, ``<key>/manifest.json``, ``<key>/dimensions/<t>.json``
and ``<key>/cut_at``, the range's recording time). A zip reads one member through its
central directory, without inflating the rest. Archives cover epochs ``1..through``
contiguously and are only ever added; each is written whole (atomically) before the
folders it replaces are removed, so a crash in between leaves both, with the same
contents.
"""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

from volley_dagster.io.atomic import write_bytes_atomic

DEFAULT_SPAN = 10_000
_NAME = re.compile(r"(\d{10})-(\d{10})\.zip")


def epoch_key(epoch: int) -> str:
    """Zero-padded, so that names (and Dagster partition keys) sort as numbers."""
    return f"{epoch:010d}"


class EpochArchives:
    """The archives under ``<epochs>/archive/``."""

    def __init__(self, epochs_dir: Path, span: int = DEFAULT_SPAN) -> None:
        if span < 1:
            raise ValueError(f"archive span must be at least 1, got {span}")
        self.dir = epochs_dir / "archive"
        self.span = span
        self._index: list[tuple[int, int, Path]] | None = None

    def _blocks(self, refresh: bool = False) -> list[tuple[int, int, Path]]:
        if self._index is None or refresh:
            found = []
            if self.dir.is_dir():
                for p in self.dir.iterdir():
                    if (m := _NAME.fullmatch(p.name)) is not None:
                        found.append((int(m.group(1)), int(m.group(2)), p))
            self._index = sorted(found)
        return self._index

    def through(self) -> int:
        """The last archived epoch (0: none); archives cover 1..through."""
        last = self.last_block()
        return last[1] if last else 0

    def last_block(self) -> tuple[int, int] | None:
        """(first, last) epoch of the newest archive."""
        blocks = self._blocks(refresh=True)
        return (blocks[-1][0], blocks[-1][1]) if blocks else None

    def read(self, epoch: int, name: str) -> bytes | None:
        """A member of an archived epoch (``offsets.json``, ``manifest.json``,
        ``dimensions/<t>.json``, ``cut_at``), or None when the epoch is not archived or
        had no such file."""
        for refresh in (False, True):
            for first, last, path in self._blocks(refresh):
                if first <= epoch <= last:
                    with zipfile.ZipFile(path) as archive:
                        try:
                            return archive.read(f"{epoch_key(epoch)}/{name}")
                        except KeyError:
                            return None
        return None

    def write(self, first: int, last: int, members: dict[str, bytes]) -> Path:
        """Write the archive of epochs ``first..last`` whole; ``members`` by path."""
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for name in sorted(members):
                archive.writestr(name, members[name])
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{epoch_key(first)}-{epoch_key(last)}.zip"
        write_bytes_atomic(path, buf.getvalue())
        self._index = None
        return path
