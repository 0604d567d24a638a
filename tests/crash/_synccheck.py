"""Check from an strace log that what a process wrote to a store was synced before a marker.

The process under `strace -f -y` writes the marker lines `EMBSTORE-MARK-A` (its writes are
done) and `EMBSTORE-MARK-B` (its `flush()` returned) to a descriptor of its own. Before B:

1. every file of the store written by a write call (write, pwrite, writev, ftruncate,
   fallocate) was fsynced or fdatasynced (or msynced) after its last write;
2. every file of the store that is mapped writable was synced as a whole after A (stores into
   a mapping are invisible to strace, and the store's writes came before A): fsync,
   fdatasync, or msync of the whole mapping;
3. every file created or renamed into place in the store has had its directory fsynced
   since (else a power cut may lose the directory entry: the file's data is synced but it is
   not reachable).

Files that never hold data a reopen needs are exempt: RocksDB's info LOG, the lock files (the
store's and LMDB's reader table), and rocksdict's settings file, which it rewrites without a
sync but which a reopen does not need: the backend passes every setting itself (a store opens
with that file empty, torn or missing; tests/crash/test_sync_coverage.py checks it).
sync_file_range alone is not a sync: it neither commits metadata nor flushes the device cache.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\w+)")
_FD = re.compile(r"^(-?\d+)<([^>]*)>")
_EXEMPT = re.compile(r"(^|/)(LOG(\.old\.\d+)?|LOCK|lock\.mdb|rocksdict-config\.json)$")
WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2", "ftruncate", "fallocate"}
SYNCS = {"fsync", "fdatasync"}


@dataclass
class Report:
    """What the log shows, and what is wrong with it (empty: every write was synced)."""

    problems: list[str] = field(default_factory=list)
    synced_files: set[str] = field(default_factory=set)
    marker_b_seen: bool = False


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
        elif ch in "[{(":
            depth += 1
            cur.append(ch)
        elif ch in "]})":
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


def _path(arg: str) -> str | None:
    m = _FD.match(arg)
    return m.group(2) if m else None


def check(log_text: str, root: str) -> Report:
    """Check an strace log (see the module docstring) for the store under `root`."""
    root = os.path.realpath(root)
    report = Report()
    last_write: dict[str, int] = {}
    last_sync: dict[str, int] = {}
    mapped: dict[str, list[tuple[int, int]]] = {}
    created: dict[str, int] = {}
    dir_synced: dict[str, int] = {}
    gone: set[str] = set()
    mark_a = mark_b = None

    def inside(p: str | None) -> bool:
        return p is not None and (p == root or p.startswith(root + "/"))

    for i, line in enumerate(_join_unfinished(log_text.splitlines())):
        m = _LINE.match(line)
        if not m:
            continue
        _, call, raw, ret = m.groups()
        if ret.startswith("-1"):
            continue
        if call == "write" and "EMBSTORE-MARK-A" in raw:
            mark_a = i
            continue
        if call == "write" and "EMBSTORE-MARK-B" in raw:
            mark_b = i
            break
        args = _args(raw)
        if call in WRITES:
            p = _path(args[0])
            if inside(p):
                last_write[p] = i
        elif call in SYNCS:
            p = _path(args[0])
            if p is not None and os.path.isdir(p):
                dir_synced[p] = i  # the store's own parent counts too
            elif inside(p):
                last_sync[p] = i
        elif call == "msync":
            # a sync of the whole mapping only: the stores it must cover are not in the log
            lo, hi = int(args[0], 16), int(args[0], 16) + int(args[1])
            for p, spans in mapped.items():
                if any(lo <= a and b <= hi for a, b in spans):
                    last_sync[p] = i
        elif call == "mmap":
            p = _path(args[4]) if len(args) > 4 else None
            if inside(p) and "PROT_WRITE" in args[2] and "MAP_SHARED" in args[3]:
                mapped.setdefault(p, []).append((int(ret, 16), int(ret, 16) + int(args[1])))
        elif call == "openat":
            if "O_CREAT" in raw:
                m2 = _FD.match(line[line.rfind("= ") + 2:])
                p = m2.group(2) if m2 else None
                if inside(p) and p not in created:
                    created[p] = i
        elif call in ("rename", "renameat", "renameat2"):
            names = [a.strip('"') for a in args if a.startswith('"')]
            if len(names) == 2 and inside(os.path.realpath(names[1])):
                src, dst = os.path.realpath(names[0]), os.path.realpath(names[1])
                gone.add(src)
                created[dst] = i
                if src in last_write:
                    last_write[dst] = last_write[src]
                    last_sync[dst] = last_sync.get(src, -1)
        elif call in ("mkdir", "mkdirat"):
            names = [a.strip('"') for a in args if a.startswith('"')]
            if names and inside(os.path.realpath(names[0])):
                created[os.path.realpath(names[0])] = i
        elif call in ("unlink", "unlinkat"):
            names = [a.strip('"') for a in args if a.startswith('"')]
            if names:
                gone.add(os.path.realpath(names[-1]))
    if mark_a is None or mark_b is None:
        report.problems.append("the markers are missing: the process did not reach flush()")
        return report
    report.marker_b_seen = True
    for p, w in sorted(last_write.items()):
        if p in gone or _EXEMPT.search(p):
            continue
        if last_sync.get(p, -1) < w:
            report.problems.append(f"written but not synced before flush() returned: {p}")
        else:
            report.synced_files.add(p)
    for p in sorted(mapped):
        if p in gone or _EXEMPT.search(p):
            continue
        if last_sync.get(p, -1) < mark_a:
            report.problems.append(f"mapped writable but not synced by flush(): {p}")
        else:
            report.synced_files.add(p)
    for p, c in sorted(created.items()):
        if p in gone or _EXEMPT.search(p):
            continue
        parent = os.path.dirname(p)
        if dir_synced.get(parent, -1) < c:
            report.problems.append(f"created but its directory was not synced since: {p}")
    return report


TRACED = ("write,pwrite64,writev,pwritev,pwritev2,ftruncate,fallocate,fsync,fdatasync,msync,"
          "mmap,openat,rename,renameat,renameat2,unlink,unlinkat,mkdir,mkdirat")
"""The system calls `check` reads (strace -e trace=...)."""
