"""Export and import refuse damaged input with one clear line and leave nothing behind.

A header of the wrong shape, rows a table's spec forbids (behind checksums recomputed to
match) and destinations that cannot be made are each refused with an embstore error naming
what the user gave: the file and field, the table and an id, or the destination path.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import TableSpec, TierSpec, fsck, optim
from embstore._export import export_store, import_store
from embstore.errors import CorruptStoreError
from embstore.tools.cli import main


def _fill(path: Path) -> Path:
    """A small store: `user` (dim 8, row-wise Adagrad) and `item` (dim 4, 10 ids at most)."""
    specs = [TableSpec("user", dim=8, optimizer=optim.RowWiseAdagrad(lr=0.05)),
             TableSpec("item", dim=4, num_embeddings=10)]
    with embstore.open(path, tables=specs, tiers=[TierSpec("dram", capacity=64),
                                                  TierSpec("lmdb")]) as store:
        ids = np.arange(300)
        store.apply_gradients("user", ids, np.ones((300, 8), np.float32))
        store.update("item", np.arange(10), np.ones((10, 4), np.float32))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of `_fill`'s store (copy it before damaging it)."""
    root = tmp_path_factory.mktemp("exported")
    export_store(_fill(root / "s"), root / "x")
    return root / "x"


def _copy(exported: Path, tmp_path: Path) -> Path:
    out = tmp_path / "x"
    shutil.copytree(exported, out)
    return out


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error of a CLI run that must fail with exit 2 (never an internal error)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"embstore {argv[0]}: error: ") and err.count("\n") == 1, err
    assert ".tmp-" not in err, err  # the private build directory means nothing to the user
    return err


def _write_header(export, header: dict) -> None:
    """Write `header` into `export` with its checksum made again, as a careful forger would."""
    from embstore.manifest import json_checksum

    header = {k: v for k, v in header.items() if k != "checksum"}
    header["checksum"] = json_checksum(header)
    (export / "header.json").write_text(json.dumps(header))


def _table(h: dict, name: str) -> dict:
    return next(t for t in h["tables"] if t["spec"]["name"] == name)


