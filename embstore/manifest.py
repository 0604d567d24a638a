"""The store manifest: `MANIFEST.json` in the store's directory, written atomically.

It records the format version, the default tier chain and every table (dim, dtype, initializer,
optimizer, chain), which is all `embstore.open(path)` needs to reopen a store, and a checksum:
`"checksum": "crc32:<8 hex digits>"`, the zlib CRC-32 of the document without that field as
`json.dumps(doc, indent=2, sort_keys=True)` writes it, so damage anywhere in the file (a key
name included) is reported as such. Files are created 0600 and opened without following a
symbolic link.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import _crash
from .errors import CorruptStoreError, StoreNotFoundError

__all__ = ["FORMAT", "MANIFEST_NAME", "VERSION", "fsync_dir", "fsync_tree", "is_json_int",
           "json_checksum",
           "make_dirs", "optional_fields_problem", "read_manifest", "write_atomic",
           "write_atomic_many", "write_manifest"]

FORMAT = "embstore"
VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
FILE_MODE = 0o600
DIR_MODE = 0o700
MAX_MANIFEST_BYTES = 16 << 20  # a damaged size never makes a reader allocate more


def fsync_dir(path: Path) -> None:
    """Fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Fsync every file and directory under `root`, `root` included."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def make_dirs(directory: Path, mode: int = 0o777) -> None:
    """Create `directory` (with `mode`) and its missing parents, syncing each one's parent.

    So the new directories' entries survive a power cut once something is synced in them.
    """
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        d.mkdir(mode=mode if d == directory else 0o777, exist_ok=True)
        fsync_dir(d.parent)


def write_atomic(file: Path, data: bytes) -> None:
    """Replace `file` with `data`; a crash leaves either the old or the new content.

    Writes a temporary file, fsyncs it, renames it over the target, fsyncs the directory.
    """
    write_atomic_many([(file, data)])


def write_atomic_many(items: Sequence[tuple[Path, bytes]]) -> None:
    """`write_atomic` of several files, each on its own: old or new content after a crash.

    Every temporary file is written and synced, then all are renamed, then each directory is
    synced once (not once per file: a store flush rewrites a record of every table). Many
    files are synced on several threads: the file system commits concurrent syncs together,
    ten times faster than one after the other for hundreds of small files.
    """
    tmps = [file.with_name(file.name + ".tmp") for file, _ in items]
    if len(items) < _PARALLEL_SYNCS:
        for tmp, (_, data) in zip(tmps, items, strict=True):
            _write_synced(tmp, data)
    else:
        with ThreadPoolExecutor(min(len(items), 16), "embstore-sync") as pool:
            list(pool.map(_write_synced, tmps, [data for _, data in items]))
    for (file, _), tmp in zip(items, tmps, strict=True):
        _crash.point("manifest.before_rename")
        os.replace(tmp, file)
    for directory in dict.fromkeys(file.parent for file, _ in items):
        _crash.point("manifest.before_dir_sync")
        fsync_dir(directory)


_PARALLEL_SYNCS = 8
"""Files from which `write_atomic_many` syncs on several threads."""


def _write_synced(tmp: Path, data: bytes) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a leftover temporary file may have had another mode
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        _crash.point("manifest.before_sync")
        os.fsync(fd)
    finally:
        os.close(fd)


def json_checksum(doc: dict[str, Any]) -> str:
    """The checksum of a JSON document as written (sorted keys, indent 2): crc32:<hex>."""
    text = json.dumps(doc, indent=2, sort_keys=True).encode()
    return f"crc32:{zlib.crc32(text):08x}"


