"""A plan or placement that the store's record (sharded.json) could not hold as given is refused
up front with ConfigError: no raw TypeError, OverflowError or NaN in the record.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from embstore.distributed.plan import Placement, Plan
from embstore.errors import ConfigError


@pytest.mark.parametrize("args", [
    ("row", None), ("row", 0), ("row", "01"), ("row", (0.9,)), ("row", (math.nan,)),
    ("row", (math.inf,)), ("row", ("0",)), ("row", (True,)), ("row", (-1,)),
    ("row", (2**40,)), (3, (0,)), (["row"], (0,)),
], ids=repr)
def test_ranks_and_kinds_that_are_not_what_they_say_are_refused(args) -> None:
    with pytest.raises(ConfigError):
        Placement(*args)


@pytest.mark.parametrize("kwargs", [
    {"kind": "table", "ranks": (0,), "split": math.nan},
    {"kind": "column", "ranks": (0, 1), "split": {1}, "columns": (0, 1, 2)},
    {"kind": "table", "ranks": (0,), "split": "range"},
    {"kind": "table", "ranks": (0,), "bounds": (10**30,)},
    {"kind": "row", "ranks": (0, 1), "columns": (5, 3)},
    {"kind": "row", "ranks": (0, 1), "split": "range", "bounds": (10**30,)},
    {"kind": "row", "ranks": (0, 1), "split": "range", "bounds": (math.inf,)},
    {"kind": "column", "ranks": (0, 1), "columns": (0, 2.5, 4)},
], ids=repr)
def test_fields_another_kind_uses_or_that_overflow_are_refused(kwargs) -> None:
    with pytest.raises(ConfigError):
        Placement(**kwargs)


def test_numpy_ranks_and_bounds_become_ints_and_the_json_is_plain() -> None:
    p = Placement("row", (np.int64(0), np.int32(1)), split="range", bounds=[np.int64(-5)])
    assert p.ranks == (0, 1) and p.bounds == (-5,)
    assert all(type(x) is int for x in p.ranks + p.bounds)
    assert Placement.from_json(json.loads(json.dumps(p.to_json(), allow_nan=False))) == p


@pytest.mark.parametrize("world", [np.float64(math.nan), True, 0, -1, 2.5, "2", 2**40, None])
def test_a_world_size_that_is_no_count_of_ranks_is_refused(world) -> None:
    with pytest.raises(ConfigError):
        Plan(world, {"t": Placement("row", (0,))})


def test_a_numpy_world_size_becomes_an_int() -> None:
    plan = Plan(np.int64(2), {"t": Placement("row", (0, 1))})
    assert type(plan.world_size) is int
    json.dumps(plan.to_json(), allow_nan=False)


@pytest.mark.parametrize("tables", [{"t": "row"}, {1: Placement("row", (0,))}, ["t"]],
                         ids=repr)
def test_tables_that_are_not_placements_by_name_are_refused(tables) -> None:
    with pytest.raises(ConfigError):
        Plan(1, tables)


def test_the_plan_keeps_its_own_copy_of_the_callers_tables() -> None:
    tables = {"t": Placement("row", (0,))}
    plan = Plan(1, tables)
    tables["u"] = Placement("row", (0,))
    assert list(plan.tables) == ["t"]
    assert list(plan.to_json()["tables"]) == ["t"]


def test_open_refuses_a_plan_of_another_type_and_a_timeout_that_is_no_duration(tmp_path) -> None:
    pytest.importorskip("torch", reason="embstore.distributed needs torch (the 'torch' extra)")
    import embstore
    import embstore.distributed as ed

    tables = [embstore.TableSpec("t", 4)]
    with pytest.raises(ConfigError, match="plan must be"):
        ed.open(tmp_path / "s", tables=tables, plan={"t": Placement("row", (0,))})
    for timeout in (math.nan, -1, 0, math.inf, True, "5"):
        with pytest.raises(ConfigError, match="timeout_s"):
            ed.open(tmp_path / "s", tables=tables, timeout_s=timeout)
    assert not (tmp_path / "s").exists()