# (mutation of the header document, the field the error must name)
HEADERS = {
    "list": (lambda h: [], "JSON object"),
    "null": (lambda h: None, "JSON object"),
    "no_tiers": (lambda h: {k: v for k, v in h.items() if k != "tiers"}, "tiers is missing"),
    "tiers_empty": (lambda h: {**h, "tiers": []}, "tiers must be"),
    "tiers_null": (lambda h: {**h, "tiers": None}, "tiers must be"),
    "tier_str": (lambda h: {**h, "tiers": ["dram"]}, "tiers[0]"),
    "tier_options": (lambda h: {**h, "tiers": [{**h["tiers"][0], "options": 5}]},
                     "tiers[0].options"),
    "extras_str": (lambda h: {**h, "extras": "x"}, "extras must be"),
    "gradient_steps": (lambda h: {**h, "extras": {"gradient_steps": {"user": "x"}}},
                       "extras.gradient_steps"),
    "byte_order_big": (lambda h: {**h, "byte_order": "big"}, "byte_order"),
    "no_byte_order": (lambda h: {k: v for k, v in h.items() if k != "byte_order"},
                      "byte_order"),
    "version_true": (lambda h: {**h, "version": True}, "version 1"),
    "step_str": (lambda h: {**h, "step": "x"}, "step must be"),
    "tables_dict": (lambda h: {**h, "tables": {}}, "tables must be"),
    "no_rows_crc": (lambda h: {**h, "tables": [{k: v for k, v in t.items() if k != "rows_crc32"}
                                               for t in h["tables"]]}, "rows_crc32 is missing"),
    "crc_negative": (lambda h: {**h, "tables": [{**t, "ids_crc32": -1} for t in h["tables"]]},
                     "ids_crc32"),
    "rows_true": (lambda h: {**h, "tables": [{**t, "rows": True} for t in h["tables"]]},
                  ".rows must be"),
    "dtype_f8": (lambda h: {**h, "tables": [{**t, "dtype": "<f8"} for t in h["tables"]]},
                 ".dtype must be"),
    "allow_nonfinite_str": (lambda h: {**h, "tables": [
        {**t, "spec": {**t["spec"], "allow_nonfinite": "no"}} for t in h["tables"]]},
        "spec.allow_nonfinite"),
    "init_config_list": (lambda h: {**h, "tables": [
        {**t, "spec": {**t["spec"], "init": {"name": "zeros", "config": [1]}}}
        for t in h["tables"]]}, "spec.init"),
    "same_name_twice": (lambda h: {**h, "tables": [h["tables"][0], h["tables"][0]]},
                        "again"),
    "same_file_twice": (lambda h: {**h, "tables": [
        h["tables"][0], {**h["tables"][1], "ids_file": h["tables"][0]["ids_file"]}]},
        "ids_file"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_a_header_of_the_wrong_shape_is_refused_naming_file_and_field(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    mutate, field = HEADERS[case]
    src = _copy(exported, tmp_path)
    header = src / "header.json"
    header.write_text(json.dumps(mutate(json.loads(header.read_text()))))
    with pytest.raises(CorruptStoreError, match="header.json") as info:
        import_store(src, tmp_path / "new" / "store")
    assert field in str(info.value)
    err = _refused(["import", str(src), str(tmp_path / "new" / "store")], capsys)
    assert str(header) in err and field in err
    assert not (tmp_path / "new").exists()  # nothing made, not even the parent


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"{" * 100_000,
                                 b'{"format": "embstore-export", "step": ' + b"9" * 5000 + b"}"])
def test_a_header_that_is_not_json_is_refused_in_our_words(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: bytes) -> None:
    src = _copy(exported, tmp_path)
    (src / "header.json").write_bytes(raw)
    err = _refused(["import", str(src), str(tmp_path / "new")], capsys)
    assert "header.json is damaged" in err and "Expecting" not in err  # not json's message
    assert not (tmp_path / "new").exists()


def _damage_rows(src: Path, name: str, value: float, *, row: int = 3, column: int = 0) -> int:
    """Put `value` in column `column` of row `row` of table `name`, fixing its CRC-32."""
    header = json.loads((src / "header.json").read_text())
    t = _table(header, name)
    rows = np.fromfile(src / t["rows_file"], dtype=t["dtype"]).reshape(t["rows"], -1)
    rows[row, column] = value
    rows.tofile(src / t["rows_file"])
    t["rows_crc32"] = zlib.crc32(rows.tobytes())
    _write_header(src, header)
    return int(np.fromfile(src / t["ids_file"], dtype="<i8")[row])


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_rows_a_table_forbids_are_not_imported_even_with_matching_checksums(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float
) -> None:
    src = _copy(exported, tmp_path)
    bad_id = _damage_rows(src, "user", value)
    with pytest.raises(CorruptStoreError, match=rf"'user'.*NaN or infinity.*id {bad_id}\b"):
        import_store(src, tmp_path / "new")
    err = _refused(["import", str(src), str(tmp_path / "new"), "--tiers", "pmem"], capsys)
    assert "'user'" in err and f"id {bad_id}" in err
    assert not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".new")]


