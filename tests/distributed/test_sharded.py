"""Sharded stores over 2 and 4 gloo processes on loopback: bit-identity with one process for
every kind of sharding, checkpoints resharded to another world size, and failures.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("torch", reason="embstore.distributed needs torch (the 'torch' extra)")

import _scenarios as sc  # noqa: E402

from embstore.distributed import launch  # noqa: E402
from embstore.errors import PeerFailedError  # noqa: E402


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_bit_identical_to_one_process(world: int) -> None:
    """Two plans (every kind of sharding, every optimizer) in one group of processes."""
    results = launch.run(sc.train_and_compare_plans, world, "ab", 4, timeout_s=150)
    for rank, per_plan in enumerate(results):
        for plan, res in zip("ab", per_plan, strict=True):
            assert res["bad"] == [], f"rank {rank}, plan {plan}: {res['bad']}"
    sent = sum(res["sent"] for per_plan in results for res in per_plan)
    assert sent > 0 and sum(res["minimum"] for per_plan in results for res in per_plan) <= sent


@pytest.mark.timeout(240)
def test_checkpoint_reshards_to_another_world_size(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    bad = launch.run(sc.checkpoint_run, 2, str(tmp_path / "two"), ckpt, 4, timeout_s=100)
    assert bad == [[], []]
    bad = launch.run(sc.restore_run, 4, ckpt, str(tmp_path / "four"), 2, 4, timeout_s=120)
    assert bad == [[], [], [], []]


@pytest.mark.timeout(120)
def test_a_half_precision_table_is_bit_identical_through_a_resharding_restore(tmp_path
                                                                             ) -> None:
    # its rounding is seeded by the table's step count: an owner given no ids in a step
    # used to skip the count, and a restore failed (DtypeMismatchError) on its rows
    assert launch.run(sc.half_precision_through_restore, 2, str(tmp_path),
                      timeout_s=100) == [[], []]


@pytest.mark.timeout(120)
def test_dead_rank_is_a_clear_error_not_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(PeerFailedError) as info:
        launch.run(sc.dies, 2, 5.0, timeout_s=90)
    message = str(info.value)
    assert "rank 0 failed: PeerFailedError" in message
    assert "same order" in message
    assert time.monotonic() - start < 80


@pytest.mark.timeout(120)
def test_ranks_making_different_calls_fail_on_every_rank() -> None:
    with pytest.raises(PeerFailedError) as info:
        launch.run(sc.mismatched, 2, timeout_s=90)
    message = str(info.value)
    assert "rank 0 failed: ConfigError" in message and "rank 1 failed: ConfigError" in message


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_nccl_group_and_cuda_modules_are_bit_identical() -> None:
    import torch

    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("needs a CUDA device and NCCL")
    world = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    bad = launch.run(sc.modules_on, world, "cuda", timeout_s=150, backend="nccl")
    assert bad == [[]] * world


@pytest.mark.timeout(120)
def test_modules_over_the_world_group_are_bit_identical() -> None:
    assert launch.run(sc.modules_on, 2, "cpu", timeout_s=100) == [[], []]


@pytest.mark.timeout(120)
def test_modules_with_ids_repeating_on_each_rank_are_bit_identical() -> None:
    # every rank's partial sum of an id went to its owner as one term: the global sum
    # differed from one store's, which adds the positions one by one in order
    assert launch.run(sc.modules_with_repeats, 3, timeout_s=100) == [[], [], []]


@pytest.mark.slow  # waits out the timeout: the slow job
@pytest.mark.timeout(120)
def test_a_rank_that_stops_calling_times_out_the_others() -> None:
    with pytest.raises(PeerFailedError) as info:
        launch.run(sc.stalls, 2, 3.0, timeout_s=60)
    # rank 0 caught the timeout (and returned); rank 1 exited without a result
    assert "rank 1 exited" in str(info.value) and "rank 0 failed" not in str(info.value)


@pytest.mark.timeout(120)
def test_input_rejected_on_one_rank_fails_every_rank_at_once_and_changes_nothing() -> None:
    got = launch.run(sc.rejects, 2, timeout_s=90)
    assert got[0] == ["PeerFailedError"] * 3
    assert got[1] == ["InvalidIdsError", "NonFiniteValueError", "UnknownTableError"]


def test_a_sharded_store_records_the_log_one_store_fed_the_ranks_in_order_would(
        tmp_path) -> None:
    from embstore._access_log import read_access_log
    from embstore.tools.cli import main

    logs, ref = tmp_path / "logs", tmp_path / "ref"
    launch.run(sc.records_accesses, 2, str(logs), str(ref), timeout_s=120)
    assert sorted(p.name for p in logs.iterdir()) == ["rank0", "rank1"]
    merged, single = read_access_log(logs), read_access_log(ref)
    assert sorted(merged.ids) == sorted(single.ids) == ["r_adagrad", "t_sgd"]
    for table in single.ids:
        assert np.array_equal(merged.offsets[table], single.offsets[table]), table
        assert np.array_equal(merged.ids[table], single.ids[table]), table
    assert len(merged.batches("t_sgd")) == 3 * 2 + 2  # 3 steps x 2 ranks, then 2 writes
    # and the profiler reads the directory as it reads the one store's log
    assert main(["profile", str(logs), "-o", str(tmp_path / "p1.json")]) == 0
    assert main(["profile", str(ref), "-o", str(tmp_path / "p2.json")]) == 0
    p1, p2 = (json.loads((tmp_path / f"p{k}.json").read_text()) for k in (1, 2))
    assert p1["tables"] == p2["tables"]


@pytest.mark.timeout(120)
def test_input_refused_on_one_rank_fails_that_steps_forward_on_every_rank() -> None:
    # the module's own checks (dtype, offsets) raised on the refusing rank alone: the other
    # rank's lookup was paired with its next call (a ConfigError later, or, pipelined, a step
    # trained against another step's batch, and a close that failed)
    cases = [(fault, pipeline) for fault in ("id outside the table", "float ids",
                                             "offsets out of order")
             for pipeline in (False, True)]
    got = launch.run(sc.bad_inputs_on_one_rank, 2, cases, timeout_s=110)
    for case, mine, theirs in zip(cases, got[0], got[1], strict=True):
        assert mine == (["ok", "PeerFailedError", "ok", "ok"], True), case
        assert theirs == (["ok", "InvalidIdsError", "ok", "ok"], True), case


@pytest.mark.timeout(120)
def test_a_write_failing_after_its_exchange_fails_every_later_call_on_every_rank(
        tmp_path) -> None:
    got = launch.run(sc.diverges, 2, str(tmp_path / "ckpt"), timeout_s=90)
    later = ["ShardsDivergedError"] * 4 + ["closed"]
    assert got[0] == ["NonFiniteValueError", *later]
    assert got[1] == ["no error", *later]  # the owner's failure came after the exchange
    assert not (tmp_path / "ckpt").exists()
