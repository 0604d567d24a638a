"""`embstore trace`: write synthetic id traces and compare their reuse with production."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import numpy as np

from embstore._private_dir import temporary_beside
from embstore.errors import ConfigError
from embstore.tools._args import check_output, non_negative_int, positive_int

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `trace` subcommand with `synth` and `stats`."""
    parser = sub.add_parser("trace", help="synthetic traces and their reuse statistics",
                            epilog="example: embstore trace synth /tmp/t.npy --batches 50")
    trace_sub = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    trace_sub.required = True

    p = trace_sub.add_parser("synth", help="write a calibrated synthetic trace (.npy, a batch "
                                           "per row)")
    p.add_argument("out", metavar="OUT.npy", help="the file to write (.npy is added if missing)")
    p.add_argument("--batches", type=non_negative_int, default=20)
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="lookups per batch (default: the profile's calibrated 1048576)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--profile", default="2021", help="production year to match: 2021 or 2022")
    p.add_argument("--drift", type=float, default=0.0,
                   help="share of rows given a new id after each batch (not calibrated)")
    p.set_defaults(func=_synth)

    p = trace_sub.add_parser("stats", help="reuse histograms of a trace's batches beside the "
                                           "production ones")
    p.add_argument("trace", metavar="TRACE", help="a .npy/.npz trace or synth:... spec")
    p.add_argument("--production", type=Path, default=None,
                   help="a dlrm_datasets locality_stats.txt to compare with")
    p.set_defaults(func=_stats)


def _synth(args: argparse.Namespace) -> int:
    from embstore.tools.traces import synthesize

    out = args.out if args.out.endswith(".npy") else f"{args.out}.npy"  # as np.save names it
    check_output(args.out, "OUT.npy")
    check_output(out, "OUT.npy")
    batches = list(synthesize(args.batches, seed=args.seed, profile=args.profile,
                              lookups=args.batch_size, drift=args.drift))
    _save(out, np.stack(batches) if batches else np.zeros((0, 0), np.int64))
    n = sum(len(b) for b in batches)
    print(f"wrote {out}: {len(batches)} batches, {n} ids")
    return 0


def _save(out: str, array: np.ndarray) -> None:
    """Write `array` to `out` through a temporary file renamed over it.

    A failed write (no such folder, a full disk) leaves neither a partial trace nor a stray
    file, and is told in terms of `out`, never of the temporary file.

    Raises:
        ConfigError: the file cannot be written.
    """
    tmp = temporary_beside(Path(out))
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"cannot write {out!r}: {exc.strerror or exc}") from None


def _stats(args: argparse.Namespace) -> int:
    from embstore.tools.simulator import load_trace
    from embstore.tools.traces import (
        BIN_LABELS,
        load_locality_stats,
        mean_histograms,
        reuse_histograms,
        total_variation,
    )

    trace = load_trace(args.trace)
    hists = [reuse_histograms(b) for b in trace.batches if len(b)]
    if not hists:
        raise ConfigError(f"trace {args.trace!r} holds no ids")
    rows = np.mean([h[0] for h in hists], axis=0)
    access = np.mean([h[1] for h in hists], axis=0)
    target = mean_histograms(load_locality_stats(args.production)) if args.production else None
    print(f"{'bin':<16} {'rows':>7} {'accesses':>9}" + ("  production rows / accesses"
                                                         if target else ""))
    for j, label in enumerate(BIN_LABELS):
        extra = f"  {target[0][j]:>7.3f} {target[1][j]:>9.3f}" if target else ""
        print(f"{label:<16} {rows[j]:>7.3f} {access[j]:>9.3f}{extra}")
    if target:
        print(f"total variation: rows {total_variation(rows, target[0]):.3f}, "
              f"accesses {total_variation(access, target[1]):.3f}")
    return 0
