"""Check from an strace log that what a process wrote under a root was durable when it said so.

The traced process (tests/crash/_syncchild.py) marks each acknowledged point: it writes
`EMBSTORE-MARK-A <label>` to a descriptor of its own before the operation and
`EMBSTORE-MARK-B <label>` once the operation returned (flush(), checkpoint(), bulk_load,
restore, a rebuild, an export or an import). At each B, for everything under the root:

1. data: every file written (write, pwrite, writev, sendfile, copy_file_range, ftruncate,
   fallocate, truncate; and sync_file_range, whose write-back is no sync: it neither
   commits metadata nor flushes the device's cache) was fsynced or fdatasynced after its
   last write; a write through an O_SYNC or O_DSYNC descriptor syncs itself;
2. pages: no page of a file mapped writable and shared is dirty or under write-back in the
   page cache, as the process measured at B (`dirty`): stores into a mapping are invisible
   to strace (so msync, which only ever syncs such stores here, counts only through this
   rule);
3. names: every entry created since the trace began (a new file or directory, the target
   of a rename or link, both sides of an exchange) had its directory fsynced since.

And at each event, as it happens:

4. publishing: a rename, exchange or link into the root comes after every file under its
   source was synced and every entry under it was synced into its directory (else a power
   cut may publish a torn file or an empty directory);
5. write-ahead: a delete journal (`written/<table>.del`) and its directory entries are
   synced before the process writes any other file of the root (embstore._written: the
   journal must be durable before the medium's delete is);
6. LMDB's meta pages (the first two pages of `data.mdb`) are written only after the data
   pages written before them were synced (else a power cut may leave a meta page that
   points at pages never written).

Files that never hold data a reopen needs are exempt: RocksDB's info LOG, the lock files (the
store's and LMDB's reader table), and rocksdict's settings file, which it rewrites without a
sync but which a reopen does not need: the backend passes every setting itself (a store
opens with that file empty, torn or missing; tests/crash/test_sync_coverage.py checks it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\w+)(.*)$")
_FD = re.compile(r"^(-?\d+|AT_FDCWD)<([^>]*)>")
_MARK = re.compile(r'"EMBSTORE-MARK-([AB]) ([\w.-]+)\\n"')
_EXEMPT = re.compile(r"(^|/)(LOG(\.old\.\d+)?|LOCK|lock\.mdb|rocksdict-config\.json)$")
_JOURNAL = re.compile(r"/written/[^/]+\.del$")
_PREALLOCATED = re.compile(r"/(MANIFEST-\d+|\d+\.log)$")
"""RocksDB's MANIFEST and write-ahead log: it preallocates them and, closing one, trims the
unused tail with ftruncate and no sync; a power cut leaves the zeros of that tail, which its
log reader takes for the end of the log, so such a truncation is no write to sync."""
LMDB_META_BYTES = 2 * 4096
"""LMDB's two meta pages (its page size is the OS page size, 4 KiB here)."""
_FD_ARG = {"write": 0, "pwrite64": 0, "writev": 0, "pwritev": 0, "pwritev2": 0,
           "ftruncate": 0, "fallocate": 0, "sync_file_range": 0, "sendfile": 0,
           "copy_file_range": 2}
WRITES = set(_FD_ARG) | {"truncate"}
SYNCS = {"fsync", "fdatasync"}
SYNC_ALL = {"sync", "syncfs"}
TRACED = ",".join(sorted(WRITES | SYNCS | SYNC_ALL | {
    "mmap", "openat", "rename", "renameat", "renameat2", "link", "linkat", "unlink", "unlinkat",
    "rmdir", "mkdir", "mkdirat"}))
"""The system calls `check` reads (strace -e trace=...)."""


@dataclass
class Report:
    """What the log shows, and what is wrong with it (empty `problems`: all was durable)."""

    problems: list[str] = field(default_factory=list)
    synced_files: set[str] = field(default_factory=set)
    points: list[str] = field(default_factory=list)
    """The labels of the acknowledged points reached (B markers), in order."""


