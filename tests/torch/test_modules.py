"""The torch modules against torch.nn.EmbeddingBag / Embedding trained by torch.optim."""

from __future__ import annotations

import copy
import pickle
import re
import types
import warnings

import numpy as np
import pytest
import torch

import embstore
import embstore.torch as et
from embstore.errors import (
    ConfigError,
    DeviceMismatchError,
    InvalidIdsError,
    InvalidValuesError,
    NonFiniteValueError,
    UnknownTableError,
)

ROWS, DIM = 40, 8


def _store(optimizer, tiers=None, path=None, **spec):
    spec.setdefault("num_embeddings", ROWS)
    table = embstore.TableSpec("t", dim=DIM, init=embstore.init.Uniform(-0.5, 0.5, seed=3),
                               optimizer=optimizer, **spec)
    return embstore.open(path, tables=[table], tiers=tiers)


def _table(store):
    """Every row's weights and optimizer state, without creating rows."""
    ids = np.arange(ROWS)
    return store.lookup("t", ids).copy(), store.lookup_state("t", ids).copy()


def _batches(seed, steps, *, bags=6, max_len=5, weights=False, padding=None):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, max_len + 1, size=bags)
        ids = rng.integers(0, ROWS // 2, size=int(lengths.sum()))  # many repeats
        if padding is not None and len(ids):
            ids[rng.random(len(ids)) < 0.3] = padding
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        psw = rng.standard_normal(len(ids)).astype(np.float32) if weights else None
        target = rng.standard_normal((bags, DIM)).astype(np.float32)
        out.append((torch.from_numpy(ids), torch.from_numpy(offsets),
                    None if psw is None else torch.from_numpy(psw), torch.from_numpy(target)))
    return out


OPTIMIZERS = {
    "sgd": (lambda: embstore.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (lambda: embstore.optim.Adagrad(lr=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.1)),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode,weights,padding", [
    ("sum", False, None), ("sum", False, 7), ("sum", True, None), ("sum", True, 7),
    ("mean", False, None),
    ("mean", False, 7), ("max", False, None), ("max", False, 7)])
def test_embedding_bag_trains_like_torch(opt, mode, weights, padding):
    make_store_opt, make_torch_opt = OPTIMIZERS[opt]
    store = _store(make_store_opt())
    ours = et.EmbeddingBag(store, "t", mode=mode, padding_idx=padding)
    initial, _ = _table(store)
    ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(initial.copy()), freeze=False,
                                                mode=mode, padding_idx=padding)
    torch_opt = make_torch_opt(ref.parameters())
    for step, (ids, offsets, psw, target) in enumerate(
            _batches(1, 6, weights=weights, padding=padding)):
        psw_ours = None if psw is None else psw.clone().requires_grad_()
        psw_ref = None if psw is None else psw.clone().requires_grad_()
        out = ours(ids, offsets, psw_ours)
        expected = ref(ids, offsets, per_sample_weights=psw_ref)
        if step == 0:  # same rows, same kernel: the forward is bit-identical
            assert torch.equal(out, expected)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        ((out - target) ** 2).sum().backward()
        ((expected - target) ** 2).sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
        if psw is not None:
            torch.testing.assert_close(psw_ours.grad, psw_ref.grad, rtol=1e-5, atol=1e-5)
    weights_now, _ = _table(store)
    mask = np.ones(ROWS, dtype=bool)
    if padding is not None:
        mask[padding] = False  # excluded from every bag: never written, still its init
        assert store.lookup("t", np.array([padding]))[0].tolist() == initial[padding].tolist()
    np.testing.assert_allclose(weights_now[mask], ref.weight.detach().numpy()[mask],
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(weights_now, initial)  # it did train


@pytest.mark.parametrize("loaded", [False, True], ids=["fresh", "loaded"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_the_padding_row_is_never_pooled_nor_stepped(mode, loaded):
    # weight decay moves a row under a zero gradient: a padding row handed to the optimizer
    # with one would change and be stored
    store = _store(embstore.optim.SGD(lr=0.1, weight_decay=0.5))
    initial, _ = _table(store)
    if loaded:  # pretrained rows, the padding row's too: the DRAM tier holds every row
        store.update("t", np.arange(ROWS), initial)
    bag = et.EmbeddingBag(store, "t", mode=mode, padding_idx=7)
    ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(initial), mode=mode,
                                                padding_idx=7)
    # mostly distinct ids: "sum" pools rows the DRAM tier holds where they lie, skipping 7 too
    ids, offsets = torch.tensor([7, 1, 7, 2, 7, 3]), torch.tensor([0, 2])
    out = bag(ids, offsets)
    assert torch.equal(out, ref(ids, offsets))
    out.sum().backward()
    assert store.lookup("t", np.array([7])).tobytes() == initial[7:8].tobytes()
    assert store.num_rows("t") == (ROWS if loaded else 3)  # 7 was never written


def test_embedding_bag_accepts_2d_input_and_include_last_offset():
    store = _store(embstore.optim.SGD(lr=0.1))
    initial, _ = _table(store)
    ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(initial.copy()), mode="sum")
    bag = et.EmbeddingBag(store, "t", mode="sum")
    x = torch.tensor([[1, 2, 3], [4, 4, 1]])
    assert torch.equal(bag(x), ref(x))
    last = et.EmbeddingBag(store, "t", mode="sum", include_last_offset=True)
    ids, off = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 4])
    assert torch.equal(last(ids, off), ref(ids, torch.tensor([0, 1])))


