"""A pipeline over a sharded store serves rows that hold every write made before the forward."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="embstore.distributed needs torch (the 'torch' extra)")

import _pipeline_writes as pw  # noqa: E402

from embstore.distributed import launch  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["own write", "module after a backward"])
def test_writes_between_handing_out_a_batch_and_its_forward_reach_its_rows(variant: str) -> None:
    # rows read when the batch was handed out missed them: the pipeline's table drifted
    assert launch.run(pw.pipelined_equals_loop, 2, variant, timeout_s=100) == [True, True]
