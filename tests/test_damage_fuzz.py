"""Damaged stores give documented errors only: a Hypothesis fuzzer in a child process.

The child (tests/_fuzz_damage.py) damages copies of one small store per backend, the manifest,
the written-id record and the media's headers included, and opens, reads, flushes and fscks
each one, under a cap on its address space. The parent requires it to exit normally (no
SIGBUS or SIGSEGV, no hang past the timeout, no MemoryError from a damaged size) having seen
only embstore errors and no wrong row. The README's suite runs 80 examples; the slow test
3,000.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).with_name("_fuzz_damage.py")


def _fuzz(tmp_path: Path, examples: int, seed: int, timeout: int) -> dict[str, int]:
    current = tmp_path / "current-example.json"
    # a session of its own: on failure or timeout its whole process group goes, fsck's
    # scanner children included (the child's own exit leaves them running)
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(FUZZER), str(tmp_path),
                             str(examples), str(seed)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the child stops itself on an example that hangs; this is a run that was slow overall
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        example = current.read_text() if current.exists() else "(none recorded)"
        pytest.fail(f"the fuzzer ran past {timeout} s; the example running: {example}\n"
                    f"stderr: {stderr[-5000:]}", pytrace=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        # in full (an assertion's message is cut short): the fault handler's trace and the
        # example that was running
        example = current.read_text() if current.exists() else "(none recorded)"
        pytest.fail(f"the fuzzer exited with {proc.returncode}; the example running: "
                    f"{example}\nstdout: {stdout[-3000:]}\nstderr: {stderr[-5000:]}",
                    pytrace=False)
    tally: dict[str, int] = json.loads(stdout.strip().splitlines()[-1])
    print(f"damage fuzz: {tally}")
    assert tally["examples"] == examples
    return tally


def test_damaged_stores_raise_only_embstore_errors(tmp_path):
    tally = _fuzz(tmp_path, 80, seed=1, timeout=500)
    assert tally["errors"] > 0  # the damage was seen, not only survived


@pytest.mark.slow
@pytest.mark.timeout(2500)  # the child's own limit is 2,400 s; the suite's 600 s is too short
def test_damaged_stores_raise_only_embstore_errors_3000_examples(tmp_path):
    _fuzz(tmp_path, 3000, seed=2, timeout=2400)