def test_embedding_trains_like_torch_embedding():
    store = _store(embstore.optim.SGD(lr=0.5))
    initial, _ = _table(store)
    initial[3] = 0  # a new torch.nn.Embedding's padding row: ours reads zeros there
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(initial.copy()), freeze=False,
                                             padding_idx=3)
    ours = et.Embedding(store, "t", padding_idx=3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = torch.from_numpy(rng.integers(0, 10, size=(3, 5)))
        out, expected = ours(x), ref(x)
        assert out.shape == (3, 5, DIM)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        (out * out).sum().backward()
        (expected * expected).sum().backward()
        opt.step()
        opt.zero_grad()
    trained = _table(store)[0][:10]
    trained[3] = 0
    np.testing.assert_allclose(trained, ref.weight.detach().numpy()[:10], rtol=1e-5, atol=1e-6)


def test_collection_concatenates_features_and_shares_one_lookup_per_table():
    tables = [embstore.TableSpec(name, dim=d, init=embstore.init.Uniform(-1, 1, seed=i),
                                 optimizer=embstore.optim.SGD(lr=0.1))
              for i, (name, d) in enumerate([("a", 4), ("b", 6)])]
    store = embstore.open(None, tables=tables)
    ebc = et.EmbeddingBagCollection(store, {"f1": "a", "f2": "b", "f3": "a"}, mode="sum")
    feats = {"f1": (torch.tensor([1, 2, 3]), torch.tensor([2, 1])),
             "f2": (torch.tensor([5]), torch.tensor([0, 1])),
             "f3": (torch.tensor([3, 3, 9]), torch.tensor([1, 2]))}
    before = store.tier_statistics("a")[0].lookups
    out = ebc(feats)
    # f1 and f3 share table "a": one lookup of its distinct ids {1, 2, 3, 9}
    assert store.tier_statistics("a")[0].lookups - before == 4
    assert out.keys() == ["f1", "f2", "f3"]
    assert out.values().shape == (2, 4 + 6 + 4)
    assert out.offset_per_key() == [0, 4, 10, 14]
    for name, table in ebc.tables.items():
        values, lengths = feats[name]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        single = et.EmbeddingBag(store, table, mode="sum")
        assert torch.equal(out[name], single(values, offsets))
    # the backward of shared features sums their gradients per id, in feature order
    out.values().sum().backward()
    grads = np.ones((7, 4), np.float32)
    expected_store = embstore.open(None, tables=tables)
    expected_store.apply_gradients("a", np.array([1, 2, 3, 3, 3, 9]), grads[:6])
    np.testing.assert_array_equal(store.lookup("a", np.arange(12)),
                                  expected_store.lookup("a", np.arange(12)))


def test_collection_takes_a_keyed_jagged_tensor():
    torchrec = pytest.importorskip("torchrec", reason="torchrec not installed (the 'torchrec' "
                                   "extra)")
    store = _store(embstore.optim.SGD(lr=0.1))
    ebc = et.EmbeddingBagCollection(store, {"x": "t", "y": "t"})
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["x", "y"], values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([2, 1, 0, 2]))
    out = ebc(kjt)
    by_dict = ebc({"x": (torch.tensor([1, 2, 3]), torch.tensor([2, 1])),
                   "y": (torch.tensor([4, 5]), torch.tensor([0, 2]))})
    assert torch.equal(out.values(), by_dict.values())


class _Jagged:
    """A KeyedJaggedTensor as the collection reads one (duck-typed), built unchecked."""

    def __init__(self, keys, values, lengths):
        self._keys, self._values, self._lengths = keys, values, lengths

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths


@pytest.mark.parametrize(("keys", "values", "lengths", "words"), [
    (["x", "y"], [1, 2, 3], [1, 1, 1], "do not split into one run per key"),
    (["x", "y"], [1, 2, 3, 99, 98], [1, 1, 1, 0], "holds 5 values"),  # a tail no bag holds
    (["x", "y"], [1, 2], [1, 1, 1, 0], "holds 2 values"),
    (["x", "x"], [1, 2, 3], [1, 1, 1, 0], "names a key twice"),
    ([], [], [], "missing"),
])
def test_a_malformed_keyed_jagged_tensor_is_refused_and_changes_nothing(keys, values,
                                                                        lengths, words):
    store = _store(embstore.optim.SGD(lr=0.1))
    ebc = et.EmbeddingBagCollection(store, {"x": "t", "y": "t"})
    jagged = _Jagged(keys, torch.tensor(values, dtype=torch.long),
                     torch.tensor(lengths, dtype=torch.long))
    with pytest.raises(InvalidIdsError, match=words):
        ebc(jagged)
    assert store.num_rows("t") == 0


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_forward_without_training_changes_nothing(tmp_path, how):
    store = _store(embstore.optim.Adagrad(lr=0.1), path=tmp_path / "s",
                   tiers=[embstore.TierSpec("dram", capacity=8), embstore.TierSpec("lmdb")])
    bag = et.EmbeddingBag(store, "t", mode="sum")
    bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    table = _table(store)
    rows = store.num_rows("t")
    if how == "eval":
        bag.eval()
        out = bag(torch.arange(30), torch.tensor([0, 10]))
        assert not out.requires_grad
    else:
        with torch.no_grad():
            bag(torch.arange(30), torch.tensor([0, 10]))
    assert store.num_rows("t") == rows
    np.testing.assert_array_equal(_table(store)[0], table[0])
    np.testing.assert_array_equal(_table(store)[1], table[1])
    store.close()


