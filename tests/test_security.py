"""Files a store writes are private, nothing is unpickled, and links are never followed.

Every file of a store, its checkpoints and restores, exports and imports, and of the store
after compact, migrate and fsck --repair (its backup too) is 0600 and every directory 0700
(the store's parent excepted); a symbolic link planted where the manifest points (a tier
directory, a table's file, the written-id record, the manifest itself) is refused with
CorruptStoreError and the file it points to is left untouched.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.errors import CorruptStoreError
from embstore.layout import read_manifest, write_manifest
from embstore.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["rocksdb", "lmdb", "pmem", "dram"]


def _store(path: Path, backend: str) -> None:
    tiers = [embstore.TierSpec("dram", capacity=10), embstore.TierSpec(backend)]
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=4)], tiers=tiers) as store:
        store.update("t", np.arange(50), np.ones((50, 4), np.float32))
        store.delete("t", np.arange(5))
        store.flush()
        store.checkpoint(path.parent / "ckpt", step=1)
        store.update("t", np.arange(50, 60), np.ones((10, 4), np.float32))
        store.checkpoint(path.parent / "inc", step=2, incremental=True)
    embstore.restore(path.parent / "inc", path.parent / "restored")


def test_no_pickle_anywhere_in_the_package():
    pattern = re.compile(r"\bimport pickle\b|\bpickle\.|\bcPickle\b|allow_pickle\s*=\s*True|"
                         r"torch\.load\((?!.*weights_only=True)|\bshelve\b|\bmarshal\.load")
    hits = []
    for folder in ("embstore", "backends", "policies", "tools"):
        for file in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(file.read_text().splitlines(), 1):
                if pattern.search(line) and "never" not in line:
                    hits.append(f"{file.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


def _loose(root: Path) -> list[str]:
    """Every file under `root` not 0600 and directory not 0700 (`root` itself excepted)."""
    loose = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            mode = stat.S_IMODE(p.lstat().st_mode)
            if mode & 0o077 or (p.is_dir() and mode != 0o700) or \
                    (p.is_file() and mode != 0o600):
                loose.append(f"{p.relative_to(root)} {oct(mode)}")
    return sorted(loose)


@pytest.fixture
def usual_umask():
    old = os.umask(0o022)  # the usual umask: the modes must not come from it
    yield
    os.umask(old)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_file_is_0600_and_every_directory_0700(tmp_path, backend, usual_umask):
    _store(tmp_path / "s", backend)
    assert _loose(tmp_path) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_operation_on_a_store_leaves_only_private_files(tmp_path, backend, usual_umask,
                                                               capsys):
    """Export, import, compact, migrate and fsck --repair, each followed by a walk of all."""
    path = tmp_path / "s"
    tiers = [embstore.TierSpec("dram", capacity=10), embstore.TierSpec(backend)]
    # a table fsck will find fault with (NaN rows, once its spec forbids them): a repair
    # then rewrites the whole store, the table under test too
    tables = [embstore.TableSpec("t", dim=4),
              embstore.TableSpec("n", dim=2, allow_nonfinite=True,
                                 tiers=(embstore.TierSpec("lmdb"),))]
    with embstore.open(path, tables=tables, tiers=tiers) as store:
        store.update("t", np.arange(50), np.ones((50, 4), np.float32))
        store.update("n", np.arange(5), np.full((5, 2), np.nan, np.float32))
    # export and import before the spec forbids the NaN rows: import refuses such rows
    for argv in (["export", str(path), str(tmp_path / "exported")],
                 ["import", str(tmp_path / "exported"), str(tmp_path / "imported")]):
        assert main(argv) == 0, argv
        assert _loose(tmp_path) == [], argv
    doc = read_manifest(path)
    doc["tables"][1]["allow_nonfinite"] = False
    write_manifest(path, {k: v for k, v in doc.items() if k not in ("format", "version")})
    other = "lmdb" if backend != "lmdb" else "rocksdb"
    # "n" stays on lmdb (a whole-store migrate moves it too), where fsck checks its rows
    steps = [["compact", str(path)],
             ["migrate", str(path), "--tiers", f"dram:10,{other}", "--table", "t"],
             ["migrate", str(path), "--tiers", f"dram:10,{backend}", "--table", "t"],
             ["fsck", "--repair", str(path)]]
    for argv in steps:
        assert main(argv) in (0, 1), argv
        assert _loose(tmp_path) == [], argv
    assert "dropped 5 row(s)" in capsys.readouterr().out  # the repair did rewrite the store
    assert len(list(tmp_path.glob(".s.fsck-backup-*"))) == 1


def _plant(link: Path, target: Path) -> None:
    if link.is_dir() or link.exists():
        os.rename(link, target)
    link.symlink_to(target)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_linked_tier_directory_is_refused(tmp_path, backend):
    _store(tmp_path / "s", backend)
    tier = next((tmp_path / "s").glob("tier1-*"))
    _plant(tier, tmp_path / "elsewhere")
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        embstore.open(tmp_path / "s")


@pytest.mark.parametrize("backend", ["lmdb", "pmem", "dram"])
def test_a_linked_table_file_is_refused_and_its_target_untouched(tmp_path, backend):
    _store(tmp_path / "s", backend)
    tier = next((tmp_path / "s").glob("tier1-*"))
    data = max((p for p in tier.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    target = tmp_path / "victim"
    _plant(data, target)
    before = target.read_bytes()
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        embstore.open(tmp_path / "s")
    assert target.read_bytes() == before


@pytest.mark.parametrize("name", ["MANIFEST.json", "written/t.ids", "written"])
def test_a_linked_manifest_or_record_is_refused(tmp_path, name):
    _store(tmp_path / "s", "lmdb")
    _plant(tmp_path / "s" / name, tmp_path / "victim")
    with pytest.raises(CorruptStoreError, match="symbolic link|special file"):
        embstore.open(tmp_path / "s")


def test_an_access_log_is_private_refuses_links_and_stays_out_of_the_store(tmp_path):
    spec = embstore.TableSpec("t", dim=4)
    log = tmp_path / "log"
    with embstore.open(tmp_path / "s", tables=[spec], record_accesses=log) as store:
        store.lookup("t", np.arange(5))
    assert stat.S_IMODE(log.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in log.iterdir()} == {0o600}
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    (log / "t.ids").unlink()
    (log / "t.ids").symlink_to(target)
    with pytest.raises(embstore.errors.ConfigError, match="cannot record"):
        embstore.open(tmp_path / "s", record_accesses=log)
    assert target.read_bytes() == b"keep me"
    with embstore.open(tmp_path / "s") as store:  # the failed open closed the store again
        store.lookup("t", np.arange(2))
    with pytest.raises(embstore.errors.ConfigError, match="inside the store"):
        embstore.open(tmp_path / "s", record_accesses=tmp_path / "s" / "log")
    assert not (tmp_path / "s" / "log").exists()
