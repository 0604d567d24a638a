import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (the 'torch' extra)")
