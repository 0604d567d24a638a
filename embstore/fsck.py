"""`check`: verify a store end to end, list what is wrong with it, and repair it on request.

What is checked, from the top:
    - the manifest: it parses, has a known version, its tables and tiers are valid, and every
      file it leads to lies inside the store, exists and is not a symbolic link;
    - each store of record's files: pmem headers, state blocks, sizes and preallocation
      (`_fsck_pmem`); LMDB's meta pages and structure, RocksDB's log and block checksums
      (`_fsck_native`, in a child process, so a crash of a native reader is a finding);
    - every row: its checksum (which covers the id, so a row under a key that is not its own
      is caught), length, id range and finiteness against the table spec, and an optimizer
      state that some sequence of steps reaches (`Optimizer.unreachable_state`);
    - row counts against what the store recorded at its last clean close (STATS.json), when
      no writer touched the store since.

`repair=True` never edits in place: the rows that pass their checks are written into a new
store beside the old one, which is swapped in with one atomic rename (`_rebuild`); the old
store is kept as `.<name>.fsck-backup-<time>` beside it. Only rows failing their checks are
dropped, and the findings list their ids: those the scanners dropped, and those the old
written-id record held that the new store lacks (rows in RocksDB blocks that could not be
read, rows the medium had lost before). Where no record names them, the finding says that an
unknown number more were lost. The new store's record holds the rows it kept, so a dropped
row reads as never written from then on (the backup keeps what was there). The backup's name
and the dropped ids are recorded beside the store before the swap: a repair killed after it
leaves them to the next `fsck --repair`, compact, migrate or open, which keeps the old store
under that name (`_kept.recover_kept`); a check before them reports where the old store lies
and the dropped ids, and changes nothing. What kept it notes the killed repair beside the
store, and every check reports it, the dropped ids too, until a repair has. A damaged
manifest is not repaired (restore it from a checkpoint). Exit codes of `exit_code` follow
e2fsck: 0 clean, 1 repaired, 4 problems left, 8 fsck could not run.

Beside a writer (another process holds the store open for writing) a check takes no lock and
changes nothing: it reads the state the writer's last flush left (see `_check_path`) and adds
a note saying so (`Finding.note`, which no exit code counts). A repair needs the writer gone:
it fails at once naming the writer's pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import _counters, registry
from ._fsck_common import Finding, RowDump, TableScan
from ._fsck_pmem import SPEC_MISMATCH, scan_pmem
from ._fsck_repair import closed_cleanly, dropped_finding, record_ids
from ._kept import (
    clear_killed_repairs,
    keep_marker,
    killed_repairs,
    recover_kept,
    recover_swap,
)
from ._lmdb_walk import newest_meta
from ._lmdb_walk import walk as walk_lmdb
from ._rebuild import (
    check_chains,
    keeps_written_record,
    read_store,
    replace_store,
    store_rows,
)
from .errors import CorruptStoreError, EmbstoreError, StoreLockedError
from .layout import (
    MANIFEST_NAME,
    bottom_dir,
    lock,
    lock_for_reading,
    parked_store,
    read_manifest,
    release,
    remove_dead_owned,
    table_chain,
    tier_dir,
    written_file,
)
from .spec import TableSpec, TierSpec
from .store import EmbeddingStore

__all__ = ["Finding", "check", "exit_code"]

CHILD_TIMEOUT_S = 3600
_SYSTEMATIC = 16
"""Rows of a table all failing their checks, from which a repair takes it for a manifest or
header that no longer describes the table, not damage to each row, and refuses."""
_LIVE_TRIES = 3
"""Reads of a table beside a writer before what it lacks counts as lost or damaged."""
_MANIFEST_MAX = 16 << 20


def exit_code(findings: list[Finding]) -> int:
    """e2fsck's exit code for `findings`: 0 clean, 1 all repaired, 4 problems left, 8 no check.

    Notes (`Finding.note`) are no problems and count for nothing.
    """
    problems = [f for f in findings if not f.note]
    if any(f.fatal for f in problems):
        return 8
    if any(not f.repaired for f in problems):
        return 4
    return 1 if problems else 0


def check(store: EmbeddingStore | str | os.PathLike[str], *, repair: bool = False,
          progress: Callable[[str], None] | None = None) -> list[Finding]:
    """Every problem found in `store` (an open store, or the path of one).

    A path is checked file by file under the store's shared lock (exclusive to repair), or
    beside the writer that holds it (see the module doc); an open store only row by row
    through its API. Returns an empty list for a healthy store.

    Args:
        store: the store's path, or an open store.
        repair: write a repaired copy and swap it in (paths only); see the module doc.
        progress: called with the name of each part as its check begins.
    """
    if isinstance(store, EmbeddingStore):
        findings: list[Finding] = []
        for name in store.tables:
            findings.extend(_check_open_table(store, name))
        return findings
    root = Path(store)
    if repair:  # its exclusive lock keeps every rewrite out
        return _check_root(root, True, progress)
    before = _identity(root)
    findings = _check_root(root, False, progress)
    if before is not None and any(not f.note for f in findings) and _identity(root) != before:
        # a compact, migrate or repair swapped another directory in during the check: what
        # it read was half of each, and its findings (missing files, a reader failing on
        # them) are no damage of either store
        return [Finding(None, f"{root} was rewritten (a compact, migrate or repair swapped a "
                        "new store in) while it was checked, so the check is void; run fsck "
                        "again", fatal=True)]
    return findings


def _identity(root: Path) -> tuple[int, int] | None:
    """The device and inode of the store's directory (a rewrite swaps another one in)."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _check_root(root: Path, repair: bool, progress: Callable[[str], None] | None
                ) -> list[Finding]:
    """`check` of the store at path `root`."""
    try:
        moved = _kept_by_a_killed_repair(root, repair)
    except (OSError, EmbstoreError) as exc:
        return [Finding(None, f"cannot keep or list the stores killed repairs left at "
                        f"{root.parent}: {exc}", fatal=True)]
    parked_at = parked_store(root)
    if parked_at.exists() and not os.path.lexists(root):
        parked = Finding(None, "a compact, migrate or repair was interrupted between its two "
                         f"renames: the store lies at {parked_at}; `embstore.open` or "
                         "`embstore fsck --repair` puts it back", file=str(parked_at))
        if not repair:
            return moved + [parked]
        recover_swap(root)
        moved.append(_repaired(parked))
    elif parked_at.exists() and not keep_marker(root).exists():  # else a repair's, above
        what = ("a compact, migrate or repair was interrupted right after its swap: the store "
                f"before it is left at {parked_at}")
        if repair:
            recover_swap(root)
            moved.append(Finding(None, f"{what}, and is removed", file=str(parked_at),
                                 repaired=True))
        else:
            moved.append(Finding(None, f"{what}; a writable open, compact, migrate or "
                                 "`embstore fsck --repair` removes it", file=str(parked_at)))
    writer: StoreLockedError | None = None
    try:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory" if os.path.lexists(root)
                                    else f"{root} does not exist")
        if not os.path.lexists(root / MANIFEST_NAME):
            raise FileNotFoundError(f"{root} holds no embstore store (no {MANIFEST_NAME})")
        if repair:
            fd: int | None = lock(root, read_only=False)
        else:
            try:
                fd = lock_for_reading(root)
            except StoreLockedError as exc:  # a writer holds it: check beside the writer
                fd, writer = None, exc
    except (OSError, StoreLockedError, CorruptStoreError) as exc:
        return moved + [Finding(None, f"cannot open {root}: {exc}", fatal=True)]
    dump_dir = None
    if repair:
        _remove_dead_dumps(root)
        # the pid in its name tells the next repair whether its owner is gone (a kill
        # leaves it, with rows of the store in it)
        dump_dir = Path(tempfile.mkdtemp(prefix=f".{root.name}.fsck-rows-{os.getpid()}-",
                                         dir=root.parent))
    try:
        findings, parsed, scans = _check_path(root, dump_dir, progress, live=writer is not None)
        if not findings and parsed is not None:
            findings += _lost_rows(root, parsed, live=writer is not None)
        if writer is not None:
            who = (f"process {writer.holder_pid}" if writer.holder_pid is not None
                   else "another process")
            findings.append(Finding(None, f"{who} held the store open for writing: checked "
                                    "what its last flush left (rows it wrote since are not "
                                    "checked, and nothing was changed); run fsck again once "
                                    "it has closed the store for a check of everything",
                                    note=True))
        damage = _counters.damage(root) if parsed is not None else None
        if damage is not None:
            findings.append(Finding(None, f"{_counters.STATS_NAME} {damage}: the counters of "
                                    "earlier sessions are lost and the row counts of the last "
                                    "close were not compared; the next close of a writer "
                                    "writes it anew", file=str(root / _counters.STATS_NAME),
                                    note=True))
        problems = [f for f in findings if not f.note]
        if not repair or not problems or parsed is None or any(f.fatal for f in findings):
            return moved + findings
        assert dump_dir is not None and fd is not None
        return moved + _repair(root, fd, findings, parsed, scans, dump_dir, progress)
    finally:
        if fd is not None:
            (release if repair else os.close)(fd)
        if dump_dir is not None:
            shutil.rmtree(dump_dir, ignore_errors=True)


