"""Operating a store from the command line: export and import, migrate, compact.

Every round trip must give bit-identical tables (weights and optimizer state), every rewrite a
store that fsck finds clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck, optim
from embstore.tools.cli import main
from embstore.tools.compact import store_bytes

PERSISTENT = ["rocksdb", "lmdb", "pmem"]


def _fill(path, bottom, *, n_steps=10, own_chain=None):
    tables = [TableSpec("t", dim=4, optimizer=optim.Adam(lr=0.1)),
              TableSpec("u", dim=3, dtype=np.float64, tiers=own_chain)]
    tiers = [TierSpec("dram", capacity=16), TierSpec(bottom)]
    rng = np.random.default_rng(3)
    with embstore.open(path, tables=tables, tiers=tiers) as store:
        for _ in range(n_steps):
            ids = rng.integers(0, 2000, 64)
            store.apply_gradients("t", ids, rng.standard_normal((64, 4)).astype(np.float32))
        store.update("u", np.arange(-5, 40), rng.standard_normal((45, 3)))
        store.delete("t", ids[:5])
    return path


def _contents(path):
    """Every table as (sorted ids, their full rows as bytes)."""
    out = {}
    with embstore.open(path, read_only=True) as store:
        for name in store.tables:
            parts = list(store.items(name))
            ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
            rows = (np.concatenate([np.concatenate([p[1], p[2]], axis=1) for p in parts])
                    if parts else np.zeros((0, 1)))
            order = np.argsort(ids)
            out[name] = (ids[order].tolist(), rows[order].tobytes())
    return out


@pytest.mark.parametrize("bottom", PERSISTENT)
def test_export_then_import_into_another_layout_is_bit_identical(tmp_path, bottom, capsys):
    src = _fill(tmp_path / "s", bottom)
    before = _contents(src)
    assert main(["export", str(src), str(tmp_path / "x"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"]["u"] == 45
    header = json.loads((tmp_path / "x" / "header.json").read_text())
    assert header["format"] == "embstore-export" and header["byte_order"] == "little"
    other = {"rocksdb": "pmem", "lmdb": "rocksdb", "pmem": "lmdb"}[bottom]
    assert main(["import", str(tmp_path / "x"), str(tmp_path / "s2"), "--tiers",
                 f"dram:1KiB:lru,{other}"]) == 0
    assert _contents(tmp_path / "s2") == before
    assert fsck.check(tmp_path / "s2") == []
    with embstore.open(tmp_path / "s2", read_only=True) as store:
        assert store.describe()["tiers"][-1]["backend"] == other
    # and back into the exported layout
    assert main(["import", str(tmp_path / "x"), str(tmp_path / "s3")]) == 0
    assert _contents(tmp_path / "s3") == before


def test_an_export_is_readable_with_numpy_alone(tmp_path):
    src = _fill(tmp_path / "s", "lmdb")
    assert main(["export", str(src), str(tmp_path / "x"), "-q"]) == 0
    header = json.loads((tmp_path / "x" / "header.json").read_text())
    (u,) = [t for t in header["tables"] if t["spec"]["name"] == "u"]
    ids = np.fromfile(tmp_path / "x" / u["ids_file"], dtype="<i8")
    rows = np.fromfile(tmp_path / "x" / u["rows_file"], dtype=u["dtype"]).reshape(-1, 3)
    with embstore.open(src, read_only=True) as store:
        assert (store.lookup("u", ids) == rows).all()


def test_a_damaged_export_is_refused_and_leaves_no_store(tmp_path, capsys):
    src = _fill(tmp_path / "s", "pmem")
    assert main(["export", str(src), str(tmp_path / "x")]) == 0
    rows_file = tmp_path / "x" / "0.rows"
    raw = bytearray(rows_file.read_bytes())
    raw[17] ^= 4
    rows_file.write_bytes(bytes(raw))
    assert main(["import", str(tmp_path / "x"), str(tmp_path / "s2")]) == 2
    assert "CRC" in capsys.readouterr().err
    assert not (tmp_path / "s2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".s2")]


@pytest.mark.parametrize("bottom", PERSISTENT)
def test_migrate_moves_a_store_and_one_table_to_other_layouts_bit_for_bit(tmp_path, bottom):
    path = _fill(tmp_path / "s", bottom)
    before = _contents(path)
    other = {"rocksdb": "pmem", "lmdb": "rocksdb", "pmem": "lmdb"}[bottom]
    assert main(["migrate", str(path), "--tiers", f"dram:64:lru,{other}"]) == 0
    assert _contents(path) == before and fsck.check(path) == []
    assert main(["migrate", str(path), "--tiers", "dram:8,lmdb", "--table", "u"]) == 0
    assert _contents(path) == before and fsck.check(path) == []
    with embstore.open(path) as store:  # and it works as a store
        d = store.describe()
        assert [t["backend"] for t in d["tables"]["u"]["tiers"]] == ["dram", "lmdb"]
        assert [t["backend"] for t in d["tables"]["t"]["tiers"]] == ["dram", other]
        store.update("u", np.array([1000]), np.ones((1, 3)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".s.")]
    # the whole store again: "u", given a chain of its own above, stayed on it
    before = _contents(path)
    assert main(["migrate", str(path), "--tiers", f"dram:16,{other}"]) == 0
    assert _contents(path) == before and fsck.check(path) == []
    with embstore.open(path) as store:
        for table in ("t", "u"):
            assert [(t["backend"], t["capacity_rows"]) for t in
                    store.describe()["tables"][table]["tiers"]] == [("dram", 16), (other, None)]


@pytest.mark.parametrize("bottom", PERSISTENT)
def test_compact_after_deleting_half_the_rows_gives_back_at_least_40_percent(tmp_path, bottom,
                                                                           capsys):
    path = tmp_path / "s"
    n = 40_000
    with embstore.open(path, tables=[TableSpec("t", dim=16)], tiers=[TierSpec(bottom)]) as s:
        for i in range(0, n, 10_000):
            s.update("t", np.arange(i, i + 10_000),
                     np.random.default_rng(i).random((10_000, 16), np.float32))
    with embstore.open(path) as s:
        s.delete("t", np.arange(0, n, 2))
    before = _contents(path)
    assert main(["compact", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_before"] == pytest.approx(report["bytes_before"])
    assert report["bytes_after"] <= 0.6 * report["bytes_before"], report
    assert report["bytes_after"] == store_bytes(path)
    assert _contents(path) == before and fsck.check(path) == []


_KILL_AT = """
import os, signal, sys
import embstore._rebuild as rb
point, argv = sys.argv[2], sys.argv[3:]
real = {"write": rb.write_store, "swap": rb.swap_in}
def killer(name):
    def wrapped(*a, **k):
        if name == "swap":
            real[name](*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    return wrapped
if point == "write":
    rb.write_store = killer("write")
elif point == "swap":
    rb.swap_in = killer("swap")
from embstore.tools.cli import main
main([argv[0], sys.argv[1], *argv[1:]])
"""


@pytest.mark.parametrize("command", [["compact"], ["migrate", "--tiers", "dram:8,rocksdb"]])
@pytest.mark.parametrize("point", ["write", "swap"])
def test_sigkill_during_compact_or_migrate_leaves_the_old_or_the_new_store_complete(
        tmp_path, point, command):
    path = _fill(tmp_path / "s", "pmem")
    before = _contents(path)
    proc = subprocess.run([sys.executable, "-c", _KILL_AT, str(path), point, *command])
    assert proc.returncode == -9
    assert _contents(path) == before and fsck.check(path) == []
    assert main(["compact", str(path)]) == 0  # and the next run clears what was left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".s.")]
    assert _contents(path) == before


def test_the_private_directory_of_a_killed_import_is_removed_by_the_next_import(tmp_path):
    path = _fill(tmp_path / "s", "pmem")
    assert main(["export", str(path), str(tmp_path / "x")]) == 0
    env = {**os.environ, "EMBSTORE_CRASH_AT": "rebuild.page:1"}
    argv = [sys.executable, "-m", "embstore.tools.cli", "import", str(tmp_path / "x"),
            str(tmp_path / "d")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".d.tmp-")]
    live = tmp_path / f".d.tmp-{os.getpid()}-0123456789ab"  # an import still under way
    live.mkdir()
    assert main(["import", str(tmp_path / "x"), str(tmp_path / "d")]) == 0
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".d.tmp-")] == [live]
    assert _contents(tmp_path / "d") == _contents(path)


def _peak_rss_growth(argv):
    """Peak RSS of `embstore argv` in a fresh process, over its RSS once imports are done."""
    # the high-water mark is reset after the imports (clear_refs 5)
    code = ("import sys\nfrom embstore.tools.cli import main\n"
            "import embstore._export, embstore.backends.rocksdb, embstore.backends.lmdb\n"
            "def rss(key):\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith(key):\n"
            "            return int(line.split()[1]) * 1024\n"
            "base = rss('VmRSS')\n"
            "open('/proc/self/clear_refs', 'w').write('5')\n"
            "assert main(sys.argv[1:]) == 0\n"
            "print(base, rss('VmHWM') - base)\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         check=True).stdout
    base, grown = map(int, out.split()[-2:])
    return base, grown


@pytest.mark.slow
def test_export_and_import_peak_memory_does_not_grow_with_the_table(tmp_path):
    dim = 64
    peaks = {}
    for n in (100_000, 400_000):  # the larger: 100 MiB of rows, ten times its DRAM tier
        path = tmp_path / f"s{n}"
        tiers = [TierSpec("dram", capacity=n // 10), TierSpec("rocksdb")]
        with embstore.open(path, tables=[TableSpec("t", dim=dim)], tiers=tiers) as s:
            for i in range(0, n, 50_000):
                s.bulk_load("t", np.arange(i, i + 50_000), np.ones((50_000, dim), np.float32))
        _, exp = _peak_rss_growth(["export", str(path), str(tmp_path / f"x{n}")])
        _, imp = _peak_rss_growth(["import", str(tmp_path / f"x{n}"), str(tmp_path / f"i{n}"),
                                   "--tiers", f"dram:{n // 10},lmdb"])
        peaks[n] = (exp, imp)
        print(f"{n} rows ({n * dim * 4 >> 20} MiB): peak RSS growth export {exp >> 20} MiB, "
              f"import {imp >> 20} MiB")
    small, large = peaks[100_000], peaks[400_000]
    for a, b in zip(small, large, strict=True):
        assert b < a + (16 << 20), peaks  # four times the rows, about the same memory
        assert b < 400_000 * dim * 4 * 0.6, peaks  # well under the table itself
    assert _contents(tmp_path / "i400000") == _contents(tmp_path / "s400000")


# the README's suite kills a migrate of the default bottom tier; the slow job the others'
@pytest.mark.parametrize("bottom", [pytest.param(b, marks=[] if b == "rocksdb" else
                                                 [pytest.mark.slow]) for b in PERSISTENT])
def test_sigkill_at_random_moments_of_a_migrate_never_loses_the_store(tmp_path, bottom):
    import signal
    import time

    path = _fill(tmp_path / "s", bottom, n_steps=40)
    before = _contents(path)
    rng = np.random.default_rng(7)
    other = {"rocksdb": "lmdb", "lmdb": "pmem", "pmem": "rocksdb"}[bottom]
    for delay in rng.uniform(0.3, 1.5, 4):
        proc = subprocess.Popen([sys.executable, "-m", "embstore.tools.cli", "migrate",
                                 str(path), "--tiers", f"dram:16,{other}"])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _contents(path) == before
        assert fsck.check(path) == []


def _stderr_on_a_terminal(argv):
    """Run `embstore argv` with stderr on a pseudo-terminal; returns what it printed there."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # a terminal of 80 columns: tqdm draws nothing on one of zero
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        proc = subprocess.run([sys.executable, "-m", "embstore.tools.cli", *argv],
                              stderr=slave, stdout=subprocess.PIPE, check=True, timeout=300)
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        del proc
        return b"".join(chunks).decode(errors="replace")
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)


