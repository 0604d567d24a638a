"""All-to-all exchanges of byte buffers over a torch.distributed group (gloo or NCCL).

Every exchange is collective: each rank passes one buffer per destination rank and gets one
buffer per source rank, in rank order. A failure of the transport (a peer that died, a peer
that stopped calling, the group's timeout) becomes `PeerFailedError`, and ranks that made
different calls are caught by a signature sent with the sizes.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError, EmbstoreError, PeerFailedError, ShardsDivergedError

__all__ = ["Comm", "as_bytes", "group_timeout"]

_REJECTED = -1
"""The signature a rank sends in place of a call whose input it rejected."""
_DIVERGED = -2
"""The signature a rank sends in place of every call once its shards may disagree."""


def as_bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array viewed as uint8[nbytes]."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> float | None:
    """The timeout `group` was created with, in seconds; None where torch does not say.

    Read through torch's private backend options (torch has no public getter): a torch
    that lacks them gives None, and messages then name the group's timeout without a number.
    """
    try:
        backend: Any = (group or dist.group.WORLD)._get_backend(device)  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def signature(text: str) -> int:
    """A stable 31-bit digest of a call's description."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass
class Traffic:
    """Bytes this rank sent to other ranks (itself excluded), and the minimum for the same calls.

    The minimum sends each distinct id and each distinct row (or gradient row) once per owner.
    """

    sent: int = 0
    minimum: int = 0
    exchanges: int = 0


