"""The C kernels of the torch adapter: pooling from a DRAM tier, and bag gradients per row.

Both give the float32 sums of the torch path, in its order (`_kernels/bag_kernels.c`): the
pooled rows of torch.embedding_bag's "sum", and the per-row sums of each position's
gradient that materialising them and summing in position order would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._kernels._bag_kernels import ffi as bag_ffi
from .._kernels._bag_kernels import lib as bag_lib
from .._parallel import MIN_ROWS_PER_THREAD, run_ranges
from ..index import RowSlabs, c_pointer
from ..store import EmbeddingStore
from ._plans import TablePlan

__all__ = ["pool_rows_in_store", "summed_bag_grads"]


def pool_rows_in_store(store: EmbeddingStore, tp: TablePlan) -> list[torch.Tensor] | None:
    """Sum-pool every feature of `tp` straight from the store's DRAM tier: [B, dim] each.

    None where the top tier does not hold every distinct id (nothing is read then).
    """
    dim = store.table_spec(tp.table).dim
    inverse = tp.groups.inverse

    def read(slabs: RowSlabs, slots: np.ndarray) -> list[torch.Tensor]:
        outs = []
        for fp in tp.features:
            offsets = fp.bags.offsets
            out = np.empty((len(offsets) - 1, dim), dtype=np.float32)
            args = (slabs.pointer(), slabs.shift, slabs.row_bytes, c_pointer("int32_t *", slots),
                    c_pointer("int64_t *", offsets),
                    c_pointer("int64_t *", inverse[fp.start:]), dim)
            out_p = c_pointer("float *", out)
            per_bag = max(1, len(fp.bags.ids) // max(1, len(offsets) - 1))

            def pool(lo: int, hi: int, args: tuple[Any, ...] = args, out_p: Any = out_p) -> None:
                bag_lib.bag_pool_slots_f32(*args, lo, hi, out_p)

            run_ranges(len(offsets) - 1, pool, min_rows=max(1, MIN_ROWS_PER_THREAD // per_bag))
            outs.append(torch.from_numpy(out))
        return outs

    return store._read_top_in_place(tp.table, tp.groups.unique,
                                    tp.ids if store.records_accesses else None, read)


def summed_bag_grads(tp: TablePlan, mode: str, grads: Sequence[torch.Tensor],
                      saved: list[Any]) -> tuple[np.ndarray, bool]:
    """Sum the positions' gradients of every feature per distinct row: ([U, dim], all finite).

    C passes in position order (`_kernels/bag_kernels.c`), equal bit for bit to
    `_position_grads` then `sum_rows`; rows are summed on the store's threads.
    """
    dim = grads[0].shape[1]
    n_rows = len(tp.groups.unique)
    out = np.empty((n_rows, dim), dtype=np.float32)
    skip = -1 if tp.padding is None else tp.padding
    finite = True
    start = np.empty(n_rows + 1, dtype=np.int64)
    out_p = c_pointer("float *", out)
    for i, (fp, g, (_, bag_size, _)) in enumerate(zip(tp.features, grads, saved, strict=True)):
        g_np = np.ascontiguousarray(g.detach().numpy())
        offsets = fp.bags.offsets
        inverse = tp.groups.inverse[fp.start: fp.start + len(fp.bags.ids)]
        order = np.empty(len(inverse), dtype=np.int64)
        bag_of = np.empty(len(inverse), dtype=np.int32)
        bag_lib.bag_group(c_pointer("int64_t *", offsets), len(offsets) - 1,
                          c_pointer("int64_t *", inverse), n_rows, c_pointer("int64_t *", start),
                          c_pointer("int64_t *", order), c_pointer("int32_t *", bag_of))
        psw = fp.bags.per_sample_weights
        weights = None if psw is None else np.ascontiguousarray(psw.detach().numpy())
        sizes = (np.ascontiguousarray(bag_size.numpy(), dtype=np.float32)
                 if mode == "mean" else None)
        args = (c_pointer("float *", g_np), dim, c_pointer("int64_t *", start),
                c_pointer("int64_t *", order), c_pointer("int32_t *", bag_of),
                bag_ffi.NULL if weights is None else c_pointer("float *", weights),
                bag_ffi.NULL if sizes is None else c_pointer("float *", sizes),
                skip, int(i > 0))

        def rows(lo: int, hi: int, args: tuple[Any, ...] = args) -> int:
            acc = np.empty(dim, dtype=np.float32)
            return int(bag_lib.bag_grad_rows(*args, lo, hi, c_pointer("float *", acc), out_p))

        # only the last feature's pass sees every row's final sum
        finite = all(ok for _, ok in run_ranges(n_rows, rows))
    return out, finite
