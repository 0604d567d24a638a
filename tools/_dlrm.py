"""The small DLRM of `embstore demo` and `embstore bench torch`, and its synthetic click stream.

The click stream has a learnable signal: a hidden ground-truth model draws the clicks. Every
sparse id has a hidden vector (a pure function of the feature and the id, so nothing of the
size of the tables is held in memory); a sample's click logit is the scaled sum of the dot
products of its features' pooled hidden vectors plus a hidden linear function of its dense
features, and the click is a Bernoulli draw of its sigmoid. The model (bottom MLP over the dense
features, one embstore table per sparse feature, pairwise dot interaction, top MLP) can
represent that function, so its loss falls and its held-out AUC rises well above 0.5.

Ids are Zipf-distributed per feature, with a small hot set taking most lookups as in
production traces, and scattered over the 64-bit id space as hashed ids are. Batch `k` of the
stream is a pure function of (seed, k): a run resumed at step k continues the same stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore import TableSpec, TierSpec
from embstore.manifest import MANIFEST_NAME

__all__ = ["Batch", "ClickStream", "DemoConfig", "auc", "build_model", "make_store",
           "table_digest", "table_bytes"]


@dataclass(frozen=True)
class DemoConfig:
    """Shape of the demo's model and data."""

    rows: int = 1_000_000
    """Ids per sparse feature (each feature has its own table)."""
    features: int = 8
    """Sparse features (= tables)."""
    dim: int = 16
    """Embedding dim of every table (and the bottom MLP's output width)."""
    dense: int = 13
    """Dense features per sample."""
    hidden_dim: int = 4
    """Width of the ground truth's hidden vectors."""
    seed: int = 0
    lr: float = 0.05
    """Learning rate of the tables' fused row-wise Adagrad."""
    dense_lr: float = 1e-3
    """Learning rate of the dense part's Adam."""

    def table_names(self) -> list[str]:
        """Names of the tables, t0 .. t<features-1>."""
        return [f"t{i}" for i in range(self.features)]

    def feature_names(self) -> list[str]:
        """Names of the sparse features, f0 .. f<features-1>."""
        return [f"f{i}" for i in range(self.features)]

    def feature_tables(self) -> dict[str, str]:
        """Feature -> table: feature f<i> is looked up in table t<i>."""
        return {f"f{i}": f"t{i}" for i in range(self.features)}

    def zipf_exponent(self, f: int) -> float:
        """Skew of feature `f`: from 1.05 (user-like, long tail) to 1.3 (small hot set)."""
        return 1.05 + 0.25 * f / max(self.features - 1, 1)

    def pooling(self, f: int) -> int:
        """Most ids in one bag of feature `f` (bags hold 1..pooling ids; 1 = one-hot)."""
        return (1, 1, 1, 2, 3, 4, 6, 8)[f % 8]

    def to_json(self) -> dict[str, Any]:
        """The settings as a plain dict (kept beside a run to check a resume against)."""
        return asdict(self)


def table_bytes(cfg: DemoConfig) -> int:
    """Bytes of all tables at full size: rows x (dim + row-wise Adagrad's one state) x 4."""
    return cfg.features * cfg.rows * (cfg.dim + 1) * 4


ROCKSDB_OPTIONS = {"block_cache_bytes": 8 << 20, "row_cache_bytes": 0, "mmap_reads": True,
                   "memtable_bloom_ratio": 0.1, "write_buffer_bytes": 4 << 20}
"""RocksDB's own DRAM caches kept small, so the DRAM tier is most of the DRAM the rows use;
table files read through a memory map, and a bloom filter of the memtable's keys, as suit the
random point reads of the DRAM tier's misses beside its write-backs. A 4 MiB memtable per
table, not 64: rocksdict's write holds the GIL while it inserts into the memtable, which costs
more per row the larger the memtable (over 600 pipelined demo steps: 7.1 ms a step at 64 MiB,
3.7 at 4 MiB), while the compactions that smaller memtables bring run on RocksDB's own threads
without the GIL (4.1 ms a step): the same CPU, and the steps 12% shorter."""


