"""The old store a rewrite keeps: its marker, the recovery of killed swaps, and their notes.

A repair (`fsck --repair`) keeps the store it replaces as a backup beside it, the only copy
of the rows it dropped. Before its swap it writes a marker (`keep_marker`) naming that store,
its backup name and what it dropped, so that a kill between the swap and the backup's rename
loses neither: whoever comes next keeps the old store under its backup name
(`recover_kept`). Where that is not fsck, which reports the killed repair itself, the marker's
document moves to a note (`killed_repairs_note`) that every fsck reports, and `fsck --repair`
clears once it has reported it.

    <parent>/
        .<name>.keep-old        the marker of a rewrite that keeps the old store
        .<name>.swap-old        a store parked between the two renames of a swap
        .<name>.killed-repairs  the notes of repairs killed after their swaps
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from .errors import CorruptStoreError
from .layout import parked_store, process_alive
from .manifest import fsync_dir, read_bytes_nofollow, write_atomic

__all__ = ["clear_killed_repairs", "keep_marker", "killed_repairs", "killed_repairs_note",
           "mark_keep", "recover_kept", "recover_swap", "unmark_keep"]


def keep_marker(root: Path) -> Path:
    """Where a rewrite that keeps the old store says, before its swap, where that one goes.

    Its JSON names the old store's directory (device and inode, which a rename keeps), the
    name it is to be kept under beside `root`, the rewriting process and what the rewrite
    dropped (`recover_kept`).
    """
    return root.parent / f".{root.name}.keep-old"


def killed_repairs_note(root: Path) -> Path:
    """Where the documents of repairs killed after their swaps wait for fsck to report them."""
    return root.parent / f".{root.name}.killed-repairs"


def killed_repairs(root: Path) -> list[dict[str, Any]]:
    """The documents in `killed_repairs_note` (a `keep_marker` document each, with "kept")."""
    try:
        docs = json.loads(read_bytes_nofollow(killed_repairs_note(root), 1 << 26))
    except FileNotFoundError:
        return []
    except (OSError, CorruptStoreError, ValueError) as exc:
        raise CorruptStoreError(f"{killed_repairs_note(root)} cannot be read ({exc}): it "
                                "lists repairs killed after their swaps; move it aside to "
                                "check the store") from exc
    if not (isinstance(docs, list) and all(isinstance(d, dict) and isinstance(d.get("kept"), str)
                                           for d in docs)):
        raise CorruptStoreError(f"{killed_repairs_note(root)} is not a list of killed repairs: "
                                "move it aside to check the store")
    return docs


def _add_killed_repair(root: Path, doc: dict[str, Any]) -> bool:
    """Add `doc` to `killed_repairs_note`; False where that note is damaged (left as it is)."""
    # one marker exists at a time, so two writers of this note add the same document
    try:
        docs = killed_repairs(root)
    except CorruptStoreError:
        return False
    if all((d.get("ino"), d.get("dev")) != (doc["ino"], doc["dev"]) for d in docs):
        write_atomic(killed_repairs_note(root), json.dumps([*docs, doc]).encode())
    return True


def clear_killed_repairs(root: Path) -> None:
    """Remove `killed_repairs_note`, once a repair has reported what it lists."""
    with contextlib.suppress(FileNotFoundError):
        killed_repairs_note(root).unlink()
    fsync_dir(root.parent)


def recover_kept(root: Path, *, locked: bool = False, move: bool = True, note: bool = True
                 ) -> dict[str, Any] | None:
    """Keep the old store of a rewrite killed after its swap, as that rewrite promised.

    A killed repair leaves the store before it, the only copy of the rows it dropped, under a
    temporary name that the next rewrite would delete (`.<name>.rebuild-*`, or the parked
    `.<name>.swap-old`). Its marker (`keep_marker`) says which directory that is; it is
    renamed to the backup name the marker gives. Returns the marker's document when such an
    old store was found (now at `doc["kept"]`), else None. One whose swap never happened is
    removed.

    Args:
        root: the store.
        locked: the caller holds the store's lock exclusively, so the rewrite that wrote the
            marker (which held it from before the marker until it kept the old store) is
            gone whatever its process id now names. Otherwise a marker of a live process is
            left to it; a reused id only delays the keeping, to a caller that holds the lock.
        move: without, nothing changes: the document says where the old store lies now
            (`doc["at"]`), for a check that must not write.
        note: keep the document in `killed_repairs_note` for the next fsck to report, as
            every caller but fsck, which reports it itself, must: the killed repair never
            said what it dropped.
    """
    marker = keep_marker(root)
    try:
        doc = json.loads(read_bytes_nofollow(marker, 1 << 24))
        ino, dev, name, pid = doc["ino"], doc["dev"], doc["keep"], doc["pid"]
    except FileNotFoundError:
        return None
    except (OSError, CorruptStoreError, ValueError, KeyError, TypeError):
        return None  # written atomically, so not one of ours: left as it is
    if not (isinstance(name, str) and "/" not in name and isinstance(pid, int)):
        return None
    if not locked and (pid == os.getpid() or process_alive(pid)):
        return None
    try:
        here = os.lstat(root)
    except FileNotFoundError:
        return None  # parked with nothing at its path: `recover_swap` puts it back first
    keep = root.parent / name
    found = None
    if (here.st_ino, here.st_dev) != (ino, dev):
        for candidate in [keep, parked_store(root), *root.parent.glob(f".{root.name}.rebuild-*")]:
            try:
                st = os.lstat(candidate)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode) and (st.st_ino, st.st_dev) == (ino, dev):
                found = candidate
                break
    if not move:
        return None if found is None else {**doc, "at": str(found), "kept": str(keep)}
    if found is not None and found != keep:
        try:
            os.replace(found, keep)
        except FileNotFoundError:  # another process kept it first
            if not keep.is_dir():
                return None
        fsync_dir(keep.parent)  # kept for good before the marker that leads to it goes
    if found is not None and note and not _add_killed_repair(root, {**doc, "kept": str(keep)}):
        return {**doc, "kept": str(keep)}  # the marker stays to say it, beside a damaged note
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
    fsync_dir(root.parent)
    if found is None:
        return None
    return {**doc, "kept": str(keep)}


def mark_keep(root: Path, keep: Path, dropped: list[dict[str, Any]]) -> None:
    """Write `keep_marker` for a rewrite of `root` that keeps the old store at `keep`."""
    here = os.lstat(root)
    doc = {"ino": here.st_ino, "dev": here.st_dev, "keep": keep.name, "pid": os.getpid(),
           "dropped": dropped}
    write_atomic(keep_marker(root), json.dumps(doc).encode())


def unmark_keep(root: Path) -> None:
    """Remove `keep_marker` once the old store is kept under its name."""
    with contextlib.suppress(FileNotFoundError):
        keep_marker(root).unlink()
    fsync_dir(root.parent)


def recover_swap(root: Path) -> None:
    """Finish or undo a two-rename swap (embstore._rebuild) that a crash interrupted.

    A store parked with nothing at its path goes back (the new copy, unnamed, is dropped by
    the next rebuild); a parked store beside a store at its path is the old one, removed,
    unless a killed rewrite promised to keep it (`recover_kept` keeps it first).
    """
    recover_kept(root)
    parked = parked_store(root)
    if not parked.exists():
        return
    if not root.exists():
        try:
            os.replace(parked, root)
        except FileNotFoundError:
            return  # another process put it back first
        fsync_dir(root.parent)
    elif not keep_marker(root).exists():  # else it may be a killed repair's promised backup:
        shutil.rmtree(parked, ignore_errors=True)  # left for a rewrite holding the lock
