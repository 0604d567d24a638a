"""The private directory a checkpoint, restore, export or import is built in before it appears.

Each builds `dest` in `.<name>.tmp-<pid>-<random>` beside it (mode 0700: it holds every row)
and renames it into place once complete (`publish`), so a failure or a crash never leaves a
half-made `dest`. Two builds of one `dest` at once (threads of one process, or processes) each
have their own directory, and the second to finish is refused: exactly one is published. A
build killed before it published leaves its directory; the next build of the same `dest`
removes those whose process is gone (`remove_dead_leftovers`).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import EmbstoreError, StorageIOError, StoreExistsError
from .layout import remove_dead_owned
from .manifest import fsync_dir, make_dirs

__all__ = ["discard", "io_error", "make_private", "missing_dirs", "not_a_directory",
           "plain_path", "publish", "reason", "remove_dead_leftovers", "temporary_beside"]


_NAME_MAX = 255  # bytes of a file name on Linux's file systems


def temporary_beside(path: Path) -> Path:
    """A name for a temporary file beside `path`, to be renamed over it once written.

    Of this call alone (`.<name>.tmp-<pid>-<random>`): a fixed `<name>.tmp` would overwrite
    and then remove a file of the user's of that name, even an input of the same command.
    """
    tail = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return path.parent / f".{_short_name(path, len(tail))}{tail}"


def _short_name(path: Path, tail: int) -> str:
    """The name of `path`, cut to leave `tail` bytes and a dot within a file name's limit.

    A name near the file system's limit (255 bytes) keeps room for the tail: cut short, it
    is still of one call alone.
    """
    room = _NAME_MAX - 1 - tail
    return os.fsencode(path.name)[:room].decode(errors="ignore") if len(
        os.fsencode(path.name)) > room else path.name


def remove_dead_leftovers(dest: Path) -> list[Path]:
    """Remove the private directories of `dest` left by processes that died; returns them.

    A build killed before it published leaves `.<name>.tmp-<pid>-<random>`, every row it
    had copied, that nothing else would remove. Only those of a process no longer running
    go: another process's build of `dest` may be under way.
    """
    def owner(name: str) -> int | None:
        if ".tmp-" not in name:
            return None
        tail = name[name.rindex(".tmp-"):]
        pid, _, rest = tail[len(".tmp-"):].partition("-")
        if name != f".{_short_name(dest, len(tail))}{tail}" or not pid.isdigit() or len(
                rest) != 12:
            return None
        return int(pid)

    return remove_dead_owned(dest.parent, owner)


def missing_dirs(directory: Path) -> list[Path]:
    """`directory` and its parents that do not exist, nearest first (what making it makes).

    Nearest first, so that a failure can remove them in order (`discard`).
    """
    made = []
    d = directory
    while not d.exists() and d != d.parent:
        made.append(d)
        d = d.parent
    return made


def make_private(dest: Path, error: Callable[[int, str], OSError] = OSError
                 ) -> tuple[Path, list[Path]]:
    """A new private directory to build `dest` in, and the parents of `dest` made for it.

    Raises:
        OSError (or what `error(errno, message)` makes): `dest` cannot be made there (a
            parent is a file, no permission, a read-only file system); the message names
            `dest`, not the private path, and nothing is left behind.
    """
    dest = plain_path(dest)
    remove_dead_leftovers(dest)
    made = missing_dirs(dest.parent)
    # of this call alone: another thread's or process's build of `dest` has a name of its own
    tmp = temporary_beside(dest)
    try:
        make_dirs(dest.parent)  # new parents: their entries must survive with what is published
        tmp.mkdir(mode=0o700)
    except OSError as exc:
        discard(tmp, made)
        raise error(exc.errno or errno.EIO, f"cannot create {dest}: {reason(exc, dest)}"
                    ) from exc
    return tmp, made


def publish(tmp: Path, dest: Path, what: str) -> None:
    """Rename the complete build `tmp` to `dest` (absent or an empty directory), durably.

    Raises:
        StoreExistsError: `dest` was published by another build meanwhile (it is kept).
        OSError: the rename failed otherwise.
    """
    dest = plain_path(dest)  # as make_private named it beside
    try:
        if dest.is_dir() and not dest.is_symlink():
            dest.rmdir()  # an empty directory given as the destination
        os.replace(tmp, dest)
    except OSError as exc:
        # ENOTDIR: a file or a link put at `dest` (a directory cannot replace either)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) or (
                exc.errno == errno.ENOTDIR and not_a_directory(dest)):
            raise StoreExistsError(f"{dest} was made by another writer while {what} was being "
                                   "written; it is kept, and nothing of this one is left: "
                                   "choose a new path") from exc
        raise
    fsync_dir(dest.parent)


def plain_path(path: Path) -> Path:
    """`path` with the directories above its last name resolved (links, `.` and `..`).

    `out/../out` names `out` only while `out` exists: removing an empty `out` to rename a
    build over it would leave nothing to reach it through. The last name itself is kept as
    given (a link there is refused, not followed).
    """
    if path.name in ("", ".", ".."):
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def not_a_directory(path: Path) -> bool:
    """Whether something other than a directory is at `path` (a link counts, dangling or not)."""
    try:
        return path.is_symlink() or (path.exists() and not path.is_dir())
    except OSError:
        return False


def discard(tmp: Path, made: Sequence[Path]) -> None:
    """Remove the private directory `tmp` and the (still empty) parents `made` for it."""
    shutil.rmtree(tmp, ignore_errors=True)
    for d in made:
        try:
            d.rmdir()
        except OSError:  # not empty: someone else put something there meanwhile
            break


def reason(exc: OSError, dest: Path) -> str:
    """Why `exc` stopped the making or writing of `dest`, in the user's path's terms."""
    why = exc.strerror or type(exc).__name__
    if exc.errno == errno.ENOTDIR:  # say which of the user's path components is a file
        blocker = next((p for p in reversed(dest.parents) if p.exists() and not p.is_dir()),
                       None)
        if blocker is not None:
            why = f"{blocker} is not a directory"
    return why


def io_error(exc: OSError, dest: Path, doing: str) -> OSError:
    """`exc`, met while `doing` `dest`, as a StorageIOError naming `dest`, not a private path.

    An embstore error already says what it means and is returned as it is.
    """
    if isinstance(exc, EmbstoreError):
        return exc
    return StorageIOError(exc.errno, f"cannot {doing} {dest}: {reason(exc, dest)}")
