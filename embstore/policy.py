"""Admission and eviction policy interfaces.

A tier *composes* one eviction and one admission policy; policies never touch storage. Each
policy works on whole batches of int64 ids and keeps its state in numpy arrays (no Python
object per id). Time and randomness are injected: `now` is passed to every call (the tier uses
a logical clock, the batch counter, so runs are reproducible) and randomness comes from a
`numpy.random.Generator` seeded from the `seed` setting. Adding a policy is adding
`policies/<name>.py` with one public class whose `name` equals the module name.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from ._named import number_setting
from .errors import ConfigError

if TYPE_CHECKING:
    from .index import IdIndex

__all__ = ["AdmissionPolicy", "EvictionPolicy", "Policy", "SupportsSharedIndex", "real_setting",
           "whole_setting"]

P = TypeVar("P", bound="Policy")


def whole_setting(owner: str, setting: str, value: Any, least: int, most: int) -> int:
    """`value` as an int in [least, most]: a whole-number setting of policy `owner`.

    A float with no fraction (2.0) counts as its int: manifests written before this check
    hold settings as the user gave them, and such a store must still open.

    Raises:
        ConfigError: a bool, a float with a fraction, NaN or infinity, anything else that is
            not a number, or out of range.
    """
    if isinstance(value, (float, np.floating)) and np.isfinite(value) \
            and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not least <= value <= most:
        raise ConfigError(f"{owner} {setting} must be a whole number in [{least}, {most}], "
                          f"got {value!r}")
    return int(value)


def real_setting(owner: str, setting: str, value: Any, low: float, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a finite float in [low, high]: a real-number setting of policy `owner`.

    `low_open`, `high_open`: the bound itself is out of range (an open end of the interval);
    with no `high` any finite number from `low` up is taken.

    Raises:
        ConfigError: a bool (True is an int to Python, but no share or period), a string or
            anything else that is not a number, NaN or infinity, or out of range.
    """
    interval = (("(" if low_open else "[") + f"{low:g}, {high:g}"
                + (")" if high_open or high == math.inf else "]"))
    try:
        number = number_setting(f"{owner} {setting}", value)
    except ConfigError:
        number = math.nan  # not a number: refused below, with the range in the message
    if not (math.isfinite(number)
            and (low < number if low_open else low <= number)
            and (number < high if high_open else number <= high)):
        raise ConfigError(f"{owner} {setting} must be a finite number in {interval}, got "
                          f"{value!r}")
    return number


