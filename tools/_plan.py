"""The planner: per-table tier chains and cache sizes that minimise the predicted time per batch.

Cost model, per table and batch: the predicted seconds of the batch's lookup and update
through the chain (`embstore._tier_cost.step_seconds`: reads of the distinct ids from the top,
misses read from below, promotions, the update's read and write, write-backs), with m(C) the
miss ratio of a cache of C rows (the profile's curve of the chosen policy, interpolated in
log C). Memory: a cache of C rows costs C x (r + the tier's overhead per row); a table whose
bottom is DRAM or pmem costs all its rows there; rocksdb and lmdb are not budgeted.

Each table's options are: all in DRAM; a DRAM cache (0 or one of the profile's capacities)
over pmem, rocksdb or lmdb; a DRAM cache over a pmem cache over rocksdb. Each cache takes the
profiled eviction policy with the fewest misses at its size. The options of all tables form
a multiple-choice knapsack under the budgets; the planner starts every table at its cheapest
option and repeatedly takes the move with the largest time saved per budget share spent
(free improvements first) until no move fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embstore._tier_cost import SSD_TIERS, step_seconds
from embstore.errors import ConfigError
from embstore.placement import KNOWN_TIERS, MAX_NUMBER, load_document
from embstore.spec import TierSpec, parse_bytes
from embstore.tools.simulator import parse_policy

__all__ = ["Option", "chain_option", "naive_placement", "parse_budget", "plan", "to_placement"]

_BUDGETED = ("dram", "pmem")
_SSD = SSD_TIERS
_MOST_SIZE_CHARACTERS = 40  # 2**63 bytes take 19 digits; with a fraction and a unit, fewer than 40


@dataclass
class Option:
    """One way to place a table: a chain, its caches' sizes and policies, and its figures."""

    backends: list[str]
    """Tier backends, top first."""
    caps: list[int]
    """Rows of each cache tier (all but the bottom)."""
    policies: list[str]
    """Eviction policy of each cache tier."""
    hit_ratios: list[float]
    """Share of lookups each tier serves, top first (they sum to 1)."""
    seconds: float
    """Predicted seconds per batch."""
    use: dict[str, float] = field(default_factory=dict)
    """Budgeted bytes per tier."""


def parse_budget(text: str, row_bytes: int, model: dict[str, Any]) -> dict[str, int]:
    """Bytes per budgeted tier from "dram=8GiB,pmem=64GiB".

    A size is bytes: with a unit (8GiB, 512MiB, 2GB) or a bare whole number of bytes. Only
    dram and pmem are budgeted; ``rocksdb=unbounded`` and ``lmdb=unbounded`` (the form
    `embstore.distributed.parse_tier_budgets` reads) are accepted and change nothing.

    Raises:
        ConfigError: bad syntax, an unknown, unmeasured or repeated tier, a size that is no
            byte count, or a budget below one row.
    """
    out = dict.fromkeys(_BUDGETED, 0)
    given: set[str] = set()
    for item in filter(None, text.split(",")):
        name, eq, size = item.partition("=")
        name, size = name.strip(), size.strip()
        if not eq:
            raise ConfigError(f"--budget {text!r}: expected tier=size, e.g. dram=8GiB,pmem=64GiB")
        if name in given:  # which of two sizes was meant is a guess: ask instead
            raise ConfigError(f"--budget {text!r} gives {name} twice; give each tier once")
        given.add(name)
        if name in _SSD:
            if size.lower() != "unbounded":
                raise ConfigError(f"--budget {name}={size}: {name} is not limited (budgets are "
                                  f"for {list(_BUDGETED)}); leave it out or write "
                                  f"{name}=unbounded")
            continue
        if name not in _BUDGETED:
            raise ConfigError(f"--budget names tier {name!r}; budgets are for {list(_BUDGETED)} "
                              f"(rocksdb and lmdb are not limited)")
        if name not in model["tiers"]:
            raise ConfigError(f"--budget gives {name} but the tier model has no {name!r} tier; "
                              "measure it (embstore bench tiers) or drop the budget")
        if size.lower() == "unbounded":
            raise ConfigError(f"--budget {name}=unbounded: the planner shares out {name}'s bytes, "
                              f"so it needs a size, e.g. {name}=8GiB")
        if "." in size and size.replace(".", "", 1).isdigit():  # parse_bytes would cut it
            raise ConfigError(f"--budget {name}={size}: a number without a unit counts bytes, "
                              "which are whole; write e.g. 8GiB or 8589934592")
        if len(size) > _MOST_SIZE_CHARACTERS:  # a size beyond any a budget could be
            raise ConfigError(f"--budget {name}: {len(size)} characters is too large for a "
                              "size; give it with a unit, e.g. 8GiB")
        try:
            out[name] = parse_bytes(size)
        except ConfigError:  # parse_bytes's own words offer a row count, which this is not
            raise ConfigError(f"--budget {name}={size}: not a size in bytes; write it with a "
                              "unit (8GiB, 512MiB) or as a whole number of bytes") from None
        if out[name] > MAX_NUMBER:  # a placement keeps sizes as exact JSON numbers
            raise ConfigError(f"--budget {name}={size} is {out[name]} bytes, above the "
                              f"2**53 a placement holds")
        if out[name] < row_bytes:
            raise ConfigError(f"--budget {name}={size} is {out[name]} bytes (a number without a "
                              f"unit counts bytes), below one row ({row_bytes} bytes); raise "
                              "it or leave the tier out")
    if out["dram"] < row_bytes:
        raise ConfigError("--budget needs dram=SIZE of at least one row: every chain but the "
                          "SSD-only one caches in DRAM")
    return out


