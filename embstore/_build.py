"""Building a table's tier chain from its specs: one path for stores and the simulator.

`build_chain` opens each tier's backend where `layout` says, builds its policies from the
registry and composes them into a `TableChain`; `embstore.tools.simulate` replays traces
through a chain built here, so a simulated tier admits, inserts and evicts exactly as a
store's tier does.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import registry
from .backend import BackendSpec
from .errors import ConfigError
from .hierarchy import TableChain, Tier
from .layout import check_inside, table_chain, tier_dir
from .policy import AdmissionPolicy, EvictionPolicy
from .spec import TableSpec, TierSpec

__all__ = ["build_chain", "make_policy"]


def build_chain(spec: TableSpec, default_tiers: Sequence[TierSpec], root: Path | None, *,
                read_only: bool, background_writes: bool = True) -> TableChain:
    """Open the tiers of table `spec` (its own chain, else `default_tiers`) as a `TableChain`.

    Args:
        spec: the table.
        default_tiers: the store's default chain.
        root: the store's directory; None for in-memory tiers only.
        read_only: open the store of record read-only; cache tiers that keep files become
            DRAM tiers of the same capacity and policies (nothing is written).
        background_writes: write back into the store of record on a second thread.

    Raises:
        ConfigError: a tier needs a directory and `root` is None, or a bad policy setting.
        BackendUnavailableError, CorruptStoreError: from opening a backend.
    """
    tier_specs = table_chain(spec, default_tiers)
    width, dtype = spec.storage_width, spec.storage_dtype
    row_bytes = width * dtype.itemsize
    tiers: list[Tier] = []
    try:
        for level, ts in enumerate(tier_specs):
            is_bottom = level == len(tier_specs) - 1
            cls = registry.load_backend(ts.backend)
            path = None
            if root is not None and (cls.requires_path or is_bottom):
                path = tier_dir(root, level, ts.backend, is_bottom=is_bottom)
                if not is_bottom and path.exists() and not read_only:
                    # caches start empty on open: after a crash their unflushed rows must
                    # not shadow the bottom tier's
                    shutil.rmtree(path / spec.name, ignore_errors=True)
            elif cls.requires_path:
                raise ConfigError(
                    f"table {spec.name!r}: backend {ts.backend!r} needs a directory; open the "
                    "store with a path, or use only 'dram' tiers for an in-memory store"
                )
            options = ts.options
            if read_only and not is_bottom and path is not None:
                # a read-only store writes no file, and the writer may be using the cache
                # directory: its caches are DRAM stand-ins of the same capacity and policies
                cls, path, options = registry.load_backend("dram"), None, {}
            if path is not None and root is not None:
                check_inside(root, path)
            capacity = ts.capacity_rows(row_bytes)
            bspec = BackendSpec(path=path, dim=width, dtype=dtype, table=spec.name,
                                read_only=read_only and is_bottom,
                                capacity_bytes=None if capacity is None
                                else capacity * row_bytes)
            backend = cls.open(bspec, **options)
            if not is_bottom and len(backend):
                backend.delete(backend.ids())  # a cache medium that kept rows: start empty
            eviction = make_policy(ts.eviction, ts.eviction_options, EvictionPolicy)
            admission = (None if ts.admission in (None, "always")
                         else make_policy(ts.admission, ts.admission_options, AdmissionPolicy))
            if eviction is not None and is_bottom and len(backend):
                # feature expiry must see the rows stored before this open, too
                for ids, _ in backend.items():
                    eviction.record_insert(ids, 0)
            tiers.append(Tier(level, ts, backend, capacity, eviction, admission, is_bottom))
    except BaseException:
        for tier in tiers:
            tier.backend.close()
        raise
    return TableChain(tiers, width, dtype, background_writes=background_writes)


def make_policy(name: str | None, options: dict[str, Any], family: type[Any]) -> Any:
    """Build the registered policy `name` of `family` with `options`.

    `family` is EvictionPolicy or AdmissionPolicy; returns None for no name.

    Raises:
        UnknownNameError: no policy of that name.
        ConfigError: a policy of the other family, or bad options.
    """
    if name is None:
        return None
    kind = family.kind
    cls = registry.load_policy(name)
    if cls.kind != kind:
        raise ConfigError(f"{name!r} is an {cls.kind} policy, given as the {kind} policy")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"{kind} policy {name!r}: bad options {options!r} ({exc})") from exc
