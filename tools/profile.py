"""`embstore profile TRACE`: per-table bandwidth demand, reuse and miss-ratio curves.

A trace gives, per table, the ids of each batch: a .npz holding ``<table>.ids`` (int64) and
``<table>.offsets`` (where each batch starts, one more than the batches) per table, a .npy or
.npz the simulator reads (tables told apart by the bits above 40, as the generator writes
them), ``synth:key=value,...`` (`embstore.tools.traces.synthesize`), or the directory of an
access log a store recorded (``embstore.open(..., record_accesses=DIR)``; see
`embstore._access_log`). A log sampled at rate R holds the ids of a hash-chosen share R of
each table's ids: its counts are scaled back by 1/R and its curves computed as SHARDS at R
(or at a lower rate asked for), which is what profiling the whole trace sampled at R gives.
The profile (schema in `embstore.placement`) is what `embstore plan` reads.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from embstore.errors import ConfigError
from embstore.placement import MAX_NUMBER
from embstore.spec import is_table_name

from ._mrc import check_plot_path, plot_profile
from .traces import is_whole_number

__all__ = ["build_profile", "check_plot_path", "check_settings", "check_table_names",
           "load_tables", "plot_profile", "read_trace", "register", "save_tables",
           "split_tables"]

EXACT_LOOKUPS = 2_000_000
"""Tables with more lookups than this are profiled by SHARDS sampling (unless told)."""
_TABLE_SHIFT = 40
MAX_POINTS = 1000
"""The most capacities a curve may have (`--points`)."""
MAX_STEP_CALLS = 1000
"""The most tier calls per batch (`--step-calls`): each is replayed at every capacity."""


def read_trace(spec: str, notes: list[str] | None = None
               ) -> tuple[dict[str, list[np.ndarray]], dict[str, float]]:
    """Per table, its id batches, and the rate each table was recorded at (1.0: every id).

    Args:
        spec: the trace (see the module doc).
        notes: if given, receives a line per access log table whose torn tail (ids past its
            last complete batch) was left out, for the caller to show.

    Raises:
        ConfigError: the trace cannot be read.
        CorruptStoreError: an access log (or a directory of its files) is damaged.
    """
    from embstore._access_log import is_access_log, read_access_log

    if is_access_log(spec):
        log = read_access_log(spec)
        for name in sorted(set(log.left_out) | set(log.lost_batches)):
            if notes is None:
                continue
            parts = []  # lost ids are said, never dropped unseen
            if log.left_out.get(name):
                parts.append(f"{log.left_out[name]} logged ids past its last complete batch")
            if log.lost_batches.get(name):
                parts.append(f"{log.lost_batches[name]} batch ends past the ids its file "
                             "holds (a power cut lost their ids)")
            notes.append(f"table {name!r}: {' and '.join(parts)} were left out (a store "
                         f"killed while recording, or a damaged {name}.offsets)")
        tables = {name: log.batches(name) for name in sorted(log.ids) if len(log.ids[name])}
        if not tables:
            raise ConfigError(f"the access log {spec!r} holds no ids yet; record some batches "
                              "(or a higher record_sample) first")
        return tables, {name: log.rates[name] for name in tables}
    return load_tables(spec), {}


def load_tables(spec: str) -> dict[str, list[np.ndarray]]:
    """Per table, its id batches (a .npz's or generated tables have the same batch count).

    Raises:
        ConfigError: the trace cannot be read, or is an access log that sampled its ids
            (`read_trace` gives their rates, which `build_profile` needs).
    """
    from embstore._access_log import is_access_log

    if is_access_log(spec):
        tables, rates = read_trace(spec)
        if any(r < 1 for r in rates.values()):
            raise ConfigError(f"the access log {spec!r} sampled its ids; read it with "
                              "read_trace and pass its rates to build_profile")
        return tables
    path = Path(spec)
    if path.is_dir():
        _refuse_directory(path)
    from embstore.tools.simulator import check_batches, int64_ids, load_trace, read_arrays

    if path.is_file() and zipfile.is_zipfile(path):  # an .npz, whatever its name
        data = read_arrays(path)
        names = (sorted({k.rsplit(".", 1)[0] for k in data
                         if k.endswith((".ids", ".offsets"))})
                 if isinstance(data, dict) else [])
        if isinstance(data, dict) and names:
            check_table_names(names, f"trace {spec!r}")
            out = {}
            for name in names:
                for have, lack in (("ids", "offsets"), ("offsets", "ids")):
                    if f"{name}.{lack}" not in data:  # never a table left out unsaid
                        raise ConfigError(f"trace {spec!r}: table {name!r} has {have} but no "
                                          f"'{name}.{lack}'; save both arrays per table")
                ids, off = data[f"{name}.ids"], data[f"{name}.offsets"]
                check_batches(f"{spec}, table {name}", ids, off)
                ids = int64_ids(ids, f"trace {spec!r}, table {name!r},")
                out[name] = [ids[off[i]:off[i + 1]] for i in range(len(off) - 1)]
            if len({len(b) for b in out.values()}) != 1:
                raise ConfigError(f"trace {spec!r}: tables have different batch counts "
                                  f"({ {k: len(v) for k, v in out.items()} })")
            return out

    out = split_tables(load_trace(spec).batches, f"trace {spec!r}")
    if not out:
        raise ConfigError(f"trace {spec!r} holds no ids")
    return out


def _refuse_directory(path: Path) -> None:
    """Refuse a directory that is no access log (one that lost its header is damaged).

    Raises:
        CorruptStoreError: it holds a log's table files (<table>.ids and .offsets), no header.
        ConfigError: anything else.
    """
    from embstore._access_log import HEADER_NAME
    from embstore.errors import CorruptStoreError

    try:
        names = {p.name for p in path.iterdir()}
    except OSError as exc:
        raise ConfigError(f"trace {str(path)!r}: cannot list the directory: "
                          f"{exc.strerror or exc}") from exc
    tables = sorted(n[: -len(".ids")] for n in names
                    if n.endswith(".ids") and f"{n[: -len('.ids')]}.offsets" in names)
    if tables:
        shown = ", ".join(tables[:3]) + (", ..." if len(tables) > 3 else "")
        raise CorruptStoreError(f"trace {str(path)!r} holds the files of access log tables "
                                f"({shown}) but no {HEADER_NAME}: the log's header is lost; "
                                "record a new log")
    raise ConfigError(f"trace {str(path)!r} is a directory but no access log (no "
                      f"{HEADER_NAME}); give a .npz or .npy trace, synth:key=value,..., or "
                      "the directory of a log recorded with embstore.open(..., "
                      "record_accesses=DIR)")


def split_tables(batches: Sequence[np.ndarray], what: str = "the trace"
                 ) -> dict[str, list[np.ndarray]]:
    """Per table ("t00", "t01", ...: the id bits above 40), its share of each batch.

    Raises:
        ConfigError: an id is negative (its bits above 40 name no table), naming `what`.
    """
    flat = np.concatenate(batches) if len(batches) else np.zeros(0, np.int64)
    if len(flat) and int(flat.min()) < 0:
        raise ConfigError(f"{what} holds id {int(flat.min())}: a trace of all tables together "
                          "keeps each id's table in its bits above 40, so its ids are >= 0 "
                          "(or save one <table>.ids and <table>.offsets per table in a .npz)")
    out = {}
    for t in np.unique(flat >> _TABLE_SHIFT):
        out[f"t{int(t):02d}"] = [b[(b >> _TABLE_SHIFT) == t] for b in batches]
    return out


def check_table_names(names: Sequence[str], what: str) -> None:
    """Refuse table names a store would refuse (TableSpec's rule: they name files).

    Raises:
        ConfigError: the first such name, with `what` holds it.
    """
    for name in names:
        if not is_table_name(name):
            raise ConfigError(f"{what} names table {name!r}: a table name is 1-128 letters, "
                              "digits, '_', '.' or '-', not starting with '.' or '-'")


def save_tables(path: str | Path, tables: dict[str, list[np.ndarray]]) -> None:
    """Write per-table batches in the .npz layout `load_tables` reads."""
    arrays = {}
    for name, batches in tables.items():
        arrays[f"{name}.ids"] = (np.concatenate(batches) if batches
                                 else np.zeros(0, np.int64)).astype(np.int64)
        arrays[f"{name}.offsets"] = np.concatenate(
            [[0], np.cumsum([len(b) for b in batches])]).astype(np.int64)
    np.savez(path, **arrays)


def _row_bytes(text: str | int, names: Sequence[str]) -> dict[str, int]:
    """Row bytes per table from "260" or "260,t00=516"."""
    if isinstance(text, int):
        return dict.fromkeys(names, text)
    default, per = 260, {}
    seen: set[str | None] = set()  # table names given, None for the default
    for item in filter(None, str(text).split(",")):
        key, eq, value = item.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(f"--row-bytes {text!r}: {value!r} is not a byte count") from None
        if n < 1:
            raise ConfigError(f"--row-bytes {text!r}: a row needs at least 1 byte")
        if n > MAX_NUMBER:  # the planner's figures must stay finite floats
            raise ConfigError(f"--row-bytes {text!r}: a row of more than 2**53 bytes is no "
                              "row an embedding table has")
        if (key if eq else None) in seen:  # which of the two was meant is a guess
            raise ConfigError(f"--row-bytes {text!r}: gives "
                              f"{'table ' + repr(key) if eq else 'the default'} twice")
        seen.add(key if eq else None)
        if eq:
            if key not in names:
                raise ConfigError(f"--row-bytes names table {key!r}, not in the trace "
                                  f"({sorted(names)})")
            per[key] = n
        else:
            default = n
    return {name: per.get(name, default) for name in names}


def check_settings(*, samples_per_batch: int = 1, sample_rate: float | None = None,
                   points: int = 12, warmup: float = 0.0, step_calls: int = 3,
                   seed: int = 0) -> None:
    """Refuse a `build_profile` setting out of its range, naming its flag.

    Raises:
        ConfigError: the first setting out of range.
    """
    def refuse(flag: str, value: object, allowed: str) -> NoReturn:
        raise ConfigError(f"{flag} {value!r}: {allowed}")

    if not is_whole_number(samples_per_batch) or not 1 <= samples_per_batch <= MAX_NUMBER:
        refuse("--samples-per-batch", samples_per_batch,
               "training samples per batch must be an integer >= 1 and <= 2**53")
    if sample_rate is not None and (isinstance(sample_rate, bool) or not isinstance(
            sample_rate, (int, float)) or not 2.0 ** -24 <= sample_rate <= 1):
        # ids are kept by a 24-bit hash: a lower rate keeps none, as a recording refuses
        refuse("--sample-rate", sample_rate,
               "the SHARDS rate must be in [2**-24, 1], e.g. 0.01")
    if not is_whole_number(points) or not 2 <= points <= MAX_POINTS:
        # each capacity is a replay per policy: more only cost time (curves are
        # interpolated in log C), and a huge count would not even fit in memory
        refuse("--points", points, f"capacities per curve must be an integer >= 2 and <= "
               f"{MAX_POINTS}")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
        refuse("--warmup", warmup, "the share of batches that only warm the caches must be "
               "in [0, 1)")
    if not is_whole_number(step_calls) or not 1 <= step_calls <= MAX_STEP_CALLS:
        refuse("--step-calls", step_calls, "tier calls per batch must be an integer >= 1 "
               f"and <= {MAX_STEP_CALLS} (3 for training steps, 1 for lookups only)")
    if not is_whole_number(seed) or not 0 <= seed < 2**63:  # policies take an int64 seed
        refuse("--seed", seed, "the seed must be an integer >= 0 and < 2**63")


def build_profile(tables: dict[str, list[np.ndarray]], *, policies: Sequence[str] = ("clock",),
                  row_bytes: str | int = 260, samples_per_batch: int = 1,
                  sample_rate: float | None = None, points: int = 12, warmup: float = 0.0,
                  step_calls: int = 3,
                  trace_name: str = "", recorded_rates: dict[str, float] | None = None,
                  seed: int = 0, progress: Any = None) -> dict[str, Any]:
    """The profile document (see `embstore.placement`) of per-table batches.

    Args:
        tables: per table, its batches of ids.
        policies: eviction specs to replay for a miss-ratio curve beside LRU's.
        row_bytes: bytes per row (weights and optimizer state): an int, or "N,table=M,...".
        samples_per_batch: training samples per batch, for per-sample figures.
        sample_rate: SHARDS rate for every table; None: exact up to `EXACT_LOOKUPS` lookups
            per table, sampled above (keeping at least MIN_SAMPLED_IDS ids).
        points: capacities on each curve (log-spaced, the last one the whole table).
        warmup: share of the batches, in [0, 1), that only fill the caches: curves count the
            rest (a steady state rather than from cold).
        step_calls: calls a tier sees per batch: 3 for a training step (lookup, then the
            optimizer's read and write of the same rows, which CLOCK and W-TinyLFU count as
            accesses), 1 for lookups only (as `embstore simulate`).
        trace_name: what the trace was, recorded in the profile.
        recorded_rates: per table, the rate an access log sampled its ids at (missing: 1.0,
            every id); counts are scaled back by it and curves computed at it or below.
        seed: seeds sampling and the policies.
        progress: an object with ``update(n)`` called once per table, or None.

    Raises:
        ConfigError: a bad setting (`check_settings`) or policy spec, no table has ids, or
            one has none after the warm-up batches.
    """
    from embstore.tools.simulator import Trace, parse_policy

    from ._mrc import (
        MIN_SAMPLED_IDS,
        SHARDS_ERROR_BOUND,
        capacity_grid,
        lru_curve,
        policy_curve,
        reuse_histogram,
        sample_trace,
    )

    check_settings(samples_per_batch=samples_per_batch, sample_rate=sample_rate,
                   points=points, warmup=warmup, step_calls=step_calls, seed=seed)
    for p in policies:
        parse_policy(p, "eviction")  # a bad spec fails before any work
    names = sorted(tables)
    check_table_names(names, "the trace")
    sizes = _row_bytes(row_bytes, names)
    out: dict[str, Any] = {}
    most = max((len(b) for b in tables.values()), default=0)  # a log's tables may differ
    for name in names:
        trace = Trace(tables[name])
        n_batches = len(trace.batches)
        if not trace.lookups:
            if progress is not None:
                progress.update(1)
            continue
        # a log sampled at `recorded` holds that share of the ids: the whole trace's figures
        # are its own over `recorded`, and sampling it again at `recorded` changes nothing
        recorded = (recorded_rates or {}).get(name, 1.0)
        rows = max(1, int(round(trace.distinct / recorded)))
        lookups = trace.lookups / recorded
        rate = 1.0 if sample_rate is None else sample_rate
        if sample_rate is None and lookups > EXACT_LOOKUPS:
            rate = min(1.0, max(EXACT_LOOKUPS / lookups, MIN_SAMPLED_IDS / rows))
        rate = min(rate, recorded)
        caps = capacity_grid(rows, points)
        skip = int(warmup * len(trace.batches))
        if not any(len(u) for u in trace.unique[skip:]):
            # every ratio would be 0/0, taken as no miss: a cache of one row would look perfect
            raise ConfigError(f"table {name!r} has no ids after its first {skip} batches, "
                              f"which --warmup {warmup:g} gives to warming the caches; lower "
                              "--warmup")
        sub = sample_trace(trace, rate) if rate < 1 else trace
        kept = sub.distinct
        if not any(len(u) for u in sub.unique[skip:]):
            # no lookup would be counted, and 0 / 0 read as no miss: a perfect cache
            after = f" after its first {skip} batches (--warmup)" if skip else ""
            raise ConfigError(f"table {name!r}: sampling at {rate:g} keeps none of its "
                              f"{trace.distinct} ids{after}; give a higher --sample-rate")
        lru = lru_curve(trace, caps, rate, skip)
        # below two batches' width the order inside a batch decides what LRU keeps, which
        # stack distances do not know: replay those few capacities instead
        narrow = caps < 2 * lookups / max(len(trace.batches), 1)
        if narrow.any():
            lru[narrow] = policy_curve(trace, "lru", caps[narrow].tolist(), rate, seed, skip,
                                       step_calls)
        mrc: dict[str, list[Any]] = {"capacities": caps.tolist(), "lru": lru.tolist()}
        for p in policies:
            mrc[p] = policy_curve(trace, p, caps.tolist(), rate, seed, skip,
                                  step_calls).tolist()
        accesses = trace.accesses / recorded
        per_sample = accesses / max(n_batches, 1) / samples_per_batch
        out[name] = {
            "rows_touched": rows,
            "lookups_per_batch": accesses / max(n_batches, 1),
            "distinct_per_batch": lookups / max(n_batches, 1),
            "lookups_per_sample": per_sample, "row_bytes": sizes[name],
            "bytes_per_sample": per_sample * sizes[name],
            "method": "exact" if rate >= 1 else "shards", "sample_rate": rate,
            "error_bound": 0.0 if rate >= 1 else SHARDS_ERROR_BOUND,
            "reuse": reuse_histogram(trace, rate, skip), "mrc": mrc,
        }
        if rate < 1 and kept < MIN_SAMPLED_IDS:
            # a log's rate is the recording's choice, and --sample-rate the caller's: below
            # MIN_SAMPLED_IDS ids the tests bound no error (small tables want a higher rate)
            out[name]["error_bound"] = None
        if recorded < 1:
            out[name]["recorded_rate"] = recorded
            out[name]["sampled_ids"] = kept
        if progress is not None:
            progress.update(1)
    if not out:  # a profile of no table is one `embstore plan` refuses
        named = f" {trace_name!r}" if trace_name else ""
        raise ConfigError(f"the trace{named} holds no ids in any table; profile a trace "
                          "that has ids")
    return {"format": "embstore.profile", "version": 1, "trace": trace_name,
            "batches": most, "warmup_batches": int(warmup * most),
            "step_calls": step_calls,
            "samples_per_batch": samples_per_batch,
            "policies": ["lru", *policies], "tables": out}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `profile` subcommand."""
    from ._args import non_negative_int, positive_int

    p = sub.add_parser("profile", help="per-table bandwidth demand and miss-ratio curves",
                       description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("trace", metavar="TRACE", help="a per-table .npz (<table>.ids, "
                   "<table>.offsets), a simulator .npy/.npz, synth:key=value,..., or an "
                   "access log directory (embstore.open(..., record_accesses=DIR))")
    # str, not Path: Path("") is "." and an empty name must be told apart from a folder
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument("--plot", default=None,
                   help="draw the curves into this image (.png, .pdf, .svg, ...)")
    p.add_argument("--policies", default="clock,wtinylfu:hold_new=1",
                   help="eviction specs to replay beside LRU (default: clock, a bounded "
                        "tier's default, and W-TinyLFU as a training tier runs it)")
    p.add_argument("--row-bytes", default="260", help="bytes per row, e.g. 260 or "
                   "260,t00=516 (default 260: 64 float32 weights + row-wise Adagrad state)")
    p.add_argument("--samples-per-batch", type=positive_int, default=1)
    p.add_argument("--sample-rate", type=float, default=None,
                   help=f"SHARDS rate (default: exact up to {EXACT_LOOKUPS} lookups a table)")
    p.add_argument("--points", type=int, default=12, help="capacities per curve")
    p.add_argument("--step-calls", type=positive_int, default=3,
                   help="tier calls per batch: 3 for training steps (default), 1 for lookups")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="share of the batches that only warm the caches (default 0: from cold)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from embstore.placement import save_document

    from ._args import check_output, same_file

    # every refusal before the work (minutes on a large trace), and never over the trace
    trace = [args.trace] if Path(args.trace).exists() else []
    check_output(args.output, "-o", trace)
    if args.plot is not None:
        check_plot_path(args.plot, trace)
        if same_file(args.plot, args.output):
            raise ConfigError(f"--plot {args.plot!r} is also -o; give another file")
    check_settings(samples_per_batch=args.samples_per_batch, sample_rate=args.sample_rate,
                   points=args.points, warmup=args.warmup, step_calls=args.step_calls,
                   seed=args.seed)
    notes: list[str] = []
    tables, recorded = read_trace(args.trace, notes)
    for note in notes:
        print(f"embstore profile: note: {note}", file=sys.stderr)
    bar = None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tables), unit="table", leave=False)
        except ImportError:
            pass
    try:
        profile = build_profile(tables, policies=[p for p in args.policies.split(",") if p],
                                row_bytes=args.row_bytes,
                                samples_per_batch=args.samples_per_batch,
                                sample_rate=args.sample_rate, points=args.points,
                                warmup=args.warmup, step_calls=args.step_calls,
                                trace_name=args.trace, recorded_rates=recorded, seed=args.seed,
                                progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if args.plot is not None:  # drawing is what may still fail: before the JSON is written
        plot_profile(profile, args.plot)
    save_document(args.output, profile)
    if args.json:
        print(json.dumps(profile, indent=1))
        return 0
    print(f"{'table':<12} {'rows':>9} {'lookups/sample':>15} {'row B':>6} {'B/sample':>10} "
          f"{'method':>7}  miss ratio at 1%/10% of rows ({', '.join(profile['policies'])})")
    for name, t in profile["tables"].items():
        caps = np.asarray(t["mrc"]["capacities"], dtype=np.float64)
        marks = []
        for frac in (0.01, 0.1):
            at = max(1.0, frac * t["rows_touched"])
            marks.append("/".join(f"{np.interp(np.log(at), np.log(caps), t['mrc'][p]):.2f}"
                                  for p in profile["policies"]))
        print(f"{name:<12} {t['rows_touched']:>9} {t['lookups_per_sample']:>15.2f} "
              f"{t['row_bytes']:>6} {t['bytes_per_sample']:>10.1f} {t['method']:>7}"
              f"{'!' if t['error_bound'] is None else ' '} {'  '.join(marks)}")
    if any(t["error_bound"] is None for t in profile["tables"].values()):
        from embstore.tools._mrc import MIN_SAMPLED_IDS

        raise_it = ("record it at a higher record_sample"
                    if any("recorded_rate" in t for t in profile["tables"].values())
                    else "give a higher --sample-rate")
        print(f"!: sampling kept fewer than {MIN_SAMPLED_IDS} of this table's ids; its "
              f"curves may be far off: {raise_it}")
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return 0