def _miss(t: dict[str, Any], policy: str, cap: float) -> float:
    if cap <= 0:
        return 1.0
    caps = np.log(np.asarray(t["mrc"]["capacities"], dtype=np.float64))
    return float(np.interp(np.log(cap), caps, t["mrc"][policy]))


def _best_policy(t: dict[str, Any], cap: float) -> str:
    curves = [k for k in t["mrc"] if k != "capacities"]
    return min(curves, key=lambda p: (_miss(t, p, cap), p != "clock", p))


def chain_option(t: dict[str, Any], model: dict[str, Any], backends: list[str], caps: list[int],
                 policies: list[str] | None = None) -> Option:
    """The figures of one chain for profiled table `t` (policies: best per cache if None)."""
    r, n, rows = t["row_bytes"], float(t["distinct_per_batch"]), t["rows_touched"]
    if policies is None:
        policies = [_best_policy(t, sum(caps[:i + 1])) for i in range(len(caps))]
    # misses below each cache level (a lower cache holds what the upper one does: inclusive)
    miss = [_miss(t, policies[i], sum(caps[:i + 1])) for i in range(len(caps))]
    # so no lower level misses more than the one above, even where a curve rises between
    # two profiled sizes: every hit ratio stays >= 0, as placements are checked to hold
    miss = [min(miss[:i + 1]) for i in range(len(miss))]
    secs = float(step_seconds(model, backends, n, r, miss))
    served = [1.0 - m for m in miss] + [1.0]
    hits = [served[0]] + [served[i] - served[i - 1] for i in range(1, len(served))]
    use = dict.fromkeys(_BUDGETED, 0.0)
    for i, b in enumerate(backends):
        if b in _BUDGETED:
            held = caps[i] if i < len(caps) else rows
            use[b] += held * (r + float(model["tiers"][b].get("overhead_bytes_per_row", 0.0)))
    return Option(list(backends), list(caps), list(policies), hits, secs, use)


def _options(t: dict[str, Any], model: dict[str, Any], budget: dict[str, int]) -> list[Option]:
    tiers = model["tiers"]
    rows = t["rows_touched"]
    # a cache must hold a step's rows from its lookup to its update, or it thrashes within
    # the step (promoted rows evicted before the optimizer writes them): at least two
    # batches' distinct ids
    caps = [c for c in t["mrc"]["capacities"] if 2 * t["distinct_per_batch"] <= c < rows]
    out = []
    if "dram" in tiers:
        out.append(chain_option(t, model, ["dram"], []))
    bottoms = [b for b in (*_SSD, "pmem") if b in tiers and (b != "pmem" or budget["pmem"])]
    for bottom in bottoms:
        out.append(chain_option(t, model, [bottom], []))
        if "dram" in tiers:
            out += [chain_option(t, model, ["dram", bottom], [c]) for c in caps]
    if "dram" in tiers and "pmem" in tiers and budget["pmem"]:
        for ssd in (b for b in _SSD if b in tiers):
            out += [chain_option(t, model, ["pmem", ssd], [c]) for c in caps]
            out += [chain_option(t, model, ["dram", "pmem", ssd], [c1, c2])
                    for c1 in caps for c2 in caps if c2 > c1]
    return out


