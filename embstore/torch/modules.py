"""torch.nn modules whose embedding tables live in an embstore store.

The modules hold no parameters: a forward looks up the rows it needs in the store, and in
training the backward applies each table's fused optimizer in the store: one step per
backward through each forward call (two calls reading one table in one loss are two steps,
not one step of their summed gradients as with torch.optim). A model that holds
them saves its dense part with ``torch.save(model.state_dict())`` as usual and its tables with
``store.checkpoint``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, SupportsIndex, TypeVar, cast

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, EmbstoreError, InvalidIdsError, InvalidValuesError, brief
from ..store import EmbeddingStore
from ._core import MODES, ForwardPlan, fetch, pool_in_store, prepare, run
from ._inputs import BagInput, bag_input, check_tensor, flat_ids, integer_tensor, jagged_input

_F = TypeVar("_F", bound=Callable[..., Any])
_run_eagerly = cast(Callable[[_F], _F], torch.compiler.disable)
"""Under torch.compile, run the decorated method eagerly (a graph break) and compile what is
around it: dynamo cannot trace the store's locks, files and cffi kernels (it failed on them)."""

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "KeyedEmbeddings"]


_INT64 = np.iinfo(np.int64)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def _mode(mode: object) -> str:
    """`mode` as a plain str (np.str_ and other str subclasses too), if one of `MODES`.

    Raises:
        ConfigError: anything else, unhashable values (a list, a numpy array) included.
    """
    if isinstance(mode, str) and str(mode) in MODES:
        return str(mode)
    raise ConfigError(f"mode must be one of {sorted(MODES)}, got {mode!r}")


def _check_flag(name: str, value: object, *, or_none: bool = False) -> None:
    """Refuse a `value` for the switch `name` that is not a bool (or None, with `or_none`).

    Nothing is read for its truth: "no" or 0 is no more False than [] is.

    Raises:
        ConfigError: `value` is not True or False (nor None where None is allowed).
    """
    if isinstance(value, bool) or (or_none and value is None):
        return
    accepted = "True, False or None" if or_none else "True or False"
    raise ConfigError(f"{name} must be {accepted}, got {value!r}")