BAD_CALLS = [
    ("float ids", lambda b: b(torch.tensor([1.0, 2.0]), torch.tensor([0])), InvalidIdsError),
    ("id out of range", lambda b: b(torch.tensor([1, ROWS]), torch.tensor([0])),
     InvalidIdsError),
    ("negative id", lambda b: b(torch.tensor([-1, 2]), torch.tensor([0])), InvalidIdsError),
    ("offsets decrease", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])),
     InvalidIdsError),
    ("offsets past input", lambda b: b(torch.tensor([1, 2]), torch.tensor([0, 5])),
     InvalidIdsError),
    ("offsets not from 0", lambda b: b(torch.tensor([1, 2]), torch.tensor([1])),
     InvalidIdsError),
    ("float offsets", lambda b: b(torch.tensor([1, 2]), torch.tensor([0.0])), InvalidIdsError),
    ("1-D without offsets", lambda b: b(torch.tensor([1, 2])), InvalidIdsError),
    ("2-D with offsets", lambda b: b(torch.tensor([[1, 2]]), torch.tensor([0])),
     InvalidIdsError),
    ("3-D input", lambda b: b(torch.zeros((1, 1, 1), dtype=torch.long)), InvalidIdsError),
    ("weights of wrong length", lambda b: b(torch.tensor([1, 2]), torch.tensor([0]),
                                            torch.ones(3)), InvalidValuesError),
    ("weights of wrong dtype", lambda b: b(torch.tensor([1, 2]), torch.tensor([0]),
                                           torch.ones(2, dtype=torch.float64)),
     InvalidValuesError),
    ("input on another device", lambda b: b.to("meta")(torch.tensor([1]), torch.tensor([0])),
     DeviceMismatchError),
    ("ids not a tensor", lambda b: b([1, 2], torch.tensor([0])), InvalidIdsError),
    # ids 1 and 2 are in the DRAM tier, where a sum pools in place: no bag must reach it
    ("ids but no bag", lambda b: b(torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)),
     InvalidIdsError),
    ("weights of another shape", lambda b: b(torch.tensor([1, 2]), torch.tensor([0]),
                                             torch.ones(1, 2)), InvalidValuesError),
    ("complex offsets", lambda b: b(torch.tensor([1, 2]), torch.tensor([0j])),
     InvalidIdsError),
]


@pytest.mark.parametrize("what,call,error", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(what, call, error):
    store = _store(embstore.optim.SGD(lr=0.1))
    bag = et.EmbeddingBag(store, "t", mode="sum")
    bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    before = _table(store)
    with pytest.raises(error):
        call(bag)
    assert store.num_rows("t") == 2
    np.testing.assert_array_equal(_table(store)[0], before[0])


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_no_bag_holding_ids_is_refused_even_for_rows_in_dram(include_last_offset):
    store = _store(embstore.optim.SGD(lr=0.1))
    bag = et.EmbeddingBag(store, "t", mode="sum", include_last_offset=include_last_offset)
    bag(torch.tensor([1, 2, 3]), torch.tensor([0, 3] if include_last_offset else [0])) \
        .sum().backward()
    before = _table(store)
    offsets = torch.tensor([3] if include_last_offset else [], dtype=torch.long)
    with pytest.raises(InvalidIdsError):
        bag(torch.tensor([1, 2, 3]), offsets)
    np.testing.assert_array_equal(_table(store)[0], before[0])
    # no ids and no bag is an empty batch
    assert bag(torch.tensor([], dtype=torch.long), offsets[:0] if not include_last_offset
               else torch.tensor([0])).shape == (0, DIM)


def test_unsigned_ids_past_the_largest_id_are_named_as_given():
    store = _store(embstore.optim.SGD(lr=0.1))
    bag = et.EmbeddingBag(store, "t", mode="sum")
    with pytest.raises(InvalidIdsError, match="18446744073709551615"):  # not wrapped to -1
        bag(torch.tensor([1, 2**64 - 1], dtype=torch.uint64), torch.tensor([0]))
    out = bag(torch.tensor([1, 2], dtype=torch.uint64), torch.tensor([0]))
    assert torch.equal(out, bag(torch.tensor([1, 2]), torch.tensor([0])))


def _sparse(values):
    return torch.tensor(values).to_sparse()


def _quantized(values):
    with warnings.catch_warnings():  # torch deprecates its quantized tensors
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.tensor(values, dtype=torch.float32), 1.0, 0,
                                         torch.quint8)


def _nested(*parts):
    with warnings.catch_warnings():  # torch calls its nested tensors a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.tensor(p) for p in parts])


def _meta(values):
    return torch.tensor(values, device="meta")


