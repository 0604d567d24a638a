"""Crash points: named places where a test makes the process kill itself with SIGKILL.

`EMBSTORE_CRASH_AT="<point>:<n>"` (read once, at import) makes the n-th hit of `<point>` in
this process send SIGKILL to the process itself: no handler, no flush, no atexit runs, as in
a crash. Unset (the normal case), `point()` costs one comparison. The points (`POINTS`) sit
in write-back, flush, checkpoint, the manifest's atomic write, the rewrite of compact, migrate
and repair, recovery (opening a store) and access logs; tests/crash/test_crash_points.py runs
each of the store's and the rewrite's for hits 1 and 2 on every persistent backend
(tests/test_access_log.py the access log's).
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["ENV", "POINTS", "point"]

ENV = "EMBSTORE_CRASH_AT"

POINTS = (
    "writeback.before_put",      # the background writer is about to write a batch below
    "writeback.after_put",       # ... and has written it (not yet synced)
    "flush.before_written",      # a store flush, before the written-id record's first write
    "flush.before_sync",         # write-backs done, the store of record not yet synced
    "flush.after_sync",          # synced, the written-id record not yet updated
    "checkpoint.begin",          # a checkpoint's flush is done, nothing copied yet
    "checkpoint.page",           # a page of rows was copied into the checkpoint
    "checkpoint.before_publish",  # the copy is complete, not yet renamed into place
    "manifest.before_sync",      # the manifest's temporary file is written, not synced
    "manifest.before_rename",    # ... synced, not yet renamed over the manifest
    "manifest.before_dir_sync",  # ... renamed, its directory not yet synced
    "rebuild.page",              # compact/migrate/repair: a page of rows is in the new copy
    "rebuild.before_swap",       # ... the new copy is complete and synced, not swapped in
    "rebuild.swap_parked",       # ... (no atomic exchange) the old store moved aside
    "rebuild.after_swap",        # ... swapped in, the old store not yet removed
    "recovery.opened",           # reopening: the store of record is open, caches not yet
    "recovery.written",          # reopening: the written-id record is being rebuilt
    "access_log.after_ids",      # an access log has a batch's ids, not yet its end offset
)


def _target() -> tuple[str, int] | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    name, _, nth = value.rpartition(":")
    if name not in POINTS or not nth.isdigit() or int(nth) < 1:
        raise ValueError(f"{ENV}={value!r}: expected <point>:<n> with n >= 1 and a point "
                         f"among {POINTS}")
    return name, int(nth)


_TARGET = _target()
_hits = 0
_lock = threading.Lock()


def point(name: str) -> None:
    """Count a hit of crash point `name`; kill the process if it is the one asked for."""
    if _TARGET is None or name != _TARGET[0]:
        return
    global _hits
    with _lock:
        _hits += 1
        if _hits == _TARGET[1]:
            os.kill(os.getpid(), signal.SIGKILL)