def _as_index(value: Any) -> int | None:
    """`value` as a plain int where it is an integer of any kind (np.int64 too), else None.

    As torch takes: ``operator.index``, but a bool is a switch, never an id.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _same(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are the very same arguments (identity of every tensor)."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return False


def _tensors(args: Any) -> list[torch.Tensor]:
    """Every tensor in `args`, in a fixed order (a torchrec KeyedJaggedTensor's too)."""
    out: list[torch.Tensor] = []
    stack = [args]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            stack.extend(reversed(a))
        elif isinstance(a, Mapping):
            stack.extend(reversed(list(a.values())))
        elif all(callable(getattr(a, m, None)) for m in ("keys", "values", "lengths")):
            # a torchrec KeyedJaggedTensor, as EmbeddingBagCollection reads it
            stack.extend([a.values(), a.lengths(), getattr(a, "weights_or_none",
                                                           lambda: None)()])
    return out


def _snapshot(args: Any) -> list[Any]:
    """What shows a change of the tensors in `args`: CPU ones copied, others' versions.

    A plan made ahead of its forward serves it only while `_unchanged` holds: a step that
    edits its batch's ids in place gets them read anew, as the loop without a pipeline would.
    On the CPU a copy, not torch's version counter: an edit through a numpy view of the
    tensor bumps no counter, and tensors made in inference mode have none. A device tensor
    without a counter gets a fresh object, so never matches.
    """
    out: list[Any] = []
    for t in _tensors(args):
        if t.device.type == "cpu":
            out.append(t.detach().clone())
            continue
        out.append(_version(t))
    return out


def _unchanged(snapshot: list[Any] | None, args: Any) -> bool:
    """Whether the tensors of `args` hold what they held when `snapshot` was taken."""
    tensors = _tensors(args)
    if snapshot is None or len(snapshot) != len(tensors):
        return False
    for then, now in zip(snapshot, tensors, strict=True):
        if isinstance(then, torch.Tensor):
            if not (now.device.type == "cpu" and then.dtype == now.dtype
                    and then.shape == now.shape and torch.equal(then, now.detach())):
                return False
        elif now.device.type == "cpu" or _version(now) != then:
            return False
    return True


def _version(t: torch.Tensor) -> Any:
    try:
        return t._version
    except RuntimeError:  # no counter: never the same
        return object()


class _StoreModule(nn.Module):
    """Common base: the store, the device, and the plan staged by a pipeline."""

    def __init__(self, store: Any, tables: list[str], padding_idx: SupportsIndex | None,
                 mode: str) -> None:
        super().__init__()
        if not isinstance(store, EmbeddingStore) and not all(
                callable(getattr(store, m, None))
                for m in ("lookup", "apply_gradients", "table_spec")):
            # any store with EmbeddingStore's lookup/apply_gradients/table_spec will do,
            # such as embstore.distributed's sharded store (whose calls are collective)
            raise ConfigError(f"store must be an open embstore.EmbeddingStore, got "
                              f"{type(store).__name__}")
        for table in tables:  # before any store's lookup of the name (a dict's, unhashable)
            if not isinstance(table, str):
                raise ConfigError(f"table must be a table name (a str), got {table!r}")
        self.store = store
        self.mode = mode if mode == "none" else _mode(mode)  # "none": Embedding's, unpooled
        self._specs = {t: store.table_spec(t) for t in tables}  # UnknownTableError
        dtypes = {s.dtype for s in self._specs.values()}
        if len(dtypes) != 1:
            raise ConfigError(f"tables of one module must share a dtype, got "
                              f"{sorted(map(str, dtypes))}")
        self._dtype = _torch_dtype(dtypes.pop())
        self.padding_idx = self._padding(padding_idx)
        # no tensors of the module's own: the anchor only follows .to(device) and is not saved
        self.register_buffer("_anchor", torch.empty(0), persistent=False)
        self._staged: ForwardPlan | None = None

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # pickle, copy.deepcopy and torch.save(model) all come here; the store (its locks,
        # files, threads) cannot travel, and pickle's own TypeError names only an RLock
        raise ConfigError(
            f"{type(self).__name__} holds an open store, which cannot be pickled or copied "
            "(pickle, copy.deepcopy, torch.save of the model): save the dense part with "
            "torch.save(model.state_dict()) and the tables with store.checkpoint(...), and "
            "build the model anew over the restored store to load them"
        )

    def _padding(self, given: SupportsIndex | None) -> int | None:
        """`given` as a plain int id of the tables (negative: counted from num_embeddings).

        Raises:
            ConfigError: not an integer (a bool neither), or no id the tables can hold.
        """
        if given is None:
            return None
        padding_idx = _as_index(given)
        if padding_idx is None:
            raise ConfigError(f"padding_idx must be an int or None, got {given!r}")
        if not _INT64.min <= padding_idx <= _INT64.max:  # no id could ever match it
            raise ConfigError(f"padding_idx {padding_idx} is outside int64, the range of ids")
        if padding_idx < 0:
            sizes = {s.num_embeddings for s in self._specs.values()}
            if len(sizes) != 1 or None in sizes:
                raise ConfigError("a negative padding_idx counts from num_embeddings; declare "
                                  "num_embeddings in the TableSpec or give a non-negative id")
            n = sizes.pop()
            assert n is not None
            if padding_idx < -n:
                raise ConfigError(f"padding_idx {padding_idx} is below -num_embeddings ({-n})")
            padding_idx += n
        for spec in self._specs.values():
            if spec.num_embeddings is not None and padding_idx >= spec.num_embeddings:
                raise ConfigError(f"padding_idx {padding_idx} is outside table {spec.name!r} "
                                  f"(num_embeddings {spec.num_embeddings})")
        return padding_idx

    @property
    def device(self) -> torch.device:
        """The device outputs are on (follows ``module.to(device)``)."""
        anchor: torch.Tensor = self.get_buffer("_anchor")
        return anchor.device

    def _features(self, args: tuple[Any, ...]) -> list[tuple[str, str, BagInput]]:
        """(feature, table, bags) of each output, in output order; checks the arguments."""
        raise NotImplementedError

    _arity = (1, 1)
    """The forward's fewest and most positional arguments."""

    def _call_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` as forward passes them on: every optional argument given (None if left out)."""
        low, high = self._arity
        if not low <= len(args) <= high:
            raise ConfigError(f"{type(self).__name__} takes {low} to {high} arguments, got "
                              f"{len(args)}")
        return (*args, *[None] * (high - len(args)))

    def prepare_forward(self, *args: Any) -> ForwardPlan:
        """Check `args` (as forward takes them) and group their ids; nothing is read yet.

        For a plan made ahead of the forward (a pipeline's): the forward uses it only if
        the tensors of its arguments still hold what they held here.
        """
        snapshot = _snapshot(args)  # before the ids are read: a change meanwhile shows
        plan = self._plan(args)
        plan.snapshot = snapshot
        return plan

    def _plan(self, args: tuple[Any, ...]) -> ForwardPlan:
        args = self._call_args(args)
        return prepare(args, self._features(args), self.padding_idx)

    def fetch_forward(self, plan: ForwardPlan) -> None:
        """Look up the rows `plan` needs and put them on the module's device."""
        fetch(self.store, plan, self.device)

    def stage(self, plan: ForwardPlan) -> None:
        """Serve the next forward with exactly `plan.args` from `plan` (used by pipelines)."""
        self._staged = plan

    @_run_eagerly
    def _outputs(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        plan = self._staged
        if plan is not None and _same(plan.args, args) and _unchanged(plan.snapshot, args):
            self._staged = None
            if plan.catch_up is not None:
                plan.catch_up(self, plan)
        else:
            try:
                plan = self._plan(args)
            except Exception as exc:
                if getattr(self.store, "collective", False):
                    # the other ranks' forwards wait in their lookup: this rank's place in it
                    # says it rejected its input, so every rank raises now and in step
                    self.store.reject("lookup_many", exc)
                raise
        pool_in_store(self.store, plan, self.mode, self.device)
        self.fetch_forward(plan)  # what a pipeline did not stage, nor the store pools
        return run(self.store, plan, self.mode, train=self.training and torch.is_grad_enabled())


class EmbeddingBag(_StoreModule):
    """Pooled lookups of one store table, with torch.nn.EmbeddingBag's calling convention.

    The backward pass applies the table's fused optimizer (its `TableSpec.optimizer`) in the
    store; no dense gradient exists and the module has no parameters for a torch optimizer.
    Every backward through an output is one optimizer step of the table, even a
    ``torch.autograd.grad`` with respect to per_sample_weights alone; their gradient cannot be
    differentiated again (``create_graph=True``). Forward in ``eval()`` mode or under
    ``torch.no_grad()`` changes nothing in the store.

    Args:
        store: an open store.
        table: the table's name.
        mode: "sum", "mean" or "max".
        padding_idx: an id excluded from every bag and never updated (negative: counted
            from the table's num_embeddings).
        include_last_offset: offsets carry a last element, the input's length (as torch).

    Example::

        bag = embstore.torch.EmbeddingBag(store, "user", mode="sum")
        pooled = bag(torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 2]))  # [2, dim]
        pooled.sum().backward()                                           # updates the store

    Raises:
        UnknownTableError: no such table. ConfigError: a bad table name (not a str), mode,
        padding_idx or include_last_offset (not a bool).
    """

    _arity = (1, 3)  # input, offsets, per_sample_weights

    def __init__(self, store: EmbeddingStore, table: str, mode: str = "mean",
                 padding_idx: SupportsIndex | None = None,
                 include_last_offset: bool = False) -> None:
        mode = _mode(mode)
        _check_flag("include_last_offset", include_last_offset)
        super().__init__(store, [table], padding_idx, mode)
        self.table = table
        self.include_last_offset = include_last_offset
        spec = self._specs[table]
        self.embedding_dim = spec.dim
        self.num_embeddings = spec.num_embeddings

    def _features(self, args: tuple[Any, ...]) -> list[tuple[str, str, BagInput]]:
        input, offsets, weights = args
        bags = bag_input(input, offsets, weights, mode=self.mode,
                         include_last_offset=self.include_last_offset, device=self.device,
                         dtype=self._dtype)
        return [("", self.table, bags)]

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pool the rows of each bag.

        Args:
            input: LongTensor [N] of ids with `offsets`, or [B, L] (B bags of L ids).
            offsets: LongTensor [B] where each bag starts ([B + 1] with include_last_offset).
            per_sample_weights: [N] (or [B, L]) weights of the table dtype, "sum" mode only.

        Returns:
            Tensor [B, embedding_dim] on the module's device.

        Raises:
            InvalidIdsError, InvalidValuesError, DeviceMismatchError: bad arguments (the
            store is unchanged).
        """
        return self._outputs((input, offsets, per_sample_weights))[0]

    def extra_repr(self) -> str:
        """The table and shape, for print(module)."""
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}, mode={self.mode!r}"


class Embedding(_StoreModule):
    """Unpooled lookups of one store table: torch.nn.Embedding's calling convention.

    Args:
        store: an open store.
        table: the table's name.
        padding_idx: an id whose output is zeros and which is never updated.

    Example::

        emb = embstore.torch.Embedding(store, "item")
        rows = emb(torch.tensor([[1, 2], [3, 1]]))   # [2, 2, dim]
    """

    def __init__(self, store: EmbeddingStore, table: str,
                 padding_idx: SupportsIndex | None = None) -> None:
        super().__init__(store, [table], padding_idx, "none")
        self.table = table
        spec = self._specs[table]
        self.embedding_dim = spec.dim
        self.num_embeddings = spec.num_embeddings

    def _features(self, args: tuple[Any, ...]) -> list[tuple[str, str, BagInput]]:
        ids = flat_ids("input", args[0], self.device)
        return [("", self.table, BagInput(ids, np.zeros(0, dtype=np.int64), None))]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Rows of `input`.

        Args:
            input: LongTensor of ids, any shape [*].

        Returns:
            Tensor [*, embedding_dim] on the module's device.
        """
        if not isinstance(input, torch.Tensor):
            raise InvalidIdsError(f"input must be a torch.Tensor of ids, got "
                                  f"{type(input).__name__}")
        out = self._outputs((input,))[0]
        return out.reshape(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        """The table and shape, for print(module)."""
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}"


class KeyedEmbeddings:
    """Pooled embeddings of several features side by side, like TorchRec's KeyedTensor.

    `values()` is [B, sum of the features' dims]; feature k occupies the columns
    ``offset_per_key()[k]:offset_per_key()[k + 1]``.
    """

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: list[int]) -> None:
        self._keys = keys
        self._values = values
        self._lengths = lengths
        self._offsets = [0, *np.cumsum(lengths).tolist()]

    def keys(self) -> list[str]:
        """Feature names, in column order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """[B, sum of dims]: every feature's pooled rows, concatenated in key order."""
        return self._values

    def length_per_key(self) -> list[int]:
        """The embedding dim of each feature."""
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        """Column where each feature starts, plus the total width."""
        return list(self._offsets)

    def __getitem__(self, key: str) -> torch.Tensor:
        """[B, dim] of one feature (a view of `values()`).

        Raises:
            KeyError: no feature `key` (as torchrec's KeyedTensor raises).
        """
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"no feature {key!r} among {self._keys}") from None
        return self._values[:, self._offsets[k]: self._offsets[k + 1]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """{feature: [B, dim]}."""
        return {k: self[k] for k in self._keys}

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __repr__(self) -> str:
        return f"KeyedEmbeddings(keys={self._keys}, values={tuple(self._values.shape)})"


def _jagged_part(what: str, part: object, device: torch.device,
                 error: type[EmbstoreError] = InvalidIdsError) -> torch.Tensor:
    """A KeyedJaggedTensor's `what` ("values", ...), checked before it is cut per key."""
    if not isinstance(part, torch.Tensor):
        raise error(f"the KeyedJaggedTensor's {what}() must be a torch.Tensor, got "
                    f"{type(part).__name__}")
    check_tensor(f"the KeyedJaggedTensor's {what}()", part, device, error)
    return part


def _keyed_jagged(features: Any, device: torch.device) -> dict[str, tuple[Any, Any, Any]]:
    """{key: (values, lengths, weights or None)} of a torchrec KeyedJaggedTensor.

    Duck-typed: torchrec need not be installed. Checks what the dict form's checks cannot see
    once the tensor is cut per key: str keys, one key once, lengths that split evenly over
    the keys, and values exactly as many as the lengths add up to.
    """
    keys = list(features.keys())
    if not all(isinstance(k, str) for k in keys):  # before a set of them: a list is unhashable
        raise InvalidIdsError(f"the KeyedJaggedTensor's keys must be feature names (str), got "
                              f"{brief(keys)}")
    values = _jagged_part("values", features.values(), device)
    lengths = _jagged_part("lengths", features.lengths(), device)
    weights = getattr(features, "weights_or_none", lambda: None)()
    if weights is not None:
        weights = _jagged_part("weights", weights, device, InvalidValuesError)
    if len(set(keys)) != len(keys):
        raise InvalidIdsError(f"the KeyedJaggedTensor names a key twice: {keys}")
    if not keys:
        return {}
    if lengths.dim() != 1 or not integer_tensor(lengths) or lengths.numel() % len(keys):
        raise InvalidIdsError(f"the KeyedJaggedTensor's lengths (dtype {lengths.dtype}, shape "
                              f"{tuple(lengths.shape)}) do not split into one run per key over "
                              f"its {len(keys)} keys (1-D integers, as many per key)")
    per_key = lengths.reshape(len(keys), -1)
    starts = np.concatenate([[0], np.cumsum(per_key.sum(dim=1).cpu().numpy())])
    if values.dim() != 1 or values.numel() != int(starts[-1]):
        raise InvalidIdsError(f"the KeyedJaggedTensor holds {values.numel()} values (shape "
                              f"{tuple(values.shape)}) but its lengths add up to "
                              f"{int(starts[-1])}")
    return {k: (values[int(starts[i]):int(starts[i + 1])], per_key[i],
                None if weights is None else weights[int(starts[i]):int(starts[i + 1])])
            for i, k in enumerate(keys)}


class EmbeddingBagCollection(_StoreModule):
    """Pooled lookups of several features, each through a store table: TorchRec's shape.

    Features that share a table cost one store lookup of their distinct ids together, and one
    fused update. As with `EmbeddingBag`, every backward through the output is one optimizer
    step of the tables, even a ``torch.autograd.grad`` with respect to per-sample weights alone.

    Args:
        store: an open store.
        tables: {feature: table name}; its order is the output's column order.
        mode: "sum", "mean" or "max", for every feature.
        padding_idx: an id excluded from every bag and never updated.

    Example::

        ebc = embstore.torch.EmbeddingBagCollection(store, {"user": "user", "ad": "ad"})
        out = ebc({"user": (values, lengths), "ad": (values2, lengths2)})
        out.values()     # [B, dim_user + dim_ad]
    """

    def __init__(self, store: EmbeddingStore, tables: Mapping[str, str], mode: str = "sum",
                 padding_idx: SupportsIndex | None = None) -> None:
        mode = _mode(mode)
        if not isinstance(tables, Mapping) or not tables \
                or not all(isinstance(t, str) for t in tables.values()):
            raise ConfigError("tables must be a non-empty mapping {feature: table name}")
        for feature in tables:  # as table names are: inputs and outputs are keyed by str
            if not isinstance(feature, str):
                raise ConfigError(f"feature names must be str, got {type(feature).__name__} "
                                  f"{feature!r}")
        super().__init__(store, sorted(set(tables.values())), padding_idx, mode)
        self.feature_names = list(tables)
        self.tables = dict(tables)
        self.embedding_dims = [self._specs[tables[f]].dim for f in self.feature_names]

    def _features(self, args: tuple[Any, ...]) -> list[tuple[str, str, BagInput]]:
        features = args[0]
        if all(hasattr(features, m) for m in ("keys", "values", "lengths")) \
                and not isinstance(features, Mapping):
            given = _keyed_jagged(features, self.device)
        elif isinstance(features, Mapping):
            given = {}
            for k, v in features.items():
                if not isinstance(v, (tuple, list)) or len(v) not in (2, 3):
                    raise InvalidIdsError(f"feature {k!r}: give (values, lengths) or (values, "
                                          f"lengths, weights), got {type(v).__name__}")
                given[k] = (v[0], v[1], v[2] if len(v) == 3 else None)
        else:
            raise InvalidIdsError("features must be a KeyedJaggedTensor or a mapping "
                                  f"{{feature: (values, lengths)}}, got {type(features).__name__}")
        missing = [f for f in self.feature_names if f not in given]
        unknown = [f for f in given if f not in self.tables]
        if missing or unknown:
            # sorted by repr: a mapping may mix key types ("a" and 1), which do not compare
            raise InvalidIdsError(f"features {sorted(given, key=repr)} do not match the "
                                  f"collection's {self.feature_names} (missing {missing}, "
                                  f"unknown {unknown})")
        out = []
        batch = None
        for f in self.feature_names:
            values, lengths, weights = given[f]
            if weights is not None and self.mode != "sum":
                raise InvalidValuesError(f"feature {f!r}: per-sample weights are only "
                                         f"supported with mode='sum' (as in torch), got "
                                         f"mode={self.mode!r}")
            bags = jagged_input(f, values, lengths, self.device, self._dtype, weights)
            if batch is None:
                batch = bags.num_bags
            elif bags.num_bags != batch:
                raise InvalidIdsError(f"feature {f!r} has {bags.num_bags} bags, the first "
                                      f"feature {batch}: every feature needs one bag per sample")
            out.append((f, self.tables[f], bags))
        return out

    def forward(self, features: Any) -> KeyedEmbeddings:
        """Pool every feature's bags.

        Args:
            features: a torchrec KeyedJaggedTensor, or {feature: (values [N_f], lengths [B])}
                (optionally with per-sample weights [N_f] as a third element).

        Returns:
            KeyedEmbeddings: values() [B, sum of dims], in the collection's feature order.
        """
        outs = self._outputs((features,))
        values = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return KeyedEmbeddings(self.feature_names, values, self.embedding_dims)

    def extra_repr(self) -> str:
        """The table and shape, for print(module)."""
        return f"tables={self.tables}, mode={self.mode!r}"