def _remove_dead_dumps(root: Path) -> None:
    """Remove the row dumps (`.<name>.fsck-rows-<pid>-*`) of repairs whose process is gone."""
    prefix = f".{root.name}.fsck-rows-"

    def owner(name: str) -> int | None:
        pid = name[len(prefix):].split("-", 1)[0]
        return int(pid) if name.startswith(prefix) and pid.isdigit() else None

    remove_dead_owned(root.parent, owner)


def _kept_by_a_killed_repair(root: Path, repair: bool) -> list[Finding]:
    """Findings of repairs killed after their swaps; with `repair`, their old stores now kept.

    A check alone changes nothing: it says where the old store lies, which a repair (or any
    compact, migrate or writable open) keeps under its backup name. Those others note what
    they kept (`_kept.killed_repairs`) for every check to report until a repair has.
    """
    out = []
    killed = "a repair was killed after it swapped in the repaired store, before it reported"
    doc = recover_kept(root, move=repair, note=False)
    if doc is not None and repair:
        out.append(Finding(None, f"{killed}: the store before it is kept at {doc['kept']}",
                           file=str(doc["kept"]), repaired=True))
    elif doc is not None:
        out.append(Finding(None, f"{killed}: the store before it, the only copy of the rows it "
                           f"dropped, lies at {doc['at']}; `embstore fsck --repair` keeps it as "
                           f"{doc['kept']}", file=str(doc["at"])))
    noted = killed_repairs(root)
    for kept in noted:
        what = (f"{killed}: the store before it, the only copy of the rows it dropped, is kept "
                f"at {kept['kept']}")
        out.append(Finding(None, what, file=kept["kept"], repaired=True) if repair else
                   Finding(None, f"{what}; `embstore fsck --repair` reports it once more and "
                           "clears this note", file=kept["kept"]))
    for found in ([] if doc is None else [doc]) + noted:
        out.extend(_dropped_findings(found))
    if repair and noted:
        clear_killed_repairs(root)
    return out