IDS, LENGTHS = torch.tensor([1, 2]), torch.tensor([2])
# tensors whose data torch's reshape or .numpy() cannot read: each reached the caller as
# torch's own error (RuntimeError, TypeError, NotImplementedError, AttributeError)
KIND_CALLS = [
    ("sparse ids", lambda m: m.bag(_sparse([1, 2]), torch.tensor([0])), InvalidIdsError,
     "sparse_coo"),
    ("sparse offsets", lambda m: m.bag(IDS, _sparse([0])), InvalidIdsError, "sparse_coo"),
    ("sparse weights", lambda m: m.bag(IDS, torch.tensor([0]), torch.ones(2).to_sparse()),
     InvalidValuesError, "sparse_coo"),
    ("sparse values", lambda m: m.ebc({"a": (_sparse([1, 2]), LENGTHS)}), InvalidIdsError,
     "sparse_coo"),
    ("sparse lengths", lambda m: m.ebc({"a": (IDS, _sparse([2]))}), InvalidIdsError,
     "sparse_coo"),
    ("sparse feature weights", lambda m: m.ebc({"a": (IDS, LENGTHS, torch.ones(2).to_sparse())}),
     InvalidValuesError, "sparse_coo"),
    ("quantized ids of embedding", lambda m: m.emb(_quantized([1, 2])), InvalidIdsError,
     "quantized"),
    ("quantized ids of bag", lambda m: m.bag(_quantized([1, 2]), torch.tensor([0])),
     InvalidIdsError, "quantized"),
    ("quantized offsets", lambda m: m.bag(IDS, _quantized([0])), InvalidIdsError, "quantized"),
    ("nested ids of embedding", lambda m: m.emb(_nested([1, 2], [3])), InvalidIdsError,
     "nested"),
    ("nested ids of bag", lambda m: m.bag(_nested([1, 2], [3])), InvalidIdsError, "nested"),
    ("meta ids of embedding", lambda m: m.emb.to("meta")(_meta([1])), InvalidIdsError, "meta"),
    ("meta ids of bag", lambda m: m.bag.to("meta")(_meta([1]), _meta([0])), InvalidIdsError,
     "meta"),
    ("jagged lengths on meta", lambda m: m.ebc(_Jagged(["a"], IDS, _meta([2]))),
     InvalidIdsError, "meta"),
    ("jagged lengths a list", lambda m: m.ebc(_Jagged(["a"], IDS, [2])), InvalidIdsError,
     "lengths.. must be a torch.Tensor, got list"),
    ("jagged lengths an ndarray", lambda m: m.ebc(_Jagged(["a"], IDS, np.array([2]))),
     InvalidIdsError, "got ndarray"),
    ("jagged values a list", lambda m: m.ebc(_Jagged(["a"], [1, 2], LENGTHS)), InvalidIdsError,
     "values.. must be a torch.Tensor, got list"),
    ("jagged keys unhashable", lambda m: m.ebc(_Jagged([["a"]], IDS, LENGTHS)),
     InvalidIdsError, "keys must be feature names"),
]


@pytest.mark.parametrize("what,call,error,words", KIND_CALLS, ids=[c[0] for c in KIND_CALLS])
def test_tensors_the_store_cannot_read_are_refused_and_change_nothing(what, call, error, words):
    store = _store(embstore.optim.SGD(lr=0.1))
    m = types.SimpleNamespace(bag=et.EmbeddingBag(store, "t", mode="sum"),
                              emb=et.Embedding(store, "t"),
                              ebc=et.EmbeddingBagCollection(store, {"a": "t"}))
    m.bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    before = _table(store)
    with pytest.raises(error, match=words):
        call(m)
    assert store.num_rows("t") == 2
    np.testing.assert_array_equal(_table(store)[0], before[0])


def test_a_keyed_jagged_tensor_with_lengths_on_meta_is_refused():
    torchrec = pytest.importorskip("torchrec", reason="torchrec not installed (the 'torchrec' "
                                   "extra)")
    store = _store(embstore.optim.SGD(lr=0.1))
    ebc = et.EmbeddingBagCollection(store, {"a": "t"})
    kjt = torchrec.KeyedJaggedTensor(keys=["a"], values=IDS, lengths=_meta([2]))
    with pytest.raises(InvalidIdsError, match="lengths.. is on the meta device"):
        ebc(kjt)
    assert store.num_rows("t") == 0


def _torch_bag(store, mode):
    """torch.nn.EmbeddingBag holding the table's weights now."""
    return torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(_table(store)[0].copy()),
                                                 freeze=False, mode=mode)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_batches_without_ids_train_like_torch(mode):
    """Bags that are all empty, an unpooled input of no ids, and a 2-D input of empty bags."""
    store = _store(embstore.optim.Adagrad(lr=0.1))
    ref = _torch_bag(store, mode)
    bag = et.EmbeddingBag(store, "t", mode=mode)
    empty = torch.tensor([], dtype=torch.long)
    for ours, theirs in ((bag(empty, torch.tensor([0, 0])), ref(empty, torch.tensor([0, 0]))),
                         (bag(torch.zeros(3, 0, dtype=torch.long)),
                          ref(empty, torch.tensor([0, 0, 0])))):
        assert torch.equal(ours, theirs) and ours.shape[1] == DIM
        ours.sum().backward()
    unpooled = et.Embedding(store, "t")(torch.zeros(2, 0, dtype=torch.long))
    assert unpooled.shape == (2, 0, DIM)
    unpooled.sum().backward()
    assert store.num_rows("t") == 0


def test_a_second_backward_through_a_freed_graph_is_refused_as_torch_refuses_it():
    store = _store(embstore.optim.Adagrad(lr=0.1))
    for module in (et.EmbeddingBag(store, "t", mode="sum"),
                   et.EmbeddingBagCollection(store, {"a": "t", "b": "t"})):
        if isinstance(module, et.EmbeddingBag):
            loss = module(torch.tensor([1, 2]), torch.tensor([0])).sum()
        else:
            loss = module({"a": (torch.tensor([1]), torch.tensor([1])),
                           "b": (torch.tensor([2]), torch.tensor([1]))}).values().sum()
        loss.backward()
        once = _table(store)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        np.testing.assert_array_equal(_table(store)[0], once[0])  # one step, not two
        np.testing.assert_array_equal(_table(store)[1], once[1])


