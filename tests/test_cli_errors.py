"""Bad invocations of every subcommand: a one-line message, the documented exit code, and
never a traceback (`main(argv)` in-process).
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.tools.cli import main


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    store = root / "store"
    with embstore.open(store, tables=[embstore.TableSpec("t", dim=4)],
                       tiers=[embstore.TierSpec("lmdb")]) as s:
        s.update("t", np.arange(10), np.ones((10, 4), np.float32))
    (root / "file.txt").write_text("not a store")
    (root / "foreign").mkdir()
    (root / "foreign" / "data.bin").write_bytes(b"x")
    assert main(["export", str(store), str(root / "export")]) == 0
    np.save(root / "trace.npy", np.arange(64).reshape(4, 16))
    return {"S": str(store), "F": str(root / "file.txt"), "D": str(root / "foreign"),
            "M": str(root / "missing"), "X": str(root / "export"), "T": str(root / "trace.npy"),
            "N": str(root / "new"), "root": root}


BAD = [
    # (argv with placeholders, exit code)
    ([], 2), (["nosuch"], 2), (["--bogus"], 2),
    (["info"], 2), (["info", "S", "--bogus"], 2), (["info", "M"], 2), (["info", "F"], 2),
    (["info", "D"], 2),
    (["fsck"], 2), (["fsck", "S", "--repair=yes"], 2), (["fsck", "M"], 8), (["fsck", "F"], 8),
    (["fsck", "D"], 8),
    (["compact"], 2), (["compact", "M"], 2), (["compact", "F"], 2), (["compact", "D"], 2),
    (["export", "S"], 2), (["export", "M", "N"], 2), (["export", "S", "D"], 2),
    (["export", "D", "N"], 2),
    (["import", "X"], 2), (["import", "M", "N"], 2), (["import", "S", "N"], 2),
    (["import", "X", "S"], 2), (["import", "X", "N", "--tiers", "floppy"], 2),
    (["import", "X", "N", "--tiers", "dram:lots"], 2), (["import", "X", "N", "--tiers", ""], 2),
    (["import", "X", "N", "--tiers", "dram:1:lru:x"], 2),
    (["import", "X", "N", "--tiers", "dram:10:nosuchpolicy,lmdb"], 2),
    (["migrate", "S"], 2), (["migrate", "S", "--tiers", "nosuch"], 2),
    (["migrate", "S", "--tiers", "lmdb", "--table", "nope"], 2),
    (["migrate", "M", "--tiers", "lmdb"], 2), (["migrate", "D", "--tiers", "lmdb"], 2),
    (["migrate", "S", "--placement", "M"], 2), (["migrate", "S", "--placement", "F"], 2),
    (["migrate", "S", "--placement", "T"], 2), (["migrate", "S", "--tiers", "lmdb",
                                                 "--placement", "F"], 2),
    (["profile", "D", "-o", "N"], 2), (["profile", "M", "-o", "N"], 2),
    (["simulate"], 2), (["simulate", "M", "--capacity", "5%"], 2),
    (["simulate", "T", "--capacity", "abc"], 2), (["simulate", "T", "--capacity", "-1"], 2),
    (["simulate", "T", "--capacity", "0"], 2), (["simulate", "T", "--capacity", "150%"], 2),
    (["simulate", "T", "--capacity", "1.5"], 2), (["simulate", "T", "--batch-size", "x"], 2),
    (["simulate", "T", "--batch-size", "0"], 2), (["simulate", "T", "--policy", "nosuch"], 2),
    (["simulate", "F"], 2),
    (["trace"], 2), (["trace", "synth"], 2), (["trace", "synth", "N", "--batches", "x"], 2),
    (["bench"], 2), (["bench", "nosuch"], 2), (["bench", "lookup", "--bogus"], 2),
    (["demo", "--steps", "x"], 2), (["demo", "--rows", "0"], 2),
]


def _argv(argv, places):
    return [places.get(a, a) if isinstance(places.get(a), str) else a for a in argv]


@pytest.mark.parametrize(("argv", "code"), BAD, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else str(v))
def test_a_bad_invocation_gets_one_line_and_its_exit_code(argv, code, places, capsys):
    assert main(_argv(argv, places)) == code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "error" in lines[0], err
    assert not (places["root"] / "new").exists()
    assert sorted(p.name for p in (places["root"] / "foreign").iterdir()) == ["data.bin"]


def test_a_store_locked_by_another_handle_is_refused_by_every_command_that_needs_it(places,
                                                                                  capsys):
    with embstore.open(places["S"]):
        for argv, code in ((["compact", "S"], 2), (["export", "S", "N"], 2),
                           (["migrate", "S", "--tiers", "rocksdb"], 2),
                           (["fsck", "S", "--repair"], 8)):
            assert main(_argv(argv, places)) == code, argv
            out, err = capsys.readouterr()
            assert "Traceback" not in out + err
            assert "open in another" in out + err, argv
        for argv in (["info", "S"], ["fsck", "S"]):  # readers: beside the writer
            assert main(_argv(argv, places)) == 0, argv
            out, err = capsys.readouterr()
            assert "Traceback" not in out + err and not err, argv


@pytest.mark.parametrize("capacity", ["\u00b2", "\u0663"])  # superscript 2, Arabic-Indic 3
def test_a_tier_capacity_of_non_ascii_digits_is_refused_by_name(capacity, places, capsys):
    argv = ["import", places["X"], places["N"], "--tiers", f"dram:{capacity},lmdb"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot read {capacity!r} as a size" in err, err
    assert not (places["root"] / "new").exists()


@pytest.mark.parametrize("capacity", ["5%", "0.05", "4", "1KiB", "5%,0.5,4,1KiB"])
def test_sizes_and_fractions_read_the_way_people_write_them(capacity, places, capsys):
    assert main(["simulate", places["T"], "--capacity", capacity, "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["info", "fsck", "compact", "export", "import", "migrate",
                                     "simulate", "trace", "bench", "demo"])
def test_each_command_has_help_with_an_example(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: embstore" in out
    if command != "demo":  # the demo's help is its owner's
        assert "example" in out


def test_top_level_help_lists_every_command_with_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("info", "fsck", "compact", "export", "import", "migrate"):
        assert command in out
    assert "examples:" in out
