"""Building a table's tier chain from its specs: one path for stores and the simulator.

`build_chain` opens each tier's backend where `layout` says, builds its policies from the
registry and composes them into a `TableChain`; `embstore.tools.simulate` replays traces
through a chain built here, so a simulated tier admits, inserts and evicts exactly as a
store's tier does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import registry
from .backend import Backend, BackendSpec
from .errors import CapacityError, ConfigError, EmbstoreError
from .hierarchy import TableChain, Tier
from .layout import check_inside, table_chain, tier_dir
from .policy import AdmissionPolicy, EvictionPolicy
from .spec import TableSpec, TierSpec

__all__ = ["build_chain", "make_policy", "opening_tables"]


def _levels(spec: TableSpec, default_tiers: Sequence[TierSpec], root: Path | None, *,
            read_only: bool) -> list[tuple[type[Backend], TierSpec, BackendSpec, int | None]]:
    """(backend class, tier, BackendSpec, capacity in rows) of each tier of `spec`, top first.

    Raises:
        ConfigError: a tier needs a directory and `root` is None.
        UnknownNameError, BackendUnavailableError: from the registry.
    """
    tier_specs = table_chain(spec, default_tiers)
    width, dtype = spec.storage_width, spec.storage_dtype
    row_bytes = width * dtype.itemsize
    out = []
    for level, ts in enumerate(tier_specs):
        is_bottom = level == len(tier_specs) - 1
        cls = registry.load_backend(ts.backend)
        path = None
        if root is not None and (cls.requires_path or is_bottom):
            path = tier_dir(root, level, ts.backend, is_bottom=is_bottom)
        elif cls.requires_path:
            raise ConfigError(
                f"table {spec.name!r}: backend {ts.backend!r} needs a directory; open the "
                "store with a path, or use only 'dram' tiers for an in-memory store"
            )
        if read_only and not is_bottom and path is not None:
            # a read-only store writes no file, and the writer may be using the cache
            # directory: its caches are DRAM stand-ins of the same capacity and policies
            cls, path = registry.load_backend("dram"), None
            ts = dataclasses.replace(ts, backend="dram", options={})
        capacity = ts.capacity_rows(row_bytes)
        out.append((cls, ts, BackendSpec(path=path, dim=width, dtype=dtype, table=spec.name,
                                         read_only=read_only and is_bottom,
                                         capacity_bytes=None if capacity is None
                                         else capacity * row_bytes), capacity))
    return out


@contextlib.contextmanager
def opening_tables(specs: Sequence[TableSpec], default_tiers: Sequence[TierSpec],
                   root: Path | None, *, read_only: bool,
                   checked: set[Path] | None = None) -> Iterator[None]:
    """Open the chains of `specs` inside this block: each tier directory gets ready for all.

    Calls `Backend.opening` once per backend class, directory and options with every table
    that opens there (see it for why), each directory checked for links first (`checked`:
    as `build_chain` takes it); errors of the specs themselves are left to `build_chain`,
    which reports them table by table.

    Raises:
        CorruptStoreError: a tier directory is or holds a link.
        What `Backend.opening` raises.
    """
    groups: dict[tuple[type[Backend], Path, str], tuple[dict[str, Any], list[BackendSpec]]] = {}
    if root is not None:
        for spec in specs:
            try:
                levels = _levels(spec, default_tiers, root, read_only=read_only)
            except EmbstoreError:
                continue
            for cls, ts, bspec, _ in levels:
                if bspec.path is not None:
                    key = (cls, bspec.path, repr(sorted(ts.options.items())))
                    groups.setdefault(key, (ts.options, []))[1].append(bspec)
    with contextlib.ExitStack() as stack:
        for (cls, path, _), (options, bspecs) in groups.items():
            if len(bspecs) > 1:
                assert root is not None
                if checked is None or path not in checked:
                    check_inside(root, path)
                    if checked is not None:
                        checked.add(path)
                stack.enter_context(cls.opening(bspecs, **options))
        yield


def build_chain(spec: TableSpec, default_tiers: Sequence[TierSpec], root: Path | None, *,
                read_only: bool, background_writes: bool = True,
                checked: set[Path] | None = None) -> TableChain:
    """Open the tiers of table `spec` (its own chain, else `default_tiers`) as a `TableChain`.

    Args:
        spec: the table.
        default_tiers: the store's default chain.
        root: the store's directory; None for in-memory tiers only.
        read_only: open the store of record read-only; cache tiers that keep files become
            DRAM tiers of the same capacity and policies (nothing is written).
        background_writes: write back into the store of record on a second thread.
        checked: tier directories already checked for links by this open (`check_inside`
            walks a whole directory, which the tables of a tier share); updated.

    Raises:
        ConfigError: a tier needs a directory and `root` is None, or a bad policy setting.
        BackendUnavailableError, CorruptStoreError: from opening a backend.
    """
    tiers: list[Tier] = []
    try:
        levels = _levels(spec, default_tiers, root, read_only=read_only)
        for level, (cls, ts, bspec, capacity) in enumerate(levels):
            is_bottom = level == len(levels) - 1
            path = bspec.path
            if path is not None and root is not None:
                if not is_bottom and path.exists() and not read_only:
                    # caches start empty on open: after a crash their unflushed rows must
                    # not shadow the bottom tier's
                    shutil.rmtree(path / spec.name, ignore_errors=True)
                if checked is None or path not in checked:
                    check_inside(root, path)
                    if checked is not None:
                        checked.add(path)
            backend = cls.open(bspec, **ts.options)
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
    return TableChain(tiers, spec.storage_width, spec.storage_dtype,
                      background_writes=background_writes)


def check_ignored_settings(tiers: Iterable[TierSpec]) -> None:
    """Refuse policy settings a chain would ignore without a word.

    Those of admission "always" (which takes none but `seed`), and eviction settings for no
    eviction policy. Checked where a user gives tiers (a new store, a new table's own
    chain), not on reopen: a store made before this check, whose manifest holds such
    settings, still opens.

    Raises:
        ConfigError: naming the tier and the settings.
    """
    for ts in tiers:
        if ts.admission in (None, "always") and ts.admission_options:
            make_policy("always", ts.admission_options, AdmissionPolicy)
        if ts.eviction is None and ts.eviction_options:
            raise ConfigError(f"tier {ts.backend!r}: eviction_options "
                              f"{ts.eviction_options!r} given but no eviction policy (an "
                              "unbounded tier evicts nothing): name one, or give a capacity")


def make_policy(name: str | None, options: dict[str, Any], family: type[Any]) -> Any:
    """Build the registered policy `name` of `family` with `options`.

    `family` is EvictionPolicy or AdmissionPolicy; returns None for no name.

    Raises:
        UnknownNameError: no policy of that name.
        ConfigError: a policy of the other family, or bad options.
        CapacityError: the options size the policy's state beyond the machine's memory.
    """
    if name is None:
        return None
    kind = family.kind
    cls = registry.load_policy(name)
    if cls.kind != kind:
        raise ConfigError(f"{name!r} is an {cls.kind} policy, given as the {kind} policy")
    try:
        return cls.from_options(options)
    except MemoryError as exc:  # a sketch or filter sized beyond this machine's memory
        raise CapacityError(f"{kind} policy {name!r} with options {options!r} needs more "
                            "memory than this machine has", "give it smaller sizes") from exc
