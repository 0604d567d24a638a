"""The fused optimizer step of `apply_gradients` on float32 rows, in C (`_kernels/optim_kernels.c`).

Every tier layout runs the same kernel on the same gathered rows, so tables stay bit-identical
across layouts by construction; the kernel performs the float32 operations of the numpy rules
in `_optim_rules.py` in their order (same bits, which the tests check). Rules without a
kernel (Adam, AdamW, subclasses, other dtypes) run their numpy `step`.

Three ways in:

- `step_rows`: rows already gathered (any tier chain), stepped in place.
- `step_in_place`: rows of a slotted DRAM tier (`backends.dram`) stepped where they lie, by
  slot, in one pass: no hash probe, no gathered copy and no write back. Each row's pre-image
  is kept while the pass runs, so that a step that is not finite can be undone.
- `gather_step`: rows of a slotted tier without a kernel for the rule: gathered by slot,
  stepped, and written back by slot by the caller once the step is known to be good.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np

from ._kernels._optim_kernels import ffi, lib
from ._parallel import run_ranges
from .optim import SGD, Adagrad, Optimizer, RowWiseAdagrad

__all__ = ["distinct_slots", "gather_step", "kernel_rule", "step_in_place", "step_rows"]

_RULE_SGD, _RULE_ADAGRAD, _RULE_ROWWISE = 0, 1, 2
_DECAY_NONE, _DECAY_L2, _DECAY_DECOUPLED = 0, 1, 2


def kernel_rule(optimizer: Optimizer, dtype: np.dtype) -> tuple[int, int, float, float,
                                                                 float] | None:
    """Choose the C kernel's rule for `optimizer` on rows of `dtype`.

    Returns (rule, decay mode, lr, eps, weight_decay), or None where the numpy rule applies.
    """
    if np.dtype(dtype) != np.float32:
        return None
    kind = type(optimizer)  # exactly these classes: a subclass may change `step`
    if kind is RowWiseAdagrad:
        rw = cast(RowWiseAdagrad, optimizer)
        decay = (_DECAY_NONE if not rw.weight_decay else
                 _DECAY_DECOUPLED if rw.weight_decay_mode == "decoupled" else _DECAY_L2)
        return _RULE_ROWWISE, decay, rw.lr, rw.eps, rw.weight_decay
    if kind is Adagrad:
        ada = cast(Adagrad, optimizer)
        return (_RULE_ADAGRAD, _DECAY_L2 if ada.weight_decay else _DECAY_NONE,
                ada.lr, ada.eps, ada.weight_decay)
    if kind is SGD:
        sgd = cast(SGD, optimizer)
        return (_RULE_SGD, _DECAY_L2 if sgd.weight_decay else _DECAY_NONE,
                sgd.lr, 0.0, sgd.weight_decay)
    return None


def _ptr(ctype: str, arr: np.ndarray) -> Any:
    # from_buffer takes a tenth of the time of a cast of `arr.ctypes.data`, which a store
    # pays a dozen times per table and call; a strided view has no buffer of its own
    try:
        return ffi.from_buffer(ctype, arr)
    except ValueError:
        return ffi.cast(ctype, arr.ctypes.data)


_local = threading.local()


def _preimage_buffer(rows: int, width: int) -> np.ndarray:
    """Return a float32 [rows, width] scratch array of this thread, reused across calls.

    A fresh batch-sized array costs page faults and zeroing (up to 8x the time of writing it)
    each time the allocator hands the memory back to the system.
    """
    need = rows * width
    buf = getattr(_local, "preimage", None)
    if buf is None or len(buf) < need:
        buf = np.empty(max(need, 1), dtype=np.float32)
        _local.preimage = buf
    return buf[:need].reshape(rows, width)


def _order_buffer(rows: int) -> np.ndarray:
    """Return an int64 [2 * rows] scratch array of this thread for the slot-order sort."""
    buf = getattr(_local, "order", None)
    if buf is None or len(buf) < 2 * rows:
        buf = np.empty(max(2 * rows, 1), dtype=np.int64)
        _local.order = buf
    return buf[: 2 * rows]


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


def distinct_slots(slots: np.ndarray, bound: int) -> bool:
    """Whether the int32 `slots`, all in [0, bound), are distinct (one bit per slot)."""
    words = (bound + 63) // 64
    bits = getattr(_local, "bits", None)
    if bits is None or len(bits) < words:
        bits = np.zeros(max(words, 1), dtype=np.uint64)  # cleared by the kernel after use
        _local.bits = bits
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    return bool(lib.slots_distinct(_ptr("int32_t *", slots), len(slots),
                                   _ptr("uint64_t *", bits)))


def step_in_place(optimizer: Optimizer, dim: int, backend: Any, slots: np.ndarray,
                  grads: np.ndarray, *, undo: bool) -> int | None:
    """Step the rows at `slots` (distinct) of a slotted DRAM `backend` where they lie.

    One pass from `grads` [N, dim], in ascending slot order where the batch is long (the
    rows' cache and TLB misses are cheaper in address order). Returns the first row whose
    result is not finite, or -1; with `undo` every row is as before the call when that is
    not -1. None where the rule
    has no kernel (nothing done: use `gather_step`).
    """
    rule = kernel_rule(optimizer, backend.spec.dtype)
    if rule is None or not len(slots):
        return None
    grads = np.ascontiguousarray(grads)
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    slabs = backend.slabs_for_writing()
    preimage = _preimage_buffer(len(slots), slabs.dim) if undo else None
    # each range sorts its own slots in [2 * start, 2 * stop): its order, then its scratch
    order = _order_buffer(len(slots))
    slabs_p, slots_p, grads_p, order_p = (slabs.pointer(), _ptr("int32_t *", slots),
                                          _ptr("float *", grads), _ptr("int64_t *", order))
    pre_p = ffi.NULL if preimage is None else _ptr("float *", preimage)

    def step(start: int, stop: int) -> int:
        scratch = np.empty(dim, dtype=np.float32)
        return int(lib.optim_step_slots_f32(
            *rule, slabs_p, slabs.shift, slots_p + start, slabs.dim, grads_p + start * dim,
            stop - start, dim, pre_p if preimage is None else pre_p + start * slabs.dim,
            order_p + 2 * start, _ptr("float *", scratch)))

    parts = run_ranges(len(slots), step)
    bad = [(start, first) for start, first in parts if first >= 0]
    if not bad:
        return -1
    if preimage is not None:
        # a range that failed put its own rows back; the others completed: put theirs back
        stops = [start for start, _ in parts[1:]] + [len(slots)]
        for (start, first), stop in zip(parts, stops, strict=True):
            if first < 0:  # preimage row k of a range is that of its slot order[k]
                ranked = order[2 * start : 2 * start + stop - start]
                slabs.scatter(slots[start:stop][ranked], preimage[start:stop])
    return min(start + first for start, first in bad)


def gather_step(optimizer: Optimizer, dim: int, backend: Any, slots: np.ndarray,
                grads: np.ndarray) -> tuple[np.ndarray, int]:
    """Step a copy of the rows at `slots` of a slotted `backend` from `grads` [N, dim].

    Returns a new array [N, width] and the first row whose result is not finite, or -1. The
    backend is not written.
    """
    rows = backend.rows_at(slots)
    return rows, step_rows(optimizer, dim, rows, grads)
