"""`embstore demo`: train a small DLRM whose embedding tables live in the store.

A bottom MLP over dense features, one embstore table per sparse feature (fused row-wise Adagrad
inside the store), a pairwise dot interaction and a top MLP learn a synthetic click stream
drawn by a hidden ground-truth model (tools/_dlrm.py). By default each table lives on RocksDB
behind a DRAM tier of a tenth of its rows, and the next batches' rows are fetched on a
background thread (embstore.torch.TrainPipeline) while the current batch computes.

Everything random is seeded and the dense part runs on a fixed number of threads with
deterministic algorithms, so the final tables are the same bit for bit with or without the
pipeline and the DRAM tier: the run ends with a `digest:` line of every table's rows and
optimizer state to show it. With `--path DIR` the store (DIR/store) and the dense part
(DIR/dense.pt: weights, optimizer, step and history) are kept, and running again on the same
path continues the same training and click stream where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from embstore._private_dir import temporary_beside
from embstore.layout import store_above

from ._args import (
    MAX_PROCESSES,
    PROCESSES_WHY,
    check_output,
    non_negative_int,
    positive_int,
    same_file,
    whole_up_to,
)
from ._dlrm import (
    ROCKSDB_OPTIONS,
    ClickStream,
    DemoConfig,
    auc,
    build_model,
    make_store,
    table_bytes,
    table_digest,
)
from .profile import check_plot_path

__all__ = ["register", "run"]

DENSE_FILE = "dense.pt"
STORE_DIR = "store"
TORCH_THREADS = 1


MAX_ROWS = 100_000_000
_ROWS_WHY = ("the click stream holds a sampling table of 72 bytes per id (7.2 GB at the "
             "limit) beside the tables' rows")
MAX_SAMPLES = 1 << 20
_SAMPLES_WHY = "a step's samples are drawn and pooled in memory at once"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    p = sub.add_parser("demo", help="train a small DLRM through the store and report",
                       description="Train a small DLRM whose embedding tables live in the "
                       "store, on a synthetic click stream, and report.")
    p.add_argument("--steps", type=non_negative_int, default=1000,
                   help="training steps of this run (default 1000)")
    p.add_argument("--batch-size", type=whole_up_to(MAX_SAMPLES, _SAMPLES_WHY), default=2048,
                   help="samples per step (2048)")
    p.add_argument("--rows", type=whole_up_to(MAX_ROWS, _ROWS_WHY), default=1_000_000,
                   help="ids per sparse feature, i.e. rows of each of the 8 tables (1,000,000)")
    p.add_argument("--path", metavar="DIR",
                   help="keep the run in DIR (store and dense part); run again to resume")
    p.add_argument("--no-pipeline", action="store_true",
                   help="look rows up in line instead of on a background thread")
    p.add_argument("--all-dram", action="store_true",
                   help="keep every row in DRAM instead of RocksDB behind a DRAM tier")
    p.add_argument("--plot", metavar="FILE",
                   help="draw the loss and AUC curves into FILE, in the format its extension "
                        "names (FILE.png where it has none)")
    p.add_argument("--eval-samples", type=whole_up_to(MAX_SAMPLES, _SAMPLES_WHY), default=8192,
                   help="held-out samples (8192)")
    p.add_argument("--evals", type=positive_int, default=10,
                   help="held-out evaluations during the run (10)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--nproc", type=whole_up_to(MAX_PROCESSES, PROCESSES_WHY), default=1,
                   help="train over N processes (torch.distributed, gloo on loopback): tables "
                   "sharded row-wise over the ranks, the dense part data-parallel (1)")
    p.add_argument("--json", action="store_true", help="print the final figures as JSON")
    p.set_defaults(func=run)


class _StopAtStepBoundary:
    """Turns a first Ctrl-C into a request to stop after the current step.

    While active, the training loop checks it after each step, so the store and the dense part
    are saved at the same step; a second Ctrl-C raises KeyboardInterrupt (abort mid-step).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _StopAtStepBoundary:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: Ctrl-C cannot reach the loop anyway
            self._previous = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def __bool__(self) -> bool:
        return self.requested


