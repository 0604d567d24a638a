"""TrainPipeline: exact results, errors handed over, no thread left behind, CUDA staging."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import embstore
import embstore.torch as et

ROWS = 200


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: dict
    label: torch.Tensor


def _batches(n, *, seed=0, overlap=0.9, bags=16):
    """Consecutive batches share most ids (the case where staleness would show)."""
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, ROWS, size=40)
    out = []
    for _ in range(n):
        sparse = {}
        for f in ("a", "b"):
            lengths = rng.integers(1, 4, size=bags)
            n_ids = int(lengths.sum())
            ids = np.where(rng.random(n_ids) < overlap, rng.choice(hot, size=n_ids),
                           rng.integers(0, ROWS, size=n_ids))
            sparse[f] = (torch.from_numpy(ids), torch.from_numpy(lengths))
        out.append(Batch(torch.from_numpy(rng.standard_normal((bags, 4)).astype(np.float32)),
                         sparse, torch.from_numpy(rng.random(bags).astype(np.float32))))
    return out


class Model(torch.nn.Module):
    def __init__(self, store):
        super().__init__()
        self.ebc = et.EmbeddingBagCollection(store, {"a": "t", "b": "u"}, mode="sum")
        torch.manual_seed(0)
        self.top = torch.nn.Linear(4 + 8 + 8, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse).values()
        return self.top(torch.cat([batch.dense, pooled], dim=1)).squeeze(1)


def _store(path=None, tiers=None):
    specs = [embstore.TableSpec(name, dim=8, init=embstore.init.Uniform(-0.1, 0.1, seed=i),
                                optimizer=embstore.optim.RowWiseAdagrad(lr=0.5))
             for i, name in enumerate(("t", "u"))]
    return embstore.open(path, tables=specs, tiers=tiers)


def _train(store, batches, *, depth=None, exact=True, stage_rows=None, read_threads=4,
           also=None, device="cpu"):
    """Train `batches`; `also(store, i)` runs after step i's update (the trainer's own writes)."""
    model = Model(store).to(device)
    opt = torch.optim.SGD(model.top.parameters(), lr=0.1)
    done = 0

    def step(batch):
        nonlocal done
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if also is not None:
            also(store, done)
        done += 1

    if depth is None:
        for batch in batches:
            step(batch)
    else:
        with et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse}, depth=depth,
                              exact=exact, stage_rows=stage_rows,
                              read_threads=read_threads) as pipe:
            seen = []
            for batch in pipe:
                step(batch)
                seen.append(batch)
        assert seen == list(batches)  # the same objects, in order
    tables = {t: (store.lookup(t, np.arange(ROWS)), store.lookup_state(t, np.arange(ROWS)))
              for t in ("t", "u")}
    return tables, [p.detach().clone() for p in model.top.parameters()]


def _assert_identical(a, b):
    for t in a[0]:
        np.testing.assert_array_equal(a[0][t][0], b[0][t][0])
        np.testing.assert_array_equal(a[0][t][1], b[0][t][1])
    for p, q in zip(a[1], b[1], strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("stage_rows", [False, True], ids=["prefetch", "staged"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_pipeline_is_bit_identical_to_the_plain_loop(depth, stage_rows):
    batches = _batches(12)
    plain = _train(_store(), batches)
    piped = _train(_store(), batches, depth=depth, stage_rows=stage_rows)
    _assert_identical(plain, piped)


@pytest.mark.parametrize("read_threads", [1, 4])
@pytest.mark.parametrize("stage_rows", [False, True], ids=["prefetch", "staged"])
def test_pipeline_over_a_small_cache_is_bit_identical(tmp_path, stage_rows, read_threads):
    batches = _batches(10, seed=3)
    tiers = [embstore.TierSpec("dram", capacity=30), embstore.TierSpec("rocksdb")]
    with _store(tmp_path / "a", tiers) as s:
        plain = _train(s, batches)
    with _store(tmp_path / "b", tiers) as s:
        piped = _train(s, batches, depth=3, stage_rows=stage_rows, read_threads=read_threads)
        # the pipeline moved rows up ahead of their lookups
        assert s.tier_statistics("t")[0].promotions > 0
    _assert_identical(plain, piped)


def test_prefetch_makes_the_forward_hit_the_dram_tier(tmp_path):
    tiers = [embstore.TierSpec("dram", capacity=500), embstore.TierSpec("rocksdb")]
    with _store(tmp_path / "s", tiers) as store:
        batches = _batches(6, overlap=0.0)
        for t in ("t", "u"):  # every row stored below, none cached
            store.update(t, np.arange(ROWS), np.zeros((ROWS, 8), np.float32))
        store.flush()
        store.close()
    with embstore.open(tmp_path / "s") as store:
        model = Model(store)
        before = store.tier_statistics("t")[0]
        with et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse}, depth=6) as pipe:
            for batch in pipe:
                model(batch)
        after = store.tier_statistics("t")[0]
        # the forwards' lookups all hit: the pipeline's prefetches had brought every row up
        assert after.lookups > before.lookups
        assert after.hits - before.hits == after.lookups - before.lookups


def test_the_tables_of_a_batch_are_read_concurrently(tmp_path, monkeypatch):
    # each table's read of the store of record waits until the other table's has begun: a
    # pipeline reading one table after the other breaks the barrier and fails the next step
    from embstore import _prefetch

    tiers = [embstore.TierSpec("dram", capacity=500), embstore.TierSpec("rocksdb")]
    with _store(tmp_path / "s", tiers) as store:
        for t in ("t", "u"):  # every row stored below, none cached
            store.update(t, np.arange(ROWS), np.zeros((ROWS, 8), np.float32))
    both_reading = threading.Barrier(2, timeout=10)
    read = _prefetch.PrefetchJob.read
    tables_read = []

    def read_together(job):
        tables_read.append(job.backend.spec.table)
        both_reading.wait()
        return read(job)

    monkeypatch.setattr(_prefetch.PrefetchJob, "read", read_together)
    with embstore.open(tmp_path / "s") as store:
        model = Model(store)
        batches = _batches(3, overlap=0.0)
        with et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse},
                              read_threads=2) as pipe:
            for batch in pipe:
                model(batch)
        assert sorted(tables_read[:2]) == ["t", "u"]
        assert not _pipeline_threads()


def test_without_refresh_the_staged_rows_are_stale():
    # the check above has teeth: skipping the refresh of updated rows changes the result
    batches = _batches(8)
    plain = _train(_store(), batches)
    stale = _train(_store(), batches, depth=2, exact=False, stage_rows=True)
    assert not np.array_equal(plain[0]["t"][0], stale[0]["t"][0])


def test_forward_on_other_arguments_falls_back_to_the_store():
    store = _store()
    batches = _batches(3)
    model = Model(store)
    with et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse}) as pipe:
        for batch in pipe:
            copy = {k: (v[0].clone(), v[1].clone()) for k, v in batch.sparse.items()}
            ids, lengths = copy["a"]
            rows = torch.from_numpy(store.lookup("t", ids.numpy()))
            bags = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
            expected = torch.zeros(len(lengths), 8).index_add_(0, bags, rows)
            out = model.ebc(copy)
            # the rows as the store holds them now, after the last step's update
            torch.testing.assert_close(out["a"], expected, rtol=0, atol=1e-6)
            out.values().sum().backward()


def _planned_on_this_thread(monkeypatch):
    """The number of forwards this thread planned itself (not served a pipeline's plan)."""
    from embstore.torch import modules

    calls = []
    real = modules.prepare

    def prepare(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(modules, "prepare", prepare)
    return calls


def _pipeline_threads():
    """The pipeline's thread and its readers."""
    return [t for t in threading.enumerate() if t.name.startswith("embstore-pipeline")]


def test_an_error_in_the_background_is_raised_at_the_next_step():
    store = _store()
    model = Model(store)
    good = _batches(3)

    def batches():
        yield from good
        raise RuntimeError("the data loader broke")

    steps = 0
    with pytest.raises(RuntimeError, match="data loader broke"), \
            et.TrainPipeline(batches(), inputs=lambda b: {model.ebc: b.sparse}) as pipe:
        for batch in pipe:
            model(batch).sum().backward()
            steps += 1
    assert steps == 3
    assert not _pipeline_threads()


def test_a_lookup_error_in_the_background_is_raised_in_order():
    store = embstore.open(None, tables=[embstore.TableSpec("t", dim=8, num_embeddings=ROWS),
                                        embstore.TableSpec("u", dim=8)])
    model = Model(store)
    batches = _batches(3)
    batches[1].sparse["a"] = (torch.tensor([ROWS + 5]), torch.ones(16, dtype=torch.long))
    steps = 0
    with pytest.raises(embstore.errors.InvalidIdsError), \
            et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse}) as pipe:
        for batch in pipe:
            model(batch)
            steps += 1
    assert steps == 1


