"""``nn.MultiheadAttention`` in every configuration: its in-projection, out-projection and ``bias_k``/``bias_v``.

The module calls ``F.linear`` on its weights directly, so module hooks never see the
projections. After each forward we find, in the autograd graph of the output, the
matrix-multiply node that consumes each weight (or a row block of it) and hook it: the
gradient reaching that node is the projection's suffix ``D``, and the node's saved input
its prefix ``A``, both ``(n*B, d)`` with rows ordered ``(position, sample)``.

With ``E`` the embedding dimension, ``x`` the query ``(L, E)``, ``k``/``v`` the key/value
inputs ``(S, kdim)``/``(S, vdim)`` of one sample, and ``D_q, D_k, D_v`` the gradients of the
three projections' outputs:

- packed in-projection, self-attention (``query is key is value``): one node,
  ``grad in_proj_weight_i = D_i^T x_i`` ``(3E, E)`` with ``D_i = [D_q D_k D_v]`` ``(L, 3E)``;
  one ``"outer"`` record ``<path>.in_proj``, ``G = 1``.
- packed in-projection, distinct inputs (cross-attention; ``key is value`` or not):
  ``in_proj_weight`` is split into three row blocks, each the outer product of its own input
  and its own block of the suffix: ``grad W_q = D_q^T x``, ``grad W_k = D_k^T k``,
  ``grad W_v = D_v^T v`` (stacked: ``(3E, E)``), ``grad in_proj_bias = sum_t [D_q D_k D_v][t]``.
  One ``"outer"`` record ``<path>.in_proj`` with ``G = 3`` groups (the blocks, in row order):
  row ``t`` holds query position ``t`` in group 0 and key/value position ``t`` in groups 1, 2,
  zero-padded to ``T = max(L, S)`` rows, so restoration gives ``(B, 3E, E)`` unchanged. The
  blocks' suffixes arrive at two or three nodes; the record is built when the node that splits
  the weight into blocks runs, which autograd runs after all of them.
- separate weights (``kdim``/``vdim`` != ``E``): ``grad q_proj_weight = D_q^T x`` ``(E, E)``,
  ``grad k_proj_weight = D_k^T k`` ``(E, kdim)``, ``grad v_proj_weight = D_v^T v`` ``(E, vdim)``:
  ``"outer"`` records ``<path>.q_proj``/``.k_proj``/``.v_proj``; ``in_proj_bias`` ``(3E,)`` gets one
  dense record ``<path>.in_proj`` per block (``sum_t D[t]`` in its ``E`` entries, zero elsewhere),
  which restoration sums.
- ``add_bias_kv``: ``bias_k`` ``(1, 1, E)`` is appended to every sample's keys as one more
  position (``bias_k.repeat(1, B, 1)``): its per-sample gradient is the gradient reaching that
  appended position, ``(B, 1, 1, E)``, a dense record ``<path>.bias_k`` (``bias_v`` likewise).
  ``add_zero_attn`` appends zeros: no parameter.
- out-projection: prefix = the attention output before projection, as ``nn.Linear``
  (``<path>.out_proj``).

Masks, ``need_weights`` and ``batch_first`` change nothing above: the internal layout is
always ``(position, sample)``. Hugging Face attention modules need none of this: their
projections are ``nn.Linear`` modules covered by the Linear rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture.build import as_computed, outer_record
from metastore_plugins.core.capture.layers.linear import linear_records, part_name
from metastore_plugins.core.capture.registry import LayerContext, RecordsFn, register_capture
from metastore_plugins.core.records import LayerRecord, RecordHead, dense_record

#: matmul nodes of ``F.linear`` -> the attribute holding the input it multiplied
_MATMUL_NODES = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}
_SPLIT_NODES = ("SplitBackward0", "SplitWithSizesBackward0")
_SEPARATE_WEIGHTS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_WEIGHTS = ("in_proj_weight", *_SEPARATE_WEIGHTS, "out_proj.weight")


@dataclass(frozen=True)
class Projection:
    """A matmul node multiplying by (a row block of) one of the module's weights.

    Attributes:
        node: the autograd node; the gradient reaching it is the suffix ``(n*B, width)``.
        weight: local name of the weight.
        offset: first row of the weight block it multiplies by (0 for a whole weight).
        split: the node that split the weight into blocks (None for a whole weight).
        inputs: the input it multiplied, as the kernel read it ``(n*B, d_in)``, rows (position, sample).
    """

    node: Any
    weight: str
    offset: int
    split: Any
    inputs: Tensor


def _through_casts(edge: tuple[Any, int]) -> tuple[Any, int]:
    """The edge past autocast's casts (``ToCopyBackward0``)."""
    node, index = edge
    while node is not None and type(node).__name__ == "ToCopyBackward0":
        node, index = node.next_functions[0]
    return node, index


