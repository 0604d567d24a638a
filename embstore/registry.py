"""Backends and policies by name.

`backends/*.py` and `policies/*.py` are listed with `pkgutil.iter_modules` without importing
them; a module is imported the first time its name is used, so `import embstore` pulls in
neither rocksdict nor lmdb. The registry name is the module name and equals the class's `name`.
Third-party packages add their own through the entry-point groups `embstore.backends` and
`embstore.policies` (value: ``"package.module:Class"``); a name registered twice is an error.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from .errors import BackendUnavailableError, ConfigError, UnknownNameError

__all__ = ["available_backend_names", "backend_names", "load_backend", "load_policy",
           "policy_names"]

_PACKAGES = {"backends": "embstore.backends", "policies": "embstore.policies"}
_SINGULAR = {"backends": "backend", "policies": "policy"}


@cache
def _sources(kind: str) -> dict[str, str]:
    """Map each registered name of `kind` to an import target ``module`` or ``module:attr``."""
    package = importlib.import_module(_PACKAGES[kind])
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        found[info.name] = f"{_PACKAGES[kind]}.{info.name}"
    for ep in entry_points(group=_PACKAGES[kind]):
        if ep.name in found:
            raise ConfigError(
                f"{_SINGULAR[kind]} name {ep.name!r} is registered twice ({found[ep.name]!r} and "
                f"entry point {ep.value!r}); uninstall one of the packages providing it"
            )
        found[ep.name] = ep.value
    return found


def _load(kind: str, name: str, base: type) -> Any:
    sources = _sources(kind)
    if name not in sources:
        raise UnknownNameError(
            f"unknown {_SINGULAR[kind]} {name!r}; registered: {sorted(sources)!r}"
        )
    target = sources[name]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise BackendUnavailableError(
            f"{_SINGULAR[kind]} {name!r} cannot be loaded: the module {missing!r} is missing "
            f"({exc}); install it (`pip install {missing}`) or reinstall embstore with its "
            "dependencies"
        ) from exc
    if attr:
        cls = getattr(module, attr)
    else:
        candidates = [
            getattr(module, n) for n in getattr(module, "__all__", ())
            if isinstance(getattr(module, n), type) and issubclass(getattr(module, n), base)
        ]
        if len(candidates) != 1:
            raise ConfigError(
                f"{module_name} must export exactly one {base.__name__} in __all__, "
                f"found {len(candidates)}"
            )
        cls = candidates[0]
    if getattr(cls, "name", None) != name:
        raise ConfigError(f"{cls.__qualname__}.name must be {name!r} to match its registry name")
    return cls


def backend_names() -> list[str]:
    """Names of every registered backend, whether or not its dependencies are installed."""
    return sorted(_sources("backends"))


def available_backend_names() -> list[str]:
    """Names of the registered backends that load on this machine (imports each of them)."""
    names = []
    for name in backend_names():
        try:
            load_backend(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def load_backend(name: str) -> Any:
    """Import and return the backend class registered as `name`.

    Raises:
        UnknownNameError: no backend of that name.
        BackendUnavailableError: its module or a library it needs cannot be imported.
    """
    from .backend import Backend

    return _load("backends", name, Backend)


def policy_names(kind: str | None = None) -> list[str]:
    """Names of registered policies; `kind` ("eviction" or "admission") filters by family.

    Filtering imports the policy modules (numpy only); listing all of them imports nothing.
    """
    names = sorted(_sources("policies"))
    if kind is None:
        return names
    return [n for n in names if load_policy(n).kind == kind]


def load_policy(name: str) -> Any:
    """Import and return the policy class registered as `name`.

    Raises:
        UnknownNameError: no policy of that name.
    """
    from .policy import Policy

    return _load("policies", name, Policy)