def test_leaving_early_stops_the_thread():
    store = _store()
    model = Model(store)
    with et.TrainPipeline(_batches(50), inputs=lambda b: {model.ebc: b.sparse}, depth=3) as pipe:
        next(pipe)
        assert _pipeline_threads()
    assert not _pipeline_threads()
    assert model.ebc._staged is None


def test_bad_settings_are_refused():
    with pytest.raises(embstore.errors.ConfigError):
        et.TrainPipeline([], inputs=lambda b: {}, depth=0)
    for bad in (0, 1.5, True):
        with pytest.raises(embstore.errors.ConfigError, match="read_threads"):
            et.TrainPipeline([], inputs=lambda b: {}, read_threads=bad)
    with pytest.raises(embstore.errors.ConfigError), \
            et.TrainPipeline([1], inputs=lambda b: {"not a module": b}) as pipe:
        next(pipe)


@pytest.mark.parametrize(("setting", "match"), [
    # read for their truth before: "no" staged rows and kept them exact
    ({"exact": "no"}, "exact must be True or False"),
    ({"exact": 0}, "exact must be True or False"),
    ({"exact": None}, "exact must be True or False"),
    ({"exact": np.False_}, "exact must be True or False"),
    ({"stage_rows": "no"}, "stage_rows must be True, False or None"),
    ({"stage_rows": 1}, "stage_rows must be True, False or None"),
    ({"stage_rows": np.True_}, "stage_rows must be True, False or None"),
], ids=["exact-str", "exact-int", "exact-none", "exact-np-bool", "stage-rows-str",
        "stage-rows-int", "stage-rows-np-bool"])
