"""Misuse of a sharded store over 2 gloo processes on loopback: calls that differ between
ranks, bad input on one rank, damaged or mismatched files. Every rank raises an embstore
error at once, and nothing is changed or returned as good.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch", reason="embstore.distributed needs torch (the 'torch' extra)")

import _misuse as mu  # noqa: E402

from embstore.distributed import launch  # noqa: E402


@pytest.mark.timeout(60)
def test_calls_without_rows_that_differ_between_ranks_fail_on_every_rank() -> None:
    got = launch.run(mu.mismatched_small_calls, 2, timeout_s=50)
    assert got[0] == ["ConfigError", "ConfigError", "PeerFailedError", 6]
    assert got[1] == ["ConfigError", "ConfigError", "UnknownTableError", 6]


@pytest.mark.timeout(60)
def test_a_closed_store_refuses_every_call_on_every_rank_and_no_tables_is_no_rows() -> None:
    got = launch.run(mu.after_close_and_empty, 2, timeout_s=50)
    assert got[0] == got[1] == [{}, {}] + ["StoreClosedError"] * 8


@pytest.mark.timeout(60)
def test_open_refused_on_one_rank_fails_every_rank_at_once(tmp_path) -> None:
    got = launch.run(mu.open_refused_on_one_rank, 2, str(tmp_path / "s"), timeout_s=50)
    assert got[0] == ["PeerFailedError", "PeerFailedError", "ConfigError", "0"]
    assert got[1] == ["ConfigError", "ConfigError", "ConfigError", "0"]


@pytest.mark.timeout(60)
def test_a_store_of_record_that_may_drop_rows_is_refused_on_every_rank(tmp_path) -> None:
    # each rank's admission or eviction saw only its own shard: the rows kept differed from
    # one store's
    got = launch.run(mu.policies_that_drop_rows, 2, str(tmp_path), timeout_s=50)
    assert got == [[True] * 4 + [20]] * 2


@pytest.mark.slow  # waits out a group's timeout (13 s): the slow job
@pytest.mark.timeout(60)
def test_a_timeout_with_a_group_is_refused_and_errors_name_the_groups_timeout() -> None:
    # the timeout was ignored with group= and the error said "within 300 s"
    got = launch.run(mu.group_and_timeout, 2, timeout_s=50)
    assert got[0] == ["ConfigError", "ConfigError", True]
    assert got[1] == ["ConfigError", "PeerFailedError"]


@pytest.mark.timeout(60)
def test_calls_of_several_tables_are_checked_as_one_store_checks_them() -> None:
    # a list raised a raw TypeError, and a third item in a pair was ignored, where one store
    # refuses both; a table named '_no_shards' was the placeholder of a rank without shards
    got = launch.run(mu.many_calls_checked_as_one_store, 2, timeout_s=50)
    assert got[0] == ["PeerFailedError"] * 5 + [0, "ConfigError"]
    assert got[1] == [True] * 5 + [0, "ConfigError"]


def _resign(meta_file, edit) -> None:
    """Edit a sharded checkpoint's record and make its checksum again (a careless tool)."""
    from embstore.manifest import json_checksum

    meta = json.loads(meta_file.read_text())
    meta.pop("checksum")
    edit(meta)
    meta["checksum"] = json_checksum(meta)
    meta_file.write_text(json.dumps(meta))


@pytest.mark.slow  # a dozen damaged records, each over two ranks (17 s): the slow job
@pytest.mark.timeout(90)
def test_damaged_missing_or_mismatched_shards_are_refused_on_every_rank(tmp_path) -> None:
    launch.run(mu.checkpointed, 2, str(tmp_path / "store"), str(tmp_path / "ckpt"),
               timeout_s=50)
    # a later checkpoint of the same store, with other rows
    launch.run(mu.checkpointed, 2, str(tmp_path / "store"), str(tmp_path / "later"),
               timeout_s=50)
    names = ["no-rank1", "bad-json", "other-columns", "flipped", "a-on-rank0-only",
             "one-rank", "rank1-of-another-checkpoint"]
    for name in names:
        shutil.copytree(tmp_path / "ckpt", tmp_path / name)
    shutil.rmtree(tmp_path / "no-rank1" / "rank1")
    (tmp_path / "bad-json" / "sharded.json").write_text('{"world_size": 2, "pl')
    _resign(tmp_path / "other-columns" / "sharded.json",
            lambda m: m["plan"]["tables"]["b"].update(columns=[0, 2, 6]))
    text = (tmp_path / "flipped" / "sharded.json").read_text()
    (tmp_path / "flipped" / "sharded.json").write_text(text.replace('"step": 1', '"step": 3'))
    _resign(tmp_path / "a-on-rank0-only" / "sharded.json",
            lambda m: m["plan"]["tables"]["a"].update(kind="table", ranks=[0]))

    def one_rank(m: dict) -> None:  # rank 1's shards not listed at all
        m.update(world_size=1, shard_seals=m["shard_seals"][:1])
        m["plan"].update(world_size=1)
        for t in m["plan"]["tables"].values():
            t.update(kind="table", ranks=[0], columns=[])

    _resign(tmp_path / "one-rank" / "sharded.json", one_rank)
    shutil.rmtree(tmp_path / "rank1-of-another-checkpoint" / "rank1")
    shutil.copytree(tmp_path / "later" / "rank1",
                    tmp_path / "rank1-of-another-checkpoint" / "rank1")
    shutil.rmtree(tmp_path / "store" / "rank1")  # this rank's rows must not read as new
    got = launch.run(mu.damaged, 2, str(tmp_path), names, timeout_s=80)
    assert got[0] == ["CorruptStoreError"] * len(names) + ["StoreExistsError",
                                                           "PeerFailedError"]
    assert got[1] == ["CorruptStoreError"] * len(names) + ["StoreExistsError",
                                                           "CorruptStoreError"]
    # a refused restore leaves nothing that opens as a store
    assert not any((tmp_path / f"out-{n}" / "sharded.json").exists() for n in names)