@pytest.mark.parametrize("module", ["bag", "ebc", "ebc of two tables"])
def test_a_second_order_gradient_through_per_sample_weights_is_refused(module):
    # the weights' gradient came back without a graph: a gradient penalty built on it lost
    # its dependence on the table without a word (torch.nn.EmbeddingBag refuses it)
    store = embstore.open(None, tables=[embstore.TableSpec(
        name, dim=DIM, init=embstore.init.Uniform(-0.5, 0.5, seed=3),
        optimizer=embstore.optim.SGD(lr=0.1)) for name in ("t", "u")])
    weights = torch.tensor([0.5, 2.0], requires_grad=True)
    if module == "bag":
        out = et.EmbeddingBag(store, "t", mode="sum")(IDS, torch.tensor([0]), weights)
    else:
        tables = {"a": "t", "b": "u" if module == "ebc of two tables" else "t"}
        out = et.EmbeddingBagCollection(store, tables)(
            {"a": (IDS, LENGTHS, weights), "b": (torch.tensor([3]), torch.tensor([1]))}).values()
    before = store.lookup("t", np.arange(4)).copy()
    [grad] = torch.autograd.grad(out.sum(), weights, create_graph=True)
    stepped = store.lookup("t", np.arange(4)).copy()
    assert not np.array_equal(stepped, before)  # the backward was one step of the table
    penalty = (grad ** 2).sum()
    with pytest.raises(InvalidValuesError, match="cannot be differentiated again"):
        penalty.backward()
    np.testing.assert_array_equal(store.lookup("t", np.arange(4)), stepped)
    # a first-order gradient, as before
    rows = torch.from_numpy(store.lookup("t", IDS.numpy()).copy())
    out = et.EmbeddingBag(store, "t", mode="sum")(IDS, torch.tensor([0]), weights)
    [grad] = torch.autograd.grad(out.sum(), weights)
    torch.testing.assert_close(grad, rows.sum(dim=1))
    assert not grad.requires_grad


@pytest.mark.parametrize("bad,error", [
    ({"a": (torch.tensor([[1]]), torch.tensor([1]))}, InvalidIdsError),  # 2-D values
    ({"a": (torch.tensor([1]), torch.tensor([True]))}, InvalidIdsError),  # bool lengths
    ({"a": (torch.tensor([1]), torch.tensor([1j]))}, InvalidIdsError),  # complex lengths
    ({"a": (torch.tensor([1]), torch.tensor([1]), torch.ones(1, 1))}, InvalidValuesError),
])
def test_collection_refuses_malformed_features(bad, error):
    store = _store(embstore.optim.SGD(lr=0.1))
    ebc = et.EmbeddingBagCollection(store, {"a": "t"})
    with pytest.raises(error):
        ebc(bad)
    assert store.num_rows("t") == 0


@pytest.mark.parametrize("other", [1, ("a",)])
def test_collection_names_unknown_features_of_any_key_type(other):
    # the message sorted the given keys, and "a" < 1 raised TypeError instead
    store = _store(embstore.optim.SGD(lr=0.1))
    ebc = et.EmbeddingBagCollection(store, {"a": "t"})
    with pytest.raises(InvalidIdsError, match=re.escape(f"unknown [{other!r}]")):
        ebc({"a": (IDS, LENGTHS), other: (IDS, LENGTHS)})
    assert store.num_rows("t") == 0