def split_blocks(split: Any) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each output of a split along dim 0 (``chunk``/``split``)."""
    if type(split).__name__ == "SplitBackward0":
        total, size = int(split._saved_self_sym_sizes[0]), int(split._saved_split_size)
        return [(first, min(size, total - first)) for first in range(0, total, size)]
    sizes = [int(size) for size in split._saved_split_sizes]
    return [(sum(sizes[:k]), size) for k, size in enumerate(sizes)]


def _leaf_block(edge: tuple[Any, int], leaves: Mapping[str, Tensor]) -> tuple[str, int, Any] | None:
    """``(local name, first row, split node)`` if ``edge`` leads (through casts and a dim-0 split) to a leaf."""
    node, output = _through_casts(edge)
    split = None
    if node is not None and type(node).__name__ in _SPLIT_NODES and int(node._saved_dim) == 0:
        split, (node, _) = node, _through_casts(node.next_functions[0])
    variable = getattr(node, "variable", None)
    for local, leaf in leaves.items():
        if variable is leaf:
            return local, (split_blocks(split)[output][0] if split is not None else 0), split
    return None


def _weight_block(node: Any, weights: Mapping[str, Tensor]) -> tuple[str, int, Any] | None:
    """The weight block a matmul node multiplies by (``x @ W.t()``), if it is one of ``weights``."""
    for parent, _ in node.next_functions:
        if parent is not None and type(parent).__name__ == "TBackward0":
            found = _leaf_block(parent.next_functions[0], weights)
            if found is not None:
                return found
    return None


def graph_nodes(outputs: Iterable[Tensor], stop: set[Any]) -> list[Any]:
    """Nodes of the graph of ``outputs`` up to (not including) ``stop``: the module's own operations."""
    found: list[Any] = []
    queue, seen = deque(t.grad_fn for t in outputs), set(stop)
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        found.append(node)
        queue.extend(parent for parent, _ in node.next_functions)
    return found


def find_projections(nodes: list[Any], weights: Mapping[str, Tensor]) -> list[Projection]:
    """The matmul nodes among ``nodes`` that multiply by one of ``weights`` (local name -> parameter)."""
    projections = []
    for node in nodes:
        saved = _MATMUL_NODES.get(type(node).__name__)
        if saved is None:
            continue
        block = _weight_block(node, weights)
        if block is not None:
            projections.append(Projection(node, *block, getattr(node, saved).detach()))
    return projections


def find_repeats(nodes: list[Any], leaves: Mapping[str, Tensor]) -> dict[str, Any]:
    """Local name -> the ``repeat`` node broadcasting that leaf over the batch (``bias_k``/``bias_v``)."""
    found: dict[str, Any] = {}
    for node in nodes:
        if type(node).__name__ == "RepeatBackward0":
            block = _leaf_block(node.next_functions[0], leaves)
            if block is not None:
                found[block[0]] = node
    return found


def sequence_to_batch(rows: Tensor, batch: int) -> Tensor:
    """``(n*B, d)`` rows ordered (position, sample) -> ``(B, n, d)``."""
    return rows.reshape(-1, batch, rows.shape[-1]).transpose(0, 1)


def _pad_positions(tensor: Tensor, tokens: int) -> Tensor:
    """``(B, n, d)`` zero-padded to ``(B, tokens, d)``."""
    return F.pad(tensor, (0, 0, 0, tokens - tensor.shape[1]))


def grouped_in_projection_records(
    layer: str,
    blocks: list[tuple[Tensor, Tensor | None, int]],
    embed: int,
    batch: int,
    params: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    pack: bool = True,
) -> list[LayerRecord]:
    """The packed in-projection on distinct inputs as one ``"outer"`` record of ``G = 3`` row blocks.

    Args:
        blocks: per node, in weight-row order, ``(inputs (n*B, E), grad (n*B, w) or None, w)`` with ``w``
            a multiple of ``E`` (``2E`` for the key/value node when ``key is value``); rows are (position,
            sample). A node that backward did not reach (None) contributes zero.
        embed: ``E``.

    Group ``g`` is rows ``gE..(g+1)E`` of ``in_proj_weight``: ``grad W_i[g] = sum_t D_i[t, g]^T A_i[t, g]``,
    query and key/value positions sharing the rows ``t`` (zero-padded to ``max(L, S)``).
    """
    present = [grad for _, grad, _ in blocks if grad is not None]
    if not present:
        return []
    computed_in = present[0].dtype
    prefixes: list[Tensor] = []
    suffixes: list[Tensor] = []
    for inputs, grad, width in blocks:
        prefix = as_computed(sequence_to_batch(inputs, batch), computed_in)  # (B, n, E) fp32
        rows = grad if grad is not None else present[0].new_zeros(inputs.shape[0], width)  # (n*B, w)
        suffix = as_computed(sequence_to_batch(rows, batch), computed_in)  # (B, n, w) fp32
        for block in suffix.split(embed, dim=-1):  # (B, n, E) each
            prefixes.append(prefix)
            suffixes.append(block)
    tokens = max(p.shape[1] for p in prefixes)
    prefix = torch.stack([_pad_positions(p, tokens) for p in prefixes], 2)  # (B, T, 3, E)
    suffix = torch.stack([_pad_positions(d, tokens) for d in suffixes], 2)  # (B, T, 3, E)
    return [outer_record(layer, prefix, suffix, params, shapes, pack=pack)]