def make_store(cfg: DemoConfig, path: Any, *, all_dram: bool,
               dram_fraction: float = 0.1) -> embstore.EmbeddingStore:
    """Open (or create) the demo's store: one table per feature.

    By default each table is on rocksdb behind a DRAM tier of `dram_fraction` of its rows;
    `all_dram` keeps every row in DRAM. A store already at `path` reopens with the tables
    and tiers it was made with, so a run kept by an earlier version resumes with its options.
    """
    if path is not None and (Path(path) / MANIFEST_NAME).exists():
        return embstore.open(path)
    tables = [TableSpec(name, dim=cfg.dim,
                        init=embstore.init.Uniform(-0.05, 0.05, seed=cfg.seed * 1000 + i),
                        optimizer=embstore.optim.RowWiseAdagrad(lr=cfg.lr))
              for i, name in enumerate(cfg.table_names())]
    if all_dram:
        tiers = [TierSpec("dram")]
    else:
        cache_rows = max(1, int(cfg.rows * dram_fraction))
        tiers = [TierSpec("dram", capacity=cache_rows, eviction="clock"),
                 TierSpec("rocksdb", options=dict(ROCKSDB_OPTIONS))]
    return embstore.open(path, tables=tables, tiers=tiers)


@dataclass
class Batch:
    """One batch: dense features [B, dense], sparse {feature: (values, lengths)}, labels [B]."""

    dense: Any
    sparse: dict[str, tuple[Any, Any]]
    labels: Any

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class ClickStream:
    """The synthetic click stream of `cfg` (see the module docstring)."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng((cfg.seed, 7))
        ranks = np.arange(1, cfg.rows + 1, dtype=np.float64)
        self._cdf = []
        for f in range(cfg.features):
            c = np.cumsum(1.0 / ranks ** cfg.zipf_exponent(f))
            self._cdf.append(c / c[-1])
        # scattered ids: a random odd multiplier per feature is a bijection on 64-bit words
        self._mult = [np.uint64(int(rng.integers(1, 2**62)) * 2 + 1)
                      for _ in range(cfg.features)]
        self._hidden = [embstore.init.Normal(0.0, 1.0, seed=10_000 + cfg.seed * 100 + f)
                        for f in range(cfg.features)]
        self._dense_w = rng.standard_normal(cfg.dense) / np.sqrt(cfg.dense)
        pairs = cfg.features * (cfg.features - 1) // 2
        self._scale = np.sqrt(6.0 / (pairs * cfg.hidden_dim))
        self._bias = -0.5

    def ids(self, f: int, ranks: np.ndarray) -> np.ndarray:
        """The ids of Zipf ranks `ranks` of feature `f`."""
        return (ranks.astype(np.uint64) * self._mult[f]).view(np.int64)

    def draw(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, dict, np.ndarray]:
        """`size` samples: dense float32 [size, dense], {feature: (ids, lengths)}, labels."""
        cfg = self.cfg
        dense = rng.standard_normal((size, cfg.dense)).astype(np.float32)
        pooled = np.zeros((cfg.features, size, cfg.hidden_dim))
        sparse = {}
        for f, name in enumerate(cfg.feature_names()):
            lengths = rng.integers(1, cfg.pooling(f) + 1, size=size)
            n = int(lengths.sum())
            ranks = np.minimum(np.searchsorted(self._cdf[f], rng.random(n)), cfg.rows - 1)
            ids = self.ids(f, ranks)
            h = self._hidden[f](ids, cfg.hidden_dim, np.dtype(np.float64))
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            # summed like the model's bags, scaled to unit variance per mean bag
            pooled[f] = np.add.reduceat(h, starts, axis=0) / np.sqrt((cfg.pooling(f) + 1) / 2)
            sparse[name] = (ids, lengths.astype(np.int64))
        logit = self._bias + dense.astype(np.float64) @ self._dense_w
        for i in range(cfg.features):
            for j in range(i + 1, cfg.features):
                logit += self._scale * np.einsum("bk,bk->b", pooled[i], pooled[j])
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return dense, sparse, labels

    def batch(self, step: int, size: int) -> Batch:
        """Training batch number `step` (a pure function of the seed and `step`)."""
        return _to_torch(*self.draw(np.random.default_rng((self.cfg.seed, 0, step)), size))

    def held_out(self, size: int) -> Batch:
        """The held-out set: drawn from the same process with its own seed."""
        return _to_torch(*self.draw(np.random.default_rng((self.cfg.seed, 1)), size))


def _to_torch(dense: np.ndarray, sparse: dict, labels: np.ndarray) -> Batch:
    import torch

    return Batch(torch.from_numpy(dense),
                 {f: (torch.from_numpy(v), torch.from_numpy(n)) for f, (v, n) in sparse.items()},
                 torch.from_numpy(labels))


def build_model(cfg: DemoConfig, ebc: Any) -> Any:
    """The DLRM over `ebc` (an embstore.torch.EmbeddingBagCollection of cfg's features)."""
    import torch
    from torch import nn

    class DLRM(nn.Module):
        """Bottom MLP, embeddings, pairwise dot interaction, top MLP (returns logits)."""

        def __init__(self) -> None:
            super().__init__()
            self.ebc = ebc
            n = cfg.features + 1
            self.bottom = nn.Sequential(nn.Linear(cfg.dense, 64), nn.ReLU(),
                                        nn.Linear(64, cfg.dim), nn.ReLU())
            li, lj = torch.triu_indices(n, n, offset=1)
            self.register_buffer("li", li, persistent=False)
            self.register_buffer("lj", lj, persistent=False)
            self.top = nn.Sequential(nn.Linear(cfg.dim + n * (n - 1) // 2, 64), nn.ReLU(),
                                     nn.Linear(64, 1))

        def interact(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
            z = torch.cat([x.unsqueeze(1), emb.view(x.shape[0], cfg.features, cfg.dim)], 1)
            dots = torch.bmm(z, z.transpose(1, 2))[:, self.li, self.lj]
            return self.top(torch.cat([x, dots], 1)).squeeze(1)

        def forward(self, batch: Batch) -> torch.Tensor:
            x = self.bottom(batch.dense)
            return self.interact(x, self.ebc(batch.sparse).values())

    return DLRM()


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (rank-based, ties averaged); nan with one class only."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    n1 = int(labels.sum())
    n0 = len(labels) - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    _, inverse, counts = np.unique(scores[order], return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based mean rank of each tie group
    ranks = np.empty(len(scores))
    ranks[order] = avg_rank[inverse]
    return float((ranks[labels].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def table_digest(store: embstore.EmbeddingStore) -> str:
    """Hash every table's contents: sha256 hex.

    Over every table (name order): its stored ids sorted, rows and optimizer state in id order.
    """
    h = hashlib.sha256()
    for name in sorted(store.tables):
        ids, rows, state = [], [], []
        for i, w, s in store.items(name):
            ids.append(np.array(i, dtype=np.int64))
            rows.append(np.array(w))
            state.append(np.array(s))
        spec = store.table_spec(name)
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        order = np.argsort(all_ids, kind="stable")
        w = np.concatenate(rows) if rows else np.zeros((0, spec.dim), spec.dtype)
        s = (np.concatenate(state) if state
             else np.zeros((0, spec.row_width - spec.dim), spec.dtype))
        h.update(name.encode() + b"\0")
        h.update(np.int64(len(all_ids)).tobytes())
        h.update(np.ascontiguousarray(all_ids[order]).tobytes())
        h.update(np.ascontiguousarray(w[order]).tobytes())
        h.update(np.ascontiguousarray(s[order]).tobytes())
    return h.hexdigest()
