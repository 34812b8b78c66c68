"""``nn.MultiheadAttention``: its fused in-projection and its out-projection, exactly.

The module calls ``F.linear`` on ``in_proj_weight`` and ``out_proj.weight`` directly,
so module hooks never see the projections. After each forward we find, in the
autograd graph of the output, the matrix-multiply node that consumes each of those
weights and hook it: the gradient reaching that node is the suffix ``D`` of the
projection, rows ordered ``(position, sample)``.

- in-projection (self-attention, ``query is key is value``): prefix = the input
  ``x`` ``(B, L, E)``, suffix ``(B, L, 3E)``, ``grad W_in_i = D_i^T x_i``;
- out-projection: prefix = the attention output before projection (the node's
  saved input ``(L*B, E)``), suffix ``(B, L, E)``.

Hugging Face attention modules need nothing of this: their projections are
``nn.Linear`` modules covered by the Linear rule.
"""

from __future__ import annotations

from collections import deque
from typing import Any, cast

from torch import Tensor, nn

from metastore_plugins.core.capture.layers.linear import linear_records
from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.capture.registry import LayerContext, register_capture

_MATMUL_NODES = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}


def _consumes(node: Any, weight: Tensor) -> bool:
    """Whether a matmul node multiplies by ``weight.t()``, or by its cast to autocast's dtype."""
    for parent, _ in node.next_functions:
        if parent is not None and type(parent).__name__ == "TBackward0":
            leaf = parent.next_functions[0][0]
            while leaf is not None and type(leaf).__name__ == "ToCopyBackward0":  # autocast's cast of the weight
                leaf = leaf.next_functions[0][0]
            if getattr(leaf, "variable", None) is weight:
                return True
    return False


def find_matmul_nodes(output: Tensor, weights: dict[str, Tensor], stop: set[Any]) -> dict[str, Any]:
    """Breadth-first search of ``output``'s graph for the matmul node consuming each weight."""
    found: dict[str, Any] = {}
    queue, seen = deque([output.grad_fn]), set(stop)
    while queue and len(found) < len(weights):
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in _MATMUL_NODES:
            for role, weight in weights.items():
                if role not in found and _consumes(node, weight):
                    found[role] = node
        queue.extend(parent for parent, _ in node.next_functions)
    return found


def _sequence_to_batch(rows: Tensor, batch: int) -> Tensor:
    """``(L*B, d)`` rows ordered (position, sample) -> ``(B, L, d)``."""
    return rows.reshape(-1, batch, rows.shape[-1]).transpose(0, 1)


def _projection_records(
    layer: str,
    prefix_rows: Tensor,
    grad_rows: Tensor,
    batch: int,
    params: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
) -> list[LayerRecord]:
    return linear_records(
        layer, _sequence_to_batch(prefix_rows, batch), _sequence_to_batch(grad_rows, batch), params, shapes
    )


@register_capture(
    nn.MultiheadAttention,
    params=("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"),
    covers_children=True,
)
def capture_multihead_attention(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body for ``nn.MultiheadAttention`` (self-attention; ``batch_first`` True or False)."""
    query, key, value = (args + (None,) * 3)[:3]
    query, key, value = (kwargs.get(n, v) for n, v in zip(("query", "key", "value"), (query, key, value)))
    attn_output = output[0]
    if not attn_output.requires_grad:
        return
    params = ctx.param_names(module)
    in_params = {role: params[n] for role, n in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")) if n in params}
    out_params = {role: params[f"out_proj.{role}"] for role in ("weight", "bias") if f"out_proj.{role}" in params}
    if in_params and not (query is key and key is value):
        ctx.unsupported(
            f"nn.MultiheadAttention '{ctx.name}' was called with distinct query/key/value (cross-attention); "
            "only self-attention (query is key is value) is captured for in_proj_weight/in_proj_bias "
            "(out_proj is). Freeze them or pass unsupported='skip'.",
            params=("in_proj_weight", "in_proj_bias"),
        )
        in_params = {}
    if not (in_params or out_params):
        return
    x = query.detach()
    if not module.batch_first:
        x = x.transpose(0, 1)  # (B, L, E)
    batch = x.shape[0]
    weights: dict[str, Tensor] = {"in": cast(Tensor, module.in_proj_weight)} if in_params else {}
    if out_params:
        weights["out"] = cast(nn.Linear, module.out_proj).weight
    nodes = find_matmul_nodes(attn_output, weights, stop={query.grad_fn} if query.grad_fn is not None else set())
    if ("in" not in nodes and in_params) or ("out" not in nodes and out_params):
        ctx.unsupported(
            f"could not find the projections of nn.MultiheadAttention '{ctx.name}' in the autograd graph "
            "(an unexpected PyTorch version?); its parameters are not captured."
        )
        return
    if in_params:
        in_shapes = {role: tuple(module.get_parameter(f"in_proj_{role}").shape) for role in in_params}
        x_rows = x.transpose(0, 1).reshape(-1, x.shape[-1])  # (L*B, E)
        ctx.on_node_grad(
            nodes["in"],
            lambda grad: _projection_records(ctx.name + ".in_proj", x_rows, grad, batch, in_params, in_shapes),
        )
    if out_params:
        out_shapes = {role: tuple(getattr(module.out_proj, role).shape) for role in out_params}
        attended = getattr(nodes["out"], _MATMUL_NODES[type(nodes["out"]).__name__]).detach()  # (L*B, E)
        ctx.on_node_grad(
            nodes["out"],
            lambda grad: _projection_records(ctx.name + ".out_proj", attended, grad, batch, out_params, out_shapes),
        )