def test_non_bool_switches_are_refused(setting, match):
    before = set(_pipeline_threads())
    with pytest.raises(embstore.errors.ConfigError, match=match):
        et.TrainPipeline([1], inputs=lambda b: {}, **setting)
    assert set(_pipeline_threads()) <= before  # refused before any thread started


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_is_bit_identical_to_the_cuda_loop():
    batches = _batches(10)
    gpu_batches = [Batch(b.dense.cuda(), {k: (v[0].cuda(), v[1].cuda())
                                          for k, v in b.sparse.items()}, b.label.cuda())
                   for b in batches]
    loop = _train(_store(), gpu_batches, device="cuda")
    staged = _train(_store(), gpu_batches, depth=2, device="cuda")
    on_cpu = _train(_store(), batches)
    for t in ("t", "u"):
        for part in (0, 1):  # weights, optimizer state
            assert staged[0][t][part].tobytes() == loop[0][t][part].tobytes(), (t, part)
        # the dense part on the CPU runs other kernels: the tables agree to rounding only
        np.testing.assert_allclose(staged[0][t][0], on_cpu[0][t][0], rtol=1e-4, atol=1e-5)


def test_an_unlocked_prefetch_never_promotes_a_row_changed_meanwhile(tmp_path):
    # the read of the store of record runs without the lock: a row deleted (or written back)
    # while it reads must not reach the DRAM tier from that read
    from embstore import _prefetch

    spec = embstore.TableSpec("t", dim=8, init=embstore.init.Constant(5.0))
    tiers = [embstore.TierSpec("dram", capacity=100), embstore.TierSpec("rocksdb")]
    with embstore.open(tmp_path / "s", tables=[spec], tiers=tiers) as store:
        ids = np.arange(20)
        store.update("t", ids, np.zeros((20, 8), np.float32))
        store.close()
    with embstore.open(tmp_path / "s") as store:  # caches start empty: all rows below
        chain = store._tables["t"].chain
        with store._mutex:
            missing, job = _prefetch.begin(chain, ids)
        assert job is not None and missing == 20
        rows, found = job.read()  # the bottom's zeros
        store.delete("t", np.array([3]))  # reads the initial value (5) from now on
        with store._mutex:
            _prefetch.end(chain, job, rows, found)
        assert not chain.watchers
        np.testing.assert_array_equal(store.lookup("t", np.array([3, 4])),
                                      [[5.0] * 8, [0.0] * 8])
        assert chain.tiers[0].backend.contains(np.array([4]))[0]  # the others came up


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (16, 4)])
def test_the_default_read_threads_leave_the_training_thread_its_core(monkeypatch, cores,
                                                                     threads):
    import embstore.torch.pipeline as pipeline

    monkeypatch.setattr(pipeline, "available_cores", lambda: cores)
    assert pipeline.default_read_threads() == threads
    with et.TrainPipeline([], inputs=lambda b: {}) as pipe:
        workers = 1 if pipe._readers is None else pipe._readers._max_workers
    assert workers == threads



