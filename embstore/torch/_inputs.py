"""Checks of the torch adapter's inputs, done before anything reaches the store.

Each function turns torch.nn.EmbeddingBag-style arguments into numpy arrays the store takes,
or raises an `embstore.errors` class saying what was wrong; nothing is looked up or changed
before every check has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import DeviceMismatchError, EmbstoreError, InvalidIdsError, InvalidValuesError

__all__ = ["BagInput", "bag_input", "check_tensor", "flat_ids", "integer_tensor",
           "jagged_input"]

# the dtypes whose elements are whole numbers; quantized dtypes (quint8, ...) and bit
# containers (bits8, ...) are neither floating nor complex, yet hold no plain integers
_INTEGER_DTYPES = frozenset(
    d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                getattr(torch, "uint64", None))  # torch >= 2.3 has unsigned 16 to 64-bit
    if d is not None)


@dataclass(frozen=True)
class BagInput:
    """One batch of bags, checked.

    Attributes:
        ids: int64[N], every id of every bag, bag after bag (a view of the caller's tensor
            where it is already int64 on the CPU: read, never written).
        offsets: int64[B + 1], bag b holds ``ids[offsets[b]:offsets[b + 1]]``.
        per_sample_weights: float[N] on the module's device, or None.
    """

    ids: np.ndarray
    offsets: np.ndarray
    per_sample_weights: torch.Tensor | None

    @property
    def num_bags(self) -> int:
        """B, the number of bags."""
        return len(self.offsets) - 1


def check_tensor(what: str, tensor: torch.Tensor, device: torch.device,
                 error: type[EmbstoreError] = InvalidIdsError) -> None:
    """Refuse a tensor the store cannot read as a plain array, or one not on `device`.

    Every tensor a module is given passes here before anything reads it: sparse, quantized
    and nested tensors, and meta ones (which hold no data), would otherwise fail further on
    in torch's own reshape or .numpy(), with torch's errors.

    Raises:
        `error`: a tensor that is sparse (any layout but torch.strided), quantized, nested or
            on the meta device.
        DeviceMismatchError: a tensor on another device than `device` (the module's).
    """
    if tensor.is_nested:
        kind, fix = "a nested tensor", "give it flat, with offsets or lengths marking the bags"
    elif tensor.layout != torch.strided:
        kind, fix = f"a tensor of layout {tensor.layout}", "convert it with .to_dense()"
    elif tensor.is_quantized:
        kind, fix = (f"a quantized tensor (dtype {tensor.dtype})",
                     "convert it with .int_repr() (ids) or .dequantize() (weights)")
    elif tensor.is_meta:
        kind, fix = "on the meta device (it holds no data)", "give one on a real device"
    else:
        if tensor.device != device:
            raise DeviceMismatchError(
                f"{what} is on {tensor.device} but the module is on {device}; move it with "
                f".to({str(device)!r}) or move the module"
            )
        return
    raise error(f"{what} is {kind}; the module reads dense (torch.strided) tensors with "
                f"data: {fix}")


def flat_ids(what: str, tensor: object, device: torch.device) -> np.ndarray:
    """The ids in `tensor` (an integer tensor of any shape) as a C-contiguous int64[N]."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidIdsError(f"{what} must be a torch.Tensor of integer ids, got "
                              f"{type(tensor).__name__}")
    check_tensor(what, tensor, device)
    if not integer_tensor(tensor):
        raise InvalidIdsError(
            f"{what} must hold integer ids, got dtype {tensor.dtype}; convert whole-number "
            "ids with .long()"
        )
    ids = tensor.detach().reshape(-1)
    if ids.device.type != "cpu":
        ids = ids.cpu()
    if ids.dtype == getattr(torch, "uint64", None):  # torch >= 2.3 has unsigned 64-bit
        wide = ids.numpy()
        big = np.flatnonzero(wide > np.iinfo(np.int64).max)
        if len(big):
            raise InvalidIdsError(f"{what} holds id {int(wide[big[0]])}, beyond the largest "
                                  f"id a table can hold ({np.iinfo(np.int64).max})")
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    return np.ascontiguousarray(ids.numpy())