def test_progress_shows_on_a_terminal_only_and_not_with_quiet(tmp_path, capsys):
    pytest.importorskip("tqdm")
    path = _fill(tmp_path / "s", "lmdb")
    assert "export" in _stderr_on_a_terminal(["export", str(path), str(tmp_path / "x")])
    assert _stderr_on_a_terminal(["export", "--quiet", str(path), str(tmp_path / "y")]) == ""
    assert "fsck" in _stderr_on_a_terminal(["fsck", str(path)])
    assert main(["export", str(path), str(tmp_path / "z")]) == 0  # stderr is not a terminal
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_tables_round_trip_and_check_clean(tmp_path, precision):
    path = tmp_path / "s"
    spec = TableSpec("h", dim=8, precision=precision, optimizer=optim.RowWiseAdagrad(lr=0.1))
    rng = np.random.default_rng(5)
    with embstore.open(path, tables=[spec], tiers=[TierSpec("dram", capacity=8),
                                                  TierSpec("pmem")]) as store:
        for _ in range(5):
            ids = rng.integers(0, 300, 40)
            store.apply_gradients("h", ids, rng.standard_normal((40, 8)).astype(np.float32))
    ids = np.arange(300)
    with embstore.open(path, read_only=True) as store:
        before = (store.lookup("h", ids, stored=True).tobytes(),
                  store.lookup_state("h", ids).tobytes())
    assert fsck.check(path) == []
    assert main(["export", str(path), str(tmp_path / "x")]) == 0
    assert main(["import", str(tmp_path / "x"), str(tmp_path / "s2"), "--tiers", "lmdb"]) == 0
    assert main(["migrate", str(path), "--tiers", "dram:4,rocksdb"]) == 0
    for p in (tmp_path / "s2", path):
        assert fsck.check(p) == []
        with embstore.open(p, read_only=True) as store:
            assert (store.lookup("h", ids, stored=True).tobytes(),
                    store.lookup_state("h", ids).tobytes()) == before


