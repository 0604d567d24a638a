"""What fsck's scanners share: `Finding`, the per-row checks, and the dump of good rows.

A scanner reads one store of record's files, reports what is wrong as `Finding`s and, when
repairing, appends every row that passed its checks to a dump (`RowDump`: raw little-endian
ids and rows per table), from which the repaired store is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checksum import row_checksums
from .spec import TableSpec

__all__ = ["MAX_DETAILED", "Finding", "RowDump", "TableScan", "check_rows", "original_ids"]

MAX_DETAILED = 20
"""Row findings reported one by one per table and kind; the rest are summed up in one."""


@dataclass(frozen=True)
class Finding:
    """One problem found in a store.

    The first two fields are positional (`Finding(table, message)`); the rest say where.
    """

    table: str | None
    """The table concerned; None for the store as a whole (manifest, lock, ...)."""
    message: str
    """What is wrong, and where."""
    file: str | None = None
    """The file concerned, if one."""
    id: int | None = None
    """The id of the row concerned (as its key or record names it), if one."""
    offset: int | None = None
    """Byte offset in `file`, where known."""
    expected: str | None = None
    """What should be there."""
    found: str | None = None
    """What is there."""
    repaired: bool = False
    """Whether `--repair` fixed it (the repaired store no longer has it)."""
    fatal: bool = False
    """fsck could not check the store (missing, locked, unreadable): e2fsck's exit 8."""
    ids: tuple[int, ...] = ()
    """Ids of rows a repair dropped (at most 1000 listed)."""
    note: bool = False
    """An observation, not a problem (exit codes ignore it): e.g. that a writer held the
    store while fsck read it."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON, fields that are unset left out."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if v not in (None, (), False) or k in ("table", "message")}


@dataclass
class TableScan:
    """What a scanner found of one table: rows good and bad, and which ids it dropped."""

    rows: int = 0
    dropped: list[np.ndarray] | None = None
    unreadable: bool = False
    """Some rows could not be read at all (a RocksDB block failing its checksum): their ids
    are unknown to the scan."""

    def drop(self, ids: np.ndarray) -> None:
        """Record ids of rows that failed their checks."""
        if len(ids):
            if self.dropped is None:
                self.dropped = []
            self.dropped.append(np.asarray(ids, dtype=np.int64))

    def dropped_ids(self) -> np.ndarray:
        """Every id dropped."""
        return (np.concatenate(self.dropped) if self.dropped
                else np.zeros(0, dtype=np.int64))


def check_rows(spec: TableSpec, ids: np.ndarray, rows: np.ndarray, file: str,
               counts: dict[str, int], findings: list[Finding]) -> np.ndarray:
    """bool[N]: which decoded rows break the table's spec (id range, finiteness, state).

    Adds a finding per bad row, up to MAX_DETAILED per kind (`counts` keeps the tally).
    """
    bad = np.zeros(len(ids), dtype=bool)
    n = spec.num_embeddings
    if n is not None and len(ids):
        out = (ids < 0) | (ids >= n)
        for i in np.flatnonzero(out):
            counts["range"] = counts.get("range", 0) + 1
            if counts["range"] <= MAX_DETAILED:
                findings.append(Finding(spec.name, f"stored id {int(ids[i])} lies outside "
                                        f"[0, {n})", file=file, id=int(ids[i]),
                                        expected=f"0 <= id < {n}", found=str(int(ids[i]))))
        bad |= out
    if not spec.allow_nonfinite and len(ids) and rows.dtype.kind == "f":
        # (half-precision tables store bytes, checked by their checksums only)
        nonfinite = ~np.isfinite(rows).all(axis=1)
        for i in np.flatnonzero(nonfinite):
            counts["finite"] = counts.get("finite", 0) + 1
            if counts["finite"] <= MAX_DETAILED:
                findings.append(Finding(spec.name, f"row of id {int(ids[i])} holds NaN or "
                                        "infinity, which the table forbids", file=file,
                                        id=int(ids[i]), expected="finite values",
                                        found="NaN or infinity"))
        bad |= nonfinite
    width = spec.row_width - spec.dim
    if width and len(ids) and rows.dtype.kind == "f" and rows.shape[1:] == (spec.row_width,):
        # a state no step reaches (a negative sum of squares): the row's next step is NaN,
        # so the row can never be trained again, though it passes its checksum
        unreachable = spec.optimizer.unreachable_state(rows[:, spec.dim:], spec.dim)
        for i in np.flatnonzero(unreachable):
            counts["state"] = counts.get("state", 0) + 1
            if counts["state"] <= MAX_DETAILED:
                findings.append(Finding(spec.name, f"row of id {int(ids[i])} holds an "
                                        f"optimizer state {spec.optimizer.name} never reaches",
                                        file=file, id=int(ids[i]),
                                        expected="a state some steps reach",
                                        found="a negative sum of squares or step count"))
        bad |= unreachable
    return bad


def original_ids(key_ids: np.ndarray, rows: np.ndarray, crcs: np.ndarray) -> np.ndarray:
    """For rows failing their CRC under `key_ids`: the id whose CRC they pass, -1 if none.

    Tries every id one byte away from the key's (8 x 255 candidates, one vectorised CRC
    call per row): a row found this way is intact and stored under a damaged key.
    """
    out = np.full(len(key_ids), -1, dtype=np.int64)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(8)
    deltas = (np.arange(1, 256, dtype=np.uint64)[None, :] << shifts[:, None]).reshape(-1)
    for i, (kid, row, crc) in enumerate(zip(key_ids, rows, crcs, strict=True)):
        cand = (np.uint64(np.int64(kid).view(np.uint64)) ^ deltas).view(np.int64)
        rep = np.broadcast_to(row, (len(cand),) + row.shape)
        hit = np.flatnonzero(row_checksums(cand, np.ascontiguousarray(rep)) == crc)
        if len(hit):
            out[i] = cand[hit[0]]
    return out


class RowDump:
    """Good rows per table appended to raw files: `<table>.ids` (int64) and `<table>.rows`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def append(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add a page of good rows of `table`."""
        if not len(ids):
            return
        for name, data in ((f"{table}.ids", np.ascontiguousarray(ids, dtype="<i8")),
                           (f"{table}.rows", np.ascontiguousarray(rows))):
            fd = os.open(self.directory / name,
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with open(fd, "ab") as fh:
                fh.write(data.tobytes())

    def ids(self, table: str) -> np.ndarray:
        """Every id dumped for `table`, sorted."""
        file = self.directory / f"{table}.ids"
        if not file.exists():
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.fromfile(file, dtype="<i8").astype(np.int64))

    def pages(self, spec: TableSpec, batch_rows: int = 16384
              ) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        """(row count, pages of (ids, rows)) of `spec`'s dumped rows, read back in chunks."""
        ids_file = self.directory / f"{spec.name}.ids"
        n = os.path.getsize(ids_file) // 8 if ids_file.exists() else 0
        width = spec.storage_width
        dtype = spec.storage_dtype

        def pages() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for start in range(0, n, batch_rows):
                count = min(batch_rows, n - start)
                ids = np.fromfile(ids_file, dtype="<i8", count=count, offset=start * 8)
                rows = np.fromfile(self.directory / f"{spec.name}.rows", dtype=dtype,
                                   count=count * width,
                                   offset=start * width * dtype.itemsize)
                yield ids.astype(np.int64), rows.reshape(count, width)
        return n, pages()
