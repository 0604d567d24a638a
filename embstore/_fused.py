"""The fused optimizer step of `apply_gradients` on float32 rows, in C (`_kernels/optim_kernels.c`).

Every tier layout runs the same kernel on the same gathered rows, so tables stay bit-identical
across layouts by construction; the kernel performs the float32 operations of the numpy rules
in `_optim_rules.py` in their order (same bits, which the tests check). Rules without a
kernel (Adam, AdamW, subclasses, other dtypes) run their numpy `step`.

Two ways in:

- `step_rows`: rows already gathered (any tier chain), stepped in place.
- `gather_step`: rows in a slotted DRAM tier (`backends.dram`) gathered by slot and stepped
  in one pass into a new buffer, which the caller writes back by slot once the step is known
  to be good: no hash probe and no batch-sized intermediate beyond the result itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._kernels._optim_kernels import ffi, lib
from .optim import SGD, Adagrad, Optimizer, RowWiseAdagrad

__all__ = ["gather_step", "kernel_rule", "step_rows"]

_RULE_SGD, _RULE_ADAGRAD, _RULE_ROWWISE = 0, 1, 2
_DECAY_NONE, _DECAY_L2, _DECAY_DECOUPLED = 0, 1, 2


def kernel_rule(optimizer: Optimizer, dtype: np.dtype) -> tuple[int, int, float, float,
                                                                 float] | None:
    """(rule, decay mode, lr, eps, weight_decay) of the C kernel for `optimizer` on rows of
    `dtype`, or None where the numpy rule applies."""
    if np.dtype(dtype) != np.float32:
        return None
    kind = type(optimizer)  # exactly these classes: a subclass may change `step`
    if kind is RowWiseAdagrad:
        decay = (_DECAY_NONE if not optimizer.weight_decay else
                 _DECAY_DECOUPLED if optimizer.weight_decay_mode == "decoupled" else _DECAY_L2)
        return _RULE_ROWWISE, decay, optimizer.lr, optimizer.eps, optimizer.weight_decay
    if kind is Adagrad:
        return (_RULE_ADAGRAD, _DECAY_L2 if optimizer.weight_decay else _DECAY_NONE,
                optimizer.lr, optimizer.eps, optimizer.weight_decay)
    if kind is SGD:
        return (_RULE_SGD, _DECAY_L2 if optimizer.weight_decay else _DECAY_NONE,
                optimizer.lr, 0.0, optimizer.weight_decay)
    return None


def _ptr(ctype: str, arr: np.ndarray) -> Any:
    return ffi.cast(ctype, arr.ctypes.data)


def _first_nonfinite(rows: np.ndarray) -> int:
    finite = np.isfinite(rows).all(axis=1)
    return -1 if finite.all() else int(np.flatnonzero(~finite)[0])


def step_rows(optimizer: Optimizer, dim: int, rows: np.ndarray, grads: np.ndarray) -> int:
    """Step `rows` [N, width] (weights then state) in place from `grads` [N, dim].

    Returns the first row whose result is not finite (weights or state), or -1.
    """
    rule = kernel_rule(optimizer, rows.dtype)
    if rule is None or not (rows.flags.c_contiguous and grads.flags.c_contiguous):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            # overflow is reported on the result, by row
            optimizer.step(rows[:, :dim], rows[:, dim:], grads)
        return _first_nonfinite(rows)
    if not len(rows):
        return -1
    scratch = np.empty(dim, dtype=np.float32)
    return int(lib.optim_step_f32(*rule, _ptr("float *", rows), rows.shape[1],
                                  _ptr("float *", grads), len(rows), dim,
                                  _ptr("float *", scratch)))


def gather_step(optimizer: Optimizer, dim: int, backend: Any, slots: np.ndarray,
                grads: np.ndarray) -> tuple[np.ndarray, int]:
    """The rows at `slots` of a slotted DRAM `backend`, stepped from `grads` [N, dim]: a new
    array [N, width] and the first row whose result is not finite, or -1. The backend is not
    written."""
    slabs = backend.slabs
    rule = kernel_rule(optimizer, slabs.dtype)
    if rule is None or not grads.flags.c_contiguous:
        rows = backend.rows_at(slots)
        return rows, step_rows(optimizer, dim, rows, grads)
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    rows = np.empty((len(slots), slabs.dim), dtype=np.float32)
    scratch = np.empty(dim, dtype=np.float32)
    bad = lib.optim_gather_step_f32(*rule, slabs.pointer(), slabs.shift,
                                    _ptr("int32_t *", slots), _ptr("float *", rows),
                                    slabs.dim, _ptr("float *", grads), len(slots), dim,
                                    _ptr("float *", scratch))
    return rows, int(bad)