def _fail(message: str) -> int:
    print(f"embstore demo: error: {message}", file=sys.stderr)
    return 2


def _progress(total: int, enabled: bool) -> Any:
    """A tqdm bar on a terminal, else None."""
    if not enabled or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)


def _evaluate(model: Any, held_out: Any) -> tuple[float, float]:
    """(AUC, mean log loss) of `model` on the held-out batch."""
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(held_out)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, held_out.labels)
    model.train()
    return auc(held_out.labels.numpy(), logits.numpy()), float(loss)


def _save_dense(path: Path, state: dict[str, Any]) -> None:
    """torch.save `state` to `path` atomically (temporary file, fsync, rename, fsync dir)."""
    import torch

    tmp = temporary_beside(path)
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tier_report(store: Any) -> list[dict[str, Any]]:
    """Per tier level, summed over the tables: backend, lookups, hits, hit ratio."""
    levels: dict[int, dict[str, Any]] = {}
    for info in store.stats().values():
        for t in info["tiers"]:
            lv = levels.setdefault(t.level, {"level": t.level, "backend": t.backend,
                                             "lookups": 0, "hits": 0, "rows": 0,
                                             "capacity_rows": 0, "evictions": 0})
            lv["lookups"] += t.lookups
            lv["hits"] += t.hits
            lv["rows"] += t.rows
            lv["evictions"] += t.evictions
            lv["capacity_rows"] = (None if t.capacity_rows is None or lv["capacity_rows"] is None
                                   else lv["capacity_rows"] + t.capacity_rows)
    for lv in levels.values():
        lv["hit_ratio"] = lv["hits"] / lv["lookups"] if lv["lookups"] else 0.0
    return [levels[k] for k in sorted(levels)]


