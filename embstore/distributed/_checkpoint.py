"""Checkpoints of a sharded store: every rank's shards, and the plan beside them.

Apart from `embstore.distributed._open` so that the store can take checkpoints without
importing the module that opens it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._private_dir import discard, io_error, missing_dirs
from ..checkpoint import _as_path, _check_new, _check_step
from ..manifest import make_dirs, write_atomic

__all__ = ["META", "checkpoint_sharded"]

META = "sharded.json"
"""The sharded store's own record beside the ranks' stores: world size, plan, tables."""


def checkpoint_sharded(store: Any, dest: object, step: int | None) -> Path:
    """Write every rank's shards to ``dest/rank<r>`` and the plan to ``dest/sharded.json``.

    Each step ends in an agreement of every rank (`Comm.agree`): a failure on any rank makes
    every rank raise at once, and rank 0 removes the `dest` it made, so that the same
    checkpoint can be taken again.
    """
    comm = store._comm
    error: BaseException | None = None
    path = Path()
    try:  # every rank checks everything before anything is made
        store._check_open()
        path = _as_path(dest, "the checkpoint's destination")
        _check_step(step)
        _check_new(path, "a checkpoint")
    except Exception as exc:
        error = exc
    comm.agree(error, "checkpoint's destination and step")
    made: list[Path] = []

    def undo() -> None:  # incomplete: nothing of it stays, a retry starts afresh
        if made:
            discard(made[0], made[1:])

    error = None
    if comm.rank == 0:
        made = missing_dirs(path)
        try:
            make_dirs(path)  # synced into its parent, as the ranks' checkpoints are into it
        except OSError as exc:
            error = io_error(exc, path, "create")
    comm.agree(error, "checkpoint's directory", undo=undo)
    error = None
    try:
        store.local.checkpoint(path / f"rank{comm.rank}", step=step)
    except Exception as exc:  # said to the others, which would wait for this rank
        error = exc
    comm.agree(error, "checkpoint of every rank's shards", undo=undo)
    error = None
    if comm.rank == 0:
        try:
            meta = json.loads((store.path / META).read_text()) if store.path else {
                "world_size": comm.world, "plan": store.plan.to_json(),
                "tables": [store.table_spec(t).to_json() for t in store.tables],
                "tiers": None}
            meta["step"] = None if step is None else int(step)
            write_atomic(path / META, json.dumps(meta, indent=1, allow_nan=False).encode())
        except OSError as exc:
            error = io_error(exc, path / META, "write")
        except Exception as exc:
            error = exc
    comm.agree(error, "checkpoint's record", undo=undo)
    return path