@pytest.mark.parametrize("given", ["input", "input, offsets"])
def test_an_embedding_bag_given_fewer_arguments_than_forward_takes_is_served(given):
    # bag(ids) and bag(ids, offsets) are forward calls as valid as bag(ids, offsets, weights):
    # the pipeline takes the arguments as the model passes them and serves those forwards
    rng = np.random.default_rng(0)
    offsets = torch.tensor([0, 5, 9])
    batches = [torch.from_numpy(rng.integers(0, ROWS, size=(3, 4))) for _ in range(4)]
    if given == "input, offsets":
        batches = [(b.reshape(-1), offsets) for b in batches]

    def step(bag, b):
        (bag(b) if given == "input" else bag(*b)).sum().backward()

    results, served = [], []
    for pipelined in (False, True):
        store = _store()
        bag = et.EmbeddingBag(store, "t", mode="sum")
        if pipelined:
            with et.TrainPipeline(batches, inputs=lambda b, bag=bag: {bag: b},
                                  stage_rows=True) as pipe:
                for b in pipe:
                    served.append(bag._staged is not None)
                    step(bag, b)
                    served[-1] = served[-1] and bag._staged is None  # the forward took it
        else:
            for b in batches:
                step(bag, b)
        results.append(store.lookup("t", np.arange(ROWS)))
    np.testing.assert_array_equal(results[0], results[1])
    assert served == [True] * 4
    assert not _pipeline_threads()


@pytest.mark.parametrize("edit", ["torch", "numpy"])
def test_a_step_that_edits_its_ids_in_place_trains_on_the_edited_ids(edit):
    # the pipeline read the batch ahead; a step that rewrites its ids in place (hashing them
    # into the table, say) must train on the new ids, as the loop without it does. An edit
    # through a numpy view bumps no torch version counter
    def step(model, batch):
        for ids, _ in batch.sparse.values():
            if edit == "torch":
                ids.add_(7).remainder_(ROWS)
            else:
                view = ids.numpy()
                view[:] = (view + 7) % ROWS
        model(batch).sum().backward()

    results = []
    for pipelined in (False, True):
        store = _store()
        model = Model(store)
        batches = _batches(6)
        if pipelined:
            with et.TrainPipeline(batches, inputs=lambda b, m=model: {m.ebc: b.sparse},
                                  stage_rows=True) as pipe:
                for batch in pipe:
                    step(model, batch)
        else:
            for batch in batches:
                step(model, batch)
        results.append({t: store.lookup(t, np.arange(ROWS)) for t in ("t", "u")})
    for t in ("t", "u"):
        np.testing.assert_array_equal(results[0][t], results[1][t])


@pytest.mark.parametrize("read_threads", [1, 2])
def test_ids_out_of_one_table_are_refused_by_that_steps_forward(read_threads):
    # as in the loop without a pipeline: the forward of the bad batch raises, changes nothing,
    # and a loop that skips the batch goes on with the next ones
    def store():
        return embstore.open(None, tables=[
            embstore.TableSpec("t", dim=8, num_embeddings=ROWS,
                               init=embstore.init.Uniform(-0.1, 0.1, seed=0),
                               optimizer=embstore.optim.RowWiseAdagrad(lr=0.5)),
            embstore.TableSpec("u", dim=8, init=embstore.init.Uniform(-0.1, 0.1, seed=1),
                               optimizer=embstore.optim.RowWiseAdagrad(lr=0.5))])

    batches = _batches(5)
    ids, lengths = batches[2].sparse["a"]
    batches[2].sparse["a"] = (torch.cat([ids[:-1], torch.tensor([ROWS + 5])]), lengths)
    results = []
    for pipelined in (False, True):
        s = store()
        model = Model(s)
        trained, refused = [], []
        pipe = et.TrainPipeline(batches, inputs=lambda b, m=model: {m.ebc: b.sparse},
                                stage_rows=True, read_threads=read_threads) if pipelined \
            else contextlib.nullcontext(batches)
        with pipe as steps:
            for i, batch in enumerate(steps):
                before = s.lookup("t", np.arange(ROWS))
                try:
                    model(batch).sum().backward()
                    trained.append(i)
                except embstore.errors.InvalidIdsError:
                    refused.append(i)
                    np.testing.assert_array_equal(before, s.lookup("t", np.arange(ROWS)))
        assert (trained, refused) == ([0, 1, 3, 4], [2])
        results.append({t: s.lookup(t, np.arange(ROWS)) for t in ("t", "u")})
    for t in ("t", "u"):
        np.testing.assert_array_equal(results[0][t], results[1][t])
    assert not _pipeline_threads()