def _join_unfinished(lines: list[str]) -> list[str]:
    """Merge strace -f's `<unfinished ...>` and `<... x resumed>` halves into one line."""
    pending: dict[str, str] = {}
    out = []
    for line in lines:
        pid = line.split(" ", 1)[0]
        if line.rstrip().endswith("<unfinished ...>"):
            pending[pid] = line.rstrip()[: -len("<unfinished ...>")].rstrip()
            continue
        m = re.match(r"^(\d+)\s+<\.\.\. \w+ resumed>(.*)$", line)
        if m:
            head = pending.pop(m.group(1), None)
            if head is not None:
                out.append(head + m.group(2))
            continue
        out.append(line)
    return out


def _args(text: str) -> list[str]:
    """Top-level comma-separated arguments (strings and brackets kept whole)."""
    args, depth, cur, quoted = [], 0, [], False
    i = 0
    while i < len(text):
        ch = text[i]
        if quoted:
            cur.append(ch)
            if ch == "\\":
                cur.append(text[i + 1])
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
            cur.append(ch)
        elif ch in "[{(<":
            depth += 1
            cur.append(ch)
        elif ch in "]})>":
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        args.append("".join(cur).strip())
    return args


class _Tree:
    """Names and the files (nodes) they lead to, as the log changes them."""

    def __init__(self) -> None:
        self.node: dict[str, int] = {}
        self.entries: dict[str, tuple[int, int]] = {}  # name -> (its directory's node, event)
        self._next = 0

    def key(self, path: str) -> int:
        if path not in self.node:
            self.node[path] = self._next
            self._next += 1
        return self.node[path]

    def under(self, path: str) -> list[str]:
        return [p for p in self.node if p == path or p.startswith(path + "/")]

    def create(self, path: str, at: int) -> None:
        self.remove(path)
        self.key(path)
        self.entries[path] = (self.key(os.path.dirname(path)), at)

    def remove(self, path: str) -> None:
        for p in self.under(path):
            del self.node[p]
            self.entries.pop(p, None)

    def _take(self, path: str) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
        names = {p[len(path):]: self.node.pop(p) for p in self.under(path)}
        entries = {rest: self.entries.pop(path + rest) for rest in names
                   if path + rest in self.entries}
        return names, entries

    def _put(self, path: str, taken: tuple[dict[str, int], dict[str, tuple[int, int]]],
             at: int) -> None:
        names, entries = taken
        for rest, k in names.items():
            self.node[path + rest] = k
        for rest, e in entries.items():
            self.entries[path + rest] = e
        self.entries[path] = (self.key(os.path.dirname(path)), at)

    def move(self, src: str, dst: str, at: int) -> None:
        taken = self._take(src)
        self.remove(dst)
        self._put(dst, taken, at)

    def exchange(self, a: str, b: str, at: int) -> None:
        ta, tb = self._take(a), self._take(b)
        self._put(b, ta, at)
        self._put(a, tb, at)

    def link(self, src: str, dst: str, at: int) -> None:
        self.remove(dst)
        self.node[dst] = self.key(src)
        self.entries[dst] = (self.key(os.path.dirname(dst)), at)


def check(log_text: str, root: str, dirty: dict[str, dict[str, int]] | None = None) -> Report:
    """Check an strace log (see the module docstring) for the files under `root`.

    `dirty` maps each point's label to {path: pages dirty or under write-back at its B}.
    """
    replay = _Replay(os.path.realpath(root), dirty or {})
    for i, line in enumerate(_join_unfinished(log_text.splitlines())):
        m = _LINE.match(line)
        if m:
            replay.event(i, *m.groups())
    report = replay.report
    if not report.points:
        report.problems.append("no acknowledged point was reached (no B marker)")
    report.problems += [p for at, p in replay.found if at < replay.last_b]
    return report