def _dropped_findings(doc: dict[str, Any]) -> list[Finding]:
    """The rows a killed repair dropped, from its marker's document."""
    out = []
    for f in doc.get("dropped") or []:
        try:
            out.append(Finding(str(f["table"]), str(f["message"]),
                               ids=tuple(int(i) for i in f["ids"]), repaired=True))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _lost_rows(root: Path, parsed: _Parsed, *, live: bool) -> list[Finding]:
    """Rows a table's written-id record holds that its store of record lacks: lost rows.

    Runs on files that passed every other check (so their native readers are safe to run
    here); reads the record and the store of record only, changing neither. Beside a writer
    (`live`) a row may be deleted between the two reads, so the record is read again after
    the store of record and only ids it still holds count, over a few tries.
    """
    specs, tiers = parsed
    out = []
    listed = read_manifest(root).get("written_records", [])
    for spec in specs:
        file = written_file(root, spec.name)
        if not file.is_file():
            if (isinstance(listed, list) and spec.name in listed
                    and keeps_written_record(spec, tiers)):
                # the store refuses to open without it: lost rows could no longer be told
                # from rows never written
                out.append(Finding(spec.name, "the written-id record is missing (files of the "
                                   "store were removed), so rows the medium lost cannot be "
                                   "told from rows never written: restore the store from a "
                                   "checkpoint; a repair (like embstore.rebuild_written_records"
                                   ") writes a new record of the rows there, keeping a backup",
                                   file=str(file)))
            continue
        try:
            lost = _lost_ids(root, spec, tiers, file, tries=_LIVE_TRIES if live else 1)
        except EmbstoreError as exc:
            out.append(Finding(spec.name, f"cannot compare the written-id record: {exc}",
                               file=str(file)))
            continue
        if len(lost):
            out.append(Finding(spec.name, f"{len(lost)} written row(s) lost by the medium, "
                               f"e.g. id {int(lost[0])}: restore them from a checkpoint",
                               file=str(file), id=int(lost[0])))
    return out