class Comm:
    """The group, this rank's place in it, and the exchanges."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.traffic = Traffic()
        # an NCCL group moves CUDA tensors only: buffers are staged on this rank's GPU
        nccl = dist.get_backend(group) == "nccl"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if nccl
                       else torch.device("cpu"))
        self.timeout_s = group_timeout(group, self.device) if timeout_s is None else timeout_s
        """Seconds a collective waits for the others (None: the group's, not known)."""
        self.diverged: str | None = None
        """Why this rank's shards may disagree with the others' (None while they agree)."""

    @contextmanager
    def applying(self, what: str) -> Iterator[None]:
        """Around the local writes of a call whose exchange is done.

        The other ranks have applied their parts, so a failure here leaves the shards apart.
        This rank raises the failure; every later call on every rank raises
        `ShardsDivergedError`.
        """
        try:
            yield
        except BaseException as exc:
            self.diverged = (f"rank {self.rank} failed to apply its part of a {what} that the "
                             f"other ranks applied ({type(exc).__name__}: {exc})")
            raise

    def _signature(self, what: str) -> int:
        return _DIVERGED if self.diverged is not None else signature(what)

    def _fail(self, what: str, exc: BaseException) -> PeerFailedError:
        return PeerFailedError(
            f"rank {self.rank}: the collective {what} failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); another rank died, raised, or "
            f"did not make the same call within {self._within()}. Every rank must call the "
            "sharded store's methods in the same order; restart all ranks from the last "
            "checkpoint")

    def _within(self) -> str:
        return ("the group's timeout" if self.timeout_s is None
                else f"{self.timeout_s:g} s")

    def exchange(self, sends: list[np.ndarray], what: str,
                 recv_sizes: list[int] | None = None) -> list[np.ndarray]:
        """Send uint8 buffer `sends[r]` to every rank r; return the buffer from each rank.

        With `recv_sizes` the sizes are already known to both sides and not exchanged.
        """
        sizes = [len(s) for s in sends]
        if recv_sizes is None:
            sig = self._signature(what)
            meta = torch.tensor([[sig, n] for n in sizes], dtype=torch.int64,
                                device=self.device)
            got = torch.empty_like(meta)
            self._run(lambda: dist.all_to_all_single(got, meta, group=self.group), what)
            recv_sizes = self._check_calls(got.cpu(), sig, what)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        payload = np.concatenate(sends) if sends else np.empty(0, np.uint8)
        inp = torch.from_numpy(payload).to(self.device)
        self._run(lambda: dist.all_to_all_single(out, inp, recv_sizes, sizes, group=self.group),
                  what)
        out = out.cpu()
        self.traffic.sent += sum(n for r, n in enumerate(sizes) if r != self.rank)
        self.traffic.exchanges += 1
        data = out.numpy()
        bounds = np.cumsum([0, *recv_sizes])
        return [data[bounds[r]:bounds[r + 1]] for r in range(self.world)]

    def _check_calls(self, got: torch.Tensor, sig: int, what: str) -> list[int]:
        """The values the ranks sent with their signatures ([world, 2]), once all agree."""
        diverged = [r for r in range(self.world) if int(got[r, 0]) == _DIVERGED]
        if diverged:
            if self.diverged is None:
                self.diverged = (f"rank(s) {diverged} failed to apply their part of a write "
                                 "that this rank applied (their own error said why)")
            raise ShardsDivergedError(
                f"the sharded store's shards may no longer agree: {self.diverged}; every "
                "call on every rank raises this now: restart every rank from the last "
                "checkpoint (embstore.distributed.restore)")
        rejected = [r for r in range(self.world) if int(got[r, 0]) == _REJECTED]
        if rejected:
            raise PeerFailedError(
                f"rank(s) {rejected} rejected their input to {what!r} (their own error "
                "says why); nothing was changed on any rank and the store stays usable")
        bad = [r for r in range(self.world) if int(got[r, 0]) != sig]
        if bad:
            raise ConfigError(f"rank {self.rank} called {what!r} while rank(s) {bad} made "
                              "another call: every rank must call the sharded store's "
                              "methods in the same order, with the same tables")
        return [int(n) for n in got[:, 1]]

    def abort(self, what: str, exc: BaseException) -> None:
        """Take part in a call's first exchange only to say this rank rejected its input.

        The caller raises its own error `exc` next, the other ranks PeerFailedError.
        """
        meta = torch.tensor([[_REJECTED if self.diverged is None else _DIVERGED, 0]]
                            * self.world, dtype=torch.int64, device=self.device)
        got = torch.empty_like(meta)
        self._run(lambda: dist.all_to_all_single(got, meta, group=self.group), what)

    def all_ints(self, value: int, what: str) -> list[int]:
        """Every rank's int, in rank order, once every rank has made the same call `what`.

        Sent with the call's signature, as an exchange's sizes are: ranks that made another
        call (or an exchange) raise ConfigError, and a rank that rejected its input
        (`abort`) makes the others raise PeerFailedError, instead of pairing unrelated calls.
        """
        sig = self._signature(what)
        meta = torch.tensor([[sig, value]] * self.world, dtype=torch.int64, device=self.device)
        got = torch.empty_like(meta)
        self._run(lambda: dist.all_to_all_single(got, meta, group=self.group), what)
        return self._check_calls(got.cpu(), sig, what)

    def all_sum(self, value: int, what: str) -> int:
        """Sum of an int over the group (a call checked as `all_ints` checks it)."""
        return sum(self.all_ints(value, what))

    def barrier(self, what: str) -> None:
        """Wait for every rank to call `what` (a tiny checked exchange, within the timeout)."""
        self.all_sum(0, what)

    def gather_objects(self, obj: object, what: str) -> list[object]:
        """Every rank's `obj`, in rank order (a call checked as `all_ints` checks it)."""
        self.all_ints(0, what)
        out: list[object] = [None] * self.world
        self._run(lambda: dist.all_gather_object(out, obj, group=self.group), what)
        return out

    def agree(self, error: BaseException | None, what: str, value: Any = None,
              undo: Callable[[], None] | None = None) -> None:
        """Tell every rank whether this rank's part of `what` failed; raise if any did.

        Every rank calls it whatever happened to it, with the error it met (else None) and,
        optionally, a JSON value all ranks must share. A rank raises its own error; the
        others raise PeerFailedError naming it, at once; ranks whose values differ raise
        ConfigError. So no rank is left waiting in a collective that another one skipped.

        On a failure every rank first runs its `undo` (removing what it made), and, where the
        ranks could tell each other, waits for the others' before it raises: so no rank's
        next call finds what another rank has not yet removed.
        """
        mine = None if error is None else f"{type(error).__name__}: {error}"
        try:
            seen = cast(list[tuple[str | None, str]],
                        self.gather_objects((mine, json.dumps(value, sort_keys=True)), what))
        except BaseException:
            if undo is not None:
                undo()
            raise
        failed = [(r, e) for r, (e, _) in enumerate(seen) if e is not None]
        if error is None and failed:
            error = PeerFailedError(f"the {what} failed on rank {failed[0][0]} "
                                    f"({failed[0][1]}; its own error says why)")
        elif error is None and len({v for _, v in seen}) != 1:
            error = ConfigError(f"ranks disagree on the {what}; every rank must make the same "
                                "call with the same arguments (path or none, tables, tiers, "
                                "plan)")
        if error is None:
            return
        if undo is not None:
            undo()
            with contextlib.suppress(EmbstoreError):
                self.barrier(f"{what}: undone")
        raise error

    def _run(self, fn: object, what: str) -> None:
        try:
            fn()  # type: ignore[operator]
        except (RuntimeError, ValueError) as exc:
            raise self._fail(what, exc) from exc
