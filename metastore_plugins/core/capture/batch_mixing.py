"""Layers whose per-sample gradients a batch statistic mixes: those below a BatchNorm using batch statistics.

A ``BatchNorm`` in training mode (or without running statistics) normalizes with the batch's mean
and variance, so every sample's loss ``l_i`` depends on every sample's input. Hold the statistics'
inputs (the other samples) fixed: for a parameter ``W`` of a layer *below* the norm (its output
reaches the norm's input), with ``h_j`` the layer's output for sample ``j``,

    d l_i / d W = sum_j (d l_i / d h_j) (d h_j / d W)     # every sample's input, not sample i's alone

while the one backward of the summed loss gives the layer ``D_i = d (sum_j l_j) / d h_i``, and the
factors ``D_i^T A_i`` are sample i's share of the batch gradient (the shares add up to it), not its
own-loss gradient. No factors of sample ``i`` alone hold it; capturing it exactly takes one backward
per sample. Such layers are reported as not per sample and their records of that forward dropped.

Unaffected: layers above the norm, and the norm's own weight and bias (``y_i = gamma x_hat_i + beta``
with ``x_hat`` held: captured exactly by the BatchNorm rule), unless another such norm sits above
them. Norms that normalize each sample by itself (``LayerNorm``, ``GroupNorm``, ``InstanceNorm``,
``RMSNorm``) and a BatchNorm in eval mode with running statistics mix nothing. ``SyncBatchNorm``
is a BatchNorm (it mixes the batches of every process).

"Below" is read from the autograd graph, not from module order: every parameter whose
``AccumulateGrad`` node is reachable from the norm input's ``grad_fn``. The session walks it at a
norm's first call with batch statistics (:func:`parameters_below`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

#: The store config key (manifest ``config``) listing them: ``{parameter: the norm's module path}``.
BATCH_MIXED_KEY = "batch_mixed_parameters"

#: What to do about it, in every message that reports such layers.
BATCH_MIXED_FIX = (
    "call .eval() on the BatchNorm (running statistics; checkpoint passes run in eval mode and capture these "
    "layers exactly), use GroupNorm or LayerNorm instead, or accept that training-mode steps leave them out"
)


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm that normalizes this call with the batch's statistics."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or module.running_mean is None)


def parameters_below(tensor: Tensor, names: Mapping[int, str]) -> list[str]:
    """Names (``names``: ``id(parameter) -> name``) of the parameters whose gradient flows through ``tensor``.

    A breadth-first walk of the autograd graph from ``tensor.grad_fn`` to its ``AccumulateGrad`` leaves.
    """
    found: dict[str, None] = {}
    queue: deque[Any] = deque([tensor.grad_fn])
    seen: set[Any] = set()
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if variable is not None and id(variable) in names:
            found[names[id(variable)]] = None
        queue.extend(parent for parent, _ in node.next_functions)
    return list(found)


def batch_mixed_message(norm: str, norm_type: str, params: list[str]) -> str:
    """The report of parameters below a norm that uses batch statistics: which, why, what to do."""
    return (
        f"per-sample gradients of {', '.join(params)} are not captured in this forward: their layers are below "
        f"'{norm}' ({norm_type}), which normalizes with batch statistics (training mode, or no running "
        "statistics), so each sample's loss depends on the whole batch and back-propagation gives these layers "
        "each sample's share of the batch gradient, not its own-loss gradient (layers above it and its own weight "
        f"and bias are captured). To fix: {BATCH_MIXED_FIX}; pass unsupported='skip' to accept it silently."
    )


def batch_mixed_lines(mixed: Mapping[str, str], shown: int = 4) -> list[str]:
    """The capture plan's line naming the parameters left out of training-mode steps (none when there are none)."""
    if not mixed:
        return []
    names = list(mixed)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    norms = ", ".join(f"'{norm}'" for norm in dict.fromkeys(mixed.values()))
    return [
        f"  not per sample in training-mode steps, so left out of them: {len(names)} parameter"
        f"{'s' * (len(names) != 1)} below BatchNorm {norms} (batch statistics mix the samples): "
        f"{', '.join(names[:shown])}{more}. What to do: {BATCH_MIXED_FIX}"
    ]


def batch_mixed_config(mixed: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The store config entry (:data:`BATCH_MIXED_KEY`) for ``mixed``; empty when there are none."""
    return {BATCH_MIXED_KEY: dict(mixed)} if mixed else {}


def batch_mixed_note(config: Mapping[str, Any]) -> dict[str, str]:
    """What a report built on a store with this ``config`` says about batch-mixed layers (empty when none)."""
    mixed = config.get(BATCH_MIXED_KEY)
    if not isinstance(mixed, Mapping) or not mixed:
        return {}
    norms = ", ".join(f"'{norm}'" for norm in dict.fromkeys(mixed.values()))
    return {
        "batch_mixed": f"Training-mode steps leave out {', '.join(mixed)} (below BatchNorm {norms}, whose batch "
        "statistics mix the samples: not per sample); checkpoint passes run in eval mode and hold every layer."
    }