def test_bad_batches_and_inputs_are_config_errors():
    store = _store()
    model = Model(store)
    for bad in (5, None):
        with pytest.raises(embstore.errors.ConfigError, match="batches must be an iterable"):
            et.TrainPipeline(bad, inputs=lambda b: {model.ebc: b.sparse})
    with pytest.raises(embstore.errors.ConfigError, match="inputs must be a function"):
        et.TrainPipeline(_batches(2), inputs={model.ebc: None})
    with pytest.raises(embstore.errors.ConfigError, match="must return a mapping"), \
            et.TrainPipeline(_batches(2), inputs=lambda b: [model.ebc]) as pipe:
        next(pipe)
    assert not _pipeline_threads()


def test_stop_iteration_from_inputs_is_an_error_not_the_end_of_the_batches():
    def inputs(batch):
        raise StopIteration  # a next() on an exhausted iterator, say

    steps = 0
    with pytest.raises(RuntimeError, match="StopIteration"), \
            et.TrainPipeline(_batches(3), inputs=inputs) as pipe:
        for _ in pipe:
            steps += 1
    assert steps == 0
    assert not _pipeline_threads()


def test_a_pipeline_closed_before_its_end_refuses_to_iterate_again():
    store = _store()
    model = Model(store)
    with et.TrainPipeline(_batches(5), inputs=lambda b: {model.ebc: b.sparse}) as pipe:
        for _ in pipe:
            break
    # the rest of its batches would be skipped without a word
    with pytest.raises(embstore.errors.ConfigError, match="closed before its batches ended"):
        next(pipe)
    with et.TrainPipeline(_batches(2), inputs=lambda b: {model.ebc: b.sparse}) as pipe:
        assert len(list(pipe)) == 2
    with pytest.raises(StopIteration):  # one that ended stays ended
        next(pipe)


def test_a_pipeline_dropped_unclosed_leaves_no_thread_and_no_listener():
    # a loop left by break outside a with block: once the pipeline is dropped its thread
    # ends and it stops logging every later update (which it would keep for ever)
    import gc
    import time

    from embstore import _write_hooks

    store = _store()
    model = Model(store)
    listeners = len(_write_hooks._hooks)
    pipe = et.TrainPipeline(_batches(20), inputs=lambda b: {model.ebc: b.sparse}, depth=2,
                            stage_rows=True, read_threads=2)
    for i, batch in enumerate(pipe):
        model(batch).sum().backward()
        if i == 1:
            break
    del pipe, batch
    gc.collect()
    deadline = time.monotonic() + 3
    while _pipeline_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pipeline_threads()
    assert len(_write_hooks._hooks) == listeners
    assert model.ebc._staged is None


def _own_writes(store, i):
    """A trainer writing the store itself between steps, on ids the next batches hold."""
    hot = np.unique(np.concatenate([b.sparse["a"][0].numpy() for b in _batches(3)]))[:12]
    rng = np.random.default_rng(i)
    store.apply_gradients("t", hot, rng.standard_normal((len(hot), 8)).astype(np.float32))
    store.update("u", hot[::2], rng.standard_normal((len(hot[::2]), 8)).astype(np.float32))
    if i % 3 == 2:
        store.delete("t", hot[:3])
    if i == 4:
        store.bulk_load("u", hot[1::2], np.full((len(hot[1::2]), 8), 0.25, np.float32))


