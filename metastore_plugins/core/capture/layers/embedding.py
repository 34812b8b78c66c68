"""``nn.Embedding``: the prefix is the token ids, ``grad W_i[v] = sum_{t: ids_i[t] = v} D_i[t]``.

Ids with a batch dimension of one, or 1-D ids, may be broadcast over the batch: Hugging
Face models look up position ids ``(1, T)`` (nanoGPT ``(T,)``) and add the result to
``(B, T, d)`` token embeddings. The gradient reaching the embedding's output is then
already summed over samples, so the suffix is taken where it is still per sample: at
the additions that consume the output (found in the autograd graph once the forward of
the session's model returns), with the ids expanded to the batch. If the output has any
other use, its own gradient is used: right for a genuine batch of one; for a broadcast,
the record's batch size is 1 (or T) and ``per_sample_gradients()`` refuses the mix.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture.records import LayerRecord, as_computed, nonzero_rows
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture


def embedding_rows_record(
    layer: str,
    ids: Tensor,
    suffix: Tensor,
    sample: Tensor,
    position: Tensor,
    batch: int,
    weight_shape: tuple[int, ...],
    params: dict[str, str],
    keep: Tensor | None = None,
) -> LayerRecord:
    """The ``"embedding"`` record of candidate rows ``ids (R,)``, ``suffix (R, d)``, ``sample (R,)``, ``position (R,)``.

    ``grad W_i[v] = sum_{r: sample_r = i, ids_r = v} suffix[r]``; ``sample`` must be ascending. Rows whose
    suffix is exactly zero, and rows where ``keep`` (bool ``(R,)``) is False, are dropped.
    """
    kept = nonzero_rows(suffix)  # (R,)
    if keep is not None:
        kept &= keep
    rows = kept.nonzero().squeeze(1)  # (R_kept,)
    return LayerRecord(
        layer=layer,
        kind="embedding",
        batch_size=batch,
        params=params,
        param_shapes={"weight": weight_shape},
        tensors={
            "ids": ids.index_select(0, rows).long(),
            "suffix": as_computed(suffix.index_select(0, rows), suffix.dtype),
            "sample": sample.index_select(0, rows).int(),
            "position": position.index_select(0, rows).int(),
        },
    )


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
    keep = flat_ids.ne(embedding.padding_idx) if embedding.padding_idx is not None else None  # (B*T,)
    rows = torch.arange(batch * tokens, device=flat_ids.device)  # (B*T,)
    sample, position = torch.div(rows, tokens, rounding_mode="floor"), torch.remainder(rows, tokens)
    shape = tuple(embedding.weight.shape)
    return [embedding_rows_record(layer, flat_ids, suffix, sample, position, batch, shape, params, keep)]


@register_capture(nn.Embedding, params=("weight",))
def capture_embedding(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.Embedding`` (``padding_idx`` respected)."""
    if module.scale_grad_by_freq:
        ctx.unsupported(
            f"nn.Embedding '{ctx.name}' uses scale_grad_by_freq=True, which mixes samples' gradients "
            "by batch-wide token counts; per-sample gradients are not captured for it. "
            "Set scale_grad_by_freq=False to capture it."
        )
        return
    ids = ctx.batch_first(first_input(args, kwargs)).detach()  # (B, ...)
    params = ctx.param_names(module)
    maybe_broadcast = ids.dim() == 1 or ids.shape[0] == 1  # position ids (T,) or (1, T)
    if maybe_broadcast and ctx.batch_dim == 0 and isinstance(output, Tensor) and output.grad_fn is not None:
        at_consumers: list[bool] = []  # [True]: the additions consuming the output were hooked instead of it

        def hook_consumers(outputs: list[Tensor]) -> None:
            at_consumers.append(_hook_consumers(module, ctx, ids, output, outputs, params))

        def records(grad: Tensor) -> list[LayerRecord]:
            if not at_consumers:
                ctx.unsupported(
                    f"nn.Embedding '{ctx.name}' was called with ids of shape {tuple(ids.shape)}, which may be "
                    "broadcast over the batch, and the forward of the model the session is attached to did not "
                    "return before backward. Call that model itself, or pass ids with one row per sample."
                )
                return []
            return [] if at_consumers[0] else embedding_records(module, ctx.name, ids, grad, params)  # type: ignore[arg-type]

        ctx.after_model_forward(hook_consumers)
        ctx.on_output_grad(output, records)
        return
    ctx.on_output_grad(output, lambda grad: embedding_records(module, ctx.name, ids, grad, params))  # type: ignore[arg-type]


def find_consumers(outputs: list[Tensor], node: Any) -> list[Any]:
    """Nodes of the autograd graph of ``outputs`` that take ``node``'s output, once per use."""
    consumers: list[Any] = []
    queue, seen = deque(t.grad_fn for t in outputs), {node}
    while queue:
        current = queue.popleft()
        if current is None or current in seen:
            continue
        seen.add(current)
        parents = [parent for parent, _ in current.next_functions]
        consumers += [current for parent in parents if parent is node]
        queue.extend(parents)
    return consumers


def _per_sample_ids(ids: Tensor, shape: tuple[int, ...], grad: Tensor) -> Tensor | None:
    """Ids ``(B, ...)`` matching ``grad``, the gradient of a sum to which an output of ``shape`` was added."""
    if tuple(grad.shape) == shape:  # not broadcast
        return ids
    if grad.dim() == len(shape) + 1 and tuple(grad.shape[1:]) == shape:  # (T, d) added to (B, T, d)
        return ids.unsqueeze(0).expand(grad.shape[0], *ids.shape)
    if ids.shape[0] == 1 and grad.dim() == len(shape) and tuple(grad.shape[1:]) == shape[1:]:  # (1, T, d) to (B, T, d)
        return ids.expand(grad.shape[0], *ids.shape[1:])
    return None


def _hook_consumers(
    module: nn.Module, ctx: LayerContext, ids: Tensor, output: Tensor, outputs: list[Tensor], params: dict[str, str]
) -> bool:
    """Take the suffix of maybe-broadcast ids at the additions consuming the output, where it is per sample.

    Returns whether it did; it does not when the output has another use (its own gradient is then used).
    """
    consumers = find_consumers(outputs, output.grad_fn)
    adds = [c for c in consumers if type(c).__name__ == "AddBackward0" and c._saved_alpha == 1]
    if not consumers or len(adds) < len(consumers):
        return False
    shape = tuple(output.shape)

    def records(grad: Tensor) -> list[LayerRecord]:
        per_sample = _per_sample_ids(ids, shape, grad)  # grad: (B, ..., d), the output's before the sum over samples
        if per_sample is None:
            ctx.unsupported(
                f"nn.Embedding '{ctx.name}' output {shape} is broadcast to {tuple(grad.shape)}, which capture "
                "cannot split per sample. Pass ids with one row per sample (e.g. position_ids of shape (B, T))."
            )
            return []
        return embedding_records(module, ctx.name, per_sample, grad, params)  # type: ignore[arg-type]

    for add in adds:
        ctx.on_node_grad(add, records)
    return True