def test_a_copy_into_a_store_of_record_too_small_for_its_rows_is_refused(tmp_path):
    """The last tier's eviction is feature expiry: a copy into a bounded one would lose rows."""
    from embstore._export import export_store, import_store
    from embstore._rebuild import replace_store
    from embstore.errors import CapacityError

    path = tmp_path / "s"
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=4)],
                       tiers=[embstore.TierSpec("rocksdb")]) as store:
        store.update("t", np.arange(300), np.ones((300, 4), np.float32))
    export_store(path, tmp_path / "ex")
    small = [embstore.TierSpec("dram", capacity=50), embstore.TierSpec("lmdb", capacity=100)]
    with pytest.raises(CapacityError, match="300 rows .* at most 100"):
        replace_store(path, default_tiers=small)
    with pytest.raises(CapacityError):
        import_store(tmp_path / "ex", tmp_path / "s2", tiers=small)
    assert not (tmp_path / "s2").exists()
    with embstore.open(path) as store:
        assert store.num_rows("t") == 300
    replace_store(path, default_tiers=[small[0], embstore.TierSpec("lmdb", capacity=300)])
    with embstore.open(path) as store:
        assert store.num_rows("t") == 300


@pytest.mark.parametrize("command", [["compact"], ["migrate", "--tiers", "lmdb"],
                                     ["migrate", "--tiers", "dram:100:lru,rocksdb"]],
                         ids=["compact", "migrate-lmdb", "migrate-tiered"])
