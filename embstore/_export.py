"""Export a store to a portable directory and import it back, in bounded memory.

The format (no pickle; readable with numpy alone, or any language)::

    OUT/
        header.json   {"format": "embstore-export", "version": 2, "byte_order": "little",
                       "tiers": [TierSpec JSON], "step": int | null, "extras": {...},
                       "tables": [{"spec": TableSpec JSON, "rows": n, "row_width": w,
                                   "dtype": "<f4", "ids_file": "0.ids", "rows_file": "0.rows",
                                   "ids_crc32": int, "rows_crc32": int}],
                       "checksum": "crc32:<hex>"}
        <i>.ids       n ids, int64 little-endian
        <i>.rows      n rows of w values of "dtype" little-endian, C order, as the store
                      keeps them: the weights (dim values) then the optimizer state; a
                      half-precision table's rows are its stored bytes (embstore._precision)

CRC-32 (zlib's) of each file's bytes guards the copy, and of the header's JSON (sorted keys,
indented by 2, without the checksum field) the header: a flipped bit in a spec's learning rate
or an initializer's seed would otherwise import as a different table. Version 1 exports,
whose header has no checksum, still import. Import also checks every field of the header
and every page against its table's spec (ids in range, values finite where the spec forbids
NaN and infinity), refusing the whole import at the first fault. Rows stream page by
page both ways (about 4 MiB of rows at a time), so memory stays bounded whatever a table's
size. Export writes `.OUT.tmp-<pid>-<random>` and renames it, import builds `.PATH.tmp-*` and
renames it: a crash leaves no half-written export or store behind (errors name OUT or PATH).
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ._precision import RowCodec
from ._private_dir import discard, make_private, not_a_directory, publish
from ._rebuild import (
    ClosablePages,
    check_path,
    page_rows,
    read_store,
    store_rows,
    write_store,
)
from .errors import ConfigError, CorruptStoreError, StoreExistsError, StoreNotFoundError
from .layout import lock, refuse_inside_store, require_directory
from .manifest import is_json_int, json_checksum, optional_fields_problem, write_atomic
from .spec import TableSpec, TierSpec

__all__ = ["FORMAT", "export_store", "import_store", "read_header"]

FORMAT = "embstore-export"
VERSION = 2
READS = (1, 2)  # version 1: no checksum of the header
HEADER = "header.json"
_TABLE_FIELDS = ("spec", "rows", "row_width", "dtype", "ids_file", "rows_file", "ids_crc32",
                 "rows_crc32")
_SPEC_FIELDS = ("name", "dim", "dtype", "init", "optimizer", "num_embeddings",
                "allow_nonfinite", "tiers")
_TIER_FIELDS = ("backend", "capacity", "eviction", "admission", "eviction_options",
                "admission_options", "options")
_MISSING = object()


def _le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def _fresh(dest: Path) -> tuple[Path, list[Path]]:
    """A new private directory to build `dest` in, and the parents of `dest` made for it.

    Raises:
        StoreExistsError: `dest` exists and is not an empty directory.
        OSError: `dest` cannot be made there; the message names `dest`, not the private path.
    """
    if not_a_directory(dest) or (dest.is_dir() and any(dest.iterdir())):
        raise StoreExistsError(f"{dest} exists; choose a new path (nothing is overwritten)")
    return make_private(dest)


def _public(exc: OSError, tmp: Path, dest: Path) -> OSError:
    """`exc` naming `dest` where it names the private `tmp` or a file in it, else `exc`.

    The private name (`.out.tmp-<pid>-<random>`) means nothing to the user and is gone once raised.
    """
    def private(name: object) -> bool:
        if not isinstance(name, (str, bytes, os.PathLike)):
            return False  # a file descriptor, or no file at all
        text = os.fsdecode(name)
        return text == str(tmp) or text.startswith(f"{tmp}{os.sep}")

    if not (private(exc.filename) or private(exc.filename2)):
        return exc
    return OSError(exc.errno, f"cannot write {dest}: {exc.strerror or type(exc).__name__}")


def _private(file: Path) -> BinaryIO:
    """`file`, created 0600 for writing (never through a link)."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return open(fd, "wb")


def _commit(tmp: Path, dest: Path) -> None:
    publish(tmp, dest, "the export or import")