class _Replay:
    """The log's events applied in order to what they change, checked as they go."""

    def __init__(self, root: str, dirty: dict[str, dict[str, int]]) -> None:
        self.root, self.dirty = root, dirty
        self.report = Report()
        self.tree = _Tree()
        self.last_write: dict[int, int] = {}
        self.last_sync: dict[int, int] = {}
        self.last_append: dict[int, tuple[int, str]] = {}  # journals: (last append, thread)
        self.lmdb_data: dict[int, int] = {}  # data.mdb: the last write of a data page
        self.sync_fds: set[str] = set()  # descriptors opened O_SYNC or O_DSYNC
        self.mapped: set[int] = set()  # files mapped writable and shared (rule 2)
        self.cwd = "/"
        self.label = "setup"  # the operation under way, for the problems of rules 4-6
        self.found: list[tuple[int, str]] = []  # (event, problem) of rules 4-6
        self.last_b = -1

    # --- names ------------------------------------------------------------------------------

    def inside(self, p: str) -> bool:
        return p == self.root or p.startswith(self.root + "/")

    def norm(self, p: str) -> str:
        return os.path.normpath(p) if p.startswith(self.root + "/") else os.path.realpath(p)

    def name(self, arg: str, dirfd: str | None = None) -> str:
        """The path of a string argument, relative ones against `dirfd` or the cwd."""
        text = arg.strip('"')
        if not text.startswith("/"):
            m = _FD.match(dirfd) if dirfd else None
            text = os.path.join(m.group(2) if m else self.cwd, text)
        return self.norm(text)

    def fd_path(self, arg: str) -> str | None:
        m = _FD.match(arg)
        return self.norm(m.group(2)) if m else None

    def unsynced_entries(self, paths: list[str], skip: str | None = None) -> list[str]:
        entries = self.tree.entries
        return [p for p in paths if p != skip and p in entries and not _EXEMPT.search(p)
                and self.last_sync.get(entries[p][0], -1) < entries[p][1]]

    # --- events -----------------------------------------------------------------------------

    def event(self, i: int, tid: str, call: str, raw: str, ret: str, rest: str) -> None:
        if "AT_FDCWD<" in raw:
            at = _FD.match(raw[raw.index("AT_FDCWD<"):])
            self.cwd = at.group(2) if at else self.cwd
        if ret.startswith("-1"):
            return
        mark = _MARK.search(raw) if call == "write" else None
        if mark:
            self.marker(i, mark.group(1), mark.group(2))
            return
        args = _args(raw)
        if call in WRITES:
            self.write(i, tid, call, args)
        elif call in SYNC_ALL:  # sync(2): everything, for the test's own setup steps
            for k in set(self.tree.node.values()) | set(self.last_write):
                self.last_sync[k] = i
        elif call in SYNCS:
            p = self.fd_path(args[0])
            if p is not None:
                self.last_sync[self.tree.key(p)] = i
        elif call == "mmap":
            p = self.fd_path(args[4])
            if (p is not None and self.inside(p) and "PROT_WRITE" in args[2]
                    and "MAP_SHARED" in args[3]):
                self.mapped.add(self.tree.key(p))
        elif call == "openat":
            self.openat(i, args, f"{ret}{rest.strip()}")
        elif call in ("rename", "renameat", "renameat2", "link", "linkat"):
            if call in ("rename", "link"):
                src, dst = self.name(args[0]), self.name(args[1])
            else:
                src, dst = self.name(args[1], args[0]), self.name(args[3], args[2])
            self.publish(i, src, dst)
            if call == "renameat2" and "RENAME_EXCHANGE" in args[-1]:
                self.publish(i, dst, src)
                self.tree.exchange(src, dst, i)
            elif call.startswith("link"):
                self.tree.link(src, dst, i)
            else:
                self.tree.move(src, dst, i)
        elif call in ("mkdir", "mkdirat"):
            self.tree.create(self.name(args[0]) if call == "mkdir"
                             else self.name(args[1], args[0]), i)
        elif call in ("unlink", "unlinkat", "rmdir"):
            self.tree.remove(self.name(args[1], args[0]) if call == "unlinkat"
                             else self.name(args[0]))

    def marker(self, i: int, kind: str, label: str) -> None:
        self.label = label if kind == "A" else f"after {label}"
        if kind == "B":
            self.last_b = i
            self.report.points.append(label)
            self.at_point(label)

    def openat(self, i: int, args: list[str], result: str) -> None:
        r = _FD.match(result)
        if r is None:
            return
        p, fd = self.norm(r.group(2)), r.group(1)
        flags = args[2] if len(args) > 2 else ""
        if re.search(r"\bO_(D?SYNC)\b", flags):
            self.sync_fds.add(fd)
        else:
            self.sync_fds.discard(fd)
        if "O_CREAT" in flags and p not in self.tree.node:
            self.tree.create(p, i)
        elif "O_TRUNC" in flags and self.inside(p):
            self.last_write[self.tree.key(p)] = i

    def write(self, i: int, tid: str, call: str, args: list[str]) -> None:
        p = self.name(args[0]) if call == "truncate" else self.fd_path(args[_FD_ARG[call]])
        if p is None or not self.inside(p) or (call == "ftruncate" and _PREALLOCATED.search(p)):
            return
        k = self.tree.key(p)
        self.last_write[k] = i
        fd = args[_FD_ARG.get(call, 0)].split("<", 1)[0]
        if fd in self.sync_fds and call not in ("sync_file_range", "ftruncate", "fallocate"):
            self.last_sync[k] = i
        if _JOURNAL.search(p) and call not in ("ftruncate", "truncate"):
            self.last_append[k] = (i, tid)
        if p.endswith("/data.mdb"):  # rule 6
            meta = call == "pwrite64" and int(args[3], 0) < LMDB_META_BYTES
            if meta and self.lmdb_data.get(k, -1) > self.last_sync.get(k, -1):
                self.found.append((i, f"[{self.label}] LMDB meta page written before the data "
                                      f"pages it commits were synced: {p}"))
            elif not meta:
                self.lmdb_data[k] = i
        self.write_ahead(i, tid, p)

    # --- rules 4 and 5, as events happen ----------------------------------------------------

    def publish(self, i: int, src: str, dst: str) -> None:
        """Rule 4 for `src` about to be published at `dst`."""
        if not self.inside(dst):
            return
        below = [p for p in self.tree.under(src) if not _EXEMPT.search(p)]
        for p in below:
            k = self.tree.node[p]
            if self.last_write.get(k, -1) > self.last_sync.get(k, -1):
                self.found.append((i, f"[{self.label}] published at {dst} before its data was "
                                      f"synced: {p}"))
        for p in self.unsynced_entries(below, skip=src):
            self.found.append((i, f"[{self.label}] published at {dst} before its directory "
                                  f"entry was synced: {p}"))

    def write_ahead(self, i: int, tid: str, p: str) -> None:
        """Rule 5 at a write to `p` by thread `tid`."""
        if _JOURNAL.search(p) or _EXEMPT.search(p):
            return
        for j in [q for q in self.tree.node if _JOURNAL.search(q) and self.inside(q)]:
            k = self.tree.node[j]
            appended, by = self.last_append.get(k, (-1, ""))
            if by != tid:
                continue
            if appended > self.last_sync.get(k, -1):
                self.found.append((i, f"[{self.label}] wrote {p} before the delete journal was "
                                      f"synced: {j}"))
            for q in self.unsynced_entries([j, os.path.dirname(j)]):
                self.found.append((i, f"[{self.label}] wrote {p} before the delete journal's "
                                      f"directory entry was synced: {q}"))

    # --- rules 1 to 3, at a B marker --------------------------------------------------------

    def at_point(self, label: str) -> None:
        report, tree = self.report, self.tree
        here = sorted(p for p in tree.node if self.inside(p) and not _EXEMPT.search(p))
        seen: set[int] = set()
        for p in here:
            k = tree.node[p]
            if k in seen or k not in self.last_write:
                continue
            seen.add(k)
            if self.last_write[k] > self.last_sync.get(k, -1):
                report.problems.append(f"[{label}] written but not synced when it returned: "
                                       f"{p}")
            else:
                report.synced_files.add(p)
        for p, pages in sorted(self.dirty.get(label, {}).items()):
            if pages and tree.node.get(p) in self.mapped and not _EXEMPT.search(p):
                report.problems.append(f"[{label}] {pages} page(s) dirty in the page cache "
                                       f"when it returned: {p}")
        for p in here:
            if p in tree.entries:
                parent, at = tree.entries[p]
                if self.last_sync.get(parent, -1) < at:
                    report.problems.append(f"[{label}] created but its directory was not "
                                           f"synced since: {p}")
