"""Admit everything: a plain cache."""

from __future__ import annotations

from typing import ClassVar, final

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

    def _admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        return np.ones(len(ids), dtype=bool)
