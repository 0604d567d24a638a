"""The distributed trainer (tools/_demo_distributed.py) on a tiny model of its own."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="embstore.distributed needs torch (the 'torch' extra)")

import _tiny_job  # noqa: E402

from embstore.tools._demo_distributed import train_distributed  # noqa: E402

STEPS = 30


@pytest.mark.slow  # three demo runs (16 s); tests/test_demo.py keeps the one-process promise
@pytest.mark.timeout(240)
def test_two_processes_rerun_to_the_same_digest_and_follow_one_process() -> None:
    one = train_distributed(_tiny_job.tiny, 1, STEPS, timeout_s=100)
    two = train_distributed(_tiny_job.tiny, 2, STEPS, timeout_s=100)
    again = train_distributed(_tiny_job.tiny, 2, STEPS, timeout_s=100)
    assert two.digest == again.digest and two.losses == again.losses
    assert len(set(two.per_rank_digests)) == 1  # every rank sees the same tables and weights
    # same data and model: the curve follows one process's up to rounding of the sums
    assert np.allclose(two.losses, one.losses, rtol=1e-4, atol=1e-5), (one.losses, two.losses)
    assert np.mean(two.losses[-6:]) < 0.9 * np.mean(two.losses[:6])  # it learns
    assert one.bytes_per_step == 0 and two.bytes_per_step >= two.min_bytes_per_step > 0


@pytest.mark.slow  # the README's suite checks the same through `embstore demo --nproc 2`
@pytest.mark.timeout(120)
def test_the_pipeline_over_a_sharded_store_gives_the_same_bits() -> None:
    plain = train_distributed(_tiny_job.tiny, 2, 6, timeout_s=100)
    piped = train_distributed(_tiny_job.tiny, 2, 6, timeout_s=100, pipeline=True)
    assert piped.digest == plain.digest and piped.losses == plain.losses
