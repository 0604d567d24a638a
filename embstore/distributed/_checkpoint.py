"""Checkpoints of a sharded store: every rank's shards, and the plan beside them.

Apart from `embstore.distributed._open` so that the store can take checkpoints without
importing the module that opens it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._private_dir import discard, io_error, missing_dirs
from ..checkpoint import _as_path, _check_new, _check_step
from ..manifest import json_checksum, make_dirs, read_manifest, write_atomic

__all__ = ["META", "checkpoint_sharded"]

META = "sharded.json"
"""The sharded store's own record beside the ranks' stores: world size, plan, tables."""


def checkpoint_sharded(store: Any, dest: object, step: int | None) -> Path:
    """Write every rank's shards to ``dest/rank<r>`` and the plan to ``dest/sharded.json``.

    The record also lists each rank's checkpoint seal and a checksum of itself, so that a
    restore refuses a damaged record and shards of other checkpoints. Every rank must pass
    the same `dest` and `step`.

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
    # ranks given other paths would each write their shards to their own
    comm.agree(error, "checkpoint's destination and step", None if error is not None else
               [os.path.abspath(path), None if step is None else int(step)])
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
    seal = None
    try:
        store.local.checkpoint(path / f"rank{comm.rank}", step=step)
        seal = read_manifest(path / f"rank{comm.rank}")["checkpoint_seal"]["id"]
    except Exception as exc:  # said to the others, which would wait for this rank
        error = exc
    comm.agree(error, "checkpoint of every rank's shards", undo=undo)
    # each rank's seal, so that a restore refuses a shard put there from another checkpoint
    seals = comm.gather_objects(seal, "checkpoint's shard seals")
    error = None
    if comm.rank == 0:
        try:
            meta = json.loads((store.path / META).read_text()) if store.path else {
                "world_size": comm.world, "plan": store.plan.to_json(),
                "tables": [store.table_spec(t).to_json() for t in store.tables],
                "tiers": None}
            meta.pop("checksum", None)
            meta["step"] = None if step is None else int(step)
            meta["shard_seals"] = seals
            meta["checksum"] = json_checksum(meta)
            write_atomic(path / META, json.dumps(meta, indent=1, allow_nan=False).encode())
        except OSError as exc:
            error = io_error(exc, path / META, "write")
        except Exception as exc:
            error = exc
    comm.agree(error, "checkpoint's record", undo=undo)
    return path
