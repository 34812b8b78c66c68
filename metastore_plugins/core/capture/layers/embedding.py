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

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture.build import as_computed, nonzero_rows
from metastore_plugins.core.capture.registry import LayerContext, first_input, register_capture
from metastore_plugins.core.records import LayerRecord


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
    maybe_reshaped = ids.dim() >= 2 and module not in _USED_PER_SAMPLE  # T5's (T_q, T_k) ids, permuted
    if (maybe_broadcast or maybe_reshaped) and ctx.batch_dim == 0 and isinstance(output, Tensor) and output.grad_fn:
        at_consumers: list[bool] = []  # [True]: the additions consuming the output were hooked instead of it

        reshaped: list[Callable[[], list[LayerRecord]]] = []  # builds the records of a reshaped output

        def hook_consumers(outputs: list[Tensor]) -> None:
            if maybe_broadcast:
                at_consumers.append(_hook_consumers(module, ctx, ids, output, outputs, params))
                return
            build = _hook_reshaped(module, ctx, ids, output, outputs, params)
            at_consumers.append(build is not None)
            if build is None:
                _USED_PER_SAMPLE.add(module)  # its output keeps the batch first: no graph search again
            else:
                reshaped.append(build)

        def records(grad: Tensor) -> list[LayerRecord]:
            if not at_consumers and not maybe_broadcast:  # ids with a batch of rows: as before, when unsure
                return embedding_records(module, ctx.name, ids, grad, params)  # type: ignore[arg-type]
            if not at_consumers:
                ctx.unsupported(
                    f"nn.Embedding '{ctx.name}' was called with ids of shape {tuple(ids.shape)}, which may be "
                    "broadcast over the batch, and the forward of the model the session is attached to did not "
                    "return before backward. Call that model itself, or pass ids with one row per sample."
                )
                return []
            if reshaped:
                return reshaped[0]()
            return [] if at_consumers[0] else embedding_records(module, ctx.name, ids, grad, params)  # type: ignore[arg-type]

        ctx.after_model_forward(hook_consumers)
        ctx.on_output_grad(output, records)
        return
    ctx.on_output_grad(output, lambda grad: embedding_records(module, ctx.name, ids, grad, params))  # type: ignore[arg-type]


#: Embeddings whose ids (with a first dimension other than 1) were found to index samples.
_USED_PER_SAMPLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: Autograd nodes that only move, add or drop unit dimensions: a gradient passes them one sample at a time.
_SHAPE_NODES = {"PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "TransposeBackward0",
                "CloneBackward0"}  # fmt: skip


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


def _consumer_map(outputs: list[Tensor]) -> dict[Any, list[Any]]:
    """Node -> the nodes of ``outputs``' autograd graph that take its output, once per use (one search)."""
    users: dict[Any, list[Any]] = {}
    queue, seen = deque(t.grad_fn for t in outputs), set()
    while queue:
        current = queue.popleft()
        if current is None or current in seen:
            continue
        seen.add(current)
        for parent, _ in current.next_functions:
            if parent is not None:
                users.setdefault(parent, []).append(current)
                queue.append(parent)
    return users


def _paths_to_additions(users: dict[Any, list[Any]], start: Any) -> list[list[Any]] | None:
    """Each use of ``start``'s output as ``[shape nodes..., addition]``; None if any use is something else."""
    paths, todo = [], [[start]]
    while todo:
        path = todo.pop()
        if not users.get(path[-1]):
            return None
        for user in users[path[-1]]:
            if _joins_batch(user):
                paths.append([*path[1:], user])
            elif type(user).__name__ in _SHAPE_NODES or type(user).__name__ == "WhereBackward0":
                todo.append([*path, user])
            else:
                return None
    return paths


