"""Run a function on N local processes joined in a gloo group on loopback (tests, demos).

`run(fn, nproc, *args)` starts `nproc` processes with torch.multiprocessing, each calling
``fn(rank, nproc, *args)`` after ``init_process_group("gloo")`` (or "nccl") on 127.0.0.1 with a
free port,
and returns their results in rank order. A rank that raises or dies makes `run` raise
`PeerFailedError` naming it, with its traceback; no process outlives `timeout_s`.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import PeerFailedError

__all__ = ["free_port", "run"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, nproc: int, port: int, timeout_s: float, backend: str, results: Any,
           fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nproc, timeout=timedelta(seconds=timeout_s))
        try:
            out = fn(rank, nproc, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException as exc:  # report every failure to the parent, then fail
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def run(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 120.0,
        start_method: str = "spawn", backend: str = "gloo") -> list[Any]:
    """``[fn(rank, nproc, *args) for rank in range(nproc)]``, each in its own process.

    `fn` and `args` must be picklable (a module-level function). `timeout_s` bounds the whole
    run and each collective of the group. `backend` "nccl" gives rank r the GPU
    r % device_count (NCCL needs one GPU per rank).

    Raises:
        PeerFailedError: a rank raised or exited without a result, or the run timed out.
    """
    ctx: Any = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, nproc, port, timeout_s, backend, results, fn,
                                                    args),
                         daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < nproc:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, out = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, out)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    break  # every rank has ended and nothing more is queued
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: out for r, (ok, out) in got.items() if not ok}
    missing = [r for r in range(nproc) if r not in got]
    if failed or missing:
        lines = [f"rank {r} failed: {msg}" for r, msg in sorted(failed.items())]
        lines += [f"rank {r} exited with code {procs[r].exitcode} and no result"
                  for r in missing]
        raise PeerFailedError("; ".join(line.splitlines()[0] for line in lines)
                              + "\n\n" + "\n".join(lines))
    return [got[r][1] for r in range(nproc)]