def test_a_full_checkpoint_rewritten_in_place_still_roots_its_incremental_chain(tmp_path,
                                                                               command):
    spec = TableSpec("t", dim=4, optimizer=optim.RowWiseAdagrad(0.1))
    rng = np.random.default_rng(0)
    with embstore.open(tmp_path / "s", tables=[spec], tiers=[TierSpec("rocksdb")]) as store:
        for k in range(3):
            ids = rng.integers(0, 500, 200)
            store.apply_gradients("t", ids, rng.standard_normal((200, 4)).astype(np.float32))
            store.delete("t", rng.integers(0, 500, 5))
            store.checkpoint(tmp_path / f"c{k}", step=k, incremental=k > 0)
    embstore.restore(tmp_path / "c2", tmp_path / "before")
    assert main([command[0], str(tmp_path / "c0"), *command[1:]]) == 0
    doc = json.loads((tmp_path / "c0" / "MANIFEST.json").read_text())
    assert doc["checkpoint"] == {"step": 0, "kind": "full", "parent": None}
    embstore.restore(tmp_path / "c2", tmp_path / "after")  # used to call c0 "a store"
    assert _contents(tmp_path / "after") == _contents(tmp_path / "before")


@pytest.mark.parametrize("command", [["compact"], ["migrate", "--tiers", "lmdb"],
                                     ["export", "OUT"]])
@pytest.mark.parametrize("given", ["link", "missing", "file", "broken-link"])
def test_a_path_that_is_not_a_store_directory_is_refused_saying_what_it_is(tmp_path, capsys,
                                                                          command, given):
    store = _fill(tmp_path / "s", "rocksdb", n_steps=2)
    before = _contents(store)
    path = tmp_path / given
    expected = {"link": "is a symbolic link (to ", "missing": "does not exist",
                "file": "is a file, not a store directory",
                "broken-link": "does not exist (a broken symbolic link)"}[given]
    if given == "link":
        path.symlink_to(store)
        if command[0] == "export":  # a read: through the link is the store itself
            expected = "exported"
    elif given == "file":
        path.write_text("x")
    elif given == "broken-link":
        path.symlink_to(tmp_path / "nowhere")
    argv = [command[0], str(path),
            *[str(tmp_path / "out") if a == "OUT" else a for a in command[1:]]]
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert expected in out + err, out + err
    assert code == (0 if expected == "exported" else 2)
    assert _contents(store) == before and path.is_symlink() == (given.endswith("link"))