def _hook_reshaped(
    module: nn.Module, ctx: LayerContext, ids: Tensor, output: Tensor, outputs: list[Tensor], params: dict[str, str]
) -> Callable[[], list[LayerRecord]] | None:
    """Per-sample suffixes of an output that is reshaped (permuted, unsqueezed, cloned) and then added to a batch.

    T5 looks up ``(T_q, T_k)`` relative-position ids, permutes the ``(T_q, T_k, H)`` result to
    ``(1, H, T_q, T_k)`` and adds it to every sample's attention scores. The gradient of each addition's
    result ``(B, H, T_q, T_k)`` is per sample; sample ``i``'s slice, passed back through the shape nodes,
    is that sample's ``(T_q, T_k, H)`` suffix. Returns what builds the records once backward has passed
    every addition, or None (the output's own gradient is then used, as for ids that index samples)
    unless the output reaches only additions, through shape nodes, and some through at least one.
    """
    paths = _paths_to_additions(_consumer_map(outputs), output.grad_fn)
    if not paths or all(len(path) == 1 for path in paths):
        return None
    shape, seen, masks = tuple(output.shape), [], {}
    for path in paths:
        grads: dict[str, Tensor] = {}
        path[-1].register_prehook(_keeper(grads, "sum"))  # (B, ...): per sample
        if len(path) > 1:  # the shape of what was added: that of its gradient, reduced over the batch
            path[-2].register_prehook(_keeper(grads, "added"))
        for k, node in enumerate(path):  # masks of torch.where, read while the graph still holds them
            if type(node).__name__ == "WhereBackward0":
                masks[node] = _where_mask(node, path[k - 1] if k else output.grad_fn)
        seen.append((path, grads))

    def records() -> list[LayerRecord]:
        suffixes = []
        for path, grads in seen:
            added = tuple(grads["added"].shape) if len(path) > 1 else shape
            suffixes.append(_through_chain(path, grads["sum"], added, shape, masks))
        if any(suffix is None for suffix in suffixes):
            ctx.unsupported(
                f"nn.Embedding '{ctx.name}' output {shape} is reshaped and broadcast in a way capture cannot "
                "split per sample. Pass ids with one row per sample."
            )
            return []
        suffix = torch.stack([s for s in suffixes if s is not None]).sum(0)  # (B, *shape)
        per_sample_ids = ids.unsqueeze(0).expand(suffix.shape[0], *ids.shape)  # (B, T_q, T_k)
        return embedding_records(module, ctx.name, per_sample_ids, suffix, params)  # type: ignore[arg-type]

    return records


def _keeper(kept: dict[str, Tensor], key: str) -> Callable[[tuple[Tensor, ...]], None]:
    """A node pre-hook that keeps the gradient reaching the node under ``key``."""

    def keep(grads: tuple[Tensor, ...]) -> None:
        kept[key] = grads[0]

    return keep


def _joins_batch(node: Any) -> bool:
    """Whether ``node`` may combine a tensor with a batch: an addition, or a ``torch.where`` with a batched mask."""
    if type(node).__name__ == "WhereBackward0":
        mask = node._saved_condition
        return mask.dim() > 0 and mask.shape[0] != 1
    return type(node).__name__ == "AddBackward0" and node._saved_alpha == 1


def _where_mask(node: Any, feeding: Any) -> Tensor:
    """Where a ``torch.where`` node took the tensor ``feeding`` produced: its condition, or the negation."""
    ours = next(k for k, (parent, _) in enumerate(node.next_functions) if parent is feeding)
    return node._saved_condition if ours == 0 else ~node._saved_condition


def _through_chain(
    path: list[Any], grad: Tensor, added: tuple[int, ...], shape: tuple[int, ...], masks: dict[Any, Tensor]
) -> Tensor | None:
    """``(B, *shape)``: each sample's slice of ``grad`` (the gradient of ``path[-1]``'s batched result) reduced
    to what that sample passed back, then back through the shape nodes and unbatched ``torch.where`` of ``path``.

    ``added``: the shape of the tensor the chain fed to ``path[-1]`` (``(1, H, T_q, T_k)``); ``masks``: where
    each ``torch.where`` took our tensor (the gradient passes there only).
    """
    *chain, joining = path
    if grad.dim() == len(added) + 1:
        slices = [grad[i] for i in range(grad.shape[0])]  # each (...)
    elif added[0] == 1 and grad.dim() == len(added):
        slices = [grad[i : i + 1] for i in range(grad.shape[0])]  # each (1, ...)
    else:
        return None
    out = []
    for i, piece in enumerate(slices):
        if joining in masks:  # a where with a mask per sample
            piece = torch.where(_sample_mask(masks[joining], i, piece), piece, 0.0)
        try:
            piece = piece.sum_to_size(added)  # dimensions the joining node broadcast within a sample
        except RuntimeError:
            return None
        for node in reversed(chain):
            piece = torch.where(masks[node], piece, 0.0) if node in masks else node(piece)
        if tuple(piece.shape) != shape:
            return None
        out.append(piece)
    return torch.stack(out)  # (B, *shape)


def _sample_mask(mask: Tensor, i: int, piece: Tensor) -> Tensor:
    """Sample ``i``'s part of a batched ``torch.where`` mask, shaped to broadcast against its slice ``piece``."""
    own = mask[i]  # (...)
    return own.unsqueeze(0) if own.dim() < piece.dim() else own
