"""``nn.EmbeddingBag``: one bag per sample, the prefix is the bag's ids.

Bag ``i`` (row ``i`` of the output, sample ``i``) holds entries ``j`` with ids ``v_j``; ``D_i`` ``(d,)``
is the gradient of its output row. Entries at ``padding_idx`` belong to no bag. Then

- ``sum``:  ``out_i = sum_j w_j W[v_j]`` (``w_j`` the ``per_sample_weights``, else 1):
  ``grad W_i[v] = sum_{j: v_j = v} w_j D_i``;
- ``mean``: ``out_i = (1 / n_i) sum_j W[v_j]`` (``n_i`` entries, empty bags give zeros):
  ``grad W_i[v] = sum_{j: v_j = v} D_i / n_i``;
- ``max``:  ``out_i[k] = W[m_i[k], k]`` with ``m_i[k]`` the id of the bag's largest entry in
  dimension ``k``: ``grad W_i[v, k] = D_i[k] if v = m_i[k] else 0``.

Records are of the ``"embedding"`` kind (``grad W_i[v] = sum_{r: sample_r = i, ids_r = v} suffix[r]``):
for ``sum``/``mean`` one row per entry (``suffix = w_j D_i`` or ``D_i / n_i``, ``position`` = the
entry's index in its bag); for ``max`` one row per distinct id of ``m_i`` (``suffix = D_i`` on the
dimensions that id wins, zero elsewhere; ``position`` = the row's rank within the bag). Input is
2-D ``(B, N)`` (a bag per row) or 1-D with ``offsets`` (``include_last_offset`` either way).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture.build import as_computed
from metastore_plugins.core.capture.layers.embedding import embedding_rows_record
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.records import LayerRecord

_MODES = {"sum": 0, "mean": 1, "max": 2}


def flat_bags(ids: Tensor, offsets: Tensor | None, include_last_offset: bool) -> tuple[Tensor, Tensor, bool]:
    """The input as ``F.embedding_bag`` reads it: flat ids ``(N,)``, offsets, ``include_last_offset``.

    A 2-D input ``(B, n)`` is ``B`` bags of ``n`` ids.
    """
    if ids.dim() == 2:
        return ids.reshape(-1), torch.arange(ids.shape[0], device=ids.device) * ids.shape[1], False
    if offsets is None:
        raise ConfigError("nn.EmbeddingBag was called with 1-D input and no offsets")
    return ids, offsets, include_last_offset


def bag_entries(ids: Tensor, offsets: Tensor, include_last_offset: bool) -> tuple[Tensor, Tensor, int]:
    """For flat ids ``(N,)``: the bag of each entry ``(N,)`` (-1 outside every bag), its index in its bag, ``B``."""
    starts = offsets[:-1] if include_last_offset else offsets  # (B,)
    end = int(offsets[-1]) if include_last_offset else ids.numel()
    entry = torch.arange(ids.numel(), device=ids.device)  # (N,)
    bag = torch.searchsorted(starts.to(entry.dtype), entry, right=True) - 1  # (N,)
    position = entry - starts[bag.clamp_min(0)]  # (N,)
    inside = (bag >= 0) & (entry < end)
    return torch.where(inside, bag, -1), position, starts.numel()


def valid_entries(
    bags: nn.EmbeddingBag, ids: Tensor, offsets: Tensor, include_last_offset: bool
) -> tuple[Tensor, Tensor, int, Tensor]:
    """Bag (0 outside every bag) and position of each of the flat ids ``(N,)``, ``B``, and whether each counts.

    An entry counts when it is in a bag and not at ``padding_idx``.
    """
    bag, position, batch = bag_entries(ids, offsets, include_last_offset)
    valid = bag >= 0  # (N,)
    if bags.padding_idx is not None:
        valid &= ids.ne(bags.padding_idx)
    return bag.clamp_min(0), position, batch, valid


def bag_sum_records(
    bags: nn.EmbeddingBag,
    layer: str,
    ids: Tensor,
    offsets: Tensor,
    include_last_offset: bool,
    weights: Tensor | None,
    grad_output: Tensor,
    params: dict[str, str],
) -> list[LayerRecord]:
    """``sum``/``mean`` mode: one row per entry, ``suffix = w_j D_i`` (``D_i / n_i`` for ``mean``).

    Args:
        ids: flat ``(N,)`` with ``offsets`` ``(B,)`` (``(B + 1,)`` with ``include_last_offset``): :func:`flat_bags`.
        weights: ``per_sample_weights`` ``(N,)`` (``sum`` mode), or None.
        grad_output: ``(B, d)``.
    """
    bag, position, batch, valid = valid_entries(bags, ids, offsets, include_last_offset)  # (N,) each
    grad = as_computed(grad_output, grad_output.dtype)  # (B, d) fp32
    coefficient = grad.new_ones(ids.shape) if weights is None else weights.to(grad.dtype)  # (N,)
    if bags.mode == "mean":
        counts = torch.bincount(bag[valid], minlength=batch).clamp_min(1)  # (B,)
        coefficient = coefficient / counts[bag]
    suffix = grad[bag] * coefficient.unsqueeze(1)  # (N, d)
    shape = tuple(bags.weight.shape)
    return [embedding_rows_record(layer, ids, suffix, bag, position, batch, shape, params, valid)]


def bag_max_records(
    bags: nn.EmbeddingBag, layer: str, max_ids: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """``max`` mode: ``max_ids`` ``(B, d)`` (the id each bag takes each dimension from, -1 for an empty bag).

    One row per distinct ``(bag, id)``: ``suffix[k] = D_i[k]`` where ``max_ids[i, k] = id``, else 0.
    """
    batch, dim = max_ids.shape
    vocab = bags.weight.shape[0]
    grad = as_computed(grad_output, grad_output.dtype)  # (B, d) fp32
    sample = torch.arange(batch, device=max_ids.device).unsqueeze(1).expand(batch, dim)  # (B, d)
    column = torch.arange(dim, device=max_ids.device).expand(batch, dim)  # (B, d)
    won = max_ids >= 0  # (B, d)
    keys, inverse = torch.unique(sample[won] * vocab + max_ids[won], return_inverse=True)  # (U,), (W,)
    suffix = grad.new_zeros(keys.numel(), dim)  # (U, d)
    suffix[inverse, column[won]] = grad[won]
    row_sample = torch.div(keys, vocab, rounding_mode="floor")  # (U,) ascending: keys are sorted
    counts = torch.bincount(row_sample, minlength=batch)  # (B,)
    position = torch.arange(keys.numel(), device=keys.device) - (torch.cumsum(counts, 0) - counts)[row_sample]
    ids = torch.remainder(keys, vocab)  # (U,)
    return [embedding_rows_record(layer, ids, suffix, row_sample, position, batch, (vocab, dim), params)]


def max_ids_of(bags: nn.EmbeddingBag, ids: Tensor, offsets: Tensor, include_last_offset: bool) -> Tensor:
    """``(B, d)``: the id each bag's output takes each dimension from (PyTorch's own choice among ties), -1 if empty."""
    bag, _, batch, valid = valid_entries(bags, ids, offsets, include_last_offset)
    with torch.no_grad():
        _, _, _, max_ids = torch.embedding_bag(
            bags.weight, ids, offsets, False, _MODES["max"], False, None, include_last_offset, bags.padding_idx
        )  # (B, d); an empty bag reads 0
    empty = torch.bincount(bag[valid], minlength=batch).eq(0)  # (B,)
    return max_ids.masked_fill(empty.unsqueeze(1), -1)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Tensor | None:
    return args[index] if len(args) > index else kwargs.get(name)


@register_capture(nn.EmbeddingBag, params=("weight",))
def capture_embedding_bag(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.EmbeddingBag`` (modes, offsets, ``per_sample_weights``, ``padding_idx``)."""
    if cast(nn.EmbeddingBag, module).scale_grad_by_freq:
        ctx.unsupported(
            f"nn.EmbeddingBag '{ctx.name}' uses scale_grad_by_freq=True, which mixes samples' gradients "
            "by batch-wide id counts; per-sample gradients are not captured for it. "
            "Set scale_grad_by_freq=False to capture it."
        )
        return
    bags = cast(nn.EmbeddingBag, module)
    offsets, weights = _argument(args, kwargs, 1, "offsets"), _argument(args, kwargs, 2, "per_sample_weights")
    ids, offsets, last = flat_bags(
        first_input(args, kwargs).detach(),  # bags are the output's rows, whatever batch_dims says
        offsets.detach() if offsets is not None else None,
        bags.include_last_offset,
    )  # (N,), (B,) or (B + 1,)
    weights = weights.detach().reshape(-1) if weights is not None else None  # (N,)
    params = ctx.param_names(module)
    max_ids = max_ids_of(bags, ids, offsets, last) if bags.mode == "max" else None  # (B, d)
    batch_dim = ctx.batch_dim

    def records(grad: Tensor) -> list[LayerRecord]:
        grad = grad.movedim(0, batch_dim) if batch_dim else grad  # (B, d): undo the session's move
        if max_ids is not None:
            return bag_max_records(bags, ctx.name, max_ids, grad, params)
        return bag_sum_records(bags, ctx.name, ids, offsets, last, weights, grad, params)

    ctx.on_output_grad(output, records)