@pytest.mark.timeout(60)
def test_ranks_given_other_paths_or_steps_are_refused_on_every_rank_at_once(tmp_path
                                                                             ) -> None:
    got = launch.run(mu.ranks_disagree, 2, str(tmp_path), timeout_s=50)
    made = ["c", "d"]  # the two checkpoints every rank agreed on, nothing else
    assert got[0] == ["ConfigError"] * 4 + ["PeerFailedError", "ConfigError",
                                            "PeerFailedError", made]
    assert got[1] == ["ConfigError"] * 7 + [made]


@pytest.mark.timeout(60)
def test_a_checkpoint_one_rank_cannot_write_fails_every_rank_and_stays_incomplete(
        tmp_path) -> None:
    got = launch.run(mu.checkpoint_fails_on_one_rank, 2, str(tmp_path), timeout_s=50)
    done = str(["rank0", "rank1", "sharded.json"])
    assert got[0] == ["PeerFailedError", "ok", done]
    assert got[1] == ["StorageIOError", "ok", done]
    assert not (tmp_path / "c1" / "sharded.json").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("error", "raised"), [("embstore", "StorageIOError"),
                                               ("raw", "KeyError")])
def test_an_owner_that_fails_to_read_makes_the_lookup_fail_everywhere(error: str,
                                                                      raised: str) -> None:
    got = launch.run(mu.owner_read_fails, 2, error, timeout_s=50)
    rows = [[7.0] * 4] * 3
    assert got[0] == ["PeerFailedError", rows, rows]
    assert got[1] == [raised, rows, rows]


@pytest.mark.timeout(40)
def test_flush_and_stats_of_a_store_closed_on_one_rank_fail_every_rank_at_once() -> None:
    got = launch.run(mu.closed_on_one_rank, 2, timeout_s=30)
    assert got[0] == ["PeerFailedError", "PeerFailedError", 0]
    assert got[1] == ["StoreClosedError", "StoreClosedError", 0]


@pytest.mark.timeout(40)
def test_a_numpy_step_is_recorded_and_a_record_rank0_cannot_write_fails_every_rank(
        tmp_path) -> None:
    got = launch.run(mu.checkpoint_numpy_step_and_failed_record, 2, str(tmp_path),
                     timeout_s=30)
    assert got[0] == ["ok", "StorageIOError", False, "ok", 3]
    assert got[1] == ["ok", "PeerFailedError", False, "ok", 3]


@pytest.mark.timeout(40)
def test_a_refused_step_leaves_no_checkpoint_directory(tmp_path) -> None:
    got = launch.run(mu.checkpoint_bad_step_leaves_nothing, 2, str(tmp_path), timeout_s=30)
    assert got[0] == got[1] == ["ConfigError", "ConfigError", False, "ok"]


@pytest.mark.timeout(40)
def test_an_open_that_cannot_make_its_directory_or_record_fails_every_rank_at_once(
        tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    got = launch.run(mu.open_fails_to_make_or_publish, 2, str(tmp_path), timeout_s=30)
    assert got[0] == ["StorageIOError", "StorageIOError", False, 0]
    assert got[1] == ["PeerFailedError", "PeerFailedError", False, 0]


@pytest.mark.timeout(40)
def test_a_failed_restore_leaves_nothing_and_can_be_made_again(tmp_path) -> None:
    got = launch.run(mu.restore_fails_then_retried, 2, str(tmp_path), timeout_s=30)
    assert got[0] == ["PeerFailedError", False, 20]
    assert got[1] == ["StorageIOError", False, 20]


@pytest.mark.timeout(90)
def test_a_store_whose_record_is_gone_or_unreadable_is_refused_not_made_anew(tmp_path) -> None:
    # the record removed or a dangling link: reopening with tables= once made a new store
    # over the old shards, serving most of their rows as never written
    launch.run(mu.checkpointed, 2, str(tmp_path / "store"), str(tmp_path / "ckpt"),
               timeout_s=50)
    for name in ("removed", "dangling", "deep", "huge-world"):
        shutil.copytree(tmp_path / "store", tmp_path / name)
    (tmp_path / "removed" / "sharded.json").unlink()
    (tmp_path / "dangling" / "sharded.json").unlink()
    (tmp_path / "dangling" / "sharded.json").symlink_to(tmp_path / "nowhere.json")
    (tmp_path / "deep" / "sharded.json").write_text("[" * 100_000 + "]" * 100_000)
    meta = json.loads((tmp_path / "huge-world" / "sharded.json").read_text())
    meta["plan"]["world_size"] = 1e400
    (tmp_path / "huge-world" / "sharded.json").write_text(
        json.dumps(meta).replace("Infinity", "1e400"))
    got = launch.run(mu.record_gone, 2, str(tmp_path), timeout_s=80)
    assert got[0] == got[1] == ["CorruptStoreError"] * 4
    assert not (tmp_path / "removed" / "sharded.json").exists()
    assert (tmp_path / "dangling" / "sharded.json").is_symlink()


@pytest.mark.timeout(60)
def test_a_count_of_rows_one_rank_lost_fails_every_rank_at_once(tmp_path) -> None:
    got = launch.run(mu.lost_rows_on_one_rank, 2, str(tmp_path), timeout_s=50)
    assert got[0] == [40, "CorruptStoreError", 0]
    assert got[1] == [40, "PeerFailedError", 0]