@pytest.mark.parametrize("stage_rows", [False, True], ids=["prefetch", "staged"])
def test_the_trainers_own_writes_between_steps_reach_the_staged_rows(stage_rows):
    # staged rows read ahead go stale on any write, not only the modules' updates: a trainer
    # that also calls update, apply_gradients, delete or bulk_load sees what the loop sees
    batches = _batches(10)
    plain = _train(_store(), batches, also=_own_writes)
    piped = _train(_store(), batches, depth=3, stage_rows=stage_rows, also=_own_writes)
    _assert_identical(plain, piped)


def test_closing_one_pipeline_keeps_the_plan_another_staged_on_a_shared_module(monkeypatch):
    store = _store()
    model = Model(store)
    first = et.TrainPipeline(_batches(4), inputs=lambda b: {model.ebc: b.sparse},
                             stage_rows=True)
    model(next(first)).sum().backward()  # the first pipeline has served the module
    with et.TrainPipeline(_batches(3, seed=1), inputs=lambda b: {model.ebc: b.sparse},
                          stage_rows=True) as second:
        batch = next(second)
        first.close()
        planned = _planned_on_this_thread(monkeypatch)
        model(batch)
        assert planned == []  # served the second pipeline's staged plan


def test_batches_made_in_inference_mode_are_served_from_the_staged_rows(monkeypatch):
    # such tensors have no version counter; their contents show they are unchanged
    with torch.inference_mode():
        batches = _batches(3)
    store = _store()
    model = Model(store)
    planned = _planned_on_this_thread(monkeypatch)
    with et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse},
                          stage_rows=True) as pipe:
        for batch in pipe:
            model(batch).sum().backward()
    assert planned == []
    plain = _store()
    plain_model = Model(plain)
    for batch in _batches(3):
        plain_model(batch).sum().backward()
    for t in ("t", "u"):
        np.testing.assert_array_equal(store.lookup(t, np.arange(ROWS)),
                                      plain.lookup(t, np.arange(ROWS)))


class TwoBags(torch.nn.Module):
    """Two bags over one table, each trained on its own loss.

    The second forward runs after the first one's backward has updated rows it staged.
    """

    def __init__(self, store):
        super().__init__()
        self.first = et.EmbeddingBag(store, "t", mode="sum")
        self.second = et.EmbeddingBag(store, "t", mode="sum")


@pytest.mark.parametrize("between", ["own-write", "earlier-backward"])
def test_writes_between_a_step_and_its_forward_reach_the_staged_rows(between):
    # the pipeline hands a batch over with its staged rows current; a trainer's own write
    # before the forward, or a first bag's backward before a second bag's forward on the
    # same table, changes rows after that: the forward must still see them as written
    batches = [tuple((ids, torch.cumsum(n, 0) - n) for ids, n in (b.sparse["a"], b.sparse["b"]))
               for b in _batches(8)]

    def train(piped):
        store = _store()
        bags = TwoBags(store)
        outputs = []

        def step(i, batch):
            if between == "own-write":
                ids = batch[1][0].numpy()
                store.update("t", ids, np.full((len(ids), 8), float(i), np.float32))
            else:
                bags.first(*batch[0]).sum().backward()
            out = bags.second(*batch[1])
            out.sum().backward()
            outputs.append(out.detach().clone())

        if not piped:
            for i, batch in enumerate(batches):
                step(i, batch)
        else:
            with et.TrainPipeline(batches, inputs=lambda b: {bags.first: b[0], bags.second: b[1]},
                                  stage_rows=True) as pipe:
                for i, batch in enumerate(pipe):
                    step(i, batch)
        return outputs, store.lookup("t", np.arange(ROWS))

    plain, piped = train(False), train(True)
    for x, y in zip(plain[0], piped[0], strict=True):
        assert torch.equal(x, y)
    np.testing.assert_array_equal(plain[1], piped[1])


class _Interrupted(BaseException):
    """Stands for Ctrl-C."""