def bias_block_record(
    layer: str, grad: Tensor, offset: int, batch: int, shape: tuple[int, ...], name: str
) -> LayerRecord:
    """Dense ``in_proj_bias`` ``(3E,)`` record of one block: ``sum_t D_i[t]`` from row ``offset``, zeros elsewhere."""
    block = as_computed(sequence_to_batch(grad, batch), grad.dtype).sum(1)  # (B, E) fp32
    full = block.new_zeros(batch, *shape)  # (B, 3E)
    full[:, offset : offset + block.shape[1]] = block
    return dense_record(layer, {"bias": full}, {"bias": name})


class _Blocks:
    """One call's in-projection suffixes, kept until the node that split the weight into blocks runs."""

    def __init__(self, projections: list[Projection], widths: dict[int, int]) -> None:
        self.projections = sorted(projections, key=lambda p: p.offset)
        self.widths = widths  # first row -> rows of each block
        self.grads: dict[int, Tensor] = {}

    def keep(self, offset: int) -> RecordsFn:
        def store(grad: Tensor) -> list[LayerRecord]:  # (n*B, w)
            self.grads[offset] = grad
            return []

        return store

    def take(self) -> list[tuple[Tensor, Tensor | None, int]]:
        grads, self.grads = self.grads, {}  # ready for another backward through a retained graph
        return [(p.inputs, grads.get(p.offset), self.widths[p.offset]) for p in self.projections]


def _tensor_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    return [value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)]


