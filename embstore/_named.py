"""`Named`: a family of classes registered by name and rebuilt from their JSON settings.

Initializers and optimizers are both stored in the manifest as (name, config) and compared by
their settings; this is the one place that does it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

import numpy as np

from .errors import ConfigError, UnknownNameError

__all__ = ["Named", "number_setting"]


def number_setting(what: str, value: Any) -> float:
    """`value` as a float, or a ConfigError naming setting `what` (no strings, bools, None)."""
    # a timedelta64 is a numpy integer, but a duration, not a number
    if isinstance(value, (bool, np.timedelta64)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        raise ConfigError(f"{what} must be a number a float can hold, got {value!r}") from None

T = TypeVar("T", bound="Named")


class Named(ABC):
    """Base of a family of named, registered classes.

    The family's root sets `_family` and an empty `_registry`; every subclass that sets `name`
    is registered in it (a name used twice is an error). A class with `listed = False` is
    registered, so that stores naming it reopen, but left out of `registered_names`: it is an
    internal part of another component (a sharded table's column shard), not a user's choice.
    """

    name: ClassVar[str]
    listed: ClassVar[bool] = True
    _family: ClassVar[str]
    _registry: ClassVar[dict[str, type[Named]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name in cls._registry:
                raise ConfigError(f"{cls._family} name {cls.name!r} is registered twice")
            cls._registry[cls.name] = cls

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """Constructor settings, JSON-serialisable; `type(self)(**config())` recreates it."""

    @classmethod
    def registered_names(cls) -> list[str]:
        """Names of every listed registered class of the family."""
        return sorted(n for n, c in cls._registry.items() if c.__dict__.get("listed", True))

    @classmethod
    def from_config(cls: type[T], name: str, config: dict[str, Any]) -> T:
        """Recreate a member of the family from its registered name and `config()`.

        Raises:
            UnknownNameError: no class of that name in the family.
            ConfigError: `config` holds settings the class does not take, or bad values.
        """
        if name not in cls._registry:
            raise UnknownNameError(
                f"unknown {cls._family} {name!r}; registered: {cls.registered_names()!r}"
            )
        if not isinstance(config, dict):
            raise ConfigError(f"{cls._family} {name!r}: its config must be a dict of settings, "
                              f"got {config!r}")
        try:
            return cls._registry[name](**config)  # type: ignore[return-value]
        except TypeError as exc:  # a setting the class does not take, or one it lacks
            raise ConfigError(f"{cls._family} {name!r}: bad settings {config!r} ({exc}); give "
                              "the keyword arguments of its constructor") from exc

    def __eq__(self, other: object) -> bool:
        # as JSON, as the manifest keeps them: a NaN setting equals itself there
        return isinstance(other, Named) and type(other) is type(self) \
            and _as_json(other.config()) == _as_json(self.config())

    def __hash__(self) -> int:
        # JSON, not a tuple of items: config values may be lists (Adam's betas)
        return hash((self.name, _as_json(self.config())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def _as_json(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)
