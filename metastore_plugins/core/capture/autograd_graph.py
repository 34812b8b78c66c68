"""Walks over an autograd graph: which nodes a backward restricted to some tensors' gradients runs."""

from __future__ import annotations

from typing import Any


def nodes_reaching(root: Any, targets: set[Any]) -> set[Any]:
    """Autograd nodes at or below ``root`` from which a node of ``targets`` is reached through at least one edge.

    Those are the nodes ``torch.autograd.grad`` runs to capture the gradients of tensors whose ``grad_fn``
    is in ``targets`` (a target's own node runs only if it leads to another). One depth-first walk.
    """
    reaches: dict[Any, bool] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        parents = [parent for parent, _ in node.next_functions if parent is not None]
        if expanded:
            reaches[node] = any(parent in targets or reaches[parent] for parent in parents)
        elif node not in reaches:
            reaches[node] = False  # visited; set when its parents are done (a DAG: they finish first)
            stack.append((node, True))
            stack.extend((parent, False) for parent in parents if parent not in reaches)
    return {node for node, reached in reaches.items() if reached}
