"""Checks of caller input, done once at the store boundary before anything changes."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._kernels._optim_kernels import ffi as _ffi
from ._kernels._optim_kernels import lib as _lib
from .errors import (
    DimensionMismatchError,
    DtypeMismatchError,
    InvalidIdsError,
    InvalidValuesError,
    NonFiniteValueError,
)
from .spec import TableSpec

_INT64_MAX = np.iinfo(np.int64).max


def _all_finite(values: np.ndarray) -> bool:
    """Whether no element of `values` is NaN or infinite (float32 in one C pass)."""
    if values.dtype == np.float32 and values.flags.c_contiguous:
        return bool(_lib.values_finite_f32(_ffi.from_buffer("float *", values), values.size))
    return bool(np.isfinite(values).all())


_BOOLS = frozenset({bool, np.bool_})


def _holds_bools(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether `items` hold a bool (Python's, numpy's, or a 0-d bool array)."""
    types = set(map(type, items))
    if not _BOOLS.isdisjoint(types):
        return True
    return np.ndarray in types and any(
        type(x) is np.ndarray and x.dtype == np.bool_ for x in items)


def as_requests(requests: Any) -> Mapping[str, Any]:
    """`requests` of a call of several tables, once seen to be a mapping {table: ...}."""
    if not isinstance(requests, Mapping):
        raise InvalidValuesError(
            f"requests must be a mapping {{table: ...}}, got {type(requests).__name__}")
    return requests


def as_pair(table: str, pair: Any, what: str) -> tuple[Any, Any]:
    """One table's ``(ids, values)`` of a write of several tables, once seen to be a pair."""
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise InvalidValuesError(
            f"table {table!r}: give (ids, {what}) for each table, got {type(pair).__name__}")
    return pair[0], pair[1]


def as_ids(ids: Any, spec: TableSpec) -> np.ndarray:
    """`ids` as a C-contiguous 1-D int64 array, or `InvalidIdsError` saying what is wrong.

    Any integer dtype is accepted when its values convert to int64 without loss; floats,
    bools and out-of-range unsigned values are rejected rather than silently rounded.
    """
    if isinstance(ids, np.ma.MaskedArray):
        raise InvalidIdsError(
            f"table {spec.name!r}: ids are a masked array, whose mask the store would not "
            "see; pass ids.compressed() (the unmasked ids) or fill the masked ones")
    if isinstance(ids, memoryview):
        ids = np.asarray(ids)  # a buffer of integers (np.isscalar calls it a scalar)
    original = ids
    if not isinstance(ids, np.ndarray):
        if np.isscalar(ids):
            raise InvalidIdsError(
                f"table {spec.name!r}: ids must be a 1-D array, got the scalar {ids!r}; "
                "wrap it: np.array([id])"
            )
        try:
            ids = np.asarray(ids)
        except (ValueError, TypeError, RuntimeError) as exc:  # torch's: RuntimeError
            raise InvalidIdsError(f"table {spec.name!r}: ids are not an array: {exc}") from exc
        if ids.size == 0 and ids.dtype == np.float64:  # a bare [] has no dtype of its own
            ids = ids.astype(np.int64)
        elif ids.ndim == 0:  # None, a dict, a set, a generator: no sequence numpy can read
            raise InvalidIdsError(f"table {spec.name!r}: ids must be a 1-D integer array, "
                                  f"got {type(original).__name__}")
    if ids.ndim != 1:
        raise InvalidIdsError(
            f"table {spec.name!r}: ids must be 1-D, got shape {ids.shape}; flatten them first"
        )
    kind = ids.dtype.kind
    if kind in "Of" and not isinstance(original, np.ndarray):
        _refuse_ints_past_int64(original, spec)
    if kind in "iu" and isinstance(original, (list, tuple)) and _holds_bools(original):
        # numpy reads [3, True] as [3, 1]: a flag taken for an id
        raise InvalidIdsError(f"table {spec.name!r}: ids must be integers, got True or False "
                              "among them")
    if kind == "b" or kind not in "iu":
        raise InvalidIdsError(
            f"table {spec.name!r}: ids must be integers, got dtype {ids.dtype}; "
            "convert with ids.astype(np.int64) if the values are whole numbers"
        )
    if kind == "u" and ids.dtype.itemsize == 8 and len(ids) and ids.max() > _INT64_MAX:
        raise InvalidIdsError(
            f"table {spec.name!r}: uint64 id {int(ids.max())} does not fit in int64; "
            "hash or remap ids into the int64 range"
        )
    out: np.ndarray = np.ascontiguousarray(ids, dtype=np.int64)
    n = spec.num_embeddings
    if n is not None and len(out):
        lo, hi = int(out.min()), int(out.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise InvalidIdsError(
                f"table {spec.name!r} has num_embeddings={n}: id {bad} is outside [0, {n}); "
                "fix the ids or declare a larger table"
            )
    return out


def _refuse_ints_past_int64(ids: Any, spec: TableSpec) -> None:
    """Name a Python int of `ids` (a sequence numpy read as floats or objects) past int64.

    numpy reads [-1, 2**63] as float64 and [2**70] as objects: converting them with
    astype(np.int64), as the dtype error advises, would wrap or round the id.
    """
    with contextlib.suppress(TypeError):  # not a sequence: the dtype error says enough
        for v in ids:
            if isinstance(v, int) and not isinstance(v, bool) and not (
                    -_INT64_MAX - 1 <= v <= _INT64_MAX):
                raise InvalidIdsError(
                    f"table {spec.name!r}: id {v} does not fit in int64; hash or remap ids "
                    "into the int64 range")


def as_rows(rows: Any, n: int, spec: TableSpec, what: str = "rows", *,
            checked_finite: bool = False) -> np.ndarray:
    """`rows` as a C-contiguous (n, dim) array of the table dtype, checked for NaN/inf.

    `checked_finite`: the caller (inside embstore) has seen every value finite already.
    """
    if isinstance(rows, np.ma.MaskedArray):
        raise InvalidValuesError(
            f"table {spec.name!r}: {what} are a masked array, whose mask the store would not "
            "see; fill the masked values (rows.filled(...)) or leave their ids out")
    if not isinstance(rows, np.ndarray):
        raise InvalidValuesError(
            f"table {spec.name!r}: {what} must be a numpy array of shape ({n}, {spec.dim}), "
            f"got {type(rows).__name__}"
        )
    if rows.dtype != spec.dtype:
        raise DtypeMismatchError(
            f"table {spec.name!r}: {what} must have the table dtype {spec.dtype}, got "
            f"{rows.dtype}; convert with "
            + (f".astype(np.{spec.dtype.name})" if spec.dtype.isnative
               else f".astype({spec.dtype.str!r})")
        )
    if rows.ndim != 2 or rows.shape[1] != spec.dim:
        raise DimensionMismatchError(
            f"table {spec.name!r}: {what} must have shape ({n}, {spec.dim}) (dim {spec.dim}), "
            f"got {rows.shape}"
        )
    if rows.shape[0] != n:
        raise InvalidValuesError(
            f"table {spec.name!r}: {n} ids but {rows.shape[0]} {what}; give one row per id"
        )
    if not (spec.allow_nonfinite or checked_finite) and rows.size and not _all_finite(rows):
        bad = int(np.flatnonzero(~np.isfinite(rows).all(axis=1))[0])
        raise NonFiniteValueError(
            f"table {spec.name!r}: {what} hold NaN or infinity (first at row {bad}); the "
            "table forbids them: fix the values or declare allow_nonfinite=True"
        )
    return np.ascontiguousarray(rows)
