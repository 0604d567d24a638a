"""The machinery behind the torch modules: plan a forward, fetch its rows, pool, update.

A forward is done in three steps, so that the pipeline can run the first two ahead of time on
a background thread:

1. `prepare`: check the inputs and group each table's ids (all features of one table share one
   lookup of their distinct ids, `IdGroups`: first-occurrence order, with the map back);
2. `fetch`: look up the distinct rows in the store and stage them on the module's device
   (several tables in one `lookup_many` call);
3. `run`: pool the rows with torch (`torch.embedding_bag`, the kernel behind
   torch.nn.EmbeddingBag) and, when training, connect the result to autograd.

A batch of mostly distinct ids pooled by "sum" on the CPU skips the copy of steps 2-3: `run`
pools straight from the store's DRAM tier (`pool_in_store`), with torch's additions in
torch's order, so the result is the same bits.

The backward pass turns the pooled gradient into one gradient row per input position (scaled
by its per-sample weight, divided by its bag's size for "mean"; "max" routes each column to
the row that won it), sums the rows of each distinct id in position order, and hands them to
the table's fused optimizer (`EmbeddingStore._apply_summed_gradients` for a local store: the
ids are distinct and the sums were checked finite as they were made; `apply_gradients` or
`apply_gradients_many` for any other, a sharded one). That is bit for bit the store's own
``apply_gradients(ids, per_position_grads)``: no dense [num_embeddings, dim] gradient exists,
and there is nothing for a torch optimizer to step. The store steps the rows at the slots its
lookup found (`SlotMemo`), without probing its index again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidValuesError
from ..index import IdGroups
from ..store import EmbeddingStore
from ._bags import pool_rows_in_store, summed_bag_grads
from ._inputs import BagInput
from ._plans import FeaturePlan, ForwardPlan, TablePlan

__all__ = ["MODES", "FeaturePlan", "ForwardPlan", "TablePlan", "fetch", "pool_in_store",
           "prepare", "run"]

MODES = {"sum": 0, "mean": 1, "max": 2}
"""Pooling modes, with torch.embedding_bag's code for each; "none" (unpooled) is extra."""

# one leaf that requires grad, so that autograd calls the backward of a lookup whose inputs
# need no gradient of their own; its gradient is always None, so nothing accumulates on it
_TRIGGER = torch.zeros((), requires_grad=True)


def prepare(args: tuple[Any, ...], features: Sequence[tuple[str, str, BagInput]],
            padding_idx: int | None) -> ForwardPlan:
    """Group the ids of `features` ((name, table, bags), in output order) by table."""
    by_table: dict[str, list[tuple[str, BagInput]]] = {}
    for name, table, bags in features:
        by_table.setdefault(table, []).append((name, bags))
    tables = []
    for table, feats in by_table.items():
        plans, parts, start = [], [], 0
        for name, bags in feats:
            plans.append(FeaturePlan(name, bags, start))
            parts.append(bags.ids)
            start += len(bags.ids)
        ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        groups = IdGroups(np.ascontiguousarray(ids))
        padding = None
        if padding_idx is not None:
            hit = np.flatnonzero(groups.unique == padding_idx)
            padding = int(hit[0]) if len(hit) else None
        tables.append(TablePlan(table, plans, groups, padding, ids=ids))
    return ForwardPlan(args, tables, [name for name, _, _ in features])


def lookup_rows(store: EmbeddingStore, table: str, ids: np.ndarray,
                accessed: np.ndarray | None = None) -> torch.Tensor:
    """Rows of distinct `ids` from the store as a C-contiguous CPU tensor [len(ids), dim].

    `accessed`: the batch's ids with their repeats, for a store's access log.
    """
    rows = (store.lookup(table, ids) if accessed is None
            else store.lookup(table, ids, accessed=accessed))
    return torch.from_numpy(np.ascontiguousarray(rows))


