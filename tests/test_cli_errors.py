"""Bad invocations of every subcommand: a one-line message, the documented exit code, and
never a traceback (`main(argv)` in-process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore.tools.cli import build_parser, main


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


@pytest.mark.parametrize("capacity", ["100.0", "1.5", "1e3"])
def test_a_tier_capacity_that_is_a_number_but_no_whole_row_count_is_refused(capacity, places,
                                                                            capsys):
    # a bare number is rows, but these fell through to bytes: dram:100.0 made a 2-row tier
    argv = ["import", places["X"], places["N"], "--tiers", f"dram:{capacity},lmdb"]
    assert main(argv) == 2
    assert f"capacity {capacity!r} is no whole row count" in capsys.readouterr().err
    assert not (places["root"] / "new").exists()


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


# --- embstore bench: every flag refused when parsed, before any benchmark runs ------------------

_TABLE_BENCHES = ("lookup", "update", "optim", "precision", "backends")
_ZIPF_BENCHES = (*_TABLE_BENCHES, "step", "scale", "torch")
_SEEDED_BENCHES = (*_TABLE_BENCHES, "step", "tiers", "tables", "placement", "torch")

BAD_BENCH = [
    # (argv after `bench`, with placeholders; the flag the one line must name)
    *[([b, "--rows", v], "--rows") for b in (*_TABLE_BENCHES, "step", "hierarchy", "torch",
                                             "tiers") for v in ("0", "-1")],
    *[([b, "--batch", v], "--batch") for b in (*_TABLE_BENCHES, "hierarchy", "torch")
      for v in ("-5", "0")],
    *[([b, "--repeats", "0"], "--repeats") for b in (*_TABLE_BENCHES, "step", "hierarchy",
                                                     "torch", "tiers")],
    *[([b, "--dim", "0"], "--dim") for b in (*_TABLE_BENCHES, "step", "scale", "torch")],
    *[([b, *quick, "--seed", "-1"], "--seed") for b in _SEEDED_BENCHES
      for quick in ([], ["--quick"])],
    *[([b, "--zipf", v], "--zipf") for b in _ZIPF_BENCHES for v in ("nan", "inf", "-1", "0",
                                                                      "1e9", "x")],
    (["scale", "--rows", "0"], "--rows"), (["scale", "--rows", "0.5"], "--rows"),
    (["scale", "--chunk", "0"], "--chunk"), (["scale", "--dram", "0"], "--dram"),
    (["scale", "--dram", "lots"], "--dram"), (["scale", "--steps", "0"], "--steps"),
    (["scale", "--bags", "0"], "--bags"), (["scale", "--bag", "-1"], "--bag"),
    (["scale", "--cold-read-threads", "0"], "--cold-read-threads"),
    (["scale", "--cold-read-threads", "257"], "--cold-read-threads"),
    (["placement", "--dram", "nan"], "--dram"), (["placement", "--dram", "-0.1"], "--dram"),
    (["placement", "--pmem", "inf"], "--pmem"), (["placement", "--warmup", "1"], "--warmup"),
    (["placement", "--tables", "0"], "--tables"), (["placement", "--batches", "0"], "--batches"),
    (["placement", "--lookups", "0"], "--lookups"), (["placement", "--tiers", "M"], "--tiers"),
    (["placement", "--dir", "F"], "--dir"),
    (["shard", "--nproc", "0"], "--nproc"), (["shard", "--nproc", "2", "-1"], "--nproc"),
    (["shard", "--steps", "0"], "--steps"),
    (["backends", "--flush-rows", "-1"], "--flush-rows"),
    (["backends", "--flush-rows", "0"], "--flush-rows"),
    (["backends", "--backends", "nosuch"], "--backends"),
    (["backends", "--dir", "F"], "--dir"), (["tiers", "--dir", "F"], "--dir"),
    (["tiers", "--dir", "F/sub"], "--dir"), (["tiers", "--row-bytes", "6"], "--row-bytes"),
    (["tiers", "--small", "0"], "--small"), (["tiers", "--tiers", "floppy"], "--tiers"),
    (["hierarchy", "--parts", "nope"], "--parts"), (["hierarchy", "--parts", ""], "--parts"),
    (["hierarchy", "--batches", "0"], "--batches"),
    (["hierarchy", "--e2e-repeats", "0"], "--e2e-repeats"),
    (["hierarchy", "--eviction", "nope"], "--eviction"),
    (["hierarchy", "--admission", "lru"], "--admission"),
    (["hierarchy", "--bottoms", "floppy"], "--bottoms"),
    (["tables", "--stats", "M"], "--stats"), (["tables", "--stats", "D"], "--stats"),
    (["tables", "--stats", ""], "--stats"),
    (["step", "--bags", "0"], "--bags"), (["step", "--bag-size", "0"], "--bag-size"),
    *[(["torch", flag, "0"], flag) for flag in ("--bag", "--demo-rows", "--demo-batch",
                                                "--demo-chunk", "--threads")],
    (["placement", "-o", ""], "-o"),  # refused by the run, before it profiles anything
    (["placement", "--tables", "9", "--lookups", "8"], "--tables 9"),  # by the run too
    # the proportional reference caches with clock: without its curve, a KeyError at the end
    (["placement", "--quick", "--no-replay", "--policies", "lru"], "--policies"),
    (["placement", "--quick", "--no-replay", "--policies", ""], "--policies"),
]


def _one_error_line(err: str, out: str = "") -> str:
    assert "Traceback" not in out + err and "internal error" not in out + err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("argv", "flag"), BAD_BENCH,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_bench_flag_is_refused_in_one_line_naming_it(argv, flag, places, capsys):
    places = {**places, "F/sub": str(places["root"] / "file.txt" / "sub")}
    assert main(["bench", *_argv(argv, places)]) == 2
    out, err = capsys.readouterr()
    line = _one_error_line(err, out)
    assert line.startswith(f"embstore bench {argv[0]}: error:") and flag in line, line


GOOD_BENCH = [  # edge values a benchmark can run: parsed, not run
    ["lookup", "--rows", "1", "--batch", "1", "--repeats", "1", "--zipf", "0.5", "--seed", "0"],
    ["step", "--zipf", "20"], ["scale", "--rows", "1.5M", "--chunk", "250k", "--dram", "64MiB"],
    ["placement", "--dram", "0", "--pmem", "0", "--warmup", "0", "--dir", "N/deeper"],
    ["tiers", "--dir", "N"], ["tables", "--stats", "F"], ["hierarchy", "--parts", "e2e"],
    ["backends", "--backends", "lmdb", "rocksdb", "--dir", "D"],
]


@pytest.mark.parametrize("argv", GOOD_BENCH, ids=" ".join)
def test_edge_values_a_bench_can_run_are_taken(argv, places):
    args = build_parser(benchmarks=True).parse_args(["bench", *_argv(argv, places)])
    assert args.benchmark == argv[0]
    assert not (places["root"] / "new").exists()  # a missing --dir is made by the run only


def test_bench_tables_without_stats_leaves_the_fallback_to_the_run():
    assert build_parser(benchmarks=True).parse_args(["bench", "tables"]).stats is None


def test_every_bench_help_example_parses(capsys):
    from embstore.tools.bench import _benchmarks

    for name in _benchmarks():
        assert main(["bench", name, "--help"]) == 0
        example = re.search(r"example: embstore (.*)", capsys.readouterr().out)
        assert example, name
        args = build_parser(benchmarks=True).parse_args(example.group(1).split())
        assert args.benchmark == name and args.quick, name


def test_shard_quick_is_a_short_run_at_one_and_two_processes(monkeypatch, capsys):
    from embstore.tools import _bench_shard

    class Result:
        steps_per_s, bytes_per_step, min_bytes_per_step, losses, digest = 1.0, 2, 1, [0.5], "ab"

    ran = []
    monkeypatch.setattr(_bench_shard, "train_distributed",
                        lambda job, n, steps, **kw: ran.append((n, steps)) or Result())
    assert main(["bench", "shard", "--quick"]) == 0
    assert ran == [(n, _bench_shard.QUICK_STEPS) for n in _bench_shard.QUICK_NPROC]
    assert "nproc 2" in capsys.readouterr().out


def test_shard_one_process_says_it_has_nothing_to_exchange(monkeypatch, capsys):
    from embstore.tools import _bench_shard

    class Result:
        steps_per_s, bytes_per_step, min_bytes_per_step, losses, digest = 1.0, 0, 0, [0.5], "ab"

    monkeypatch.setattr(_bench_shard, "train_distributed", lambda job, n, steps, **kw: Result())
    assert main(["bench", "shard", "--nproc", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "nothing to exchange" in out and "None" not in out


# --- embstore demo --plot: checked before training -----------------------------------------------

@pytest.mark.parametrize("plot", ["x.xyz", "x.", "", "D", "nofolder/x.png"])
def test_a_plot_the_demo_cannot_write_is_refused_before_training(plot, places, capsys,
                                                                monkeypatch):
    monkeypatch.chdir(places["root"])
    monkeypatch.setitem(sys.modules, "torch", None)  # so that training cannot start
    assert main(["demo", "--plot", places.get(plot, plot)]) == 2
    out, err = capsys.readouterr()
    line = _one_error_line(err, out)
    assert line.startswith("embstore demo: error: --plot"), line
    assert not list(places["root"].glob("x*"))


def test_a_plot_name_without_extension_is_the_png_the_demo_reports(places):
    pytest.importorskip("matplotlib")
    from embstore.tools.demo import _plot_file

    curves = places["root"] / "curves"
    assert _plot_file(str(curves)) == f"{curves}.png"
    assert _plot_file(str(curves) + ".svg") == f"{curves}.svg"


# --- Ctrl-C, a closed stdout, leftovers of a subcommand ------------------------------------------

@pytest.mark.parametrize(("where", "prog"), [
    ("build_parser", "embstore bench"),  # importing torch for the benchmarks' parsers
    ("parse_args", "embstore bench"), ("run", "embstore bench lookup")])
def test_ctrl_c_at_any_point_ends_in_one_line_and_130(where, prog, monkeypatch, capsys):
    from embstore.tools import _bench_lookup, cli
    from embstore.tools._args import Parser

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    owner = {"build_parser": cli, "parse_args": Parser, "run": _bench_lookup}[where]
    monkeypatch.setattr(owner, where, interrupt)
    assert main(["bench", "lookup", "--quick"]) == 130
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert err.splitlines() == [f"{prog}: interrupted"], err


def test_a_closed_stdout_ends_quietly(places):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte, as after `head -1`
    try:
        done = subprocess.run([sys.executable, "-m", "embstore.tools.cli", "info", places["S"]],
                              stdout=write, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write)
    assert done.stderr.decode() == ""  # neither our error line nor one at interpreter exit
    assert done.returncode == 141  # 128 + SIGPIPE, what a shell reports for `cat` there


@pytest.mark.parametrize(("argv", "prog"), [
    (["info", "S", "--bogus"], "embstore info"), (["fsck", "S", "-z"], "embstore fsck"),
    (["bench", "lookup", "--bogus"], "embstore bench lookup"),
    (["bench", "shard", "--quick", "extra"], "embstore bench shard")])
def test_unrecognized_arguments_are_reported_by_their_subcommand(argv, prog, places, capsys):
    assert main(_argv(argv, places)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"{prog}: error: unrecognized arguments:"), line
    assert line.endswith(f"(see `{prog} --help`)"), line


def test_an_os_error_is_printed_as_its_reason_and_file_without_the_errno():
    from embstore.errors import StorageIOError
    from embstore.tools import cli

    assert cli._one_line(FileNotFoundError(2, "No such file or directory", "a/b")) == \
        "No such file or directory: a/b"
    assert cli._one_line(StorageIOError(20, "cannot write out: Not a directory")) == \
        "cannot write out: Not a directory"
    assert cli._one_line(OSError("no errno here")) == "no errno here"


def test_a_warning_is_one_line_of_the_command_without_file_line_or_source(tmp_path, capsys,
                                                                          monkeypatch):
    # the pmem fallback's warning printed "/.../embstore/backend.py:136: PmemFallbackWarning:"
    # and then the source line that raised it
    import warnings

    from embstore import _libpmem

    path = tmp_path / "s"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _libpmem.PmemFallbackWarning)
        embstore.open(path, tables=[embstore.TableSpec("t", dim=4)],
                      tiers=[embstore.TierSpec("pmem")]).close()
    monkeypatch.setattr(_libpmem, "LIBRARY_NAME", "libpmem-missing-for-this-test.so.1")
    monkeypatch.setattr(_libpmem, "_lib", None)
    monkeypatch.setattr(_libpmem, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("always", _libpmem.PmemFallbackWarning)
        assert main(["info", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("embstore info: warning: libpmem cannot be loaded"), err
    assert len(err.strip().splitlines()) == 1 and ".py:" not in err, err


@pytest.mark.parametrize("argv", [
    ["demo", "--rows", "99999999999999999999"], ["demo", "--batch-size", "99999999999"],
    ["demo", "--eval-samples", "99999999999"], ["demo", "--nproc", "100000"],
    ["bench", "shard", "--nproc", "1", "100000"],
])
def test_a_size_that_could_never_run_is_refused_before_anything_is_allocated(argv, capsys):
    # these reached numpy as allocations of terabytes ("internal error: MemoryError") or,
    # for --nproc, would have started that many torch processes
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is more than" in err, err


@pytest.mark.parametrize(("argv", "says"), [
    # a segfault in torch; raw numpy errors; 4 GB written to /tmp; a float's digits
    (["bench", "torch", "--quick", "--threads", "5000"], "more than 1,024"),
    (["bench", "lookup", "--quick", "--rows", str(10**30)], "more than 2,147,483,647"),
    (["bench", "backends", "--quick", "--dim", str(10**30)], "more than 2,147,483,647"),
    (["bench", "scale", "--quick", "--rows", "3G"], "more than 2,147,483,647"),
    (["bench", "placement", "--quick", "--pmem", "1e300"], "at most all of them"),
    # the OS killed the process for it: allocations succeed on credit
    (["bench", "lookup", "--quick", "--rows", "2000000000"], "GiB this machine has available"),
])
def test_bench_sizes_past_what_can_run_are_refused_in_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("rates", "says"), [("1,1", "gives a rate twice"),
                                             ("1e-10", "rates must lie in [2**-24, 1]")])
def test_bench_step_refuses_recording_rates_before_the_baseline(rates, says, capsys):
    # both were refused only after the baseline ran, "1,1" as a log held by another store
    assert main(["bench", "step", "--quick", "--record-accesses", rates]) == 2
    err = capsys.readouterr().err
    assert says in err and "argument --record-accesses" in err, err
