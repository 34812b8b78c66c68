"""Compact encodings of record tensors: pure functions, no I/O.

Floating tensors (prefix, suffix, dense gradients) are encoded *per row* (the
first dimension: one kept token row, or one sample of a dense gradient):

``fp32``  exact.
``fp16``  ``q = x / s`` in float16 with ``s = max |x_row|`` (float32); scaling keeps
          small suffix values (1e-8 and below are common) out of fp16's underflow range.
``bf16``  ``x`` in bfloat16 (float32's range, 8 significant bits); no scale needed.
``int8``  ``q = round(x / s)`` with ``s = max |x_row| / 127``.

Integer tensors (sample, position, token ids) are kept as int32.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

Encoding = Literal["fp32", "fp16", "bf16", "int8"]
ENCODINGS: tuple[str, ...] = get_args(Encoding)
DEFAULT_ENCODING: Encoding = "fp16"

_SCALE_SUFFIX = ".scale"
_ROW_SCALED = {"fp16": (torch.float16, 1.0), "int8": (torch.int8, 127.0)}


def check_encoding(encoding: str) -> Encoding:
    """Return ``encoding`` if known, else raise a ``ValueError`` listing the choices."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
    return encoding  # type: ignore[return-value]


def _row_scale(x: Tensor, top: float) -> Tensor:
    """``(R,)`` float32 per-row scale ``max |x_row| / top``; 1 for all-zero rows.

    ``max(max x, -min x)``: two reductions that allocate nothing (``|x|`` would copy ``x``).
    """
    if x.numel():
        rows = x.reshape(x.shape[0], -1)  # (R, n)
        peak = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())  # (R,); NaN rows stay NaN
    else:
        peak = x.new_zeros(x.shape[0])
    peak = peak.float() / top
    return torch.where(peak > 0, peak, torch.ones_like(peak))


def encode(key: str, tensor: Tensor, encoding: Encoding, *, owned: bool = False) -> dict[str, Tensor]:
    """Stored tensors of one record tensor: ``{key: data}`` plus ``{key.scale: (R,)}`` when scaled.

    ``owned``: the caller gives up ``tensor`` (a float32 one is scaled in place: one copy fewer).
    """
    tensor = tensor.detach()
    if not tensor.is_floating_point():  # copies: a shard never shares memory with the caller's tensors
        return {key: tensor.to(torch.int32, copy=True).contiguous()}
    if encoding == "fp32":
        return {key: tensor.to(torch.float32, copy=True).contiguous()}
    if encoding == "bf16":
        return {key: tensor.to(torch.bfloat16).contiguous()}
    dtype, top = _ROW_SCALED[encoding]
    scale = _row_scale(tensor, top)  # (R,)
    view = scale.view(-1, *([1] * (tensor.dim() - 1)))
    scaled = tensor.div_(view) if owned and tensor.dtype == torch.float32 else tensor.float() / view
    if dtype == torch.int8:
        scaled = scaled.round().clamp_(-127, 127)
    return {key: scaled.to(dtype).contiguous(), key + _SCALE_SUFFIX: scale.contiguous()}


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


def encode_many(tensors: Sequence[tuple[str, Tensor]], encoding: Encoding) -> dict[str, Tensor]:
    """:func:`encode` of many ``(key, tensor)`` pairs at once, with the same stored values.

    Tensors of one dtype and trailing shape are concatenated along rows, encoded in one call
    and split again: every encoding works row by row, so the result equals encoding each
    tensor alone, at a fraction of the per-call cost. The returned tensors are contiguous
    row slices of a few shared buffers (write them with a saver that accepts shared memory).
    """
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[tuple[str, Tensor]]] = {}
    out: dict[str, Tensor] = {}
    for key, tensor in tensors:
        groups.setdefault((tensor.dtype, tuple(tensor.shape[1:])), []).append((key, tensor.detach()))
    for members in groups.values():
        rows = [tensor.shape[0] for _, tensor in members]
        joined = encode("", torch.cat([tensor for _, tensor in members]), encoding, owned=True)  # {"": data, ".scale": (R,)}
        for suffix, stored in joined.items():
            for (key, _), part in zip(members, stored.split(rows)):
                out[key + suffix] = part
    return out


def encoded_nbytes(tensor: Tensor, encoding: Encoding) -> int:
    """Bytes :func:`encode` stores for ``tensor`` (data and row scales)."""
    if not tensor.is_floating_point() or encoding == "fp32":
        return tensor.numel() * 4
    if encoding == "bf16":
        return tensor.numel() * 2
    width = 2 if encoding == "fp16" else 1
    return tensor.numel() * width + tensor.shape[0] * 4
