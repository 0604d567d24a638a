"""The vectorised update rules behind `embstore.optim`: numpy only, in place, in a fixed order.

Each function updates one batch of distinct rows: `weights` [N, dim] and the state views are
updated in place (they may be strided views into the stored rows); `grads` [N, dim] is read,
never written, because it may be the caller's buffer.

Determinism: every operation is an IEEE elementwise operation (+, -, *, /, sqrt, max, each
correctly rounded) or numpy's pairwise sum along one contiguous row, whose order depends on
the row length alone. No libm transcendental is used: `beta ** step` is computed by repeated
squaring in float64, because `pow` may differ by an ulp between libm versions and between
numpy's SIMD body and scalar tail of one array. So the same inputs give bit-identical results
on every machine, whatever the batch position of a row.

Parity: scalars are cast to the table dtype once, as torch casts a Python scalar to the tensor
dtype, and the operations follow torch.optim's order. torch's CPU kernels fuse some
multiply-adds (`lerp`, `add(alpha=)`) that numpy rounds twice, so results may differ from
torch in the last bit of an element, never more.
"""

from __future__ import annotations

import numpy as np

__all__ = ["adagrad", "adam", "power_by_squaring", "rowwise_adagrad"]


def power_by_squaring(base: float, exponent: np.ndarray) -> np.ndarray:
    """`base ** exponent` in float64 for non-negative integer-valued `exponent` [N].

    Repeated squaring uses only multiplications, so it is bit-reproducible everywhere; its
    relative error (a few float64 ulps) vanishes when the result is rounded to float32.
    """
    n = exponent.astype(np.int64)
    result = np.ones(len(n), dtype=np.float64)
    power = np.float64(base)
    top = int(n.max()) if len(n) else 0
    for bit in range(top.bit_length()):
        odd = (n >> bit) & 1
        result = np.where(odd == 1, result * power, result)
        power = power * power
    return result


def adagrad(weights: np.ndarray, acc: np.ndarray, grads: np.ndarray, *, lr: float, eps: float,
            weight_decay: float) -> None:
    """torch.optim.Adagrad's dense step (lr_decay 0) on rows: ``acc`` [N, dim] is the sum of g^2."""
    t = weights.dtype.type
    g = grads + t(weight_decay) * weights if weight_decay else grads
    sq = g * g
    acc += sq
    std = np.sqrt(acc)
    std += t(eps)
    update = g * t(lr)  # torch: w + (-lr * g) / std; negation is exact, so this is the same
    update /= std
    weights -= update


def rowwise_adagrad(weights: np.ndarray, acc: np.ndarray, grads: np.ndarray, *, lr: float,
                    eps: float, weight_decay: float, decoupled: bool) -> None:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD step; ``acc`` [N] holds one sum of mean(g^2) per row.

    With L2 decay, the decayed gradient ``g + wd * w`` feeds the accumulator only, and the
    weights get ``(1 - m * wd) * w - m * g`` with ``m = lr / (sqrt(acc) + eps)``, which is
    FBGEMM's rounding of ``w - m * (g + wd * w)``. Decoupled decay uses ``1 - lr * wd``.
    """
    t = weights.dtype.type
    l2 = bool(weight_decay) and not decoupled
    decayed = grads + t(weight_decay) * weights if l2 else grads
    sq = decayed * decayed
    mean = np.add.reduce(sq, axis=1)
    mean /= t(weights.shape[1])
    acc += mean
    multiplier = np.sqrt(acc)
    multiplier += t(eps)
    np.divide(t(lr), multiplier, out=multiplier)
    if l2:
        correction = t(1) - multiplier * t(weight_decay)
        weights *= correction[:, None]
    elif weight_decay:
        weights *= t(1) - t(lr) * t(weight_decay)
    update = grads * multiplier[:, None]
    weights -= update


def adam(weights: np.ndarray, m: np.ndarray, v: np.ndarray, vmax: np.ndarray | None,
         steps: np.ndarray, grads: np.ndarray, *, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, decoupled: bool) -> None:
    """torch.optim.Adam's step (AdamW's with `decoupled`) with a step count per row.

    ``m``, ``v`` (and ``vmax`` for amsgrad) are [N, dim]; ``steps`` [N] is the row's count of
    updates so far, a float of the table dtype that this call increments.
    """
    t = weights.dtype.type
    if weight_decay and decoupled:
        weights *= t(1.0 - lr * weight_decay)
    g = grads + t(weight_decay) * weights if weight_decay and not decoupled else grads
    # float32 + 1 saturates at 2**24, exactly as torch's own float32 step tensor does.
    steps += t(1)

    # m.lerp_(g, 1 - beta1), with torch's two formulas (it picks by the weight's size).
    w1 = t(1.0 - beta1)
    diff = g - m
    if abs(w1) < 0.5:
        diff *= w1
        m += diff
    else:
        diff *= t(1) - w1
        np.subtract(g, diff, out=m)

    # v.mul_(beta2).addcmul_(g, g, value=1 - beta2): torch multiplies value * g first.
    v *= t(beta2)
    sq = g * t(1.0 - beta2)
    sq *= g
    v += sq
    if vmax is not None:
        np.maximum(vmax, v, out=vmax)
        second = vmax
    else:
        second = v

    # Bias corrections per row, in float64 like torch's Python floats, then cast once.
    bc1 = 1.0 - power_by_squaring(beta1, steps)
    bc2 = 1.0 - power_by_squaring(beta2, steps)
    step_size = (lr / bc1).astype(weights.dtype)[:, None]
    bc2_sqrt = np.sqrt(bc2).astype(weights.dtype)[:, None]
    denom = np.sqrt(second)
    denom /= bc2_sqrt
    denom += t(eps)
    update = m * step_size  # torch: w + (-step_size * m) / denom
    update /= denom
    weights -= update