def _hook_packed(
    module: nn.MultiheadAttention, ctx: LayerContext, found: list[Projection], params: dict[str, str], batch: int
) -> bool:
    """Hook the packed in-projection; returns whether it could (one whole node, or every block of one split)."""
    roles = {role: params[n] for role, n in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")) if n in params}
    shapes = {role: tuple(module.get_parameter(f"in_proj_{role}").shape) for role in roles}
    layer, pack = part_name(ctx.name, "in_proj"), ctx.pack_rows
    head = RecordHead(layer, roles, shapes)
    if len(found) == 1 and found[0].split is None:  # self-attention: one linear of width 3E
        inputs = sequence_to_batch(found[0].inputs, batch)  # (B, L, E)
        ctx.on_node_grad(
            found[0].node,
            lambda grad: linear_records(head, inputs, sequence_to_batch(grad, batch), pack=pack),
        )
        return True
    split = found[0].split
    widths = dict(split_blocks(split)) if split is not None else {}
    if any(p.split is not split for p in found) or sorted(p.offset for p in found) != sorted(widths):
        return False
    blocks = _Blocks(found, widths)
    for projection in found:
        ctx.on_node_grad(projection.node, blocks.keep(projection.offset))
    embed = int(module.embed_dim)
    ctx.on_node_grad(
        split, lambda _: grouped_in_projection_records(layer, blocks.take(), embed, batch, roles, shapes, pack=pack)
    )
    return True


def _hook_separate(
    module: nn.MultiheadAttention,
    ctx: LayerContext,
    projection: Projection,
    params: dict[str, str],
    batch: int,
    bias: bool,
) -> None:
    """Hook one of ``q/k/v_proj_weight`` and, if ``bias``, its block of ``in_proj_bias``."""
    inputs = sequence_to_batch(projection.inputs, batch)  # (B, n, d_in)
    roles = {"weight": params[projection.weight]}
    shapes = {"weight": tuple(module.get_parameter(projection.weight).shape)}
    layer, pack = part_name(ctx.name, projection.weight.removesuffix("_weight")), ctx.pack_rows
    head = RecordHead(layer, roles, shapes)
    offset = int(module.embed_dim) * _SEPARATE_WEIGHTS.index(projection.weight)
    bias_shape = tuple(module.get_parameter("in_proj_bias").shape) if bias else ()

    def records(grad: Tensor) -> list[LayerRecord]:  # (n*B, E)
        out = linear_records(head, inputs, sequence_to_batch(grad, batch), pack=pack)
        if bias:
            out.append(
                bias_block_record(
                    part_name(ctx.name, "in_proj"), grad, offset, batch, bias_shape, params["in_proj_bias"]
                )
            )
        return out

    ctx.on_node_grad(projection.node, records)


def _hook_bias_kv(
    module: nn.MultiheadAttention, ctx: LayerContext, local: str, node: Any, name: str, batch: int
) -> None:
    """``bias_k``/``bias_v``: the gradient of ``bias.repeat(1, B, 1)`` ``(1, B, E)`` is per sample."""
    shape = tuple(module.get_parameter(local).shape)  # (1, 1, E)

    def records(grad: Tensor) -> list[LayerRecord]:  # (1, B, E)
        per_sample = as_computed(grad, grad.dtype).reshape(batch, *shape)  # (B, 1, 1, E)
        return [dense_record(part_name(ctx.name, local), {local: per_sample}, {local: name})]

    ctx.on_node_grad(node, records)


def _hook_out_projection(
    module: nn.MultiheadAttention, ctx: LayerContext, projection: Projection, params: dict[str, str], batch: int
) -> None:
    roles = {role: params[f"out_proj.{role}"] for role in ("weight", "bias") if f"out_proj.{role}" in params}
    shapes = {role: tuple(module.get_parameter(f"out_proj.{role}").shape) for role in roles}
    attended = sequence_to_batch(projection.inputs, batch)  # (B, L, E)
    layer, pack = part_name(ctx.name, "out_proj"), ctx.pack_rows
    head = RecordHead(layer, roles, shapes)
    ctx.on_node_grad(
        projection.node,
        lambda grad: linear_records(head, attended, sequence_to_batch(grad, batch), pack=pack),
    )


@register_capture(
    nn.MultiheadAttention,
    params=(
        "in_proj_weight",
        *_SEPARATE_WEIGHTS,
        "in_proj_bias",
        "bias_k",
        "bias_v",
        "out_proj.weight",
        "out_proj.bias",
    ),
    covers_children=True,
)
def capture_multihead_attention(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.MultiheadAttention``: self- and cross-attention, ``kdim``/``vdim``, ``add_bias_kv``,
    ``add_zero_attn``, masks, ``need_weights`` and ``batch_first`` either way."""
    attention, attn_output = cast(nn.MultiheadAttention, module), output[0]
    if not attn_output.requires_grad:
        return
    params = ctx.param_names(module)
    batch = 1 if attn_output.dim() == 2 else attn_output.shape[0 if attention.batch_first else 1]
    stop = {t.grad_fn for t in _tensor_arguments(args, kwargs) if t.grad_fn is not None}
    nodes = graph_nodes([attn_output], stop)
    own = {local: module.get_parameter(local) for local in params}
    projections = find_projections(nodes, {local: own[local] for local in _WEIGHTS if local in own})
    covered: set[str] = set()
    packed = [p for p in projections if p.weight == "in_proj_weight"]
    if packed and _hook_packed(attention, ctx, packed, params, batch):
        covered |= {"in_proj_weight", "in_proj_bias"}
    separate = [p for p in projections if p.weight in _SEPARATE_WEIGHTS]
    whole_bias = "in_proj_bias" in params and sorted(p.weight for p in separate) == sorted(_SEPARATE_WEIGHTS)
    for projection in separate:  # the bias only when every block of it is reached
        _hook_separate(attention, ctx, projection, params, batch, bias=whole_bias)
    covered |= {p.weight for p in separate} | ({"in_proj_bias"} if whole_bias else set())
    for local, node in find_repeats(nodes, {n: own[n] for n in ("bias_k", "bias_v") if n in own}).items():
        _hook_bias_kv(attention, ctx, local, node, params[local], batch)
        covered.add(local)
    out = [p for p in projections if p.weight == "out_proj.weight"]
    if out:
        _hook_out_projection(attention, ctx, out[0], params, batch)
        covered |= {"out_proj.weight", "out_proj.bias"}
    missed = [local for local in params if local not in covered]
    if missed:
        ctx.unsupported(
            f"could not find where nn.MultiheadAttention '{ctx.name}' uses {', '.join(missed)} in the autograd "
            "graph (a frozen weight beside its trainable bias, or an unexpected PyTorch version); their per-sample "
            "gradients are not captured. Freeze them too, or pass unsupported='skip' to accept it.",
            params=missed,
        )
