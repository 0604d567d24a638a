"""Misuse of a sharded store over 2 gloo processes on loopback: calls that differ between
ranks, bad input on one rank, damaged or mismatched files. Every rank raises an embstore
error at once, and nothing is changed or returned as good.
"""

from __future__ import annotations

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
    assert got[0] == got[1] == [{}, {}] + ["StoreClosedError"] * 6