def pool_in_store(store: Any, plan: ForwardPlan, mode: str, device: torch.device) -> None:
    """Mark the tables of `plan` that `run` may pool straight from the store's DRAM tier.

    Those not staged, pooled by "sum" on the CPU without per-sample weights or a padding id
    in the batch, of a local store: the pooling reads the rows where they lie (the same
    additions as torch.embedding_bag over a copy), and no copy of them is made. Where the
    store's top tier turns out not to hold them all, `run` looks them up after all.

    Only batches whose ids are mostly distinct (at least half): pooling in place reads a
    scattered table row per position, where a lookup reads each distinct row once and the
    pooling then reads a compact copy, which the cache holds better when rows repeat (on
    10M x 64 rows, bags of 20: 5-9% faster with uniform ids, 0-8% slower with Zipf ids).
    """
    if mode != "sum" or device.type != "cpu" or not isinstance(store, EmbeddingStore):
        return
    for tp in plan.tables:
        if tp.rows is None and tp.padding is None and all(
                fp.bags.per_sample_weights is None for fp in tp.features) and \
                2 * len(tp.groups.unique) >= len(tp.groups.inverse):
            tp.in_store = True


def fetch(store: Any, plan: ForwardPlan, device: torch.device) -> None:
    """Look up the distinct rows of every table of `plan` not staged yet; onto `device`."""
    todo = [tp for tp in plan.tables if tp.rows is None and not tp.in_store]
    many = None
    collective = getattr(store, "collective", False)
    # an access log records the batch as the model used it, repeats included
    recording = getattr(store, "records_accesses", False)
    if (len(todo) > 1 and hasattr(store, "lookup_many")) or (todo and collective):
        # one call for all tables: one exchange for a sharded store, one lock and one
        # check of the inputs for a local one
        requests = {tp.table: tp.groups.unique for tp in todo}
        many = (store.lookup_many(requests, accessed={tp.table: tp.ids for tp in todo})
                if recording else store.lookup_many(requests))
    for tp in todo:
        rows = (lookup_rows(store, tp.table, tp.groups.unique,
                            tp.ids if recording else None) if many is None
                else torch.from_numpy(np.ascontiguousarray(many[tp.table])))
        inverse = torch.from_numpy(tp.groups.inverse)
        if device.type != "cpu":
            rows, inverse = rows.to(device), inverse.to(device)
        tp.rows, tp.inverse = rows, inverse


# --- pooling -------------------------------------------------------------------------------

def _pool(rows: torch.Tensor, inverse: torch.Tensor, fp: FeaturePlan, mode: str,
          padding: int | None) -> tuple[torch.Tensor, ...]:
    """Pool one feature with torch.embedding_bag over the distinct rows.

    Returns (pooled [B, dim], offset2bag, bag_size, max_indices), as torch gives them.
    """
    n = len(fp.bags.ids)
    inv = inverse[fp.start: fp.start + n]
    offsets = torch.from_numpy(fp.bags.offsets).to(rows.device)
    return torch.embedding_bag(rows, inv, offsets, False, MODES[mode], False,
                               fp.bags.per_sample_weights, True, padding)


def _unpooled(rows: torch.Tensor, inverse: torch.Tensor, fp: FeaturePlan,
              padding: int | None) -> torch.Tensor:
    n = len(fp.bags.ids)
    inv = inverse[fp.start: fp.start + n]
    out = rows.index_select(0, inv)
    if padding is not None:
        out = out.masked_fill((inv == padding)[:, None], 0.0)
    return out


def _forward_outputs(tp: TablePlan, mode: str, store: Any = None
                     ) -> tuple[list[torch.Tensor], list[Any]]:
    if tp.in_store:
        in_place = pool_rows_in_store(store, tp)
        if in_place is not None:
            # "sum" pooling keeps nothing for backward (the bag sizes serve "mean" alone)
            return in_place, [(None, None, None) for _ in tp.features]
        tp.in_store = False  # the top tier lacks some rows: look them up after all
        fetch(store, ForwardPlan((), [tp], []), torch.device("cpu"))
    assert tp.rows is not None and tp.inverse is not None
    outs: list[torch.Tensor] = []
    saved: list[Any] = []
    for fp in tp.features:
        if mode == "none":
            outs.append(_unpooled(tp.rows, tp.inverse, fp, tp.padding))
            saved.append(None)
        else:
            pooled, offset2bag, bag_size, max_indices = _pool(tp.rows, tp.inverse, fp, mode,
                                                              tp.padding)
            outs.append(pooled)
            saved.append((offset2bag, bag_size, max_indices))
    return outs, saved