def test_a_close_cut_short_drops_the_staged_plans_and_the_next_close_finishes_it():
    store = _store()
    model = Model(store)
    pipe = et.TrainPipeline(_batches(6), inputs=lambda b: {model.ebc: b.sparse},
                            stage_rows=True, read_threads=2)
    next(pipe)  # staged on the module, its forward not run
    shutdown = pipe._readers.shutdown
    calls = []

    def interrupted(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise _Interrupted  # a second Ctrl-C while close() waits for the threads
        shutdown(*args, **kwargs)

    pipe._readers.shutdown = interrupted
    with pytest.raises(_Interrupted):
        pipe.close()
    assert model.ebc._staged is None  # no staged row outlives the pipeline's log of writes
    pipe.close()
    assert calls and not _pipeline_threads()


def test_a_step_cut_short_as_it_stages_its_plan_leaves_nothing_staged(monkeypatch):
    store = _store()
    model = Model(store)
    stage = type(model.ebc).stage

    def stage_then_interrupt(module, plan):
        stage(module, plan)
        raise _Interrupted

    with pytest.raises(_Interrupted), et.TrainPipeline(
            _batches(4), inputs=lambda b: {model.ebc: b.sparse}, stage_rows=True) as pipe:
        monkeypatch.setattr(type(model.ebc), "stage", stage_then_interrupt)
        next(pipe)
    assert model.ebc._staged is None


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_rows_staged_for_a_step_that_did_not_use_them_never_serve_a_later_step(depth):
    def first_lookup(pipelined):
        spec = embstore.TableSpec("t", dim=4, optimizer=embstore.optim.SGD(lr=0.1))
        store = embstore.open(None, tables=[spec])
        bag = et.EmbeddingBag(store, "t", mode="sum")
        ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0])
        outs = []

        def step(b):
            if b == "write":  # declares the bag's inputs, then writes instead of calling it
                store.apply_gradients("t", np.array([1, 2, 3]), np.ones((3, 4), np.float32))
            else:
                outs.append(bag(ids, offsets).detach())

        batches = ["write", "read", "read"]
        if pipelined:
            with et.TrainPipeline(batches, depth=depth, stage_rows=True,
                                  inputs=lambda b: {bag: (ids, offsets)} if b == "write"
                                  else {}) as pipe:
                for b in pipe:
                    step(b)
        else:
            for b in batches:
                step(b)
        return outs[0]

    expected = first_lookup(False)
    assert (expected != 0).all()  # the write shows
    assert torch.equal(first_lookup(True), expected)


def test_a_close_from_another_thread_wakes_a_step_waiting_for_its_batch():
    store = _store()
    model = Model(store)
    release = threading.Event()

    def slow_batches():  # a source slower than the step: the loop waits in next()
        yield from _batches(1)
        release.wait(10)
        yield from _batches(1, seed=1)

    pipe = et.TrainPipeline(slow_batches(), inputs=lambda b: {model.ebc: b.sparse})
    next(pipe)
    threading.Timer(0.2, pipe.close).start()  # a watchdog, or a signal handler
    # close() joins the reading thread, which waits in the source: let the source go on
    threading.Timer(0.6, release.set).start()
    try:
        with pytest.raises(embstore.errors.ConfigError, match="closed before"):
            next(pipe)  # used to wait for ever
    finally:
        release.set()
        pipe.close()
    assert not _pipeline_threads()


class _RefreshInterrupted(BaseException):
    pass


@pytest.mark.parametrize("depth", [2, 4])
def test_a_step_interrupted_while_it_refreshes_its_rows_loses_only_its_batch(monkeypatch,
                                                                             depth):
    # the batch whose refresh was cut short is lost; every later step still sees exactly
    # what the plain loop that skips it sees (it used to raise a raw ValueError later)
    batches = _batches(12, overlap=1.0)
    again = embstore.EmbeddingStore._lookup_again
    calls = []

    def interrupted_once(self, table, ids):
        calls.append(table)
        if len(calls) == 1:
            raise _RefreshInterrupted
        return again(self, table, ids)

    monkeypatch.setattr(embstore.EmbeddingStore, "_lookup_again", interrupted_once)
    store = _store()
    model = Model(store)
    opt = torch.optim.SGD(model.top.parameters(), lr=0.1)
    trained, lost = [], []
    with et.TrainPipeline(batches, inputs=lambda b: {model.ebc: b.sparse}, depth=depth,
                          stage_rows=True) as pipe:
        for i in range(len(batches)):
            try:
                batch = next(pipe)
            except _RefreshInterrupted:
                lost.append(i)
                continue
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch),
                                                                        batch.label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            trained.append(batch)
        # the lost batch's mark is settled: only the batch in training waits on the log
        assert set(pipe._outstanding) <= {pipe._serving}
    assert len(lost) == 1 and len(trained) == len(batches) - 1
    got = ({t: (store.lookup(t, np.arange(ROWS)), store.lookup_state(t, np.arange(ROWS)))
            for t in ("t", "u")}, [p.detach().clone() for p in model.top.parameters()])
    _assert_identical(got, _train(_store(), trained))


