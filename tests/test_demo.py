"""`embstore demo`: a short DLRM training run, its determinism promise, and resuming."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")

from embstore.tools.cli import main  # noqa: E402

SMALL = ["--rows", "20000", "--batch-size", "512", "--evals", "2", "--eval-samples", "2048"]


def _demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["demo", *SMALL, *args])
    return rc, capsys.readouterr().out


def _digest(out: str) -> str:
    found = re.findall(r"^digest: ([0-9a-f]{64})$", out, re.M)
    assert len(found) == 1, out
    return found[0]


def test_short_run_learns_and_prints_a_digest(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _demo(capsys, "--steps", "30", "--json")
    assert rc == 0
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["steps"] == 30
    assert figures["loss_end"] < figures["loss_start"] - 0.02
    assert figures["held_out_loss_end"] < figures["held_out_loss_start"]
    assert figures["auc"] > 0.53
    assert [t["backend"] for t in figures["tiers"]] == ["dram", "rocksdb"]
    assert 0 < figures["tiers"][0]["hit_ratio"] < 1
    assert re.fullmatch(r"[0-9a-f]{64}", figures["digest"])
    rc, out = _demo(capsys, "--steps", "2")
    assert rc == 0
    for text in ("loss (mean of", "AUC", "samples/s", "tier 0 dram", "tier 1 rocksdb"):
        assert text in out
    _digest(out)


def test_digest_same_without_pipeline_and_all_in_dram(capsys: pytest.CaptureFixture[str]) -> None:
    digests = []
    for flags in ([], ["--no-pipeline"], ["--all-dram"], ["--all-dram", "--no-pipeline"]):
        rc, out = _demo(capsys, "--steps", "8", *flags)
        assert rc == 0, out
        digests.append(_digest(out))
    assert len(set(digests)) == 1, digests


def test_resume_continues_where_the_first_run_stopped(tmp_path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "run")
    rc, out = _demo(capsys, "--steps", "5", "--path", path)
    assert rc == 0 and "step 5" in out
    rc, out = _demo(capsys, "--steps", "4", "--path", path, "--no-pipeline")
    assert rc == 0
    assert "resuming at step 5" in out
    resumed = _digest(out)
    # the same 9 steps in one run: the same tables, bit for bit
    rc, out = _demo(capsys, "--steps", "9")
    assert rc == 0
    assert _digest(out) == resumed
    rc, out = _demo(capsys, "--steps", "0", "--path", path, "--json")
    assert rc == 0 and json.loads(out)["step"] == 9


def test_a_run_kept_with_other_rocksdb_options_resumes_with_its_own(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run kept by a version of the demo with other tier options (a store's chain is fixed
    at creation) goes on with the chain it was made with.
    """
    from embstore.tools import _dlrm

    path = str(tmp_path / "run")
    monkeypatch.setattr(_dlrm, "ROCKSDB_OPTIONS", {"block_cache_bytes": 8 << 20})
    rc, out = _demo(capsys, "--steps", "3", "--path", path)
    assert rc == 0, out
    monkeypatch.undo()
    rc, out = _demo(capsys, "--steps", "2", "--path", path)
    assert rc == 0, out
    assert "resuming at step 3" in out
    rc, fresh = _demo(capsys, "--steps", "5")
    assert rc == 0 and _digest(out) == _digest(fresh)


def test_resume_with_other_settings_is_refused(tmp_path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "run")
    assert _demo(capsys, "--steps", "1", "--path", path)[0] == 0
    assert main(["demo", "--rows", "30000", "--steps", "1", "--path", path]) == 2
    err = capsys.readouterr().err
    assert "rows 20000 (now 30000)" in err and "Traceback" not in err
    assert main(["demo", *SMALL, "--steps", "1", "--path", path, "--all-dram"]) == 2
    assert "without --all-dram" in capsys.readouterr().err
    # another batch size cuts the click stream otherwise: the resumed run was another run
    assert main(["demo", *SMALL, "--batch-size", "256", "--steps", "1", "--path", path]) == 2
    assert "holds a run of --batch-size 512" in capsys.readouterr().err


def test_an_empty_path_or_a_plot_over_the_runs_files_is_refused(
        tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # --path "" trained in the current directory; a plot through a link to dense.pt
    # replaced it with a PNG, and the next resume failed
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *SMALL, "--steps", "1", "--path", ""]) == 2
    assert "--path is empty" in capsys.readouterr().err and not list(tmp_path.iterdir())
    path = tmp_path / "run"
    assert _demo(capsys, "--steps", "1", "--path", str(path))[0] == 0
    (tmp_path / "pic.png").symlink_to(path / "dense.pt")
    before = (path / "dense.pt").read_bytes()
    for plot in (tmp_path / "pic.png", path / "store" / "curves.png"):
        assert main(["demo", *SMALL, "--steps", "1", "--path", str(path), "--plot",
                     str(plot)]) == 2
        assert "--plot" in capsys.readouterr().err
    assert (path / "dense.pt").read_bytes() == before