def _json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as null: JSON has neither (an AUC of one class is NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _plot_file(text: str) -> str:
    """The file `--plot TEXT` will write, refused before training if it cannot be drawn.

    A name without an extension gets .png, as matplotlib would add it, so that the file
    reported is the one written.

    Raises:
        ConfigError: an empty name, a directory, a missing folder, no matplotlib, or a
            format matplotlib does not write.
    """
    check_output(text, "--plot")
    path = text if os.path.splitext(text)[1] else f"{text}.png"
    check_plot_path(path)
    return path


def _plot(file: str, history: dict[str, list], quiet: bool) -> str | None:
    """Write the loss and AUC curves to `file`; the reason if it could not."""
    try:
        import matplotlib
    except ImportError:
        return ("matplotlib is not installed, so no plot was written "
                "(pip install matplotlib, or the package's [plot] extra)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([s for s, _ in history["train"]])
    losses = np.array([v for _, v in history["train"]])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if len(losses):
        ax1.plot(steps, losses, lw=0.6, alpha=0.35, color="C0", label="training batch")
        w = max(1, len(losses) // 30)
        if len(losses) > w:
            smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
            ax1.plot(steps[w - 1:], smooth, color="C0", label=f"mean of {w} steps")
    ev = history["eval"]
    if ev:
        ax1.plot([e[0] for e in ev], [e[2] for e in ev], "o-", color="C1", label="held-out")
        ax2.plot([e[0] for e in ev], [e[1] for e in ev], "o-", color="C1")
    ax1.set(xlabel="step", ylabel="log loss (BCE)", title="loss")
    ax1.legend()
    ax2.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax2.set(xlabel="step", ylabel="AUC", title="held-out AUC")
    fig.tight_layout()
    try:
        fig.savefig(file, dpi=100)
    except OSError as exc:
        return f"could not write the plot to {file}: {exc.strerror or exc}"
    finally:
        plt.close(fig)
    return None


def run(args: argparse.Namespace) -> int:
    """Train the DLRM for `--steps` steps (resuming from `--path`), then report."""
    if args.plot is not None:  # before a minute of training, not after
        args.plot = _plot_file(args.plot)
    try:
        import torch

        import embstore.torch as et
    except ImportError as exc:
        return _fail(f"the demo needs torch ({exc}); install the package with its [torch] extra")
    previous = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        if args.nproc > 1:
            return _run_distributed(args)
        return _run(args, torch, et)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped mid-step
        print("embstore demo: aborted mid-step; a --path run may be left between steps",
              file=sys.stderr)
        return 130
    except OSError as exc:  # an unwritable --path or --plot, a full disk: one line, no traceback
        return _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
    finally:
        torch.set_num_threads(previous[0])
        torch.use_deterministic_algorithms(previous[1])


def _run_distributed(args: argparse.Namespace) -> int:
    """Train over `--nproc` local processes through a sharded store and report."""
    import functools

    from ._bench_shard import DLRMJob
    from ._demo_distributed import train_distributed

    if args.path is not None or args.plot is not None or args.all_dram:
        return _fail("--nproc above 1 trains in memory: --path, --plot and --all-dram apply "
                     "to one process only")
    job = functools.partial(DLRMJob, rows=args.rows, batch_size=args.batch_size,
                            seed=args.seed)
    print(f"DLRM over {args.nproc} processes (gloo on loopback): 8 tables of {args.rows:,} x "
          f"16 sharded row-wise by hash over the ranks, dense part data-parallel; "
          f"{args.steps:,} steps x {args.batch_size:,} samples"
          f"{'' if args.no_pipeline else ', pipelined'}")
    result = train_distributed(job, args.nproc, args.steps, pipeline=not args.no_pipeline,
                               timeout_s=max(300.0, args.steps * 2.0))
    losses = result.losses
    head, tail = losses[: min(20, len(losses))], losses[-min(20, len(losses)):]
    figures = {"nproc": args.nproc, "steps": args.steps,
               "loss_start": float(np.mean(head)) if head else None,
               "loss_end": float(np.mean(tail)) if tail else None,
               "steps_per_s": result.steps_per_s, "bytes_per_step": result.bytes_per_step,
               "min_bytes_per_step": result.min_bytes_per_step, "digest": result.digest}
    if args.json:
        print(json.dumps(_json_safe(figures), indent=1))
    elif losses:
        print(f"loss (mean of up to 20 steps): start {figures['loss_start']:.4f}  end "
              f"{figures['loss_end']:.4f}")
        print(f"throughput: {result.steps_per_s:.2f} steps/s; exchanged "
              f"{result.bytes_per_step:,.0f} bytes per step (minimum "
              f"{result.min_bytes_per_step:,.0f})")
    if not args.json:
        print(f"digest: {result.digest}")
    return 0


_LAYOUTS = ("all-dram", "dram+rocksdb")


def _saved_run_problem(saved: Any, cfg: DemoConfig, torch: Any) -> str:
    """What keeps `saved` (a loaded dense.pt) from resuming a run of `cfg`, or "".

    Each field is checked, and the weights and optimizer state are loaded into a model of
    `cfg`'s shape, before the store opens: a file damaged or written by something else is
    refused by name, not met halfway through a resume.
    """
    if not isinstance(saved, dict):
        return f"it holds a {type(saved).__name__}, not a dict"
    missing = [k for k in ("config", "layout", "step", "model", "optimizer", "history")
               if k not in saved]
    if missing:
        return f"no {', '.join(missing)}"
    step, history = saved["step"], saved["history"]
    if not isinstance(saved["config"], dict):
        return "its config is not a dict"
    if saved["layout"] not in _LAYOUTS:
        return f"layout {saved['layout']!r}, not one of {', '.join(_LAYOUTS)}"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step {step!r} is not a whole number >= 0"
    if not (isinstance(history, dict) and set(history) == {"train", "eval"}
            and all(isinstance(v, list) for v in history.values())):
        return "its history is not {'train': [...], 'eval': [...]}"
    model = build_model(cfg, None)
    try:
        model.load_state_dict(saved["model"])
        torch.optim.Adam(model.parameters(), lr=cfg.dense_lr).load_state_dict(
            saved["optimizer"])
    except Exception as exc:  # torch's own errors: wrong keys, shapes or groups
        return (f"its weights or optimizer state do not fit this model: "
                f"{' '.join(str(exc).split())[:200]}")
    return ""


def _run(args: argparse.Namespace, torch: Any, et: Any) -> int:
    cfg = DemoConfig(rows=args.rows, seed=args.seed)
    layout = "all-dram" if args.all_dram else "dram+rocksdb"
    tmp = None
    if args.path is None:
        tmp = tempfile.TemporaryDirectory(prefix="embstore-demo-")
        run_dir = Path(tmp.name)
    else:
        if not args.path:  # Path("") is the current directory
            return _fail("--path is empty; give a directory for the run")
        run_dir = Path(args.path)
        if run_dir.exists() and not run_dir.is_dir():
            return _fail(f"{run_dir} is a file; give --path a directory")
        inside = run_dir if (run_dir / "MANIFEST.json").exists() else store_above(run_dir)
        if inside is not None:  # a store's rewrites would delete the run's files
            return _fail(f"{run_dir} is or lies inside the store {inside}; --path takes a "
                         "directory of the demo's own, which holds its store and dense part")
    store_path, dense_path = run_dir / STORE_DIR, run_dir / DENSE_FILE
    if args.plot is not None and (same_file(args.plot, dense_path) or store_above(
            Path(args.plot)) is not None):  # through a link too: the plot would replace it
        return _fail(f"--plot {args.plot!r} is the run's {DENSE_FILE} or lies in its store; "
                     "draw the curves beside the run")
    saved = None
    if dense_path.exists():
        try:
            saved = torch.load(dense_path, weights_only=True)  # tensors and plain data: no pickle
        except Exception as exc:  # a damaged or foreign file: say so, no traceback
            # torch's message runs to many lines about pickles, and its advice (load with
            # weights_only=False) would run whatever the file holds: its first clause only
            why = re.split(r"\n|\.\s", str(exc).strip())[0] or type(exc).__name__
            return _fail(f"cannot read {dense_path} ({why}); remove {run_dir} to start over")
        wrong = _saved_run_problem(saved, cfg, torch)
        if wrong:
            return _fail(f"{dense_path} is not a dense part of this demo ({wrong}); remove "
                         f"{run_dir} to start over")
        saved_cfg, saved_layout = saved["config"], saved["layout"]
        if not (store_path / "MANIFEST.json").exists():
            return _fail(f"{dense_path} holds a run at step {saved.get('step')} but its store "
                         f"{store_path} is gone; resuming would train new tables under the "
                         f"old dense part: remove {run_dir} to start over")
        if saved_cfg != cfg.to_json():
            now = cfg.to_json()
            diff = ", ".join([f"{k} {saved_cfg.get(k)} (now {v})"
                              for k, v in now.items() if saved_cfg.get(k) != v]
                             + [f"{k} {v} (now none)" for k, v in saved_cfg.items()
                                if k not in now])
            return _fail(f"{run_dir} holds a run made with other settings: {diff}; "
                         "use the same --rows and --seed, or another --path")
        if saved.get("batch_size", args.batch_size) != args.batch_size:
            # the click stream is cut into batches of this size: another would train on
            # other samples than the run resumed (runs saved before it was kept: unknown)
            return _fail(f"{run_dir} holds a run of --batch-size {saved['batch_size']}; use "
                         "it again, or another --path")
        if saved_layout != layout:
            return _fail(f"{run_dir} holds a {saved_layout} store; run again "
                         f"{'with' if saved_layout == 'all-dram' else 'without'} --all-dram")
    elif (store_path / "MANIFEST.json").exists():
        return _fail(f"{store_path} exists but {dense_path} does not (an interrupted first "
                     f"run?); remove {run_dir} to start over")
    run_dir.mkdir(parents=True, exist_ok=True)

    stream = ClickStream(cfg)
    held_out = stream.held_out(args.eval_samples)
    torch.manual_seed(cfg.seed)
    out = sys.stdout
    quiet = args.json
    t_open = time.perf_counter()
    with make_store(cfg, store_path, all_dram=args.all_dram) as store:
        ebc = et.EmbeddingBagCollection(store, cfg.feature_tables(), mode="sum")
        model = build_model(cfg, ebc)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.dense_lr)
        step0 = 0
        history: dict[str, list] = {"train": [], "eval": []}
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            step0, history = saved["step"], saved["history"]
        loss_fn = torch.nn.BCEWithLogitsLoss()
        dram_rows = None if args.all_dram else cfg.features * max(1, int(cfg.rows * 0.1))
        if not quiet:
            block_cache = ROCKSDB_OPTIONS["block_cache_bytes"] >> 20
            where = "in DRAM" if args.all_dram else \
                f"on rocksdb ({block_cache} MiB block cache) behind a DRAM tier of " \
                f"{dram_rows:,} rows ({dram_rows * (cfg.dim + 1) * 4 / 2**20:,.1f} MiB, " \
                f"1/{table_bytes(cfg) / (dram_rows * (cfg.dim + 1) * 4):.0f} of the tables)"
            print(f"DLRM: {cfg.dense} dense features -> bottom MLP; {cfg.features} sparse "
                  f"features -> tables of {cfg.rows:,} x {cfg.dim} "
                  f"({table_bytes(cfg) / 2**20:,.0f} MiB with row-wise Adagrad state) {where}; "
                  f"dot interaction -> top MLP", file=out)
            print(f"{'resuming at step ' + format(step0, ',') if step0 else 'training'}: "
                  f"{args.steps:,} steps x {args.batch_size:,} samples, "
                  f"{'in-line lookups' if args.no_pipeline else 'pipelined lookups'}; "
                  f"run in {run_dir if tmp is None else 'a temporary directory'}", file=out)

        auc0, eval_loss0 = _evaluate(model, held_out)
        if not history["eval"] or history["eval"][-1][0] != step0:
            history["eval"].append((step0, auc0, eval_loss0))
        bar = _progress(args.steps, sys.stderr.isatty() and not quiet)
        evals = min(args.evals, args.steps) if args.steps else 0
        bounds = [step0 + round(args.steps * (i + 1) / evals) for i in range(evals)]
        losses: list[float] = []
        train_s = 0.0
        step = step0
        stop_requested = _StopAtStepBoundary()
        try:
            with stop_requested:
                for stop in bounds:
                    batches = (stream.batch(k, args.batch_size) for k in range(step, stop))
                    t0 = time.perf_counter()
                    pipe = None if args.no_pipeline else et.TrainPipeline(
                        batches, inputs=lambda b: {ebc: b.sparse}, depth=2)
                    try:
                        for batch in batches if pipe is None else pipe:
                            loss = loss_fn(model(batch), batch.labels)
                            opt.zero_grad()
                            loss.backward()
                            opt.step()
                            value = float(loss.detach())
                            losses.append(value)
                            history["train"].append((step, value))
                            step += 1
                            if bar is not None:
                                bar.update(1)
                                if step % 5 == 0:
                                    rate = len(losses) * args.batch_size / (
                                        train_s + time.perf_counter() - t0)
                                    bar.set_postfix_str(f"loss {np.mean(losses[-20:]):.4f}, "
                                                        f"{rate:,.0f} samples/s")
                            if stop_requested:
                                break
                    finally:
                        if pipe is not None:
                            pipe.close()
                    train_s += time.perf_counter() - t0
                    history["eval"].append((step, *_evaluate(model, held_out)))
                    if stop_requested:
                        break
        finally:
            if bar is not None:
                bar.close()
        interrupted = bool(stop_requested)
        trained = step - step0
        tiers = _tier_report(store)
        store.flush()
        digest = table_digest(store)
        stored_rows = {name: store.num_rows(name) for name in store.tables}
        if tmp is None:
            _save_dense(dense_path, {"config": cfg.to_json(), "layout": layout, "step": step,
                                     "batch_size": args.batch_size,
                                     "model": model.state_dict(), "optimizer": opt.state_dict(),
                                     "history": history})
    wall = time.perf_counter() - t_open

    final_auc, final_eval_loss = history["eval"][-1][1], history["eval"][-1][2]
    window = max(1, min(20, len(losses) // 10))
    figures = {
        "steps": trained, "step": step, "batch_size": args.batch_size, "rows": cfg.rows,
        "tables": cfg.features, "layout": layout, "pipeline": not args.no_pipeline,
        "loss_start": float(np.mean(losses[:window])) if losses else None,
        "loss_end": float(np.mean(losses[-window:])) if losses else None,
        "held_out_loss_start": eval_loss0, "held_out_loss_end": final_eval_loss,
        "auc_start": auc0, "auc": final_auc,
        "samples_per_s": trained * args.batch_size / train_s if train_s else None,
        "train_s": train_s, "wall_s": wall,
        "tiers": tiers, "stored_rows": sum(stored_rows.values()),
        "interrupted": interrupted, "digest": digest,
    }
    try:
        plot_note = _plot(args.plot, history, quiet) if args.plot else None
    except KeyboardInterrupt:  # the run is saved by now; only the picture is lost
        plot_note, interrupted = "Ctrl-C while drawing: no plot was written", True
    if quiet:
        figures["plot"] = None if plot_note or not args.plot else args.plot
        print(json.dumps(_json_safe(figures)), file=out)
    else:
        if interrupted:
            print(f"stopped at step {step:,} after Ctrl-C"
                  + ("; the run so far is saved" if tmp is None else ""), file=out)
        if losses:
            print(f"loss (mean of {window} batches): start {figures['loss_start']:.4f}  "
                  f"end {figures['loss_end']:.4f}", file=out)
        print(f"held-out ({args.eval_samples:,} samples): log loss {eval_loss0:.4f} -> "
              f"{final_eval_loss:.4f}, AUC {auc0:.4f} -> {final_auc:.4f}", file=out)
        if train_s:
            print(f"throughput: {figures['samples_per_s']:,.0f} samples/s "
                  f"({trained:,} steps in {train_s:.1f} s; {wall:.1f} s in all)", file=out)
        for t in tiers:
            cap = "unbounded" if t["capacity_rows"] is None else f"{t['capacity_rows']:,} rows"
            print(f"tier {t['level']} {t['backend']:<8} ({cap}): hit ratio "
                  f"{t['hit_ratio']:6.1%} of {t['lookups']:,} lookups; holds {t['rows']:,} rows",
                  file=out)
        print(f"stored rows: {figures['stored_rows']:,} over {cfg.features} tables", file=out)
        if tmp is None:
            print(f"kept in {run_dir} (step {step:,}); run again with --path {run_dir} to "
                  "continue", file=out)
        if args.plot and plot_note is None:
            print(f"plot: {args.plot}", file=out)
        if plot_note:
            print(f"note: {plot_note}", file=out)
        print(f"digest: {digest}", file=out)
    if tmp is not None:
        tmp.cleanup()
    if interrupted:
        return 130
    if not math.isfinite(figures["loss_end"] or 0.0):
        return _fail("the loss is not finite")
    return 0