@pytest.mark.parametrize("stage_rows", [False, True], ids=["prefetch", "staged"])
def test_the_access_log_of_a_pipelined_loop_is_the_plain_loops(tmp_path, stage_rows):
    from embstore._access_log_read import read_access_log

    def logged(pipelined):
        path = tmp_path / f"{pipelined}"
        spec = embstore.TableSpec("t", dim=4, num_embeddings=8,
                                  optimizer=embstore.optim.SGD(lr=0.1))
        store = embstore.open(path / "s", tables=[spec], record_accesses=path / "log",
                              record_sample=1.0)
        bag = et.EmbeddingBag(store, "t", mode="sum")
        batches = [torch.tensor([[1, 2], [2, 3]]) for _ in range(4)]
        loop = (et.TrainPipeline(batches, inputs=lambda b: {bag: b}, stage_rows=stage_rows)
                if pipelined else batches)
        for b in loop:
            bag(b).sum().backward()  # every step rewrites rows the next batch staged
        store.close()
        return [ids.tolist() for ids in read_access_log(path / "log").batches("t")]

    plain = logged(False)
    assert plain == [[1, 2, 2, 3]] * 4
    assert logged(True) == plain


def test_a_pipeline_with_nothing_staged_keeps_no_log_of_writes():
    store = _store()
    model = Model(store)
    pipe = et.TrainPipeline(_batches(3), inputs=lambda b: {model.ebc: b.sparse})
    try:
        next(pipe)  # read ahead on the CPU: prefetched, nothing staged
        deadline = time.monotonic() + 10
        while pipe._queue.qsize() < 3 and time.monotonic() < deadline:  # 2 batches, the end
            time.sleep(0.01)
        for _ in range(20):  # training elsewhere, while the pipeline waits
            store.apply_gradients("t", np.arange(ROWS), np.ones((ROWS, 8), np.float32))
        assert not pipe._log
    finally:
        pipe.close()
    staged = et.TrainPipeline(_batches(3), inputs=lambda b: {model.ebc: b.sparse},
                              stage_rows=True)
    next(staged)
    store.apply_gradients("t", np.arange(ROWS), np.ones((ROWS, 8), np.float32))
    assert staged._log  # rows staged ahead: the write is kept for their refresh
    staged.close()
    assert not staged._log  # and dropped with the pipeline


def test_a_close_from_another_thread_while_a_step_is_served_hands_out_no_stale_batch(
        monkeypatch):
    # close() ran between the step taking its batch and staging its rows: the step used to
    # stage rows read before the last update, with no log left to refresh them, and return
    # the batch; its forward then pooled the old rows
    store = embstore.open(None, tables=[embstore.TableSpec(
        "t", dim=4, optimizer=embstore.optim.SGD(lr=1.0))])
    store.update("t", np.arange(4), np.ones((4, 4), np.float32))
    bag = et.EmbeddingBag(store, "t", mode="sum")
    batch = (torch.tensor([0, 1]), torch.tensor([0]))
    pipe = et.TrainPipeline([batch, batch], inputs=lambda b: {bag: b}, depth=1,
                            stage_rows=True)
    bag(*next(pipe)).sum().backward()  # rows 0 and 1: 1.0 -> 0.0, after batch 1 was read
    refresh = et.TrainPipeline._refresh

    def closed_meanwhile(self, *args):
        closer = threading.Thread(target=self.close)
        closer.start()
        closer.join()
        return refresh(self, *args)

    monkeypatch.setattr(et.TrainPipeline, "_refresh", closed_meanwhile)
    with pytest.raises(embstore.errors.ConfigError, match="closed before"):
        next(pipe)
    assert bag._staged is None
    with torch.no_grad():
        assert bag(*batch).tolist() == [[0.0] * 4]  # the store's rows, not the staged ones
    assert not _pipeline_threads()
    store.close()