def test_a_kept_run_that_lost_its_store_or_dense_part_is_refused(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    path = tmp_path / "run"
    assert _demo(capsys, "--steps", "1", "--path", str(path))[0] == 0
    shutil.rmtree(path / "store")  # new tables under the old dense part would be no resume
    assert main(["demo", *SMALL, "--steps", "1", "--path", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is gone" in err and len(err.strip().splitlines()) == 1
    assert not (path / "store").exists()
    (path / "dense.pt").write_bytes(b"garbage")  # torch's message is many lines long
    assert main(["demo", *SMALL, "--steps", "1", "--path", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and len(err.strip().splitlines()) == 1, err


def test_a_dense_part_damaged_or_written_by_something_else_is_refused_by_name(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # each of these ended in "internal error" (AttributeError, KeyError, ValueError, torch's
    # RuntimeError) halfway through opening the run, or in wrong advice (a layout "xyz")
    import torch

    path = tmp_path / "run"
    assert _demo(capsys, "--steps", "1", "--path", str(path))[0] == 0
    good = torch.load(path / "dense.pt", weights_only=True)
    store_files = {p: p.read_bytes() for p in (path / "store").rglob("*") if p.is_file()}
    damages = {
        "config is not a dict": lambda d: d.update(config=5),
        "step -7": lambda d: d.update(step=-7),
        "no history": lambda d: d.pop("history"),
        "history is not": lambda d: d.update(history={"train": 5, "eval": "x"}),
        "layout 'xyz'": lambda d: d.update(layout="xyz"),
        "do not fit this model": lambda d: d["model"].update(
            {next(iter(d["model"])): torch.zeros(2, 2)}),
        "holds a list": lambda d: d.clear(),
    }
    for words, damage in damages.items():
        saved = {**good, "model": dict(good["model"]), "history": dict(good["history"])}
        damage(saved)
        torch.save(saved if words != "holds a list" else [1, 2], path / "dense.pt")
        assert main(["demo", *SMALL, "--steps", "1", "--path", str(path)]) == 2, words
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "is not a dense part of this demo" in err and words in err, err
    assert {p: p.read_bytes() for p in (path / "store").rglob("*") if p.is_file()} \
        == store_files


def test_a_path_that_is_or_lies_in_a_store_is_refused_before_training(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import embstore

    store = tmp_path / "s"
    embstore.open(store, tables=[embstore.TableSpec("t", dim=2)]).close()
    before = sorted(p.name for p in store.iterdir())
    for path in (store, store / "run"):
        assert main(["demo", *SMALL, "--steps", "1", "--path", str(path)]) == 2
        err = capsys.readouterr().err
        assert "inside the store" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in store.iterdir()) == before


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--steps", "-1"], ["--batch-size", "0"], ["--rows", "x"]):
        assert main(["demo", *bad]) == 2  # main returns the code; it never raises SystemExit
    assert "error" in capsys.readouterr().err


def test_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    rc, out = _demo(capsys, "--steps", "3", "--plot", str(png))
    assert rc == 0 and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_processes_print_the_same_digest_with_and_without_the_pipeline(
        capsys: pytest.CaptureFixture[str]) -> None:
    # reruns of the distributed trainer: tests/distributed/test_demo_distributed.py
    small = ("--nproc", "2", "--steps", "6", "--rows", "2000", "--batch-size", "128")
    rc, out = _demo(capsys, *small)
    assert rc == 0, out
    digest = re.search(r"^digest: ([0-9a-f]{64})$", out, re.MULTILINE).group(1)
    rc, out = _demo(capsys, *small, "--no-pipeline")  # the pipeline changes no bit
    assert rc == 0 and f"digest: {digest}" in out


def test_more_processes_refuse_one_process_options(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--nproc", "2", "--all-dram"])
    assert rc == 2
    assert "one process only" in capsys.readouterr().err


def test_json_figures_are_strict_json_when_the_auc_is_undefined(
        capsys: pytest.CaptureFixture[str]) -> None:
    # one held-out sample has one class: its AUC is NaN, which was printed as NaN (no JSON)
    assert main(["demo", "--json", "--eval-samples", "1", "--steps", "2", "--rows", "2000",
                 "--batch-size", "64"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    figures = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert figures["auc"] is None and figures["digest"]
