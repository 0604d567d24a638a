"""Export a store to a portable directory and import it back, in bounded memory.

The format (no pickle; readable with numpy alone, or any language)::

    OUT/
        header.json   {"format": "embstore-export", "version": 1, "byte_order": "little",
                       "tiers": [TierSpec JSON], "step": int | null, "extras": {...},
                       "tables": [{"spec": TableSpec JSON, "rows": n, "row_width": w,
                                   "dtype": "<f4", "ids_file": "0.ids", "rows_file": "0.rows",
                                   "ids_crc32": int, "rows_crc32": int}]}
        <i>.ids       n ids, int64 little-endian
        <i>.rows      n rows of w values of "dtype" little-endian, C order, as the store
                      keeps them: the weights (dim values) then the optimizer state; a
                      half-precision table's rows are its stored bytes (embstore._precision)

CRC-32 (zlib's) of each file's bytes guards the copy. Rows stream page by page both ways
(about 4 MiB of rows at a time), so memory stays bounded whatever a table's size. Export writes
`.OUT.tmp-<pid>` and renames it, import builds `.PATH.tmp-<pid>` and renames it: a crash
leaves no half-written export or store behind.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ._rebuild import page_rows, read_store, store_rows, write_store
from .errors import ConfigError, CorruptStoreError, StoreExistsError, StoreNotFoundError
from .layout import lock
from .manifest import fsync_dir, make_dirs, write_atomic
from .spec import TableSpec, TierSpec

__all__ = ["FORMAT", "export_store", "import_store", "read_header"]

FORMAT = "embstore-export"
VERSION = 1
HEADER = "header.json"


def _le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def _fresh(dest: Path) -> Path:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StoreExistsError(f"{dest} exists; choose a new path (nothing is overwritten)")
    make_dirs(dest.parent)  # new parents' entries must survive with what is published
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)  # an export holds every row: as private as the store
    return tmp


def _private(file: Path) -> BinaryIO:
    """`file`, created 0600 for writing (never through a link)."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return open(fd, "wb")


