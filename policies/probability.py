"""Admit each id with a fixed probability."""

from __future__ import annotations

from typing import Any, ClassVar, final

import numpy as np

from embstore.policy import AdmissionPolicy, real_setting

__all__ = ["ProbabilityAdmission"]


@final
class ProbabilityAdmission(AdmissionPolicy):
    """Admit each distinct id of a call with probability `p`, drawn from the seeded Generator.

    A frequent id is seen often, so it gets in soon; a one-off id mostly does not. The draws
    are taken for the call's distinct ids in sorted order, so the same seed and the same calls
    give the same answers, and duplicates in a call share one.

    Args:
        p: admission probability in [0, 1].
        seed: seeds the numpy Generator.

    Raises:
        ConfigError: `p` is not a number in [0, 1].
    """

    name: ClassVar[str] = "probability"

    def __init__(self, *, p: float = 0.1, seed: int = 0) -> None:
        # a real number: True would pass 0 <= p <= 1 as 1 and admit everything
        p = real_setting("ProbabilityAdmission", "p", p, 0, 1)
        super().__init__(seed=seed)
        self.p = float(p)

    def _admit(self, ids: np.ndarray, now: float) -> np.ndarray:
        uniq, inverse = np.unique(ids, return_inverse=True)
        return (self.rng.random(len(uniq)) < self.p)[inverse.reshape(-1)]

    def config(self) -> dict[str, Any]:
        # docstring inherited
        return {"p": self.p, "seed": self.seed}