def test_an_optimizer_state_no_step_reaches_is_not_imported(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a negative row-wise Adagrad sum imported, and fsck called the store clean: the row's
    # next step would be NaN, which the store refuses, so it could never be trained again
    src = _copy(exported, tmp_path)
    bad_id = _damage_rows(src, "user", -5.0, column=8)  # the state after 8 weights
    with pytest.raises(CorruptStoreError, match=rf"'user'.*id {bad_id} holds a rowwise"):
        import_store(src, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def _set_id(src: Path, name: str, at: int, value: int) -> None:
    """Put id `value` at position `at` of table `name`'s ids, fixing their CRC-32."""
    header = json.loads((src / "header.json").read_text())
    t = _table(header, name)
    ids = np.fromfile(src / t["ids_file"], dtype="<i8")
    ids[at] = value
    ids.tofile(src / t["ids_file"])
    t["ids_crc32"] = zlib.crc32(ids.tobytes())
    _write_header(src, header)


def test_ids_outside_num_embeddings_are_not_imported(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy(exported, tmp_path)
    _set_id(src, "item", 2, 10)  # the table holds ids 0..9
    err = _refused(["import", str(src), str(tmp_path / "new")], capsys)
    assert "'item'" in err and "id 10" in err
    assert not (tmp_path / "new").exists()


def test_an_id_exported_twice_is_not_imported(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # an export holds each row once: a repeated id is damage, not a row to overwrite
    src = _copy(exported, tmp_path)
    t = _table(json.loads((src / "header.json").read_text()), "item")
    twice = int(np.fromfile(src / t["ids_file"], dtype="<i8")[1])
    _set_id(src, "item", 3, twice)
    with pytest.raises(CorruptStoreError, match=rf"'item'.*id {twice} twice"):
        import_store(src, tmp_path / "new")
    err = _refused(["import", str(src), str(tmp_path / "new")], capsys)
    assert f"id {twice} twice" in err
    assert not (tmp_path / "new").exists()


def test_nonfinite_and_half_precision_rows_import_where_their_spec_allows(
        tmp_path: Path) -> None:
    specs = [TableSpec("free", dim=2, allow_nonfinite=True),
             TableSpec("half", dim=4, precision="fp16", optimizer=optim.Adam(lr=0.1),
                       tiers=(TierSpec("pmem"),))]
    with embstore.open(tmp_path / "s", tables=specs, tiers=[TierSpec("lmdb")]) as store:
        store.update("free", np.arange(3), np.array([[np.nan, 1], [np.inf, 2], [3, 4]],
                                                     np.float32))
        store.apply_gradients("half", np.arange(50), np.ones((50, 4), np.float32))
    export_store(tmp_path / "s", tmp_path / "x")
    assert import_store(tmp_path / "x", tmp_path / "t") == {"free": 3, "half": 50}
    assert fsck.check(tmp_path / "t") == []
    with embstore.open(tmp_path / "t", read_only=True) as store:
        assert np.isnan(store.lookup("free", np.arange(1))).any()


def test_half_precision_rows_holding_infinity_are_not_imported(tmp_path: Path) -> None:
    spec = TableSpec("half", dim=4, precision="fp16")
    with embstore.open(tmp_path / "s", tables=[spec], tiers=[TierSpec("lmdb")]) as store:
        store.update("half", np.arange(20), np.ones((20, 4), np.float32))
    export_store(tmp_path / "s", tmp_path / "x")
    header = json.loads((tmp_path / "x" / "header.json").read_text())
    t = _table(header, "half")
    raw = np.fromfile(tmp_path / "x" / t["rows_file"], dtype=np.uint8).reshape(20, -1)
    raw[5, 2:4] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # weight 1 of row 5
    raw.tofile(tmp_path / "x" / t["rows_file"])
    t["rows_crc32"] = zlib.crc32(raw.tobytes())
    _write_header(tmp_path / "x", header)
    bad_id = int(np.fromfile(tmp_path / "x" / t["ids_file"], dtype="<i8")[5])
    with pytest.raises(CorruptStoreError, match=rf"'half'.*id {bad_id}\b"):
        import_store(tmp_path / "x", tmp_path / "t")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_destination_under_a_file_is_named_as_given(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (tmp_path / "afile").write_bytes(b"")
    src = exported.parent / "s" if command == "export" else exported
    for dest in (tmp_path / "afile" / "x", tmp_path / "afile" / "d" / "x"):
        err = _refused([command, str(src), str(dest)], capsys)
        assert f"cannot create {dest}" in err and f"{tmp_path / 'afile'} is not a directory" in err
    assert (tmp_path / "afile").read_bytes() == b""


@pytest.mark.parametrize("command", ["export", "import"])
def test_a_failure_to_publish_names_the_destination_and_leaves_nothing(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    dest = tmp_path / "new" / "out"
    real = os.replace

    def replace(a: str | os.PathLike[str], b: str | os.PathLike[str], **kw: object) -> None:
        if Path(b) == dest:  # the final rename only: the header's own stays
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fspath(a), None,
                          os.fspath(b))
        real(a, b, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", replace)
    src = exported.parent / "s" if command == "export" else exported
    err = _refused([command, str(src), str(dest)], capsys)
    assert f"cannot write {dest}" in err
    assert not (tmp_path / "new").exists()  # neither the private directory nor its parent


def _occupy(dest: Path, kind: str) -> None:
    if kind == "file":
        dest.write_text("mine")
    elif kind == "link to an empty directory":
        (dest.parent / "target").mkdir()
        dest.symlink_to(dest.parent / "target")
    else:  # a dangling link
        dest.symlink_to(dest.parent / "nowhere")


@pytest.mark.parametrize("kind", ["file", "link to an empty directory", "dangling link"])
@pytest.mark.parametrize("command", ["export", "import"])
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_destination_taken_by_a_file_or_link_is_refused_and_kept(
        exported: Path, tmp_path: Path, command: str, when: str, kind: str) -> None:
    dest = tmp_path / "out"
    occupied: list[bool] = []

    def progress(*_: object) -> None:  # called while the private build is being written
        if when == "during" and not occupied:
            occupied.append(True)
            _occupy(dest, kind)

    if when == "before":
        _occupy(dest, kind)
    with pytest.raises(embstore.errors.StoreExistsError):
        if command == "export":
            export_store(exported.parent / "s", dest, progress=progress)
        else:
            import_store(exported, dest, progress=progress)
    assert dest.is_symlink() == (kind != "file")
    if kind == "file":
        assert dest.read_text() == "mine"
    if kind == "link to an empty directory":
        assert not any((tmp_path / "target").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []


@pytest.mark.parametrize("field", ["lr", "seed"])
def test_a_header_value_changed_by_a_flipped_bit_is_refused(tmp_path, field):
    # the data files carry CRCs of their own; a spec's number in the header used to import
    # as another table (a learning rate of 0.03 for 0.01, another initializer's seed)
    with embstore.open(tmp_path / "s", tables=[TableSpec(
            "t", dim=4, init=embstore.init.Uniform(seed=1),
            optimizer=embstore.optim.Adagrad(lr=0.01))]) as store:
        store.update("t", np.arange(10), np.ones((10, 4), np.float32))
    export_store(tmp_path / "s", tmp_path / "x")
    raw = bytearray((tmp_path / "x" / "header.json").read_bytes())
    at = raw.index(b'"lr": 0.01' if field == "lr" else b'"seed": 1') + (9 if field == "lr"
                                                                      else 8)
    raw[at] ^= 0x02  # "0.01" -> "0.03", "1" -> "3": still a valid header field by field
    (tmp_path / "x" / "header.json").write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match="fails its checksum"):
        import_store(tmp_path / "x", tmp_path / "i")
    assert not (tmp_path / "i").exists()


def test_a_version_1_export_without_a_header_checksum_still_imports(tmp_path):
    with embstore.open(tmp_path / "s", tables=[TableSpec("t", dim=4)]) as store:
        store.update("t", np.arange(10), np.full((10, 4), 2.0, np.float32))
    export_store(tmp_path / "s", tmp_path / "x")
    header = json.loads((tmp_path / "x" / "header.json").read_text())
    del header["checksum"]
    header["version"] = 1  # what exports were before the header had a checksum
    (tmp_path / "x" / "header.json").write_text(json.dumps(header))
    import_store(tmp_path / "x", tmp_path / "i")
    with embstore.open(tmp_path / "i") as store:
        assert (store.lookup("t", np.arange(10)) == 2.0).all()
    header["version"] = 2  # a version 2 header must carry its checksum
    (tmp_path / "x" / "header.json").write_text(json.dumps(header))
    with pytest.raises(CorruptStoreError, match="fails its checksum"):
        import_store(tmp_path / "x", tmp_path / "j")