def plan(profile: dict[str, Any], model: dict[str, Any], budget: dict[str, int]
         ) -> dict[str, Option]:
    """The chosen option of every profiled table.

    Raises:
        ConfigError: the budgets cannot hold even the cheapest placement.
    """
    profile, model = load_document(profile, "profile"), load_document(model, "tiers")
    names = sorted(profile["tables"])
    for name in names:  # every curve, not only those chosen: a bad one is a bad profile
        for curve in profile["tables"][name]["mrc"]:
            if curve != "capacities":
                try:
                    parse_policy(curve, "eviction")
                except ConfigError as exc:
                    raise ConfigError(f"the profile's table {name!r} has a curve of no "
                                      f"eviction policy this embstore runs ({exc}); profile "
                                      "the trace again") from None
    opts = [_options(profile["tables"][n], model, budget) for n in names]
    if any(not o for o in opts):
        raise ConfigError("the tier model has no tier a table can live on; measure dram and "
                          "rocksdb at least")
    # flat arrays over every option of every table
    owner = np.concatenate([np.full(len(o), i) for i, o in enumerate(opts)])
    flat = [x for o in opts for x in o]
    secs = np.array([x.seconds for x in flat])
    use = np.array([[x.use[b] for b in _BUDGETED] for x in flat])
    cap = np.array([budget[b] for b in _BUDGETED], dtype=np.float64)
    scale = np.where(cap > 0, 1.0 / np.maximum(cap, 1.0), 0.0)
    # start: each table's least memory, then fastest
    cur = np.zeros(len(names), dtype=np.int64)
    for i in range(len(names)):
        idx = np.flatnonzero(owner == i)
        key = np.lexsort((secs[idx], (use[idx] * scale).sum(axis=1) + 1e9 * (
            (use[idx] > 0) & (cap == 0)).any(axis=1)))
        cur[i] = idx[key[0]]
    used = use[cur].sum(axis=0)
    if (used > cap + 1e-6).any():
        have = {b: int(c) for b, c in zip(_BUDGETED, cap, strict=True)}
        need = {b: int(u) for b, u in zip(_BUDGETED, used, strict=True)}
        raise ConfigError(f"the budgets ({have} bytes) cannot hold even the smallest placement "
                          f"({need}); raise them or add rocksdb to the tier model")
    while True:
        d_time = secs[cur[owner]] - secs
        d_use = use - use[cur[owner]]
        fits = ((used + d_use) <= cap + 1e-6).all(axis=1) & (d_time > 1e-15)
        if not fits.any():
            break
        spend = (d_use * scale).sum(axis=1)
        free = fits & (spend <= 0)
        if free.any():  # faster for no more memory: the largest saving first
            best = int(np.argmax(np.where(free, d_time, -1.0)))
        else:
            with np.errstate(over="ignore"):  # seconds saved per byte: inf is the best
                gain = d_time / np.maximum(spend, 1e-300)
            best = int(np.argmax(np.where(fits, gain, -1.0)))
        used += d_use[best]
        cur[owner[best]] = best
    return {name: flat[cur[i]] for i, name in enumerate(names)}