def _commit(tmp: Path, dest: Path) -> None:
    if dest.exists():
        dest.rmdir()  # an empty directory given as the destination
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def export_store(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Write every table of the store at `src` to the new export directory `out`.

    Holds the store's shared lock (readers may go on, a writer waits). Returns the header.

    Raises:
        StoreNotFoundError, StoreLockedError, CorruptStoreError: from the store.
        StoreExistsError: `out` exists and is not an empty directory.
    """
    root, dest = Path(src), Path(out)
    if not root.is_dir():
        raise StoreNotFoundError(f"{root} is not a store directory")
    read_store(root)  # no store, no LOCK file left in someone else's directory
    fd = lock(root, read_only=True)
    try:
        doc, specs, tiers = read_store(root)
        tmp = _fresh(dest)
        try:
            source = store_rows(root, tiers, specs)
            tables = []
            for i, spec in enumerate(specs):
                tables.append(_export_table(tmp, i, spec, source, progress))
            step = (doc.get("checkpoint") or doc.get("restored_from") or {}).get("step")
            header = {"format": FORMAT, "version": VERSION, "byte_order": "little",
                      "tiers": [t.to_json() for t in tiers], "step": step,
                      "extras": {k: v for k, v in doc.items()
                                 if k not in ("format", "version", "tiers", "tables")},
                      "tables": tables}
            write_atomic(tmp / HEADER, json.dumps(header, indent=1).encode())
            _commit(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.close(fd)
    return header


def _export_table(tmp: Path, i: int, spec: TableSpec,
                  source: Callable[[TableSpec], tuple[int, Iterator[tuple[np.ndarray,
                                                                         np.ndarray]]]],
                  progress: Callable[[str, int], None] | None) -> dict[str, Any]:
    _, pages = source(spec)
    n, crc_ids, crc_rows = 0, 0, 0
    dtype = _le(spec.storage_dtype)
    with _private(tmp / f"{i}.ids") as fi, _private(tmp / f"{i}.rows") as fr:
        for ids, rows in pages:
            a = np.ascontiguousarray(ids, dtype="<i8").tobytes()
            b = np.ascontiguousarray(rows, dtype=dtype).tobytes()
            fi.write(a)
            fr.write(b)
            crc_ids, crc_rows = zlib.crc32(a, crc_ids), zlib.crc32(b, crc_rows)
            n += len(ids)
            if progress is not None:
                progress(spec.name, len(ids))
        for fh in (fi, fr):
            fh.flush()
            os.fsync(fh.fileno())
    return {"spec": spec.to_json(), "rows": n, "row_width": spec.storage_width,
            "dtype": dtype.str, "ids_file": f"{i}.ids", "rows_file": f"{i}.rows",
            "ids_crc32": crc_ids, "rows_crc32": crc_rows}


def read_header(src: Path) -> dict[str, Any]:
    """The checked header of the export directory `src`.

    Raises:
        StoreNotFoundError: no export there.
        CorruptStoreError: the header is damaged, of another format, or names files that are
            missing, outside the export or of the wrong size.
    """
    file = src / HEADER
    if not file.is_file() or file.is_symlink():
        raise StoreNotFoundError(f"{src} holds no embstore export (no {HEADER})")
    try:
        doc = json.loads(file.read_bytes())
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise CorruptStoreError(f"{file} is not an embstore export of version {VERSION}")
        for t in doc["tables"]:
            spec = TableSpec.from_json(t["spec"])
            for key, width in (("ids_file", 8), ("rows_file", spec.storage_width
                                                 * np.dtype(t["dtype"]).itemsize)):
                name = t[key]
                path = src / name
                if "/" in name or name.startswith(".") or path.is_symlink() \
                        or not path.is_file():
                    raise CorruptStoreError(f"{file} names {name!r}, which is missing or "
                                            "not a plain file of the export")
                if path.stat().st_size != t["rows"] * width:
                    raise CorruptStoreError(f"{path} holds {path.stat().st_size} bytes, the "
                                            f"header says {t['rows']} rows of {width} bytes")
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise CorruptStoreError(f"{file} is damaged ({type(exc).__name__}: {exc})") from exc
    return doc  # type: ignore[no-any-return]


def import_store(src: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                 tiers: Sequence[TierSpec] | None = None,
                 progress: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Create the store `dest` from the export `src`, with its tier chain or `tiers`.

    Returns rows per table. Tables that had their own chain keep it unless `tiers` is given.

    Raises:
        StoreNotFoundError, CorruptStoreError: no export, or a damaged one (checksums).
        StoreExistsError: `dest` exists and is not an empty directory.
    """
    root, out = Path(src), Path(dest)
    doc = read_header(root)
    entries = {t["spec"]["name"]: t for t in doc["tables"]}
    specs = [TableSpec.from_json(t["spec"]) for t in doc["tables"]]
    if tiers is not None:
        specs = [TableSpec.from_json({**s.to_json(), "tiers": None}) for s in specs]
    chain = tuple(tiers) if tiers is not None else tuple(TierSpec.from_json(t)
                                                         for t in doc["tiers"])

    def source(spec: TableSpec) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        return entries[spec.name]["rows"], _pages(root, entries[spec.name], spec)

    tmp = _fresh(out)
    try:
        extras = dict(doc.get("extras") or {})
        extras["imported_from"] = {"export": str(root), "step": doc.get("step")}
        counts = write_store(tmp, chain, specs, source, extras=extras, progress=progress)
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts


def _pages(root: Path, entry: dict[str, Any], spec: TableSpec
           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    n, width = entry["rows"], entry["row_width"]
    dtype = np.dtype(entry["dtype"])
    if width != spec.storage_width:
        raise CorruptStoreError(f"export table {spec.name!r}: rows of {width} values, the "
                                f"spec needs {spec.storage_width}")
    crc_ids = crc_rows = 0
    with open(root / entry["ids_file"], "rb") as fi, open(root / entry["rows_file"],
                                                          "rb") as fr:
        step = page_rows(spec)
        for start in range(0, n, step):
            count = min(step, n - start)
            a = fi.read(count * 8)
            b = fr.read(count * width * dtype.itemsize)
            crc_ids, crc_rows = zlib.crc32(a, crc_ids), zlib.crc32(b, crc_rows)
            ids = np.frombuffer(a, dtype="<i8").astype(np.int64)
            rows = np.frombuffer(b, dtype=dtype).reshape(count, width).astype(spec.storage_dtype)
            yield ids, rows
    if (crc_ids, crc_rows) != (entry["ids_crc32"], entry["rows_crc32"]):
        raise CorruptStoreError(f"export table {spec.name!r} in {root} fails its CRC-32: the "
                                "export is damaged; export the store again")