# --- backward ------------------------------------------------------------------------------

def _position_grads(tp: TablePlan, fp: FeaturePlan, mode: str, grad: torch.Tensor,
                    saved: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of each position of one feature [N, dim], and of its per-sample weights."""
    assert tp.rows is not None and tp.inverse is not None
    n = len(fp.bags.ids)
    inv = tp.inverse[fp.start: fp.start + n]
    if mode == "none":
        return grad.reshape(n, grad.shape[-1]), None  # [..., dim]; n may be 0
    _, bag_size, _ = saved
    # torch's sum mode leaves offset2bag empty: the bag of each position, from the offsets
    offsets = fp.bags.offsets
    offset2bag = torch.from_numpy(np.repeat(np.arange(len(offsets) - 1), np.diff(offsets)))
    offset2bag = offset2bag.to(grad.device)
    per_bag = grad.index_select(0, offset2bag)
    if mode == "mean":
        per_bag = per_bag / bag_size.index_select(0, offset2bag).clamp(min=1)[:, None] \
            .to(grad.dtype)
    psw_grad = None
    psw = fp.bags.per_sample_weights
    if psw is not None:
        if psw.requires_grad:
            psw_grad = (per_bag * tp.rows.index_select(0, inv)).sum(dim=1)
            if tp.padding is not None:
                psw_grad = psw_grad.masked_fill(inv == tp.padding, 0.0)
        per_bag = per_bag * psw.detach()[:, None]
    return per_bag, psw_grad


def _weight_grad(tp: TablePlan, fp: FeaturePlan, grad: torch.Tensor) -> torch.Tensor | None:
    """The gradient of one feature's per-sample weights [N] ("sum" pooling)."""
    psw = fp.bags.per_sample_weights
    if psw is None or not psw.requires_grad:
        return None
    assert tp.rows is not None and tp.inverse is not None
    inv = tp.inverse[fp.start: fp.start + len(fp.bags.ids)]
    offsets = fp.bags.offsets
    bag_of = torch.from_numpy(np.repeat(np.arange(len(offsets) - 1), np.diff(offsets)))
    wg = (grad.index_select(0, bag_of) * tp.rows.index_select(0, inv)).sum(dim=1)
    if tp.padding is not None:
        wg = wg.masked_fill(inv == tp.padding, 0.0)
    return wg


def _max_grads(tp: TablePlan, grad: torch.Tensor, saved: Any) -> torch.Tensor:
    """Per distinct row [U, dim]: each pooled column's gradient goes to the row that won it."""
    assert tp.rows is not None
    _, bag_size, max_indices = saved
    out = torch.zeros_like(tp.rows)
    if not len(out):  # every bag empty: no row won anything
        return out
    won = (bag_size > 0)[:, None]  # an empty bag has no winner (torch reports row 0)
    return out.scatter_add_(0, max_indices, grad * won)


def _distinct_grads(tp: TablePlan, grads: np.ndarray, *, summed: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Sum `grads` per distinct id: (distinct ids, their gradients).

    `grads` are per position ([N, dim]) or, with `summed`, per distinct id already; the
    padding id is left out.
    """
    unique = tp.groups.unique
    if not summed:
        grads = tp.groups.sum_rows(grads) if tp.groups.has_duplicates else grads
    if tp.padding is not None:
        keep = np.ones(len(unique), dtype=bool)
        keep[tp.padding] = False
        unique, grads = unique[keep], grads[keep]
    return unique, np.ascontiguousarray(grads)


def _max_position_grads(tp: TablePlan, grad: torch.Tensor, saved: Any
                        ) -> tuple[np.ndarray, np.ndarray]:
    """"max" pooling's gradients one row per (bag, row that won a column of it), bag order.

    Returns (indices into ``tp.groups.unique``, gradients [P, dim]) with the columns a row did
    not win left zero. Summed in order from zero, they give `_max_grads` bit for bit (the
    scatter adds each bag's columns in bag order; adding a zero changes no sum that starts
    from +0.0); the padding row is left out.
    """
    assert tp.rows is not None
    _, bag_size, max_indices = saved
    n_rows = len(tp.rows)
    dim = grad.shape[-1]
    winners = max_indices.detach().cpu().numpy().astype(np.int64, copy=False)
    won = bag_size.detach().cpu().numpy() > 0  # an empty bag has no winner
    if not n_rows or not won.any():
        return np.empty(0, np.int64), np.empty((0, dim), np.float32)
    bags = np.flatnonzero(won)
    keys = np.unique((bags[:, None] * n_rows + winners[bags]).reshape(-1))  # bag, then row
    bag, row = keys // n_rows, keys % n_rows
    if tp.padding is not None:
        keep = row != tp.padding
        bag, row = bag[keep], row[keep]
    g = grad.detach().cpu().numpy()
    rows = np.where(winners[bag] == row[:, None], g[bag], np.zeros((), g.dtype))
    return row, np.ascontiguousarray(rows)


def _position_update(tp: TablePlan, mode: str, grads: tuple[torch.Tensor, ...],
                     saved: list[Any]
                     ) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor | None]]:
    """One table's backward as one gradient row per position, in position order.

    Returns (the id of each position, repeats kept and padding positions left out, their
    gradients, the per-sample weights' grads). For a rank of a sharded store other than rank
    0: its owners add each position's row in the global position order, as one store given
    every rank's batch would; summed per id here first, a rank's sum would be added as one
    term and the result would differ in the last bits.
    """
    weight_grads: list[torch.Tensor | None] = []
    rows_of, parts = [], []
    for fp, g, sv in zip(tp.features, grads, saved, strict=True):
        if mode == "max":
            row, part = _max_position_grads(tp, g, sv)
            rows_of.append(row)
            parts.append(part)
            continue
        pos, wg = _position_grads(tp, fp, mode, g, sv)
        inverse = tp.groups.inverse[fp.start: fp.start + len(fp.bags.ids)]
        part = pos.detach().cpu().numpy()
        if tp.padding is not None:
            keep = inverse != tp.padding
            inverse, part = inverse[keep], part[keep]
        rows_of.append(inverse)
        parts.append(part)
        if fp.bags.per_sample_weights is not None:
            weight_grads.append(wg)
    row = rows_of[0] if len(rows_of) == 1 else np.concatenate(rows_of)
    grad = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return tp.groups.unique[row], np.ascontiguousarray(grad), weight_grads


def _table_update(tp: TablePlan, mode: str, grads: tuple[torch.Tensor, ...], saved: list[Any],
                  *, per_position: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor | None], bool]:
    """One table's backward.

    Returns (distinct ids, their gradients, per-sample weights' grads, whether the
    gradients were seen finite); with `per_position`, the ids of every position and their
    gradients instead (`_position_update`), not seen finite.
    """
    if per_position:
        return (*_position_update(tp, mode, grads, saved), False)
    weight_grads: list[torch.Tensor | None] = []
    if mode == "max":
        total = None
        for g, sv in zip(grads, saved, strict=True):
            part = _max_grads(tp, g, sv)
            total = part if total is None else total + part
        assert total is not None
        unique, distinct = _distinct_grads(tp, total.detach().cpu().numpy(), summed=True)
        return unique, distinct, weight_grads, False
    if mode != "none" and all(g.device.type == "cpu" and g.dtype == torch.float32
                              for g in grads):
        for fp, g in zip(tp.features, grads, strict=True):
            if fp.bags.per_sample_weights is not None:
                weight_grads.append(_weight_grad(tp, fp, g))
        summed, finite = summed_bag_grads(tp, mode, grads, saved)
        unique, distinct = _distinct_grads(tp, summed, summed=True)
        return unique, distinct, weight_grads, finite
    parts = []
    for fp, g, sv in zip(tp.features, grads, saved, strict=True):
        pos, wg = _position_grads(tp, fp, mode, g, sv)
        parts.append(pos)
        if fp.bags.per_sample_weights is not None:
            weight_grads.append(wg)
    pos_all = parts[0] if len(parts) == 1 else torch.cat(parts)
    if tp.padding is not None:
        assert tp.inverse is not None
        pos_all = pos_all.masked_fill((tp.inverse == tp.padding)[:, None], 0.0)
    unique, distinct = _distinct_grads(tp, np.ascontiguousarray(pos_all.detach().cpu().numpy()),
                                       summed=False)
    return unique, distinct, weight_grads, False


def _apply(store: Any, updates: dict[str, tuple[np.ndarray, np.ndarray]], finite: bool
           ) -> None:
    """Hand the gradients to the store: one call for every table.

    A local store takes them summed per distinct id and, with `finite`, unscanned; any other
    store (a sharded one) through its public calls, on a sharded store's ranks other than 0
    one per position (`_position_update`).
    """
    if isinstance(store, EmbeddingStore):
        store._apply_summed_gradients(updates, finite=finite)
    elif len(updates) == 1 and not hasattr(store, "apply_gradients_many"):
        [(table, (unique, grads))] = updates.items()
        store.apply_gradients(table, unique, grads)
    else:
        store.apply_gradients_many(updates)


def _graph_token() -> torch.Tensor:
    """An empty tensor saved for backward, so that autograd frees it with the graph.

    A second backward through a graph already freed (no ``retain_graph``) then raises torch's
    own error when the backward reads it, as it does for torch.nn.EmbeddingBag, instead of
    applying the table's optimizer a second time.
    """
    return torch.empty(0)


class _NoSecondOrder(torch.autograd.Function):
    """The per-sample weights' gradients as given, on a node whose backward refuses.

    They depend on the table's rows, which live in the store where autograd does not see
    them: differentiated again (``create_graph=True``, as for a gradient penalty), they would
    silently lose that dependence. torch.nn.EmbeddingBag refuses the same when it is reached.
    """

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, *grads: torch.Tensor) -> Any:
        return grads

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise InvalidValuesError(
            "the gradient of per_sample_weights cannot be differentiated again (a backward "
            "through a gradient taken with create_graph=True): it depends on the table's rows, "
            "which live in the store, outside autograd; take it without create_graph"
        )


def _first_order(weight_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """`weight_grads`, made to refuse a second differentiation when a graph of them is built.

    Autograd builds one when the backward runs with ``create_graph=True``, which enables grad
    mode inside it.
    """
    given = [g for g in weight_grads if g is not None]
    if not given or not torch.is_grad_enabled():
        return weight_grads
    # _TRIGGER requires grad: the outputs get this node even when `given` has no graph
    wrapped = iter(_NoSecondOrder.apply(_TRIGGER, *given))  # type: ignore[no-untyped-call]
    return [None if g is None else next(wrapped) for g in weight_grads]


class _TableFunction(torch.autograd.Function):
    """Forward: pooled outputs of one table's features. Backward: the store's update."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, store: EmbeddingStore, tp: TablePlan,
                mode: str, *weights: torch.Tensor) -> Any:
        outs, saved = _forward_outputs(tp, mode, store)
        ctx.store, ctx.tp, ctx.mode, ctx.saved = store, tp, mode, saved
        ctx.set_materialize_grads(True)
        ctx.save_for_backward(_graph_token())
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.saved_tensors  # noqa: B018  # torch raises here on a second pass through a freed graph
        unique, distinct, weight_grads, finite = _table_update(ctx.tp, ctx.mode, grads,
                                                               ctx.saved)
        _apply(ctx.store, {ctx.tp.table: (unique, distinct)}, finite)
        return (None, None, None, None, *_first_order(weight_grads))


class _TablesFunction(torch.autograd.Function):
    """All tables of a forward, with one update call (`apply_gradients_many`) in backward.

    A collective (sharded) store updates every table, so that every rank makes the same
    collective calls in the same order, one exchange a step. A local store updates the tables
    whose outputs got a gradient, as one `_TableFunction` per table would, in one call.
    """

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, store: Any, tps: list[TablePlan],
                mode: str, *weights: torch.Tensor) -> Any:
        outs, saved = [], []
        for tp in tps:
            o, sv = _forward_outputs(tp, mode, store)
            outs += o
            saved.append(sv)
        ctx.store, ctx.tps, ctx.mode, ctx.saved = store, tps, mode, saved
        ctx.collective = bool(getattr(store, "collective", False))
        # rank 0's sum per id is where the global sum stands after its positions; any later
        # rank's positions must reach the owners one by one (`_position_update`)
        ctx.per_position = ctx.collective and getattr(store, "rank", 0) != 0
        ctx.set_materialize_grads(ctx.collective)
        ctx.outputs = [(o.shape, o.dtype, o.device) for o in outs]
        ctx.save_for_backward(_graph_token())
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.saved_tensors  # noqa: B018  # torch raises here on a second pass through a freed graph
        updates: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        weight_grads: list[torch.Tensor | None] = []
        finite = True
        at = 0
        for tp, saved in zip(ctx.tps, ctx.saved, strict=True):
            n = len(tp.features)
            mine = grads[at: at + n]
            at += n
            if all(g is None for g in mine):  # no output of the table reached the loss
                weight_grads += [None for fp in tp.features
                                 if fp.bags.per_sample_weights is not None]
                continue
            # an output without a gradient counts as zeros, as autograd would give them
            full = tuple(torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                         for g, (shape, dtype, device)
                         in zip(mine, ctx.outputs[at - n: at], strict=True))
            unique, distinct, wg, seen_finite = _table_update(tp, ctx.mode, full, saved,
                                                              per_position=ctx.per_position)
            updates[tp.table] = (unique, distinct)
            weight_grads += wg
            finite = finite and seen_finite
        if updates:
            _apply(ctx.store, updates, finite)
        return (None, None, None, None, *_first_order(weight_grads))


def run(store: EmbeddingStore, plan: ForwardPlan, mode: str, *, train: bool
        ) -> list[torch.Tensor]:
    """Outputs of every feature of `plan`, in the order the plan's features were given.

    With `train`, the outputs are connected to autograd and their backward updates the store.
    """
    outs: dict[str, torch.Tensor] = {}
    for tp in plan.tables:
        if tp.ready is not None:  # staged on a side stream: wait for the copy, and keep
            # the allocator from reusing the memory while this stream still reads it
            assert tp.rows is not None and tp.inverse is not None
            stream = torch.cuda.current_stream(tp.rows.device)
            stream.wait_event(tp.ready)
            tp.rows.record_stream(stream)
            tp.inverse.record_stream(stream)
            tp.ready = None
    if train and ((len(plan.tables) > 1 and hasattr(store, "apply_gradients_many"))
                  or getattr(store, "collective", False)):
        weights = [fp.bags.per_sample_weights for tp in plan.tables for fp in tp.features
                   if fp.bags.per_sample_weights is not None]
        results = _TablesFunction.apply(  # type: ignore[no-untyped-call]
            _TRIGGER, store, plan.tables, mode, *weights)
        for fp, out in zip([fp for tp in plan.tables for fp in tp.features], results,
                           strict=True):
            outs[fp.name] = out
        return [outs[name] for name in plan.order]
    for tp in plan.tables:
        if train:
            weights = [fp.bags.per_sample_weights for fp in tp.features
                       if fp.bags.per_sample_weights is not None]
            results = _TableFunction.apply(  # type: ignore[no-untyped-call]
                _TRIGGER, store, tp, mode, *weights)
        else:
            results, _ = _forward_outputs(tp, mode, store)
        for fp, out in zip(tp.features, results, strict=True):
            outs[fp.name] = out
    return [outs[name] for name in plan.order]
