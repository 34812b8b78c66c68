"""Compact encodings of record tensors: pure functions, no I/O.

Floating tensors (prefix, suffix, dense gradients) are encoded *per row* (the
first dimension: one kept token row, or one sample of a dense gradient):

``fp32``  exact.
``fp16``  ``q = x / s`` in float16 with ``s = max |x_row|`` (float32); scaling keeps
          small suffix values (1e-8 and below are common) out of fp16's underflow range.
``bf16``  ``x`` in bfloat16 (float32's range, 8 significant bits); no scale needed.
``int8``  ``q = round(x / s)`` with ``s = max |x_row| / 127``.

Integer tensors (sample, position, token ids) are kept as int32. Exact squared norms
(:data:`EXACT_KEYS`) are kept as float32 whatever the encoding: they are the store's exact answer
to self-influence and outliers, 4 bytes per sample and layer.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Literal, get_args

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError

Encoding = Literal["fp32", "fp16", "bf16", "int8"]
ENCODINGS: tuple[str, ...] = get_args(Encoding)
DEFAULT_ENCODING: Encoding = "fp16"

_SCALE_SUFFIX = ".scale"
#: Record tensors stored as float32 under every encoding.
EXACT_KEYS = frozenset({"sq_norm", "eigenvalues", "mean_eigenvalue"})
_ROW_SCALED = {"fp16": (torch.float16, 1.0), "int8": (torch.int8, 127.0)}
_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_encoding(encoding: str) -> Encoding:
    """Return ``encoding`` if known, else raise a ``ValueError`` listing the choices."""
    if encoding not in ENCODINGS:
        raise ConfigError(f"encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
    return encoding  # type: ignore[return-value]


def _row_scale(x: Tensor, top: float) -> Tensor:
    """``(R,)`` float32 per-row scale ``max |x_row| / top``; 1 for all-zero rows and rows holding NaN.

    ``max(max x, -min x)``: two reductions that allocate nothing (``|x|`` would copy ``x``).
    """
    if x.numel():
        rows = x.reshape(x.shape[0], -1)  # (R, n)
        peak = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())  # (R,); NaN where a row holds NaN
    else:
        peak = x.new_zeros(x.shape[0])
    peak = peak.float() / top
    return torch.where(peak > 0, peak, torch.ones_like(peak))


def stored_specs(key: str, tensor: Tensor, encoding: Encoding) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Stored key -> ``(dtype, shape)`` of what :func:`encode` makes of ``tensor``: data, and row scales when scaled."""
    shape = tuple(tensor.shape)
    if not tensor.is_floating_point():
        return {key: (torch.int32, shape)}
    if encoding in _ROW_SCALED:
        return {key: (_ROW_SCALED[encoding][0], shape), key + _SCALE_SUFFIX: (torch.float32, shape[:1])}
    return {key: (_PLAIN[encoding], shape)}


def encode_into(key: str, tensor: Tensor, encoding: Encoding, out: Mapping[str, Tensor]) -> None:
    """Write the encoding of ``tensor`` into ``out``, preallocated as :func:`stored_specs` says.

    ``tensor`` is only read: the scaled values go through one temporary of its size.
    """
    tensor = tensor.detach()
    data = out[key]
    if not tensor.is_floating_point() or encoding not in _ROW_SCALED:
        data.copy_(tensor)  # int32 ids, float32, or bfloat16 (round to nearest)
        return
    dtype, top = _ROW_SCALED[encoding]
    scale = _row_scale(tensor, top)  # (R,)
    scaled = tensor / scale.view(-1, *([1] * (tensor.dim() - 1)))  # float32, |values| <= top
    if dtype == torch.int8:
        scaled = scaled.round_().clamp_(-127, 127)
    data.copy_(scaled)
    out[key + _SCALE_SUFFIX].copy_(scale)


def encode(key: str, tensor: Tensor, encoding: Encoding) -> dict[str, Tensor]:
    """Stored tensors of one record tensor: ``{key: data}`` plus ``{key.scale: (R,)}`` when scaled."""
    out = {
        name: torch.empty(shape, dtype=dtype, device=tensor.device)
        for name, (dtype, shape) in stored_specs(key, tensor, encoding).items()
    }
    encode_into(key, tensor, encoding, out)
    return out


def decode(stored: dict[str, Tensor], key: str) -> Tensor:
    """Invert :func:`encode` for ``key`` (float tensors come back as float32, ids as int64)."""
    data = stored[key]
    if not data.is_floating_point() and data.dtype != torch.int8:
        return data.long()
    scale = stored.get(key + _SCALE_SUFFIX)
    if scale is None:
        return data.float()
    return data.float() * scale.view(-1, *([1] * (data.dim() - 1)))


def is_scale_key(key: str, stored: Collection[str]) -> bool:
    """Whether ``key`` holds the row scales of another key of ``stored``.

    A key that merely ends in ``.scale`` (the dense gradient of a parameter named ``scale``,
    ``grad.scale``) is data: it is a scale only when the key it scales is stored too.
    """
    return key.endswith(_SCALE_SUFFIX) and key[: -len(_SCALE_SUFFIX)] in stored


def encoded_nbytes(tensor: Tensor, encoding: Encoding) -> int:
    """Bytes :func:`encode` stores for ``tensor`` (data and row scales)."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in stored_specs("", tensor, encoding).values())
