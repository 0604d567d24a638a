"""Nothing is written inside a store but the store itself: its rewrites would delete it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.errors import ConfigError
from embstore.tools.cli import main


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "st"
    with embstore.open(path, tables=[embstore.TableSpec("t", dim=2)]) as s:
        s.update("t", np.arange(3), np.ones((3, 2), np.float32))
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()
            and p.name not in ("STATS.json", "LOCK")}


def test_writes_through_a_link_into_a_store_are_refused(store: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    # the link hid the store above: an export or checkpoint landed in it, and compact then
    # deleted it without a word
    link = tmp_path / "lt"
    link.symlink_to(store / "tier0-dram")
    before = _files(store)
    assert main(["export", str(store), str(link / "bk")]) == 2
    assert "lies inside the store" in capsys.readouterr().err
    with embstore.open(store) as s, pytest.raises(ConfigError, match="inside the store"):
        s.checkpoint(link / "ck", step=3)
    assert _files(store) == before


def test_outputs_imports_and_new_stores_inside_a_store_are_refused(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # bench tiers overwrote the manifest (the store no longer opened); import and open made a
    # store inside the store, which compact then refused
    assert main(["export", str(store), str(tmp_path / "ex")]) == 0
    before = _files(store)
    assert main(["bench", "tiers", "--quick", "--tiers", "dram", "-o",
                 str(store / "MANIFEST.json")]) == 2
    assert "lies inside the store" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "ex"), str(store / "inner")]) == 2
    assert "lies inside the store" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="inside the store"):
        embstore.open(store / "new", tables=[embstore.TableSpec("t", dim=2)])
    assert _files(store) == before and not (store / "inner").exists()
    assert main(["compact", str(store)]) == 0


def test_an_export_to_a_path_through_dot_dot_goes_there(store: Path, tmp_path: Path) -> None:
    # out/../out names out only while out exists: the export removed the empty out, could
    # not rename onto the path, and left its private copy behind
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(store), os.path.join(out, "..", "out")]) == 0
    assert (out / "header.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "st"]
    (tmp_path / "imp").mkdir()
    assert main(["import", str(out), os.path.join(tmp_path, "imp", "..", "imp")]) == 0
    with embstore.open(tmp_path / "imp") as s:
        np.testing.assert_array_equal(s.lookup("t", np.arange(3)), np.ones((3, 2)))
