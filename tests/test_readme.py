"""The README's ```python examples run as written, so they cannot drift from the API.

Each block runs in a fresh temporary directory. What a block leaves undefined is supplied by
the test: the PyTorch example's `store` (tables "user" and "ad" of dim 64, as its modules
read them) and `loader` (batches with `.features` and `.labels`). Nothing else is changed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import embstore

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[str]:
    return _BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_has_its_examples() -> None:
    blocks = _blocks()
    assert len(blocks) >= 2
    assert any("embstore.open(" in b for b in blocks)
    assert any("embstore.torch" in b for b in blocks)


def _run(block: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    return namespace


def test_use_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    [block] = [b for b in _blocks() if "embstore.open(" in b and "embstore.torch" not in b]
    ns = _run(block, {})
    store = ns["store"]
    try:
        assert ns["rows"].shape == (3, 64)                # as the example's comment says
        assert ns["rows"].dtype == np.float32
        after = store.lookup("user", ns["ids"])          # the reopened store, manifest only
        # the step was taken, made durable by flush(), and read back after the reopen
        assert not np.array_equal(after, ns["rows"])
        np.testing.assert_array_equal(after[0], after[2])  # one id, one row
    finally:
        store.close()
    assert (tmp_path / "runs" / "ctr" / "MANIFEST.json").is_file()


def _loader(batches: int, batch_size: int, seed: int) -> list[SimpleNamespace]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        features = {name: (torch.randint(0, 1000, (2 * batch_size,), generator=g),
                           torch.full((batch_size,), 2, dtype=torch.long))
                    for name in ("user", "ad")}
        labels = torch.randint(0, 2, (batch_size,), generator=g).float()
        out.append(SimpleNamespace(features=features, labels=labels))
    return out


def test_torch_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    [block] = [b for b in _blocks() if "embstore.torch" in b]
    specs = [embstore.TableSpec(name, dim=64, optimizer=embstore.optim.RowWiseAdagrad(lr=0.05))
             for name in ("user", "ad")]
    store = embstore.open("runs/ctr", tables=specs, tiers=[embstore.TierSpec("dram")])
    loader = _loader(batches=3, batch_size=8, seed=0)
    ids = np.unique(torch.cat([b.features["user"][0] for b in loader]).numpy())
    before = store.lookup("user", ids)
    try:
        ns = _run(block, {"store": store, "loader": loader})
        assert ns["step"] == len(loader) - 1
        now = store.lookup("user", ids)
        assert not np.array_equal(now, before)            # backward stepped the store's tables
        saved = torch.load(tmp_path / "dense.pt")
        assert set(saved) == {"model", "opt"}
        assert set(saved["model"]) == {"top.weight", "top.bias"}   # the modules hold no tensors
        manifest = json.loads((tmp_path / "ckpt" / "final" / "MANIFEST.json").read_text())
        assert manifest["checkpoint"]["step"] == len(loader) - 1
        ckpt = embstore.open(tmp_path / "ckpt" / "final", read_only=True)
        try:
            np.testing.assert_array_equal(ckpt.lookup("user", ids), now)
        finally:
            ckpt.close()
    finally:
        store.close()
