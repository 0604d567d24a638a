"""A typed wrapper around libpmem (PMDK), bound with cffi in ABI mode.

The declarations are compiled at install time into `embstore._kernels._libpmem_ffi` (see
`_kernels/build_libpmem.py`); the library itself, Debian's `libpmem.so.1`, is opened here with
`ffi.dlopen` on first use. Where it cannot be opened `load()` returns None and warns once with
`PmemFallbackWarning`; the pmem backend then maps its files with `mmap` and makes writes durable
with `msync`. Setting `EMBSTORE_PMEM_FORCE_MMAP=1` chooses that fallback even where libpmem is
present, so CI can test both paths.
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
import warnings
from typing import Any, Protocol, cast

from ._kernels._libpmem_ffi import ffi

__all__ = [
    "FORCE_MMAP_ENV",
    "LIBRARY_NAME",
    "LibPmem",
    "MapFlags",
    "Mapping",
    "MmapMapping",
    "PmemFallbackWarning",
    "PmemMapping",
    "force_mmap",
    "load",
    "map_file",
]

LIBRARY_NAME = "libpmem.so.1"
FORCE_MMAP_ENV = "EMBSTORE_PMEM_FORCE_MMAP"


class PmemFallbackWarning(UserWarning):
    """libpmem could not be loaded: pmem files are mapped with mmap and synced with msync.

    Data stays correct and durable on flush; only the persistence primitives differ (msync
    writes whole pages where pmem_persist flushes cache lines).
    """


class MapFlags(enum.IntFlag):
    """Flags of `pmem_map_file` (libpmem.h)."""

    CREATE = 1 << 0
    EXCL = 1 << 1
    SPARSE = 1 << 2
    TMPFILE = 1 << 3


class LibPmem(Protocol):
    """The libpmem functions embstore calls, as cffi exposes them."""

    def pmem_map_file(self, path: bytes, len: int, flags: int, mode: int,
                      mapped_lenp: Any, is_pmemp: Any) -> Any: ...
    def pmem_unmap(self, addr: Any, len: int) -> int: ...
    def pmem_is_pmem(self, addr: Any, len: int) -> int: ...
    def pmem_persist(self, addr: Any, len: int) -> None: ...
    def pmem_msync(self, addr: Any, len: int) -> int: ...
    def pmem_flush(self, addr: Any, len: int) -> None: ...
    def pmem_drain(self) -> None: ...
    def pmem_memcpy_persist(self, dest: Any, src: Any, len: int) -> Any: ...
    def pmem_errormsg(self) -> Any: ...
    def pmem_check_version(self, major: int, minor: int) -> Any: ...


_lib: LibPmem | None = None
_load_error: str | None = None
_warned = False


def force_mmap() -> bool:
    """Whether `EMBSTORE_PMEM_FORCE_MMAP` asks for the mmap + msync fallback."""
    return os.environ.get(FORCE_MMAP_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def load() -> LibPmem | None:
    """Open libpmem once per process; None (after one `PmemFallbackWarning`) if it is missing.

    Returns:
        The library, or None where it cannot be opened.
    """
    global _lib, _load_error, _warned
    if _lib is not None:
        return _lib
    try:
        lib = cast(LibPmem, ffi.dlopen(LIBRARY_NAME))
        if lib.pmem_check_version(1, 0) != ffi.NULL:
            raise OSError(f"{LIBRARY_NAME} is not a libpmem 1.x: {_errormsg(lib)}")
    except OSError as exc:
        _load_error = str(exc)
        if not _warned:
            _warned = True
            warnings.warn(
                f"libpmem cannot be loaded ({exc}); pmem tables fall back to mmap + msync. "
                "Install libpmem1 (Debian/Ubuntu: apt install libpmem1) to use persistent "
                "memory natively",
                PmemFallbackWarning,
                stacklevel=3,
            )
        return None
    _lib = lib
    return lib


def _errormsg(lib: LibPmem) -> str:
    msg = lib.pmem_errormsg()
    return ffi.string(msg).decode(errors="replace") if msg != ffi.NULL else ""


def _os_error(lib: LibPmem, what: str, path: str) -> OSError:
    err = ffi.errno or 0
    return OSError(err, f"{what}: {_errormsg(lib) or os.strerror(err)}", path)


class PmemMapping:
    """One file mapped whole with `pmem_map_file`; persists ranges of it.

    Attributes:
        address: the mapping's start as an integer (for numpy and kernels).
        length: mapped bytes (the file's size when mapped).
        is_pmem: whether the mapping is persistent memory (pmem_is_pmem), so cache flushes
            make stores durable; otherwise ranges are synced with pmem_msync.
    """

    def __init__(self, lib: LibPmem, path: str) -> None:
        """Map the existing file at `path`, all of it.

        Raises:
            OSError: pmem_map_file failed (errno and libpmem's message, with the path).
        """
        self._lib = lib
        self.path = path
        mapped_len = ffi.new("size_t *")
        is_pmem = ffi.new("int *")
        # the name as the OS holds it: a non-UTF-8 name decodes with surrogate escapes
        addr = lib.pmem_map_file(os.fsencode(path), 0, 0, 0, mapped_len, is_pmem)
        if addr == ffi.NULL:
            raise _os_error(lib, "pmem_map_file", path)
        self._addr: Any = addr
        self.length = int(mapped_len[0])
        self.address = int(ffi.cast("uintptr_t", addr))
        self.is_pmem = bool(is_pmem[0])

    def buffer(self) -> Any:
        """A writable buffer over the whole mapping (valid until `unmap`)."""
        return ffi.buffer(self._addr, self.length)

    def persist(self, offset: int, length: int) -> None:
        """Make bytes [offset, offset+length) durable.

        On persistent memory this flushes CPU cache lines (pmem_persist); elsewhere it is
        pmem_msync, which writes the pages the range touches.

        Raises:
            OSError: msync failed (e.g. EIO from the disk).
        """
        ptr = ffi.cast("char *", self._addr) + offset
        if self.is_pmem:
            self._lib.pmem_persist(ptr, length)
        elif self._lib.pmem_msync(ptr, length) != 0:
            raise _os_error(self._lib, "pmem_msync", self.path)

    def flush(self, offset: int, length: int) -> None:
        """Start making a range durable; `drain()` waits for every flushed range (pmem only)."""
        ptr = ffi.cast("char *", self._addr) + offset
        if self.is_pmem:
            self._lib.pmem_flush(ptr, length)
        elif self._lib.pmem_msync(ptr, length) != 0:
            raise _os_error(self._lib, "pmem_msync", self.path)

    def drain(self) -> None:
        """Wait until every range passed to `flush` is durable."""
        if self.is_pmem:
            self._lib.pmem_drain()

    def unmap(self) -> None:
        """Unmap; every buffer or view over the mapping is invalid afterwards. Idempotent.

        Raises:
            OSError: pmem_unmap failed.
        """
        if self._addr is None:
            return
        addr, self._addr = self._addr, None
        self.address = 0
        if self._lib.pmem_unmap(addr, self.length) != 0:
            raise _os_error(self._lib, "pmem_unmap", self.path)


class MmapMapping:
    """The fallback: a file mapped whole with Python's mmap, made durable with msync.

    Same interface as `PmemMapping`; `is_pmem` is always False.
    """

    is_pmem = False

    def __init__(self, fd: int, length: int, *, writable: bool) -> None:
        """Map `length` bytes of the open file `fd`, shared, writable or read-only."""
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._mm: mmap.mmap | None = mmap.mmap(fd, length, access=access)
        self.length = length
        self.address = int(ffi.cast("uintptr_t", ffi.from_buffer(self._mm)))

    def buffer(self) -> Any:
        """The mmap object (a buffer over the whole mapping, valid until `unmap`)."""
        return self._mm

    def persist(self, offset: int, length: int) -> None:
        """msync(MS_SYNC) the pages of bytes [offset, offset+length).

        Raises:
            OSError: msync failed.
        """
        assert self._mm is not None
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE  # msync wants a page-aligned start
        self._mm.flush(start, min(offset + length, self.length) - start)

    flush = persist

    def drain(self) -> None:
        """Nothing to wait for: msync has waited."""

    def unmap(self) -> None:
        """Unmap (every buffer over the mapping must be released first). Idempotent."""
        if self._mm is not None:
            mm, self._mm = self._mm, None
            self.address = 0
            mm.close()


Mapping = PmemMapping | MmapMapping


def map_file(lib: LibPmem | None, path: str, fd: int, size: int, *,
             writable: bool) -> Mapping:
    """Map the whole file, with libpmem when `lib` is given, else with mmap.

    mmap also serves a reader that may not open the file for writing (no permission, or a
    read-only file system), which pmem_map_file always does.

    Args:
        lib: libpmem from `load()`, or None for the mmap fallback.
        path: the file.
        fd: the same file, open (read-only for readers).
        size: the file's size in bytes (the mmap fallback maps this much).
        writable: whether stores into the mapping are allowed.

    Raises:
        OSError: the mapping failed.
    """
    if lib is not None:
        try:
            return PmemMapping(lib, path)
        except OSError as exc:
            # no permission to write the file, or a read-only file system (a checkpoint on
            # a read-only mount): a reader maps it read-only instead
            if writable or not (isinstance(exc, PermissionError) or exc.errno == errno.EROFS):
                raise
    return MmapMapping(fd, size, writable=writable)