def test_weights_with_max_pooling_are_refused():
    store = _store(embstore.optim.SGD(lr=0.1))
    bag = et.EmbeddingBag(store, "t", mode="max")
    with pytest.raises(InvalidValuesError, match="mode='sum'"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
    ebc = et.EmbeddingBagCollection(store, {"a": "t"}, mode="mean")
    with pytest.raises(InvalidValuesError, match="mode='sum'"):
        ebc({"a": (torch.tensor([1, 2]), torch.tensor([2]), torch.ones(2))})
    assert store.num_rows("t") == 0


def test_bad_construction():
    store = _store(embstore.optim.SGD(lr=0.1))
    with pytest.raises(UnknownTableError):
        et.EmbeddingBag(store, "nope")
    with pytest.raises(ConfigError):
        et.EmbeddingBag(store, "t", mode="median")
    with pytest.raises(ConfigError):
        et.EmbeddingBag(store, "t", padding_idx=ROWS)
    with pytest.raises(ConfigError):
        et.EmbeddingBag("not a store", "t")
    assert et.EmbeddingBag(store, "t", padding_idx=-1).padding_idx == ROWS - 1


@pytest.mark.parametrize(("make", "match"), [
    # unhashable modes once reached the MODES dict raw (TypeError: unhashable type)
    (lambda s: et.EmbeddingBag(s, "t", mode=np.array("sum")), "mode must be one of"),
    (lambda s: et.EmbeddingBag(s, "t", mode=["sum"]), "mode must be one of"),
    (lambda s: et.EmbeddingBagCollection(s, {"a": "t"}, mode=np.array("sum")),
     "mode must be one of"),
    (lambda s: et.EmbeddingBagCollection(s, {"a": "t"}, mode=["sum"]), "mode must be one of"),
    # non-bools were read for their truth: "no" was True
    (lambda s: et.EmbeddingBag(s, "t", include_last_offset="no"), "include_last_offset"),
    (lambda s: et.EmbeddingBag(s, "t", include_last_offset=1), "include_last_offset"),
    (lambda s: et.EmbeddingBag(s, "t", include_last_offset=None), "include_last_offset"),
    (lambda s: et.EmbeddingBag(s, "t", include_last_offset=np.True_), "include_last_offset"),
    # a table name that is no str (a sharded store's dict lookup of it raised TypeError)
    (lambda s: et.EmbeddingBag(s, ["t"]), "table must be a table name"),
    (lambda s: et.Embedding(s, ["t"]), "table must be a table name"),
    # a feature name that is no str was taken, and no input could then name it
    (lambda s: et.EmbeddingBagCollection(s, {1: "t"}), "feature names must be str"),
    (lambda s: et.EmbeddingBagCollection(s, {("a",): "t"}), "feature names must be str"),
], ids=["bag-mode-ndarray", "bag-mode-list", "ebc-mode-ndarray",
        "ebc-mode-list", "last-offset-str", "last-offset-int", "last-offset-none",
        "last-offset-np-bool", "bag-table-list", "embedding-table-list", "ebc-feature-int",
        "ebc-feature-tuple"])
def test_bad_construction_argument_types(make, match):
    store = _store(embstore.optim.SGD(lr=0.1))
    with pytest.raises(ConfigError, match=match):
        make(store)
    assert store.num_rows("t") == 0


@pytest.mark.parametrize("module", ["bag", "embedding", "ebc"])
def test_padding_idx_may_be_any_integer_like_torch_takes(module):
    store = _store(embstore.optim.SGD(lr=0.1))
    make = {"bag": lambda p: et.EmbeddingBag(store, "t", mode="sum", padding_idx=p),
            "embedding": lambda p: et.Embedding(store, "t", padding_idx=p),
            "ebc": lambda p: et.EmbeddingBagCollection(store, {"a": "t"}, padding_idx=p)}[module]
    m = make(np.int64(3))
    assert type(m.padding_idx) is int and m.padding_idx == 3
    assert make(np.int32(-1)).padding_idx == ROWS - 1
    torch.nn.EmbeddingBag(ROWS, DIM, padding_idx=np.int64(3))  # as torch does
    for switch in (True, np.True_):  # integers to Python, but no id
        with pytest.raises(ConfigError, match="padding_idx must be an int"):
            make(switch)


@pytest.mark.parametrize("padding_idx", [2**63, 2**64])
def test_a_padding_idx_no_id_can_match_is_refused(padding_idx):
    store = _store(embstore.optim.SGD(lr=0.1), num_embeddings=None)
    with pytest.raises(ConfigError, match="padding_idx"):
        et.EmbeddingBag(store, "t", padding_idx=padding_idx)


def test_keyed_embeddings_lookup_of_a_missing_feature_raises_key_error():
    # as torchrec's KeyedTensor does; list.index's ValueError came out instead
    store = _store(embstore.optim.SGD(lr=0.1))
    out = et.EmbeddingBagCollection(store, {"a": "t"})({"a": (IDS, LENGTHS)})
    with pytest.raises(KeyError, match="no feature 'zz'"):
        out["zz"]
    assert torch.equal(out["a"], out.values())


@pytest.mark.parametrize("module", ["bag", "ebc"])
def test_a_str_subclass_mode_is_kept_as_a_plain_str(module):
    store = _store(embstore.optim.SGD(lr=0.1))
    mode = np.str_("max")
    m = (et.EmbeddingBag(store, "t", mode=mode) if module == "bag"
         else et.EmbeddingBagCollection(store, {"a": "t"}, mode=mode))
    assert type(m.mode) is str and m.mode == "max"


def test_model_state_dict_holds_only_the_dense_part(tmp_path):
    store = _store(embstore.optim.SGD(lr=0.1), path=tmp_path / "s")
    model = torch.nn.ModuleDict({"bag": et.EmbeddingBag(store, "t", mode="sum"),
                                 "dense": torch.nn.Linear(DIM, 1)})
    assert set(model.state_dict()) == {"dense.weight", "dense.bias"}
    assert [p.shape for p in model.parameters()] == [(1, DIM), (1,)]
    torch.save(model.state_dict(), tmp_path / "dense.pt")
    loss = model["dense"](model["bag"](torch.tensor([[1, 2]]))).sum()
    loss.backward()
    ckpt = store.checkpoint(tmp_path / "ckpt", step=1)
    with embstore.open(ckpt) as saved:
        np.testing.assert_array_equal(saved.lookup("t", np.arange(4)),
                                      store.lookup("t", np.arange(4)))
    store.close()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_model_holding_the_store_says_how_to_save_it_instead_of_pickling(tmp_path, how):
    # the store's lock reached the caller as pickle's "cannot pickle '_thread.RLock' object"
    store = _store(embstore.optim.SGD(lr=0.1))
    model = torch.nn.ModuleDict({"bag": et.EmbeddingBag(store, "t", mode="sum"),
                                 "ebc": et.EmbeddingBagCollection(store, {"a": "t"}),
                                 "dense": torch.nn.Linear(DIM, 1)})
    save = {"deepcopy": copy.deepcopy, "pickle": pickle.dumps,
            "torch.save": lambda m: torch.save(m, tmp_path / "model.pt")}[how]
    with pytest.raises(ConfigError, match=r"torch.save\(model.state_dict\(\)\).*checkpoint"):
        save(model)
    # what a model is saved and moved with still works
    dense = model.state_dict()
    model.load_state_dict(dense)
    model.eval()
    assert not model["bag"].training
    model.train()
    model.to("cpu")
    assert "EmbeddingBag(table='t'" in repr(model)
    model["dense"](model["bag"](torch.tensor([[1, 2]]))).sum().backward()
    assert store.num_rows("t") == 2


def test_same_training_gives_identical_tables_on_any_tier_chain(tmp_path):
    results = []
    for i, tiers in enumerate([None, [embstore.TierSpec("dram", capacity=5),
                                      embstore.TierSpec("rocksdb")]]):
        store = _store(embstore.optim.RowWiseAdagrad(lr=0.1), tiers=tiers,
                       path=None if tiers is None else tmp_path / f"s{i}")
        bag = et.EmbeddingBag(store, "t", mode="mean")
        for ids, offsets, _, target in _batches(4, 8):
            ((bag(ids, offsets) - target) ** 2).sum().backward()
        results.append(_table(store))
        store.close()
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_rowwise_adagrad_matches_fbgemm_tbe(mode):
    with warnings.catch_warnings():  # fbgemm warns about its optional GPU-only modules
        warnings.simplefilter("ignore")
        pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu-cpu not installed (the "
                            "'fbgemm' extra)")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        from fbgemm_gpu.tbe.config.embedding_config import (
            ComputeDevice,
            EmbeddingLocation,
            PoolingMode,
        )

    store = _store(embstore.optim.RowWiseAdagrad(lr=0.1, eps=1e-8))
    ours = et.EmbeddingBag(store, "t", mode=mode)
    initial, _ = _table(store)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-8,
        pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN, device="cpu")
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(initial))
    for ids, offsets, _, target in _batches(2, 6):
        out = ours(ids, offsets)
        expected = tbe(ids, torch.cat([offsets, torch.tensor([len(ids)])]))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        ((out - target) ** 2).sum().backward()
        ((expected - target) ** 2).sum().backward()
    weights, state = _table(store)
    np.testing.assert_allclose(weights, tbe.split_embedding_weights()[0].detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state[:, 0], tbe.split_optimizer_states()[0][0].numpy(),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(weights, initial)


@pytest.mark.parametrize("mode,weights,padding", [("sum", False, None), ("sum", True, 7),
                                                  ("mean", False, 7)])
def test_fused_bag_gradients_equal_per_position_sums(mode, weights, padding):
    # the C pass that sums bag gradients per row equals materialising every position's
    # gradient and summing in position order, bit for bit
    from embstore.torch import _bags, _core

    store = _store(embstore.optim.SGD(lr=0.1))
    bag = et.EmbeddingBag(store, "t", mode=mode, padding_idx=padding)
    ids, offsets, psw, _ = _batches(5, 1, bags=50, max_len=9, weights=weights,
                                    padding=padding)[0]
    plan = bag.prepare_forward(ids, offsets, psw)
    bag.fetch_forward(plan)
    tp = plan.tables[0]
    _, saved = _core._forward_outputs(tp, mode)
    grad = torch.randn(50, DIM)
    fused, finite = _bags.summed_bag_grads(tp, mode, [grad], saved)
    per_position, _ = _core._position_grads(tp, tp.features[0], mode, grad, saved[0])
    if padding is not None:
        per_position = per_position.masked_fill((tp.inverse == tp.padding)[:, None], 0.0)
    expected = tp.groups.sum_rows(per_position.numpy())
    if padding is not None:
        fused[tp.padding] = expected[tp.padding] = 0
    np.testing.assert_array_equal(fused, expected)
    assert finite
    # a sum that is not finite is reported, so that the store scans what it is handed
    grad[3, 1] = float("inf") if mode != "mean" else float("nan")
    bag_ids = np.asarray(ids)[int(offsets[3]):int(offsets[4])]
    if padding is None or (bag_ids != padding).any():
        assert not _bags.summed_bag_grads(tp, mode, [grad], saved)[1]


def test_fused_bag_gradients_of_features_sharing_a_table_sum_in_feature_order():
    # two features of one table: each row sums the first feature's positions, then the
    # second's, as concatenating their per-position gradients and summing in order would
    from embstore.torch import _bags, _core

    store = _store(embstore.optim.SGD(lr=0.1))
    ebc = et.EmbeddingBagCollection(store, {"a": "t", "b": "t"}, mode="sum")
    rng = np.random.default_rng(7)
    lengths = {f: torch.from_numpy(rng.integers(0, 6, 40)) for f in "ab"}
    values = {f: torch.from_numpy(rng.integers(0, 30, int(lengths[f].sum()))) for f in "ab"}
    plan = ebc.prepare_forward({f: (values[f], lengths[f]) for f in "ab"})
    ebc.fetch_forward(plan)
    [tp] = plan.tables
    _, saved = _core._forward_outputs(tp, "sum")
    grads = [torch.randn(40, DIM), torch.randn(40, DIM)]
    fused, finite = _bags.summed_bag_grads(tp, "sum", grads, saved)
    per_position = torch.cat([_core._position_grads(tp, fp, "sum", g, sv)[0]
                              for fp, g, sv in zip(tp.features, grads, saved, strict=True)])
    np.testing.assert_array_equal(fused, tp.groups.sum_rows(per_position.numpy()))
    assert finite


def test_float64_tables_train_like_torch():
    store = embstore.open(None, tables=[embstore.TableSpec(
        "t", dim=DIM, dtype=np.float64, num_embeddings=ROWS,
        init=embstore.init.Uniform(-0.5, 0.5, seed=3), optimizer=embstore.optim.SGD(lr=0.1))])
    bag = et.EmbeddingBag(store, "t", mode="mean")
    initial = store.lookup("t", np.arange(ROWS)).copy()
    ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(initial.copy()), freeze=False,
                                                mode="mean")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, offsets, _, target in _batches(6, 4):
        out, expected = bag(ids, offsets), ref(ids, offsets)
        assert out.dtype == torch.float64
        ((out - target.double()) ** 2).sum().backward()
        ((expected - target.double()) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    np.testing.assert_allclose(store.lookup("t", np.arange(ROWS)), ref.weight.detach().numpy(),
                               rtol=1e-12, atol=1e-12)


def _collection_of_tables(n):
    tables = [embstore.TableSpec(f"t{i}", dim=4, init=embstore.init.Uniform(-1, 1, seed=i),
                                 optimizer=embstore.optim.Adam(lr=0.1)) for i in range(n)]
    features = {f"f{i}": f"t{i}" for i in range(n)}
    feats = {f"f{i}": (torch.tensor([i, i + 1, 2]), torch.tensor([2, 1])) for i in range(n)}
    return tables, features, feats


def test_collection_fetches_and_updates_all_its_tables_in_one_call_each(monkeypatch):
    tables, features, feats = _collection_of_tables(6)
    store = embstore.open(None, tables=tables)
    # the update of every table in one call: the store's own entry for summed gradients
    calls = {"lookup_many": 0, "_apply_summed_gradients": 0}
    for name in calls:
        real = getattr(store, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, spy)
    ebc = et.EmbeddingBagCollection(store, features, mode="mean")
    for _ in range(2):
        (ebc(feats).values() ** 2).sum().backward()
    assert calls == {"lookup_many": 2, "_apply_summed_gradients": 2}
    # the same steps as one module per table, each applying its own update
    reference = embstore.open(None, tables=tables)
    bags = {f: et.EmbeddingBag(reference, t, mode="mean") for f, t in features.items()}
    for _ in range(2):
        for f, bag in bags.items():
            values, lengths = feats[f]
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
            (bag(values, offsets) ** 2).sum().backward()
    for t in reference.tables:
        np.testing.assert_array_equal(store.lookup(t, np.arange(8)),
                                      reference.lookup(t, np.arange(8)))
        np.testing.assert_array_equal(store.lookup_state(t, np.arange(8)),
                                      reference.lookup_state(t, np.arange(8)))



class _PerTableStore:
    """A store with only the per-table calls the modules need (no `*_many`)."""

    def __init__(self, store):
        self._store = store

    def lookup(self, table, ids):
        return self._store.lookup(table, ids)

    def apply_gradients(self, table, ids, grads):
        self._store.apply_gradients(table, ids, grads)

    def table_spec(self, table):
        return self._store.table_spec(table)


def test_collection_works_over_a_store_without_the_calls_over_many_tables():
    tables, features, feats = _collection_of_tables(3)
    store, reference = embstore.open(None, tables=tables), embstore.open(None, tables=tables)
    for target in (_PerTableStore(store), reference):
        ebc = et.EmbeddingBagCollection(target, features, mode="sum")
        (ebc(feats).values() ** 2).sum().backward()
    for t in reference.tables:
        np.testing.assert_array_equal(store.lookup(t, np.arange(8)),
                                      reference.lookup(t, np.arange(8)))
    assert not np.array_equal(store.lookup("t0", np.arange(8)),
                              embstore.open(None, tables=tables).lookup("t0", np.arange(8)))


@pytest.mark.parametrize("tables", [1, 2])
def test_a_recording_store_logs_each_batch_as_the_model_used_it(tmp_path, tables):
    # the modules look up distinct ids; the access log must see the repeats (reuse within a
    # batch is what a profile's miss-ratio curves and lookups per sample are made of)
    from embstore._access_log import read_access_log

    names = [f"t{i}" for i in range(tables)]
    specs = [embstore.TableSpec(n, dim=4) for n in names]
    log = tmp_path / "log"
    with embstore.open(None, tables=specs, record_accesses=log) as store:
        ebc = et.EmbeddingBagCollection(store, {f"f{i}": n for i, n in enumerate(names)})
        values = torch.tensor([3, 3, 5, 7, 3, 5])
        lengths = torch.tensor([2, 1, 3])
        ebc({f"f{i}": (values + i, lengths) for i in range(tables)}).values().sum().backward()
        store.flush()
    for i, name in enumerate(names):
        assert [b.tolist() for b in read_access_log(log).batches(name)] == \
            [(values + i).tolist()]


@pytest.mark.parametrize("collection", [False, True])
@pytest.mark.parametrize("bad", ["inf", "overflowing sum"])
def test_a_gradient_that_is_not_finite_is_refused_and_changes_no_table(collection, bad):
    # the bag kernel checks the sums it writes, and the store then skips its own scan: a
    # gradient that is infinite, or whose per-row sum overflows, must still be refused
    store = embstore.open(None, tables=[embstore.TableSpec(
        name, dim=DIM, optimizer=embstore.optim.RowWiseAdagrad(0.1)) for name in ("t", "u")])
    for name in ("t", "u"):
        store.update(name, np.arange(ROWS), np.zeros((ROWS, DIM), np.float32))
    before = _table(store), store.lookup("u", np.arange(ROWS)).copy()
    ids = torch.tensor([1, 2, 2, 5])
    offsets = torch.tensor([0, 2])
    grad = torch.ones(2, DIM)
    if bad == "inf":
        grad[1, 3] = float("inf")
    else:  # id 2 is in both bags: 3e38 + 3e38 overflows
        grad[:, 0] = 3e38
    if collection:
        # two tables: one update call for both (the table "u" first takes a good step)
        ebc = et.EmbeddingBagCollection(store, {"g": "u", "f": "t"}, mode="sum")
        lengths = torch.tensor([2, 2])
        out = ebc({"g": (ids, lengths), "f": (ids, lengths)}).values()
        grad = torch.cat([torch.ones(2, DIM), grad], dim=1)  # a good step for "u"
    else:
        out = et.EmbeddingBag(store, "t", mode="sum")(ids, offsets)
    with pytest.raises(NonFiniteValueError):
        out.backward(grad)
    (weights, state), u_weights = before
    np.testing.assert_array_equal(store.lookup("t", np.arange(ROWS)), weights)
    np.testing.assert_array_equal(store.lookup_state("t", np.arange(ROWS)), state)
    np.testing.assert_array_equal(store.lookup("u", np.arange(ROWS)), u_weights)
