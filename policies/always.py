"""Admit everything: a plain cache."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore.policy import AdmissionPolicy

__all__ = ["AlwaysAdmission"]


@final
class AlwaysAdmission(AdmissionPolicy):
    """Every id may enter.

    Args:
        seed: kept for the common interface; unused.
    """

    name: ClassVar[str] = "always"

    def admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        # docstring inherited
        return np.ones(len(ids), dtype=bool)

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"seed": self.seed}
