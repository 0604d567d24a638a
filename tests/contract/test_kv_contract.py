"""What the key-value backends (`KeyValueBackend`: one shared handle per tier directory, keys
encoded by backends/_keys.py) have in common: each table's spec is checked on reopen,
read-only opens find only existing tables, a writer cannot join a directory opened read-only
in the same process, tables close in any order, and scans come in numeric id order. Every
registered backend of that kind runs here; the others skip, saying so.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from embstore import registry
from embstore.backend import Backend, BackendSpec
from embstore.backends._kv import KeyValueBackend
from embstore.errors import (
    BackendUnavailableError,
    ConfigError,
    StoreLockedError,
    StoreNotFoundError,
)

DIM = 8


def _other_options(cls: type[Backend]) -> dict[str, object]:
    """A keyword option of `cls` set to a value other than its default: its first bool one,
    flipped (a shared handle refuses options that differ while it is open).
    """
    params = inspect.signature(cls.__init__).parameters.values()
    for p in params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and isinstance(p.default, bool):
            return {p.name: not p.default}
    pytest.skip(f"{cls.name} has no bool option to vary")


@pytest.fixture(params=registry.backend_names(), ids=str)
def open_backend(request):
    try:
        cls = registry.load_backend(request.param)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    if not issubclass(cls, KeyValueBackend):
        pytest.skip(f"the {request.param} backend is not a key-value backend with shared "
                    "handles (KeyValueBackend)")

    def _open(path: Path, table: str = "t", *, dim: int = DIM, read_only: bool = False,
              other_options: bool = False) -> Backend:
        options = _other_options(cls) if other_options else {}
        return cls.open(BackendSpec(path=path, dim=dim, table=table, read_only=read_only),
                        **options)

    return _open


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def test_reopening_a_table_with_another_dim_raises_config_error(open_backend, tmp_path):
    with open_backend(tmp_path / "tier") as b:
        b.put(np.arange(3, dtype=np.int64), np.ones((3, DIM), np.float32))
    with pytest.raises(ConfigError, match="dim 8"):
        open_backend(tmp_path / "tier", dim=DIM * 2)


def test_read_only_open_of_a_missing_table_raises_not_found(open_backend, tmp_path):
    with pytest.raises(StoreNotFoundError):
        open_backend(tmp_path / "none", read_only=True)
    open_backend(tmp_path / "tier", table="a").close()
    with pytest.raises(StoreNotFoundError, match="'b'"):
        open_backend(tmp_path / "tier", table="b", read_only=True)


def test_a_writer_cannot_join_a_read_only_directory(open_backend, tmp_path):
    open_backend(tmp_path / "tier", table="a").close()
    with open_backend(tmp_path / "tier", table="a", read_only=True), \
            pytest.raises(StoreLockedError, match="read-only"):
        open_backend(tmp_path / "tier", table="b")


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_tables_in_one_directory_close_in_either_order(open_backend, tmp_path, first):
    path = tmp_path / "tier"
    tables = {"a": open_backend(path, table="a"), "b": open_backend(path, table="b")}
    ids = np.arange(10, dtype=np.int64)
    tables["a"].put(ids, _rows(10, seed=1))
    tables["b"].put(ids, _rows(10, seed=2))
    tables[first].close()
    other = tables["b" if first == "a" else "a"]
    other.put(ids[:2].copy(), _rows(2, seed=3))  # the shared handle is still open for it
    assert other.get(ids)[1].all()
    other.close()
    # Both closed: the handle is gone, so other options are accepted now, and every table
    # reopens with its rows.
    expected = {"a": _rows(10, seed=1), "b": _rows(10, seed=2)}
    expected["b" if first == "a" else "a"][:2] = _rows(2, seed=3)
    with open_backend(path, table="a", other_options=True) as a, \
            open_backend(path, table="b", other_options=True) as b:
        np.testing.assert_array_equal(a.get(ids)[0], expected["a"])
        np.testing.assert_array_equal(b.get(ids)[0], expected["b"])


def test_ids_and_items_come_in_numeric_order(open_backend, tmp_path):
    ids = np.random.default_rng(0).choice(np.arange(-(10**12), 10**12, 7919), size=2000,
                                          replace=False).astype(np.int64)
    ids[:3] = [-(2**63), 2**63 - 1, 0]
    rows = _rows(2000, seed=0)
    with open_backend(tmp_path / "tier") as b:
        b.put(ids, rows)
        np.testing.assert_array_equal(b.ids(), np.sort(ids))
        batches = list(b.items(batch_rows=333))
        assert [len(i) for i, _ in batches] == [333] * 6 + [2]
        np.testing.assert_array_equal(np.concatenate([i for i, _ in batches]), np.sort(ids))
        np.testing.assert_array_equal(np.concatenate([r for _, r in batches]),
                                      rows[np.argsort(ids)])