def _lost_ids(root: Path, spec: TableSpec, tiers: tuple[TierSpec, ...], file: Path, *,
              tries: int) -> np.ndarray:
    """Ids the record `file` holds, before and after a read of the store of record lacking them."""
    from ._rebuild import open_bottom
    from ._written import WrittenIds

    def record() -> WrittenIds:
        return WrittenIds(file, spec.num_embeddings, lambda: np.zeros(0, np.int64),
                          read_only=True)

    lost = np.zeros(0, np.int64)
    for _ in range(tries):
        ids = np.ascontiguousarray(record().ids())
        if not len(ids):
            return ids
        with open_bottom(root, spec, tiers, read_only=True) as bottom:
            lost = ids[~bottom.contains(ids)]
        if len(lost):
            lost = lost[record().holds(lost)]
        if not len(lost):
            break
    return lost


def _check_open_table(store: EmbeddingStore, name: str) -> list[Finding]:
    spec = store.table_spec(name)
    findings: list[Finding] = []
    seen = 0
    try:
        # the scan's own check of lost rows is left out: they are listed below, id by id
        for ids, weights, state in store._item_pages(name, 65536, check_lost=False):
            seen += len(ids)
            n = spec.num_embeddings
            if n is not None and len(ids) and (ids.min() < 0 or ids.max() >= n):
                bad = ids[(ids < 0) | (ids >= n)]
                findings.append(Finding(name, f"{len(bad)} stored id(s) outside [0, {n}), "
                                              f"e.g. {int(bad[0])}", id=int(bad[0])))
            if not spec.allow_nonfinite:
                bad_rows = ~np.isfinite(np.concatenate([weights, state], axis=1)).all(axis=1)
                if bad_rows.any():
                    findings.append(Finding(name, f"{int(bad_rows.sum())} stored row(s) hold "
                                                  "NaN or infinity, e.g. id "
                                                  f"{int(ids[bad_rows][0])}",
                                            id=int(ids[bad_rows][0])))
            unreachable = spec.optimizer.unreachable_state(state, spec.dim)
            if len(ids) and unreachable.any():
                findings.append(Finding(name, f"{int(unreachable.sum())} stored row(s) hold an "
                                              f"optimizer state {spec.optimizer.name} never "
                                              f"reaches, e.g. id {int(ids[unreachable][0])}",
                                        id=int(ids[unreachable][0])))
    except EmbstoreError as exc:
        findings.append(Finding(name, f"scan stopped after {seen} rows: {exc}"))
        return findings
    counted = store._stored_rows(name)  # lost rows are listed below, id by id
    if counted != seen:
        findings.append(Finding(name, "the backend's row count disagrees with a scan",
                                expected=f"{counted} rows", found=f"{seen} rows"))
    # rows written and flushed that the medium no longer has (embstore._written)
    try:
        lost = store.lost_rows(name)
    except EmbstoreError as exc:
        findings.append(Finding(name, f"cannot compare the written-id record: {exc}"))
        return findings
    if len(lost):
        findings.append(Finding(name, f"{len(lost)} written row(s) lost by the medium, "
                                      f"e.g. id {int(lost[0])}: restore them from a checkpoint"))
    return findings


_Parsed = tuple[list[TableSpec], tuple[TierSpec, ...]]