def naive_placement(profile: dict[str, Any], model: dict[str, Any], budget: dict[str, int],
                    kind: str) -> dict[str, Option]:
    """A reference placement, "proportional" or "hottest".

    "proportional": each table a DRAM cache, and a pmem one, in proportion to its size,
    clock eviction, over rocksdb; "hottest": whole tables in DRAM by bandwidth demand per
    sample while they fit, then in pmem, the rest on rocksdb.
    """
    profile = load_document(profile, "profile")
    tables = profile["tables"]
    ssd = "rocksdb" if "rocksdb" in model["tiers"] else "lmdb"
    full = {n: chain_option(t, model, ["dram"], []) for n, t in tables.items()}
    out: dict[str, Option] = {}
    if kind == "proportional":
        total = sum(o.use["dram"] for o in full.values())
        for n, t in tables.items():
            share = full[n].use["dram"] / total
            per_row = {b: t["row_bytes"] + model["tiers"].get(b, {}).get(
                "overhead_bytes_per_row", 0.0) for b in _BUDGETED}
            c1 = int(budget["dram"] * share / per_row["dram"])
            c2 = int(budget["pmem"] * share / per_row["pmem"]) if budget["pmem"] else 0
            if c1 >= t["rows_touched"]:
                out[n] = chain_option(t, model, ["dram"], [])
            elif c2 > c1:
                out[n] = chain_option(t, model, ["dram", "pmem", ssd], [max(c1, 1), c2],
                                      ["clock", "clock"])
            else:
                out[n] = chain_option(t, model, ["dram", ssd], [max(c1, 1)], ["clock"])
        return out
    if kind != "hottest":
        raise ConfigError(f"unknown naive placement {kind!r}; use proportional or hottest")
    left = {b: float(budget[b]) for b in _BUDGETED}
    for n in sorted(tables, key=lambda n: -tables[n]["bytes_per_sample"]):
        t = tables[n]
        for bottom in ("dram", "pmem", ssd):
            o = chain_option(t, model, [bottom], [])
            if bottom == ssd or (bottom in model["tiers"] and o.use[bottom] <= left[bottom]):
                if bottom in left:
                    left[bottom] -= o.use[bottom]
                out[n] = o
                break
    return out


def _cache_spec(backend: str, rows: int, policy: str) -> TierSpec:
    """A cache tier running eviction spec `policy` ("name:key=value:..." as profiled)."""
    config = parse_policy(policy, "eviction").config()
    config.pop("seed", None)
    return TierSpec(backend, capacity=rows, eviction=policy.split(":")[0],
                    eviction_options=config)


def to_placement(chosen: dict[str, Option], budget: dict[str, int]) -> dict[str, Any]:
    """The placement document of the chosen options."""
    tables = {}
    for name, o in chosen.items():
        chain = [_cache_spec(b, o.caps[i], o.policies[i]).to_json()
                 if i < len(o.caps) else TierSpec(b).to_json()
                 for i, b in enumerate(o.backends)]
        tables[name] = {"tiers": chain, "policy": o.policies[0] if o.policies else None,
                        "cache_rows": o.caps, "hit_ratios": o.hit_ratios,
                        "seconds_per_batch": o.seconds,
                        "bytes": {b: int(v) for b, v in o.use.items() if v}}
    return {"format": "embstore.placement", "version": 1, "budget": dict(budget),
            "predicted_seconds_per_batch": sum(o.seconds for o in chosen.values()),
            "tables": tables}


def describe(chosen: dict[str, Option]) -> str:
    """The plan as a printed table."""
    lines = [f"{'table':<10} {'chain':<44} {'hit ratios':<20} {'DRAM MiB':>9} {'pmem MiB':>9} "
             f"{'ms/batch':>9}"]
    for name, o in chosen.items():
        parts = [f"{b}({c} {p})" for b, c, p in zip(o.backends, o.caps, o.policies,
                                                     strict=False)]
        parts += o.backends[len(o.caps):]
        lines.append(f"{name:<10} {' > '.join(parts):<44} "
                     f"{'/'.join(f'{h:.3f}' for h in o.hit_ratios):<20} "
                     f"{o.use['dram'] / 2**20:>9.2f} {o.use['pmem'] / 2**20:>9.2f} "
                     f"{o.seconds * 1e3:>9.3f}")
    total = sum(o.seconds for o in chosen.values())
    lines.append(f"{'total':<10} {'':<44} {'':<20} "
                 f"{sum(o.use['dram'] for o in chosen.values()) / 2**20:>9.2f} "
                 f"{sum(o.use['pmem'] for o in chosen.values()) / 2**20:>9.2f} "
                 f"{total * 1e3:>9.3f}")
    return "\n".join(lines)


assert set(_BUDGETED) | set(_SSD) == set(KNOWN_TIERS)