class Policy(ABC):
    """Common base: a registered name, a family (`kind`) and its settings.

    Subclasses take their settings as keyword-only constructor arguments, all JSON-serialisable,
    and return them from `config()` so a store's manifest can recreate the policy on reopen.
    """

    name: ClassVar[str]
    kind: ClassVar[str]

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = whole_setting(type(self).__name__, "seed", seed, 0, 2**63 - 1)
        self.rng = np.random.default_rng(self.seed)

    def config(self) -> dict[str, Any]:
        """Constructor settings, JSON-serialisable; `type(self)(**config())` recreates it."""
        return {"seed": self.seed}

    @classmethod
    def setting_names(cls) -> list[str]:
        """The settings the policy's constructor takes, sorted."""
        return sorted(name for name, p in inspect.signature(cls).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @classmethod
    def from_options(cls: type[P], options: Mapping[str, Any]) -> P:
        """The policy built from its `options` (keyword settings).

        Raises:
            ConfigError: options that are no mapping, a setting the policy does not take
                (the message lists those it takes), or a bad value.
        """
        what = f"{cls.kind} policy {cls.name!r}"
        if not isinstance(options, Mapping):
            raise ConfigError(f"{what}: its options must be a dict of settings, got "
                              f"{options!r}")
        takes = cls.setting_names()
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise ConfigError(f"{what} takes no setting {unknown[0]!r}; its settings: "
                              f"{', '.join(takes)}")
        try:
            return cls(**options)
        except (TypeError, ValueError, OverflowError) as exc:  # a value it cannot take
            raise ConfigError(f"{what}: bad options {dict(options)!r} ({exc})") from exc


def as_ids(ids: np.ndarray) -> np.ndarray:
    """`ids` as a C-contiguous int64 array (the index kernels need one)."""
    return np.ascontiguousarray(ids, dtype=np.int64)


_NO_IDS = np.zeros(0, dtype=np.int64)


class EvictionPolicy(Policy):
    """Tracks the ids resident in a tier and decides which to evict.

    The public methods are concrete: they convert ids to C-contiguous int64 once, skip empty
    batches and bound `n`, then call the hooks subclasses implement (`_record_access`,
    `_record_insert`, `_record_remove`, `_choose_victims`), always with at least one id.

    Contract for implementers:
        - `_record_insert` is called with distinct ids that are not tracked yet.
        - `_record_access` may receive duplicates and ids it does not track (ignore those).
        - `_record_remove` drops ids (absent ones are ignored).
        - `_choose_victims(n, now)` gets 1 <= n <= len(self), returns n distinct tracked ids
          and stops tracking them; the same state and calls give the same victims.
        - `_advance(now)` runs first in every call that passes `now`, empty batches included
          (for policies whose state decays with time).
    """

    kind: ClassVar[str] = "eviction"

    def record_access(self, ids: np.ndarray, now: float) -> None:
        """Note reads or writes of `ids` (int64[N], duplicates allowed) at time `now`."""
        self._advance(now)
        if len(ids):
            self._record_access(as_ids(ids), now)

    def record_insert(self, ids: np.ndarray, now: float) -> None:
        """Start tracking distinct, untracked `ids` (int64[N]) inserted at time `now`."""
        self._advance(now)
        if len(ids):
            self._record_insert(as_ids(ids), now)

    def record_remove(self, ids: np.ndarray) -> None:
        """Stop tracking `ids` (int64[N]); untracked ids are ignored."""
        if len(ids):
            self._record_remove(as_ids(ids))

    def choose_victims(self, n: int, now: float) -> np.ndarray:
        """Pick up to `n` tracked ids to evict (int64[min(n, len)]) and stop tracking them."""
        self._advance(now)
        n = min(int(n), len(self))
        if n <= 0:
            return _NO_IDS.copy()
        return self._choose_victims(n, now)

    def expired(self, now: float) -> np.ndarray:
        """Tracked ids whose time is up regardless of pressure (TTL); untracks them.

        Note for implementers: the default expires nothing.
        """
        return _NO_IDS.copy()

    def _advance(self, now: float) -> None:
        """Bring time-dependent state to `now`.

        Note for implementers: the default does nothing.
        """

    @abstractmethod
    def _record_access(self, ids: np.ndarray, now: float) -> None:
        """`record_access` of a non-empty batch of C-contiguous int64 ids."""

    @abstractmethod
    def _record_insert(self, ids: np.ndarray, now: float) -> None:
        """`record_insert` of a non-empty batch of C-contiguous int64 ids."""

    @abstractmethod
    def _record_remove(self, ids: np.ndarray) -> None:
        """`record_remove` of a non-empty batch of C-contiguous int64 ids."""

    @abstractmethod
    def _choose_victims(self, n: int, now: float) -> np.ndarray:
        """`choose_victims` for 1 <= n <= len(self)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked ids."""


class AdmissionPolicy(Policy):
    """Decides which ids may enter a tier.

    `admit` is concrete: it converts ids once and answers an empty batch itself, then calls
    `_admit`, which subclasses implement.
    """

    kind: ClassVar[str] = "admission"

    def admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        """bool[N]: whether each of `ids` (int64[N], duplicates allowed) may enter now.

        A call also counts as an observation of the ids (a frequency policy learns from it).
        Duplicates of one id in a batch get the same answer.
        """
        if not len(ids):
            return np.zeros(0, dtype=bool)
        return self._admit(as_ids(ids), now)

    @abstractmethod
    def _admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        """`admit` of a non-empty batch of C-contiguous int64 ids."""


@runtime_checkable
class SupportsSharedIndex(Protocol):
    """An eviction policy that can track ids in the slots of its tier backend's `IdIndex`.

    After `share_index(index)` (called on an empty policy), the tier reports hits and
    inserts by slot (`record_access_slots`, `record_insert_slots`) and takes victims with
    their slots (`choose_victim_slots`), sparing a hash probe per call. The backend adds ids
    to the index before they are inserted here and removes them only after `record_remove`
    or a victim choice untracked them; the policy never modifies the index.
    """

    def share_index(self, index: IdIndex) -> None:
        """Track ids in the slots of `index` from now on."""

    def record_access_slots(self, slots: np.ndarray, now: float) -> None:
        """`record_access` for ids given by their slots (int32[N]) in the shared index."""

    def record_insert_slots(self, ids: np.ndarray, slots: np.ndarray, now: float) -> None:
        """`record_insert` of `ids` that the backend has just added at `slots`."""

    def choose_victim_slots(self, n: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """`choose_victims`, with the victims' slots (int32) in the shared index."""