def read_bytes_nofollow(file: Path, limit: int | Callable[[bytes, int], int]) -> bytes:
    """The content of `file`, opened without following a symbolic link; at most `limit` bytes.

    `limit` may be a function of the file's first 64 bytes and its size, called (and free to
    raise) before the rest is read: a file whose header says how long it is can be refused
    before a damaged one is read whole, from the same open file (a writer beside the reader
    renames new files in).

    Raises:
        FileNotFoundError: no such file.
        CorruptStoreError: `file` is a symbolic link or not a regular file, or is larger.
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (40, 6):  # ELOOP (a symbolic link), ENXIO (a socket or FIFO)
            raise CorruptStoreError(
                f"{file} is a symbolic link or special file; embstore opens only regular files "
                "inside the store directory: replace it with the file itself") from exc
        raise
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000) == 0o100000:
            raise CorruptStoreError(f"{file} is not a regular file; replace it with the store's "
                                    "own file or restore the store from a checkpoint")
        chunks = []
        if callable(limit):
            chunks.append(os.read(fd, 64))
            limit = limit(chunks[0], st.st_size)
        if st.st_size > limit:
            raise CorruptStoreError(f"{file} has {st.st_size} bytes, more than the {limit} "
                                    "it may have: it is damaged or not embstore's")
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_manifest(directory: Path, body: dict[str, Any]) -> None:
    """Write the manifest of the store in `directory` atomically."""
    doc = {**{k: v for k, v in body.items() if k != "checksum"}, "format": FORMAT,
           "version": VERSION}
    doc["checksum"] = json_checksum(doc)
    write_atomic(directory / MANIFEST_NAME, json.dumps(doc, indent=2, sort_keys=True).encode())


def read_manifest(directory: Path) -> dict[str, Any]:
    """Read and check the manifest of the store in `directory`.

    The checksum is checked and left out of the returned document.

    Raises:
        StoreNotFoundError: there is no manifest.
        CorruptStoreError: the manifest is unreadable, fails its checksum, or is not an
            embstore manifest.
    """
    file = directory / MANIFEST_NAME
    try:
        raw = read_bytes_nofollow(file, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise StoreNotFoundError(
            f"{directory} holds no embstore store (no {MANIFEST_NAME}); create one by passing "
            "tables=[TableSpec(...)] to embstore.open"
        ) from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStoreError(f"{file} is not valid JSON ({exc}); restore it from a checkpoint"
                                ) from exc
    except (ValueError, RecursionError):  # a number of too many digits, nesting too deep
        raise CorruptStoreError(f"{file} is not a manifest embstore could have written (a number "
                                "too long or nesting too deep); restore it from a checkpoint"
                                ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptStoreError(f"{file} is not an embstore manifest (format field missing)")
    stored = doc.pop("checksum", None)
    if stored != json_checksum(doc):
        raise CorruptStoreError(
            f"{file} fails its checksum (stored {stored!r}, computed {json_checksum(doc)!r}): it "
            "was damaged or edited by hand; restore it from a checkpoint of the store")
    if doc.get("version") != VERSION:
        raise CorruptStoreError(
            f"{file} has format version {doc.get('version')!r}; this embstore reads version "
            f"{VERSION}: use the embstore release that wrote it"
        )
    for key in ("tables", "tiers"):
        if not isinstance(doc.get(key), list):
            raise CorruptStoreError(f"{file}: field {key!r} is missing or not a list")
    problem = optional_fields_problem(doc)
    if problem is not None:
        raise CorruptStoreError(f"{file} passes its checksum but its field {problem[0]!r} "
                                f"{problem[1]}; restore it from a checkpoint")
    return doc


def is_json_int(value: Any) -> bool:
    """Whether `value` read from JSON is an integer (`true` is an int to Python, not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return is_json_int(value) and value >= 0


def _step(value: Any) -> bool:
    """A recorded training step: None or a number (checkpoints of earlier versions took any)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value))


def optional_fields_problem(doc: dict[str, Any]) -> tuple[str, str] | None:
    """(the field, what is wrong with it) for the optional fields of manifest `doc`, or None.

    These fields (a checkpoint's description, where a restored store came from, the
    half-precision step counts) are read by several commands; one check here keeps a
    hand-made or imported manifest from reaching them with the wrong kinds.
    """
    for key in ("checkpoint", "restored_from", "checkpoint_seal"):
        if key in doc and not isinstance(doc[key], dict):
            return key, f"is not an object (got {doc[key]!r:.60})"
    info = doc.get("checkpoint")
    if info is not None and (info.get("kind") not in ("full", "incremental")
                             or not _step(info.get("step"))):
        return "checkpoint", f"needs a kind (full or incremental) and a step, got {info!r:.80}"
    origin = doc.get("restored_from")
    if origin is not None and not _step(origin.get("step")):
        return "restored_from", f"has a step that is no count: {origin.get('step')!r:.40}"
    steps = doc.get("gradient_steps", {})
    if not isinstance(steps, dict) or not all(isinstance(k, str) and _whole(v)
                                              for k, v in steps.items()):
        return "gradient_steps", f"is not an object of step counts (got {steps!r:.60})"
    return None
