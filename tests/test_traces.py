"""Production locality statistics, the reuse histograms and the calibrated trace generator."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from embstore.errors import ConfigError
from embstore.tools import traces

STATS = Path(__file__).resolve().parent / "data" / "dlrm_datasets"  # a copy, with its licence
# Calibration tolerance: total-variation distance between a synthetic batch's histogram and the
# mean production one, per histogram (rows and accesses) and per year.
TV_TOLERANCE = 0.1


def stats_file(year: str) -> Path:
    return STATS / year / "locality_stats.txt"


@pytest.mark.parametrize(("year", "blocks", "tables", "batch"),
                         [("2021", 17, 856, 65536), ("2022", 16, 788, 131072)])
def test_locality_stats_parse(year: str, blocks: int, tables: int, batch: int) -> None:
    stats = traces.load_locality_stats(stats_file(year))
    assert len(stats) == blocks
    for s in stats:
        assert (s.tables, s.batch_size) == (tables, batch)
        assert s.unique < s.indices
        for hist in (s.rows_hist, s.access_hist):
            assert hist.shape == (17,) and abs(hist.sum() - 1) < 1e-9 and (hist >= 0).all()
        # more than half the touched rows are read at most twice, yet they get few lookups
        assert s.rows_hist[:2].sum() > 0.45 and s.access_hist[:2].sum() < 0.15
    if year == "2021":
        first = stats[0]
        assert (first.indices, first.unique) == (887017990, 128435723)
        assert first.rows_hist[0] == pytest.approx(0.473, abs=2e-3)


def test_locality_stats_reject_other_text(tmp_path: Path) -> None:
    bad = tmp_path / "stats.txt"
    bad.write_text("fbgemm_t2_bs4.pt\nnothing here\n")
    with pytest.raises(ConfigError, match="not a locality-stats block"):
        traces.load_locality_stats(bad)


@pytest.mark.parametrize("content", [
    np.arange(10).tobytes() + b"\xff\xfe",  # binary: not UTF-8
    None,  # a real block with one value misprinted
])
def test_locality_stats_reject_binary_files_and_malformed_numbers(tmp_path: Path,
                                                                  content: bytes | None) -> None:
    bad = tmp_path / "stats.txt"
    if content is None:
        block = stats_file("2022").read_text().strip().split("\n\n")[0]
        content = re.sub(r"^\(0, 1\]: (\d)\.", r"(0, 1]: \1.3.", block, count=1,
                         flags=re.M).encode()
        assert content.decode() != block
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match="not a locality-stats"):
        traces.load_locality_stats(bad)


def test_reuse_histograms_bin_by_log2_count() -> None:
    ids = np.array([7] + [8] * 2 + [9] * 3 + [10] * 4 + [11] * 5 + [12] * 40000)
    rows, access = traces.reuse_histograms(ids)
    # counts 1, 2, 3, 4, 5, 40000 fall in bins 0, 1, 2, 2, 3, 16
    assert rows.tolist() == pytest.approx([1/6, 1/6, 2/6, 1/6] + [0] * 12 + [1/6])
    total = len(ids)
    assert access[2] == pytest.approx(7 / total) and access[16] == pytest.approx(40000 / total)
    assert traces.total_variation(rows, rows) == 0.0


@pytest.mark.parametrize("year", ["2021", "2022"])
def test_synthetic_batch_matches_production_histograms(year: str) -> None:
    rows_target, access_target = traces.mean_histograms(
        traces.load_locality_stats(stats_file(year)))
    batch = next(traces.synthesize(1, seed=12345, profile=year))  # not the fitting seed
    assert len(batch) == traces.PROFILES[year].lookups
    rows, access = traces.reuse_histograms(batch)
    assert traces.total_variation(rows, rows_target) < TV_TOLERANCE
    assert traces.total_variation(access, access_target) < TV_TOLERANCE
    # and the reference check has teeth: a plain Zipf batch of the same size is far off
    zipf = np.random.default_rng(0).zipf(1.3, size=len(batch))
    z_rows, z_access = traces.reuse_histograms(zipf)
    assert max(traces.total_variation(z_rows, rows_target),
               traces.total_variation(z_access, access_target)) > 2 * TV_TOLERANCE


def test_synthesize_is_deterministic_and_drift_renews_ids() -> None:
    a = list(traces.synthesize(3, seed=4, lookups=1 << 14))
    b = list(traces.synthesize(3, seed=4, lookups=1 << 14))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    still = list(traces.synthesize(6, seed=4, lookups=1 << 14))
    moving = list(traces.synthesize(6, seed=4, lookups=1 << 14, drift=0.3))

    def overlap(batches: list[np.ndarray]) -> float:
        return len(np.intersect1d(batches[0], batches[-1])) / len(np.unique(batches[-1]))

    assert overlap(moving) < overlap(still) - 0.1
    with pytest.raises(ConfigError, match="unknown trace profile"):
        next(traces.synthesize(1, profile="1999"))


def test_calibrate_does_not_worsen_the_fit() -> None:
    rows_target, access_target = traces.mean_histograms(
        traces.load_locality_stats(stats_file("2022")))
    start = traces.SynthParams(rows_min=4, rows_max=8000, alpha_large=1.0, alpha_small=1.0,
                               share_exp=0.0, lookups=1 << 15)
    batch = next(traces.synthesize(1, seed=0, params=start))
    before = max(traces.total_variation(h, t) for h, t in
                 zip(traces.reuse_histograms(batch), (rows_target, access_target), strict=True))
    fitted, after = traces.calibrate(rows_target, access_target, start=start, rounds=1)
    assert after < before
    assert fitted != start


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"batches": True}, "batches must be a whole number >= 0, got True"),
    ({"batches": 2.0}, "batches must be a whole number >= 0, got 2.0"),
    ({"batches": 1, "lookups": 100.5}, "lookups must be a whole number, got 100.5"),
    ({"batches": 1, "lookups": 100, "drift": True}, "drift must be a number in [0, 1]"),
    ({"batches": 10**20}, "more than the 1,073,741,824 (2**30) a trace may have"),
    ({"batches": 2**30 // 4096 + 1, "lookups": 4096}, "held in memory whole, 8 bytes a lookup")])
def test_synthesize_refuses_wrong_kinds_and_traces_too_large_for_memory(
        kwargs: dict[str, object], says: str) -> None:
    # batches=True drew one batch, and 10**20 batches grew memory until the process was killed
    with pytest.raises(ConfigError) as info:
        next(traces.synthesize(**kwargs))  # type: ignore[arg-type]
    assert says in str(info.value)
    # the largest trace allowed is refused by nothing but its size (drawn lazily here)
    assert len(next(traces.synthesize(2**30 // 4096, lookups=4096))) == 4096