def _check_manifest(root: Path) -> tuple[list[Finding], _Parsed | None]:
    file = root / MANIFEST_NAME
    if file.is_symlink():
        return [Finding(None, "the manifest is a symbolic link; refused", file=str(file))], None
    try:
        if file.stat().st_size > _MANIFEST_MAX:
            return [Finding(None, "the manifest is implausibly large", file=str(file),
                            expected=f"<= {_MANIFEST_MAX} bytes",
                            found=f"{file.stat().st_size} bytes")], None
        doc, specs, tiers = read_store(root)
    except EmbstoreError as exc:
        return [Finding(None, f"manifest: {exc}", file=str(file))], None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return [Finding(None, f"manifest: an entry is invalid ({type(exc).__name__}: {exc})",
                        file=str(file))], None
    findings: list[Finding] = []
    try:  # backends, policies and capacities the store's open would refuse
        check_chains(specs, tiers)
    except EmbstoreError as exc:
        return [Finding(None, f"manifest: {exc}", file=str(file))], None
    real_root = root.resolve()
    for spec in specs:
        d = bottom_dir(root, spec, tiers)
        if d.is_symlink() or (d.parent != root and d.parent.is_symlink()):
            findings.append(Finding(spec.name, "the table's tier directory is a symbolic "
                                    "link; refused", file=str(d)))
        elif d.exists() and real_root not in d.resolve().parents:
            findings.append(Finding(spec.name, "the table's tier directory lies outside the "
                                    "store", file=str(d), found=str(d.resolve())))
        elif not d.is_dir():
            findings.append(Finding(spec.name, "the table's tier directory is missing",
                                    file=str(d)))
    if findings:
        return findings, None
    return findings, (specs, tiers)


def _table_file(root: Path, spec: TableSpec, tiers: tuple[TierSpec, ...]) -> Path:
    backend = table_chain(spec, tiers)[-1].backend
    d = bottom_dir(root, spec, tiers)
    return d / {"pmem": f"{spec.name}.pmem", "lmdb": "data.mdb", "rocksdb": "CURRENT"}.get(
        backend, "")


def _check_path(root: Path, dump_dir: Path | None, progress: Callable[[str], None] | None,
                *, live: bool = False) -> tuple[list[Finding], _Parsed | None,
                                                dict[str, TableScan]]:
    """Check the manifest and every store of record's files and rows.

    `live`: a writer holds the store. Its files are read as of its last flush (every reader
    pins a consistent state, records and log tails it is writing are not damage), the row
    counts of the last close and the cache tiers (the writer's, in use) are not compared.
    """
    if progress:
        progress("manifest")
    findings, parsed = _check_manifest(root)
    scans: dict[str, TableScan] = {}
    if parsed is None:
        return findings, None, scans
    specs, tiers = parsed
    history = _counters.load(root)
    recorded = history.get("fingerprints") or {}
    now = _counters.fingerprints(root, specs, tiers)
    dump = RowDump(dump_dir) if dump_dir is not None else None
    known_backends = set(registry.backend_names())
    blocked = False  # a missing file: not repairable by rewriting what is there
    groups: dict[Path, list[TableSpec]] = {}
    for spec in specs:
        groups.setdefault(bottom_dir(root, spec, tiers), []).append(spec)
    for d, group in groups.items():
        ts = table_chain(group[0], tiers)[-1]
        rel = str(d.relative_to(root))
        clean = not live and rel in recorded and recorded[rel] == now.get(rel)
        if progress:
            progress(rel)
        if ts.backend == "dram":
            continue
        for spec in group:
            file = _table_file(root, spec, tiers)
            if file.is_symlink():
                findings.append(Finding(spec.name, "a table file is a symbolic link; refused",
                                        file=str(file)))
                return findings, None, scans
            if not file.is_file() and (ts.backend == "pmem" or spec is group[0]):
                findings.append(Finding(spec.name, "the table's file is missing (a repair "
                                        "would lose its rows: restore it from a checkpoint)",
                                        file=str(file)))
        if any(f.file and Path(f.file).parent == d for f in findings):
            blocked = True
            continue
        if ts.backend == "pmem":
            for spec in group:
                found, scans[spec.name] = scan_pmem(_table_file(root, spec, tiers), spec, dump,
                                                    live=live)
                findings += found
        elif ts.backend in ("lmdb", "rocksdb"):
            if ts.backend == "lmdb" and not live:  # live: walked by the child, in its snapshot
                findings += _lmdb_structure(d / "data.mdb")
            found, got = _native(ts.backend, d, group, ts.options, dump_dir, clean, live=live)
            findings += found
            scans.update(got)
        if clean:
            for spec in group:
                want = ((history.get("tables") or {}).get(spec.name) or {}).get("rows")
                s = scans.get(spec.name)
                if isinstance(want, int) and s is not None:
                    seen = s.rows + len(s.dropped_ids())
                    if seen != want:
                        findings.append(Finding(spec.name, "the table holds another number of "
                                                "rows than the store recorded at its last "
                                                "close", file=str(d),
                                                expected=f"{want} rows", found=f"{seen} rows"))
    if not live:  # the writer's caches are in use, and a read-only open never reads them
        clean_dirs = {rel for rel in now if rel in recorded and recorded[rel] == now[rel]}
        findings += _check_caches(root, specs, tiers, clean_dirs)
    cached = any(registry.load_backend(ts.backend).supports_persistence
                 for spec in specs for ts in table_chain(spec, tiers)[:-1]
                 if ts.backend in known_backends)
    if cached and recorded and not findings and not live and all(
            recorded.get(k) == v for k, v in now.items()):
        # a clean close wrote every dirty cached row back: cached copies equal the bottom's
        found, _ = _native("cross-tier", root, specs, {}, None, True, tiers=tiers)
        findings += found
    return findings, None if blocked else parsed, scans