def export_store(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Write every table of the store at `src` to the new export directory `out`.

    Holds the store's shared lock (readers may go on, a writer waits). Returns the header.

    Raises:
        StoreNotFoundError, StoreLockedError, CorruptStoreError: from the store.
        StoreExistsError: `out` exists and is not an empty directory.
        OSError: `out` cannot be made or written (the message names `out`).
    """
    root, dest = Path(src), Path(out)
    require_directory(root, links=True)
    refuse_inside_store(dest, "export to a directory beside it")
    read_store(root)  # no store, no LOCK file left in someone else's directory
    fd = lock(root, read_only=True)
    try:
        doc, specs, tiers = read_store(root)
        tmp, made = _fresh(dest)
        try:
            source = store_rows(root, tiers, specs)
            tables = []
            for i, spec in enumerate(specs):
                tables.append(_export_table(tmp, i, spec, source, progress))
            step = (doc.get("checkpoint") or doc.get("restored_from") or {}).get("step")
            header = {"format": FORMAT, "version": VERSION, "byte_order": "little",
                      "tiers": [t.to_json() for t in tiers], "step": step,
                      "extras": {k: v for k, v in doc.items()
                                 if k not in ("format", "version", "tiers", "tables")},
                      "tables": tables}
            header["checksum"] = json_checksum(header)
            write_atomic(tmp / HEADER, json.dumps(header, indent=1).encode())
            _commit(tmp, dest)
        except OSError as exc:
            discard(tmp, made)
            raise _public(exc, tmp, dest) from exc
        except BaseException:
            discard(tmp, made)
            raise
    finally:
        os.close(fd)
    return header


def _export_table(tmp: Path, i: int, spec: TableSpec,
                  source: Callable[[TableSpec], tuple[int, Iterator[tuple[np.ndarray,
                                                                         np.ndarray]]]],
                  progress: Callable[[str, int], None] | None) -> dict[str, Any]:
    _, pages = source(spec)
    n, crc_ids, crc_rows = 0, 0, 0
    dtype = _le(spec.storage_dtype)
    # a failure closes the scan's reader now, not when the garbage collector gets to it
    with contextlib.closing(ClosablePages(pages)), _private(tmp / f"{i}.ids") as fi, \
            _private(tmp / f"{i}.rows") as fr:
        for ids, rows in pages:
            a = np.ascontiguousarray(ids, dtype="<i8").tobytes()
            b = np.ascontiguousarray(rows, dtype=dtype).tobytes()
            fi.write(a)
            fr.write(b)
            crc_ids, crc_rows = zlib.crc32(a, crc_ids), zlib.crc32(b, crc_rows)
            n += len(ids)
            if progress is not None:
                progress(spec.name, len(ids))
        for fh in (fi, fr):
            fh.flush()
            os.fsync(fh.fileno())
    return {"spec": spec.to_json(), "rows": n, "row_width": spec.storage_width,
            "dtype": dtype.str, "ids_file": f"{i}.ids", "rows_file": f"{i}.rows",
            "ids_crc32": crc_ids, "rows_crc32": crc_rows}


def read_header(src: Path) -> dict[str, Any]:
    """The checked header of the export directory `src`.

    Every field the reader uses is checked for its type and value here, so that a damaged
    header is refused before anything is made, with the file and the field named.

    Raises:
        StoreNotFoundError: no export there.
        CorruptStoreError: the header is damaged, of another format, or names files that are
            missing, outside the export or of the wrong size.
    """
    file = src / HEADER
    if not file.is_file() or file.is_symlink():
        raise StoreNotFoundError(f"{src} holds no embstore export (no {HEADER})")
    doc = _parse(file)
    if not isinstance(doc, dict):
        raise CorruptStoreError(f"{file} is damaged: it must hold a JSON object, got "
                                f"{_show(doc)}")
    if doc.get("format") != FORMAT or not is_json_int(doc.get("version")) \
            or doc["version"] not in READS:
        raise CorruptStoreError(f"{file} is not an embstore export of version "
                                f"{' or '.join(map(str, READS))}")
    stored = doc.pop("checksum", _MISSING)
    if doc.get("byte_order", _MISSING) != "little":
        raise _bad(file, "byte_order", '"little" (the only byte order this reader reads)',
                   doc.get("byte_order", _MISSING))
    tiers = doc.get("tiers", _MISSING)
    if not isinstance(tiers, list) or not tiers:
        raise _bad(file, "tiers", "a non-empty list of tiers", tiers)
    for i, t in enumerate(tiers):
        _check_tier(file, f"tiers[{i}]", t)
    step = doc.get("step", _MISSING)
    if step is not None and not (is_json_int(step) and 0 <= step < 2**63):
        raise _bad(file, "step", "a step (an int from 0 to 2**63 - 1) or null", step)
    _check_extras(file, doc.get("extras", _MISSING))
    tables = doc.get("tables", _MISSING)
    if not isinstance(tables, list):
        raise _bad(file, "tables", "a list of tables", tables)
    names: set[str] = set()
    files: set[str] = set()
    for i, t in enumerate(tables):
        spec = _check_table(file, f"tables[{i}]", t)
        if spec.name in names:
            raise CorruptStoreError(f"{file} is damaged: tables[{i}] names table "
                                    f"{spec.name!r} again")
        names.add(spec.name)
        for key in ("ids_file", "rows_file"):
            if t[key] in files:
                raise CorruptStoreError(f"{file} is damaged: tables[{i}].{key} names "
                                        f"{t[key]!r}, which another field names too")
            files.add(t[key])
        _check_files(src, file, spec, t)
    # last, so that a header edited by hand is told which field is wrong
    if doc["version"] >= 2 and stored != json_checksum(doc):
        raise CorruptStoreError(f"{file} is damaged: it fails its checksum (stored "
                                f"{_show(stored) if stored is not _MISSING else 'none'}, "
                                f"computed {json_checksum(doc)!r}); export the store again")
    return doc


def _parse(file: Path) -> Any:
    """The JSON document in `file`, or CorruptStoreError saying where it stops being JSON."""
    try:
        return json.loads(file.read_bytes())
    except UnicodeDecodeError as exc:
        why = f"it is not UTF-8 text (byte {exc.start})"
    except json.JSONDecodeError as exc:
        why = f"it is not valid JSON (line {exc.lineno}, column {exc.colno})"
    except RecursionError:
        why = "its JSON is nested too deeply"
    except ValueError:  # json's int parser refuses numbers of over 4,300 digits
        why = "it holds a number too long for an export"
    raise CorruptStoreError(f"{file} is damaged: {why}; export the store again")


def _show(value: Any) -> str:
    """`value` spelt as in the JSON file, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _bad(file: Path, field: str, want: str, got: Any) -> CorruptStoreError:
    """The error for field `field` of header `file`: `want` expected, `got` found."""
    if got is _MISSING:
        return CorruptStoreError(f"{file} is damaged: {field} is missing")
    return CorruptStoreError(f"{file} is damaged: {field} must be {want}, got {_show(got)}")


def _check_extras(file: Path, extras: Any) -> None:
    """Raise unless `extras` is an object whose fields a new store would keep are sound."""
    if not isinstance(extras, dict):
        raise _bad(file, "extras", "an object", extras)
    # the extras become the new store's manifest fields, which its manifest's reader checks
    problem = optional_fields_problem(extras)
    if problem is not None:
        raise CorruptStoreError(f"{file} is damaged: extras.{problem[0]} {problem[1]}")


def _check_tier(file: Path, field: str, data: Any) -> TierSpec:
    """The tier `data` of header `file` (at `field`), or CorruptStoreError."""
    if not isinstance(data, dict) or not isinstance(data.get("backend"), str):
        raise _bad(file, field, "a tier (an object with a backend name)", data)
    unknown = sorted(set(data) - set(_TIER_FIELDS))
    if unknown:
        raise CorruptStoreError(f"{file} is damaged: {field} has unknown field(s) {unknown}")
    for key in ("eviction", "admission"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise _bad(file, f"{field}.{key}", "a policy name or null", data[key])
    for key in ("eviction_options", "admission_options", "options"):
        if not isinstance(data.get(key, {}), dict):
            raise _bad(file, f"{field}.{key}", "an object", data[key])
    try:
        return TierSpec.from_json(data)
    except ConfigError as exc:
        raise CorruptStoreError(f"{file} is damaged: {field}: {exc}") from exc


def _check_object(file: Path, field: str, data: Any, what: str, keys: Sequence[str]) -> None:
    """Raise CorruptStoreError unless `data` (at `field` of `file`) is an object with `keys`."""
    if not isinstance(data, dict):
        raise _bad(file, field, what, data)
    for key in keys:
        if key not in data:
            raise CorruptStoreError(f"{file} is damaged: {field}.{key} is missing")


def _check_spec(file: Path, field: str, data: Any) -> TableSpec:
    """The table spec `data` of header `file` (at `field`), or CorruptStoreError."""
    _check_object(file, field, data, "a table spec (an object)", _SPEC_FIELDS)
    for key in ("init", "optimizer"):
        part = data[key]
        if not (isinstance(part, dict) and isinstance(part.get("name"), str)
                and isinstance(part.get("config"), dict)):
            raise _bad(file, f"{field}.{key}", 'an object {"name": str, "config": object}',
                       part)
    if not isinstance(data["dtype"], str):
        raise _bad(file, f"{field}.dtype", "a dtype name", data["dtype"])
    if not isinstance(data["allow_nonfinite"], bool):  # a truthy string must not allow NaN
        raise _bad(file, f"{field}.allow_nonfinite", "true or false", data["allow_nonfinite"])
    if data["tiers"] is not None:
        if not isinstance(data["tiers"], list) or not data["tiers"]:
            raise _bad(file, f"{field}.tiers", "a non-empty list of tiers or null",
                       data["tiers"])
        for j, t in enumerate(data["tiers"]):
            _check_tier(file, f"{field}.tiers[{j}]", t)
    try:
        return TableSpec.from_json(data)
    except (ConfigError, TypeError, ValueError) as exc:  # a name or a setting refused
        raise CorruptStoreError(f"{file} is damaged: {field} is not a valid table spec "
                                f"({' '.join(str(exc).split())})") from exc


def _check_table(file: Path, field: str, t: Any) -> TableSpec:
    """The spec of table entry `t` of header `file` (at `field`), its fields checked."""
    _check_object(file, field, t, "a table (an object)", _TABLE_FIELDS)
    spec = _check_spec(file, f"{field}.spec", t["spec"])
    if not is_json_int(t["rows"]) or t["rows"] < 0:
        raise _bad(file, f"{field}.rows", "a row count (an int >= 0)", t["rows"])
    if not is_json_int(t["row_width"]) or t["row_width"] != spec.storage_width:
        raise _bad(file, f"{field}.row_width",
                   f"{spec.storage_width} (the row width of table {spec.name!r})",
                   t["row_width"])
    dtype = _le(spec.storage_dtype)
    if not isinstance(t["dtype"], str) or _dtype(t["dtype"]) != dtype:
        raise _bad(file, f"{field}.dtype",
                   f'"{dtype.str}" (the stored dtype of table {spec.name!r}, little-endian)',
                   t["dtype"])
    for key in ("ids_crc32", "rows_crc32"):
        if not is_json_int(t[key]) or not 0 <= t[key] < 1 << 32:
            raise _bad(file, f"{field}.{key}", "a CRC-32 (an int in [0, 2**32))", t[key])
    for key in ("ids_file", "rows_file"):
        name = t[key]
        if not isinstance(name, str) or not name or name == HEADER or "/" in name \
                or "\0" in name or name.startswith("."):
            raise _bad(file, f"{field}.{key}", "the name of a file in the export", name)
    return spec


def _dtype(name: str) -> np.dtype | None:
    """The numpy dtype spelt `name`, None where numpy knows no such dtype."""
    try:
        return np.dtype(name)
    except (TypeError, ValueError, SyntaxError):  # numpy's ways of refusing a name
        return None


def _check_files(src: Path, file: Path, spec: TableSpec, t: dict[str, Any]) -> None:
    """Raise unless the files table entry `t` names are plain files of the right size."""
    for key, width in (("ids_file", 8),
                       ("rows_file", spec.storage_width * spec.storage_dtype.itemsize)):
        name = t[key]
        path = src / name
        if path.is_symlink() or not path.is_file():
            raise CorruptStoreError(f"{file} names {name!r}, which is missing or not a plain "
                                    "file of the export")
        if path.stat().st_size != t["rows"] * width:
            raise CorruptStoreError(f"{path} holds {path.stat().st_size} bytes, the header "
                                    f"says {t['rows']} rows of {width} bytes")


def import_store(src: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                 tiers: Sequence[TierSpec] | None = None,
                 progress: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Create the store `dest` from the export `src`, with its tier chain or `tiers`.

    Returns rows per table. Tables that had their own chain keep it unless `tiers` is given.

    Raises:
        StoreNotFoundError, CorruptStoreError: no export, or a damaged one (its header, its
            checksums, or a row its table's spec forbids); no store is left at `dest`.
        StoreExistsError: `dest` exists and is not an empty directory.
        OSError: `dest` cannot be made or written (the message names `dest`).
    """
    root, out = Path(src), Path(dest)
    refuse_inside_store(out, "import to a directory beside it")
    doc = read_header(root)
    entries = {t["spec"]["name"]: t for t in doc["tables"]}
    specs = [TableSpec.from_json(t["spec"]) for t in doc["tables"]]
    if tiers is not None:
        specs = [TableSpec.from_json({**s.to_json(), "tiers": None}) for s in specs]
    chain = tuple(tiers) if tiers is not None else tuple(TierSpec.from_json(t)
                                                         for t in doc["tiers"])
    check_path(out, specs, chain)

    def source(spec: TableSpec) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        return entries[spec.name]["rows"], _pages(root, entries[spec.name], spec)

    # the new store lists its own written-id records (write_store): a stale or damaged list
    # carried over would require records it lacks or stop checking ones it has
    extras = {k: v for k, v in doc["extras"].items() if k != "written_records"}
    extras["imported_from"] = {"export": str(root), "step": doc["step"]}
    tmp, made = _fresh(out)
    try:
        counts = write_store(tmp, chain, specs, source, extras=extras, progress=progress)
        _commit(tmp, out)
    except OSError as exc:
        discard(tmp, made)
        raise _public(exc, tmp, out) from exc
    except BaseException:
        discard(tmp, made)
        raise
    return counts


def _pages(root: Path, entry: dict[str, Any], spec: TableSpec
           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The pages of table `spec` of the export at `root` (`entry`: its checked header entry).

    Each page is checked against the spec before it is given out (ids in range and not
    repeated within the page, values finite where the table forbids NaN and infinity); the
    CRC-32s once the last is read.
    """
    n, width = entry["rows"], entry["row_width"]
    dtype = np.dtype(entry["dtype"])
    codec = None if spec.precision == "fp32" else RowCodec(spec.name, spec.precision, spec.dim,
                                                           spec.row_width - spec.dim)
    crc_ids = crc_rows = 0
    with open(root / entry["ids_file"], "rb") as fi, open(root / entry["rows_file"],
                                                          "rb") as fr:
        step = page_rows(spec)
        for start in range(0, n, step):
            count = min(step, n - start)
            a = fi.read(count * 8)
            b = fr.read(count * width * dtype.itemsize)
            crc_ids, crc_rows = zlib.crc32(a, crc_ids), zlib.crc32(b, crc_rows)
            ids = np.frombuffer(a, dtype="<i8").astype(np.int64)
            rows = np.frombuffer(b, dtype=dtype).reshape(count, width).astype(spec.storage_dtype)
            _check_page(root, spec, codec, ids, rows)
            yield ids, rows
    if (crc_ids, crc_rows) != (entry["ids_crc32"], entry["rows_crc32"]):
        raise CorruptStoreError(f"export table {spec.name!r} in {root} fails its CRC-32: the "
                                "export is damaged; export the store again")


def _check_page(root: Path, spec: TableSpec, codec: RowCodec | None, ids: np.ndarray,
                rows: np.ndarray) -> None:
    """Raise CorruptStoreError if a row of this page breaks table `spec` (the export at `root`).

    Checksums prove a copy intact, not its rows valid: a row the spec forbids (an id out of
    range, NaN where the table forbids it) would make a store that fsck finds damaged.
    """
    what = None
    n = spec.num_embeddings
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if n is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
        bad = int(ids[(ids < 0) | (ids >= n)][0])
        what = f"id {bad}, outside [0, {n}) (its num_embeddings)"
    elif len(repeated):  # an export holds each stored row once
        what = f"id {int(repeated[0])} twice"
    values = rows if codec is None else codec.decode(rows)  # half weights: their values
    if what is None and not spec.allow_nonfinite and len(ids):
        finite = np.isfinite(values)
        if not finite.all():
            bad = int(ids[~finite.all(axis=1)][0])
            what = f"NaN or infinity in the row of id {bad}, which the table forbids"
    if what is None and len(ids) and spec.row_width > spec.dim:
        unreachable = spec.optimizer.unreachable_state(values[:, spec.dim:], spec.dim)
        if unreachable.any():
            what = (f"the row of id {int(ids[unreachable][0])} holds a {spec.optimizer.name} "
                    "state no step reaches (a negative sum of squares or step count)")
    if what is not None:
        raise CorruptStoreError(f"export table {spec.name!r} in {root} holds {what}; nothing "
                                "was imported (fix the source store, e.g. `embstore fsck "
                                "--repair`, and export it again)")
