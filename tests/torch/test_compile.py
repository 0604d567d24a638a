"""torch.compile of models holding the store's modules: they run eagerly, the rest compiles.

Dynamo cannot trace into the store (its cffi kernels, locks and files), so each module's
forward is a graph break. The tests use the "aot_eager" backend: it traces with dynamo and
AOT autograd like the default backend, without compiling C++, so a compiled model must train
bit for bit as the eager one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embstore
import embstore.torch as et

ROWS, DIM = 50, 4

# dynamo reads `.grad` of the tensors a graph break hands back and hides torch's warning
# about non-leaf tensors by replacing warnings.showwarning, which the suite's "error" filter
# never reaches: the warning is raised instead. Users see nothing of it.
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or recompile counts carried between tests
    yield
    torch._dynamo.reset()


def _store(path=None, tiers=None):
    tables = [embstore.TableSpec(name, dim=DIM, num_embeddings=ROWS,
                                 init=embstore.init.Uniform(-0.5, 0.5, seed=i),
                                 optimizer=embstore.optim.RowWiseAdagrad(lr=0.1))
              for i, name in enumerate(("a", "b"))]
    return embstore.open(path, tables=tables, tiers=tiers)


class _Model(torch.nn.Module):
    """One of each module beside dense layers, so graph breaks sit between compiled parts."""

    def __init__(self, store):
        super().__init__()
        self.bag = et.EmbeddingBag(store, "a", mode="sum")
        self.emb = et.Embedding(store, "b")
        self.ebc = et.EmbeddingBagCollection(store, {"x": "a", "y": "b"}, mode="mean")
        self.dense = torch.nn.Linear(3 * DIM, 1)

    def forward(self, batch):
        bag = self.bag(batch["ids"], batch["offsets"], batch["weights"])  # [B, DIM]
        emb = self.emb(batch["pairs"]).sum(dim=1)                          # [B, DIM]
        pooled = torch.relu(bag) * emb
        return self.dense(torch.cat([pooled, self.ebc(batch["features"]).values()], 1))


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.integers(0, 4, 6)
        feats = {f: (torch.from_numpy(rng.integers(0, ROWS, int(lengths.sum()))),
                     torch.from_numpy(lengths)) for f in ("x", "y")}
        ids = torch.from_numpy(rng.integers(0, ROWS, 12))
        out.append({"ids": ids, "offsets": torch.arange(0, 12, 2),
                    "weights": torch.from_numpy(rng.random(12).astype(np.float32)),
                    "pairs": torch.from_numpy(rng.integers(0, ROWS, (6, 2))),
                    "features": feats, "y": torch.from_numpy(rng.random((6, 1)) > 0.5).float()})
    return out


def _train(store, *, compiled, pipelined=False, steps=4):
    torch.manual_seed(0)
    model = _Model(store)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = _batches(steps)
    loop = (et.TrainPipeline(batches, inputs=lambda b: {model.bag: (b["ids"], b["offsets"],
                                                                    b["weights"]),
                                                         model.ebc: b["features"]})
            if pipelined else batches)
    losses = []
    for b in loop:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(run(b), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if pipelined:
        loop.close()
    ids = np.arange(ROWS)
    tables = {t: (store.lookup(t, ids).copy(), store.lookup_state(t, ids).copy())
              for t in ("a", "b")}
    return losses, tables, [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b):
    assert a[0] == b[0]
    for t in ("a", "b"):
        np.testing.assert_array_equal(a[1][t][0], b[1][t][0])
        np.testing.assert_array_equal(a[1][t][1], b[1][t][1])
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))


def test_compiled_model_trains_as_the_eager_one():
    with _store() as eager_store, _store() as compiled_store:
        eager = _train(eager_store, compiled=False)
        compiled = _train(compiled_store, compiled=True)
    _assert_same(eager, compiled)
    initial = _store()
    with initial:  # the steps changed the tables: the comparison above can tell
        assert not np.array_equal(initial.lookup("a", np.arange(ROWS)), compiled[1]["a"][0])


def test_compiled_model_through_a_pipeline_over_tiers_trains_as_in_line(tmp_path):
    tiers = [embstore.TierSpec("dram", capacity=8), embstore.TierSpec("rocksdb")]
    with _store() as in_line_store, _store(tmp_path / "s", tiers) as tiered:
        in_line = _train(in_line_store, compiled=True)
        torch._dynamo.reset()
        pipelined = _train(tiered, compiled=True, pipelined=True)
    _assert_same(in_line, pipelined)


def test_a_backward_through_a_compiled_model_in_eval_changes_nothing():
    # eval() must reach the store's modules through the compiled graph: a backward then
    # steps the dense layers' gradients only, never a table
    with _store() as store:
        model = _Model(store).eval()
        run = torch.compile(model, backend="aot_eager")
        batch = _batches(1)[0]
        before = {t: store.lookup(t, np.arange(ROWS)).copy() for t in ("a", "b")}
        out = run(batch)
        torch.testing.assert_close(out, model(batch), rtol=0, atol=0)
        out.sum().backward()
        assert model.dense.weight.grad is not None  # the backward ran
        for t in ("a", "b"):
            np.testing.assert_array_equal(store.lookup(t, np.arange(ROWS)), before[t])
        model.train()  # the same backward in train mode does step the tables
        run(batch).sum().backward()
        assert not np.array_equal(store.lookup("a", np.arange(ROWS)), before["a"])