def _check_caches(root: Path, specs: list[TableSpec], tiers: tuple[TierSpec, ...],
                  clean_dirs: set[str]) -> list[Finding]:
    """The pmem cache tiers' files, checked record by record as opening the store reads them.

    A damaged one makes the store unopenable. A repair rewrites the store without its caches:
    where the store was closed cleanly since (`clean_dirs`: stores of record as the last
    close left them), every cached row is a copy of the store of record's; else a damaged
    cached row may have been newer than it, and that value is reported lost.
    """
    out: list[Finding] = []
    for spec in specs:
        clean = str(bottom_dir(root, spec, tiers).relative_to(root)) in clean_dirs
        for level, ts in enumerate(table_chain(spec, tiers)[:-1]):
            if ts.backend != "pmem":
                continue
            file = tier_dir(root, level, ts.backend, is_bottom=False) / f"{spec.name}.pmem"
            if not os.path.lexists(file):
                continue  # nothing cached yet
            found, scan = scan_pmem(file, spec, None)
            if not found:
                continue
            ids = np.unique(scan.dropped_ids())
            ids = ids[ids >= 0]
            shown = f", e.g. id {int(ids[0])}" if len(ids) else ""
            if clean:
                what = ("the store was closed cleanly since they were cached, so the store of "
                        "record holds their rows: a repair rewrites the store without the cache")
            else:
                what = ("the store was not closed cleanly since, so a damaged cached row may "
                        "have been newer than the store of record's, and that value is lost: "
                        "a repair rewrites the store without the cache, and these ids then "
                        "read as the store of record holds them")
            out += found
            out.append(Finding(spec.name, f"tier {level} (pmem cache) is damaged, which the "
                               f"store's open refuses ({len(ids)} damaged cached row(s)"
                               f"{shown}); {what}", file=str(file),
                               ids=tuple(int(i) for i in ids[:1000])))
    return out


def _lmdb_structure(file: Path) -> list[Finding]:
    """LMDB's B-trees walked by hand in this process (pure Python, every bound checked)."""
    try:
        current = newest_meta(file)
    except OSError as exc:
        return [Finding(None, f"cannot read the LMDB data file: {exc.strerror}",
                        file=str(file))]
    if current.problems:
        return []  # the child reports the meta pages
    return [Finding(None, f"LMDB structure: {problem}", file=str(file), offset=offset)
            for offset, problem in walk_lmdb(file, current)]


def _native(backend: str, d: Path, specs: list[TableSpec], options: dict[str, Any],
            dump_dir: Path | None, clean: bool, tiers: tuple[TierSpec, ...] = (), *,
            live: bool = False) -> tuple[list[Finding], dict[str, TableScan]]:
    """Run `_fsck_native` on one tier in a child process; a crash or hang there is a finding."""
    request = {"backend": backend, "dir": str(d), "tables": [s.to_json() for s in specs],
               "options": options, "dump": None if dump_dir is None else str(dump_dir),
               "clean": clean, "live": live, "tiers": [t.to_json() for t in tiers]}
    answer = _run_child(request)
    if isinstance(answer, str):
        return [Finding(None, f"the {backend} reader {answer} reading this tier: its files "
                        "are damaged", file=str(d))], {}
    findings = [Finding(**{**f, "ids": tuple(f.get("ids", ()))}) for f in answer["findings"]]
    scans = {}
    for name, t in answer["tables"].items():
        s = TableScan(rows=t["rows"], unreadable=bool(t.get("unreadable")))
        s.drop(np.asarray(t["dropped"], dtype=np.int64))
        if t["dropped_count"] > len(t["dropped"]):  # the count is what matters beyond 1000
            s.drop(np.full(t["dropped_count"] - len(t["dropped"]), -1, dtype=np.int64))
        scans[name] = s
    return findings, scans


