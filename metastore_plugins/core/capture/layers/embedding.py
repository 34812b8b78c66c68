"""``nn.Embedding``: the prefix is the token ids, ``grad W_i[v] = sum_{t: ids_i[t] = v} D_i[t]``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture


def embedding_records(
    embedding: nn.Embedding, layer: str, ids: Tensor, grad_output: Tensor, params: dict[str, str]
) -> list[LayerRecord]:
    """Records for token ids ``(B, ...)`` and output grads ``(B, ..., d)``.

    Rows at ``padding_idx`` (whose gradient PyTorch defines as zero) and rows whose
    gradient is exactly zero are dropped.
    """
    batch = ids.shape[0]
    flat_ids = ids.reshape(batch, -1)  # (B, T)
    tokens = flat_ids.shape[1]
    flat_ids = flat_ids.reshape(-1)  # (B*T,)
    suffix = grad_output.reshape(batch * tokens, -1)  # (B*T, d)
    keep = suffix.ne(0).any(dim=1)  # (B*T,)
    if embedding.padding_idx is not None:
        keep &= flat_ids.ne(embedding.padding_idx)
    rows = keep.nonzero().squeeze(1)  # (R,)
    record = LayerRecord(
        layer=layer,
        kind="embedding",
        batch_size=batch,
        params=params,
        param_shapes={"weight": tuple(embedding.weight.shape)},
        tensors={
            "ids": flat_ids.index_select(0, rows).long(),
            "suffix": suffix.index_select(0, rows).float(),
            "sample": torch.div(rows, tokens, rounding_mode="floor").int(),
            "position": torch.remainder(rows, tokens).int(),
        },
    )
    return [record]


@register_capture(nn.Embedding, params=("weight",))
def capture_embedding(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.Embedding`` (``padding_idx`` respected)."""
    if module.scale_grad_by_freq:  # type: ignore[union-attr]
        ctx.unsupported(
            f"nn.Embedding '{ctx.name}' uses scale_grad_by_freq=True, which mixes samples' gradients "
            "by batch-wide token counts; per-sample gradients are not captured for it. "
            "Set scale_grad_by_freq=False to capture it."
        )
        return
    ids = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ...)
    params = ctx.param_names(module)
    ctx.on_output_grad(output, lambda grad: embedding_records(module, ctx.name, ids, grad, params))  # type: ignore[arg-type]
