"""Trace files (.npy, .npz) read for the simulator and `embstore profile`.

Each array's header is checked against the bytes that hold it before anything is allocated:
a damaged header that claims terabytes is refused, not attempted.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from pathlib import Path
from typing import IO

import numpy as np
from numpy.lib import format as npy_format

from embstore.errors import ConfigError

__all__ = ["read_arrays"]

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK"  # a local file header (PK\x03\x04), or the end record of an empty archive
_DEFLATE_MAX_RATIO = 1032  # deflate's limit: no member expands more than this


def read_arrays(path: str | Path) -> np.ndarray | dict[str, np.ndarray]:
    """The array of a .npy file, or every array of a .npz file by name.

    Each array's header is checked against the bytes that follow it before anything is
    allocated: a damaged header that claims terabytes is refused, not attempted.

    Raises:
        ConfigError: the path is a directory, or the file is not a numpy file this can read
            (empty, truncated, of pickled objects, not numpy's format at all), or too large
            for memory. The message names the file as ``trace 'PATH'``.
    """
    what = f"trace {str(path)!r}"
    if os.path.isdir(path):
        raise ConfigError(f"{what} is a directory, not a .npy or .npz file")
    try:
        with open(path, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
            f.seek(0)
            if not head:
                raise ConfigError(f"{what} is empty: not a .npy or .npz file")
            if head.startswith(_ZIP_MAGIC):
                return _read_npz(f, os.fstat(f.fileno()).st_size, what)
            if head == _NPY_MAGIC:
                return _read_npy(f, os.fstat(f.fileno()).st_size, what)
            raise ConfigError(f"{what} is neither a .npy array nor a .npz archive")
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it: {exc.strerror or exc}") from exc
    except MemoryError:
        raise ConfigError(f"{what} is too large to load into this machine's memory") from None


def _array_header(f: IO[bytes], space: int, what: str) -> None:
    """Read a .npy header from `f` and refuse it unless its data fits in `space` bytes.

    `space` is the size of the whole .npy (file or archive member); `f` is left after the
    header.
    """
    try:
        version = npy_format.read_magic(f)
    except (ValueError, EOFError):
        raise ConfigError(f"{what} is not a .npy array (no numpy header)") from None
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise ConfigError(f"{what} is not a .npy array numpy can read (bad header: format "
                          f"version {version[0]}.{version[1]})")
    # version 3 differs from 2 only in its header's text encoding, not its layout
    read = (npy_format.read_array_header_1_0 if version == (1, 0)
            else npy_format.read_array_header_2_0)
    try:
        shape, _, dtype = read(f)
    except (ValueError, EOFError):  # numpy's words for a cut or garbled header
        raise ConfigError(f"{what} is not a .npy array numpy can read (bad or truncated "
                          "header)") from None
    if dtype.hasobject:
        raise ConfigError(f"{what} holds Python objects (a pickled array), which are not "
                          "loaded: save the ids as an integer array")
    need = math.prod(shape) * dtype.itemsize
    have = space - f.tell()
    if need > have:
        raise ConfigError(f"{what} is truncated or damaged: its header promises an array of "
                          f"shape {tuple(shape)} {dtype} ({need:,} bytes) but {max(have, 0):,} "
                          "bytes follow")


def _read_npy(f: IO[bytes], size: int, what: str) -> np.ndarray:
    _array_header(f, size, what)
    f.seek(0)
    try:
        return np.asarray(npy_format.read_array(f, allow_pickle=False))
    except (ValueError, EOFError):
        raise ConfigError(f"{what} is not a .npy array numpy can read (truncated or "
                          "damaged)") from None


def _read_npz(f: IO[bytes], size: int, what: str) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, EOFError, ValueError):
        raise ConfigError(f"{what} is not a .npz (zip) archive, or a truncated or damaged "
                          "one") from None
    out: dict[str, np.ndarray] = {}
    with archive:
        for info in archive.infolist():
            name = info.filename
            if not name.endswith(".npy"):
                continue  # a file beside the arrays (notes, metadata): np.load skips it too
            member = f"{what}, member {name!r}"
            # the header is checked against the member's declared size: one its stored bytes
            # could never expand to is a lie that would still allocate it
            if info.compress_size > size or (
                    info.compress_type == zipfile.ZIP_STORED
                    and info.file_size != info.compress_size) or (
                    info.compress_type == zipfile.ZIP_DEFLATED
                    and info.file_size > _DEFLATE_MAX_RATIO * info.compress_size + 64):
                raise ConfigError(f"{member} is damaged: its sizes in the archive cannot be "
                                  "those of its bytes")
            try:
                with archive.open(info) as m:
                    _array_header(m, info.file_size, member)
                with archive.open(info) as m:
                    out[name[:-4]] = np.asarray(
                        npy_format.read_array(m, allow_pickle=False))
            except ConfigError:
                raise
            except (zipfile.BadZipFile, EOFError, ValueError, zlib.error):
                raise ConfigError(f"{member} is truncated or damaged") from None
            except (NotImplementedError, RuntimeError):  # a compression or encryption
                raise ConfigError(f"{member} is stored in a way numpy never writes (encrypted "
                                  "or an unusual compression)") from None
    return out