def integer_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds plain integers (bool, quantized and bit dtypes do not)."""
    return tensor.dtype in _INTEGER_DTYPES


def _offsets(offsets: object, n: int, include_last_offset: bool,
             device: torch.device) -> np.ndarray:
    if not isinstance(offsets, torch.Tensor):
        raise InvalidIdsError(f"offsets must be a 1-D integer torch.Tensor, got "
                              f"{type(offsets).__name__}")
    check_tensor("offsets", offsets, device)
    if offsets.dim() != 1 or not integer_tensor(offsets):
        raise InvalidIdsError(
            f"offsets must be a 1-D integer tensor, got dtype {offsets.dtype} and shape "
            f"{tuple(offsets.shape)}"
        )
    off = offsets.detach().cpu().to(torch.int64).numpy()
    if include_last_offset:
        if len(off) < 1:
            raise InvalidIdsError("with include_last_offset=True, offsets needs at least one "
                                  "element (the end of the input)")
        if off[-1] != n:
            raise InvalidIdsError(
                f"with include_last_offset=True the last offset must equal the input's "
                f"length {n}, got {int(off[-1])}"
            )
    else:
        off = np.append(off, n)
    if len(off) == 1 and n:
        # torch returns no bags here, as if the ids were not there; they would be looked up
        # and updated by no bag's gradient, so the caller must mean something else
        raise InvalidIdsError(f"offsets hold no bag but the input has {n} ids; give each bag's "
                              "start (offsets[0] = 0)")
    if len(off) > 1 and off[0] != 0:
        raise InvalidIdsError(f"offsets[0] must be 0 (the first bag starts at the input's "
                              f"start), got {int(off[0])}")
    steps = np.diff(off)
    if len(steps) and steps.min() < 0:
        bad = int(np.flatnonzero(steps < 0)[0])
        raise InvalidIdsError(
            f"offsets must be non-decreasing and within the input (length {n}); offset "
            f"{bad + 1} is {int(off[bad + 1])} after {int(off[bad])}"
        )
    return np.ascontiguousarray(off)


def _weights(per_sample_weights: object, shape: tuple[int, ...], device: torch.device,
             dtype: torch.dtype, what: str = "per_sample_weights") -> torch.Tensor:
    w = per_sample_weights
    if not isinstance(w, torch.Tensor):
        raise InvalidValuesError(f"{what} must be a torch.Tensor, got {type(w).__name__}")
    check_tensor(what, w, device, InvalidValuesError)
    if w.dtype != dtype:
        raise InvalidValuesError(f"{what} must have the table's dtype {dtype}, got {w.dtype}")
    if tuple(w.shape) != shape:
        raise InvalidValuesError(
            f"{what} must have the shape of the ids, {shape} (one weight per id), "
            f"got {tuple(w.shape)}"
        )
    return w.reshape(-1)


def bag_input(input: object, offsets: object, per_sample_weights: object, *, mode: str,
              include_last_offset: bool, device: torch.device,
              dtype: torch.dtype) -> BagInput:
    """Check torch.nn.EmbeddingBag's forward arguments and return them as a `BagInput`.

    Args:
        input: LongTensor [N] with `offsets`, or [B, L] (B bags of L ids) without.
        offsets: LongTensor [B] (or [B + 1] with `include_last_offset`), or None.
        per_sample_weights: tensor shaped like `input`, "sum" mode only, or None.
        mode: the pooling mode ("sum", "mean", "max").
        include_last_offset: `offsets` ends with the input's length.
        device: the module's device; every tensor must be on it.
        dtype: the table's dtype, which per_sample_weights must have.

    Raises:
        InvalidIdsError: float ids, a wrong shape, bad offsets, ids or offsets that are not a
            dense tensor with data (sparse, quantized, nested, on the meta device).
        InvalidValuesError: per_sample_weights of the wrong shape, dtype or kind, or with a
            mode other than "sum".
        DeviceMismatchError: an argument on another device than the module.
    """
    if not isinstance(input, torch.Tensor):
        raise InvalidIdsError(f"input must be a torch.Tensor of ids, got {type(input).__name__}")
    check_tensor("input", input, device)  # before its shape is read: a nested one has none
    if input.dim() == 2:
        if offsets is not None:
            raise InvalidIdsError("a 2-D input is a batch of fixed-length bags; offsets must be "
                                  "None then (pass a 1-D input to use offsets)")
        b, length = input.shape
        ids = flat_ids("input", input, device)
        off = np.arange(b + 1, dtype=np.int64) * length  # [B, 0]: B empty bags
    elif input.dim() == 1:
        if offsets is None:
            raise InvalidIdsError("a 1-D input needs offsets (where each bag starts); or pass "
                                  "a 2-D input [bags, ids per bag]")
        ids = flat_ids("input", input, device)
        off = _offsets(offsets, len(ids), include_last_offset, device)
    else:
        raise InvalidIdsError(f"input must be 1-D (with offsets) or 2-D (bags x ids), got "
                              f"shape {tuple(input.shape)}")
    weights = None
    if per_sample_weights is not None:
        if mode != "sum":
            raise InvalidValuesError(
                f"per_sample_weights are only supported with mode='sum' (as in torch), "
                f"got mode={mode!r}"
            )
        weights = _weights(per_sample_weights, tuple(input.shape), device, dtype)
    return BagInput(ids, off, weights)


def jagged_input(feature: str, values: object, lengths: object, device: torch.device,
                 dtype: torch.dtype, weights: object = None) -> BagInput:
    """Check one feature of a jagged batch: `values` LongTensor [N], `lengths` [B]."""
    ids = flat_ids(f"feature {feature!r} values", values, device)
    assert isinstance(values, torch.Tensor)  # flat_ids refused anything else
    if values.dim() != 1:
        raise InvalidIdsError(f"feature {feature!r}: values must be a 1-D tensor of ids, got "
                              f"shape {tuple(values.shape)}")
    if not isinstance(lengths, torch.Tensor):
        raise InvalidIdsError(f"feature {feature!r}: lengths must be a 1-D integer tensor, got "
                              f"{type(lengths).__name__}")
    check_tensor(f"feature {feature!r} lengths", lengths, device)
    if lengths.dim() != 1 or not integer_tensor(lengths):
        raise InvalidIdsError(f"feature {feature!r}: lengths must be a 1-D integer tensor, got "
                              f"dtype {lengths.dtype} and shape {tuple(lengths.shape)}")
    lens = lengths.detach().cpu().to(torch.int64).numpy()
    if len(lens) and lens.min() < 0:
        raise InvalidIdsError(f"feature {feature!r}: lengths must be >= 0, got "
                              f"{int(lens.min())}")
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    if off[-1] != len(ids):
        raise InvalidIdsError(f"feature {feature!r}: lengths add up to {int(off[-1])} but "
                              f"there are {len(ids)} values")
    w = None if weights is None else _weights(weights, (len(ids),), device, dtype,
                                              f"feature {feature!r} weights")
    return BagInput(ids, off, w)
