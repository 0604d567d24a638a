"""Checkpoints of a sharded store: every rank's shards, and the plan beside them.

Apart from `embstore.distributed._open` so that the store can take checkpoints without
importing the module that opens it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import EmbstoreError, PeerFailedError, StoreExistsError
from ..manifest import make_dirs, write_atomic

__all__ = ["META", "checkpoint_sharded"]

META = "sharded.json"
"""The sharded store's own record beside the ranks' stores: world size, plan, tables."""


def checkpoint_sharded(store: Any, dest: Path, step: int | None) -> Path:
    """Write every rank's shards to ``dest/rank<r>`` and the plan to ``dest/sharded.json``."""
    comm = store._comm
    error = ""
    if comm.rank == 0:
        if dest.exists():
            error = f"{dest} exists; checkpoint into a new directory"
        else:
            make_dirs(dest)  # synced into its parent, as the ranks' checkpoints are into it
    errors = comm.gather_objects(error, "checkpoint start")
    if errors[0]:
        raise StoreExistsError(str(errors[0]))
    failure: EmbstoreError | None = None
    try:
        store.local.checkpoint(dest / f"rank{comm.rank}", step=step)
    except EmbstoreError as exc:  # said to the others, which would wait for this rank
        failure = exc
    errors = comm.gather_objects("" if failure is None else f"{type(failure).__name__}: "
                                 f"{failure}", "checkpoint shards")
    if failure is not None:
        raise failure
    failed = [r for r, e in enumerate(errors) if e]
    if failed:
        raise PeerFailedError(f"rank {failed[0]} could not write its shards into {dest} "
                              f"({errors[failed[0]]}); the checkpoint is incomplete (it has "
                              f"no {META}) and the store is unchanged")
    if comm.rank == 0:
        meta = json.loads((store.path / META).read_text()) if store.path else {
            "world_size": comm.world, "plan": store.plan.to_json(),
            "tables": [store.table_spec(t).to_json() for t in store.tables], "tiers": None}
        meta["step"] = step
        write_atomic(dest / META, json.dumps(meta, indent=1).encode())
    comm.barrier("checkpoint done")
    return dest