def _run_child(request: dict[str, Any]) -> dict[str, Any] | str:
    """The answer of `python -m embstore._fsck_native` to `request`, or how the child died."""
    try:
        proc = subprocess.run([sys.executable, "-m", "embstore._fsck_native"],
                              input=json.dumps(request), capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"hung for {CHILD_TIMEOUT_S} s (damaged structure?)"
    if proc.returncode == 0:
        try:
            answer: dict[str, Any] = json.loads(proc.stdout)
            return answer
        except ValueError:
            pass
    if proc.returncode < 0:
        return f"was killed by signal {-proc.returncode}"
    return f"failed ({' '.join(proc.stderr.split()[-30:])})"


def _repair(root: Path, fd: int, findings: list[Finding], parsed: _Parsed,
            scans: dict[str, TableScan], dump_dir: Path,
            progress: Callable[[str], None] | None) -> list[Finding]:
    """Write the good rows into a new store, swap it in, keep the old one; check again."""
    specs, tiers = parsed
    unread = [s.name for s in specs if s.name not in scans
              and table_chain(s, tiers)[-1].backend != "dram"]
    if unread:  # a rewrite would lose every row of these tables
        return findings + [Finding(None, f"not repaired: the rows of table(s) {unread} could "
                                   "not be read at all; restore them from a checkpoint")]
    # every row a scan read failing its checks is rarely damage to each row: a manifest that
    # no longer describes the table (its dim, dtype, id range), or a file header that
    # disagrees with it; rows a medium lost, or that sit in RocksDB blocks failing their
    # checksum, are damage the repair drops and lists, however many
    all_bad = sorted({name for name, scan in scans.items() if not scan.rows
                      and not scan.unreadable and len(scan.dropped_ids()) >= _SYSTEMATIC}
                     | {f.table for f in findings
                        if f.table is not None and SPEC_MISMATCH in f.message})
    if all_bad:
        return findings + [Finding(None, f"not repaired: every row of table(s) {all_bad} fails "
                                   "its checks, which a repair would drop; if the manifest "
                                   "is wrong, restore it, else restore the table(s) from a "
                                   "checkpoint")]
    dump = RowDump(dump_dir)
    backup = root.parent / f".{root.name}.fsck-backup-{time.strftime('%Y%m%dT%H%M%S')}"
    if progress:
        progress("repair")

    # rows the records hold that the medium lost are what the repair drops (and reports)
    stored = store_rows(root, tiers, specs, check_written=False)

    def source(spec: TableSpec) -> Any:
        if table_chain(spec, tiers)[-1].backend == "dram":
            return stored(spec)  # a snapshot that loads passed its checksums: every row
        return dump.pages(spec)

    # what the written-id records hold: the ids of rows no scan could read come from there
    held = {spec.name: record_ids(root, spec) for spec in specs}
    complete = closed_cleanly(root, specs, tiers)
    # listed before the swap and recorded with it: a repair killed after its swap leaves them
    # for the next fsck to report (`_kept_by_a_killed_repair`)
    dropped = [found for found in (
        dropped_finding(spec.name, scans[spec.name], held[spec.name], dump.ids(spec.name),
                        spec.name in complete, backup)
        for spec in specs if spec.name in scans) if found is not None]
    try:
        replace_store(root, source=source, keep_old=backup, lock_fd=fd,
                      dropped=[{"table": f.table, "message": f.message, "ids": list(f.ids)}
                               for f in dropped])
    except (EmbstoreError, OSError) as exc:
        return findings + [Finding(None, f"repair failed, the store is unchanged: {exc}")]
    out = [_repaired(f) for f in findings] + dropped
    after, _, _ = _check_path(root, None, progress)
    return out + after


def _repaired(f: Finding) -> Finding:
    return Finding(**{**f.__dict__, "repaired": True})

