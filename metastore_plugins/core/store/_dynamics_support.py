"""Parts of the training-dynamics queries: result types, per-batch helpers, the run profile of ``compare``."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.ops._common import chunks, restore_chunk

if TYPE_CHECKING:
    from metastore_plugins.core.store.reader import GradientStore


def positive_int(name: str, value: int) -> int:
    """``value`` as an int, or a ``ValueError`` naming the argument if it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def add_to(total: dict[str, Tensor], name: str, value: Tensor) -> None:
    """``total[name] += value``, starting from ``value``."""
    total[name] = total[name] + value if name in total else value


def holders(records: Sequence[LayerRecord], names: Iterable[str]) -> dict[str, list[LayerRecord]]:
    """Parameter name -> the records of a batch that hold it (several for shared parameters)."""
    wanted = set(names)
    held: dict[str, list[LayerRecord]] = {}
    for record in records:
        for name in record.params.values():
            if name in wanted:
                held.setdefault(name, []).append(record)
    return held


def abs_sum(records: Sequence[LayerRecord], names: Iterable[str], max_bytes: int) -> dict[str, Tensor]:
    """``sum_i |g_i|`` per parameter for one batch; shared parameters are summed before ``abs``."""
    out: dict[str, Tensor] = {}
    for name, held in holders(records, names).items():
        if len(held) == 1:
            out[name] = ops.abs_grad_accumulate(held[0], params=[name], max_bytes=max_bytes)[name]
            continue
        batch = held[0].batch_size
        numel = math.prod(next(r.param_shapes[role] for r in held for role, n in r.params.items() if n == name))
        for lo, hi in chunks(batch, max_bytes // (8 * numel + 1)):
            grad: Tensor | None = None
            for record in held:
                part = restore_chunk(record, lo, hi, [name])[name]  # (n, *shape)
                grad = part if grad is None else grad + part
            if grad is not None:
                add_to(out, name, grad.abs().sum(0))
    return out


def entry_values(records: Sequence[LayerRecord], name: str, entries: Tensor, max_bytes: int) -> Tensor:
    """``(B, E)`` per-sample gradient of the given entries of parameter ``name`` (all holders summed)."""
    total: Tensor | None = None
    for record in holders(records, [name]).get(name, []):
        role = next(role for role, n in record.params.items() if n == name)
        part = ops.entry_gradients(record, role, entries, max_bytes)  # (B, E)
        total = part if total is None else total + part
    if total is None:
        raise ValueError(f"a stored batch holds no record of parameter '{name}'")
    return total


def top_entries(values: Tensor, k: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """The ``k`` largest entries of ``values`` as index tuples (largest first) and their values."""
    flat = values.reshape(-1).double()
    order = torch.sort(flat, descending=True, stable=True).indices[: min(k, flat.numel())]
    index = np.unravel_index(order.numpy(), tuple(values.shape))
    return [tuple(int(i[j]) for i in index) for j in range(order.numel())], flat[order].tolist()


class WeightChange(NamedTuple):
    """One weight entry and its aggregated ``sum_t lr_t sum_i |g_i[index]|``."""

    param: str
    index: tuple[int, ...]
    value: float


@dataclass(frozen=True)
class Contributors:
    """Per entry of one parameter, the sample occurrences with the largest ``|g_i[entry]|``.

    Attributes:
        param: the parameter's name.
        entries: ``E`` index tuples into the parameter.
        sample_ids, steps: ``(E, k)`` int64: who, and at which step.
        values: ``(E, k)`` float64 signed per-sample gradients, largest magnitude first.
    """

    param: str
    entries: list[tuple[int, ...]]
    sample_ids: np.ndarray
    steps: np.ndarray
    values: np.ndarray

    def rows(self) -> list[dict[str, Any]]:
        """One dict per entry: ``{"entry", "contributors": [(sample_id, step, value), ...]}``."""
        return [
            {
                "entry": entry,
                "contributors": [
                    (int(i), int(s), float(v)) for i, s, v in zip(self.sample_ids[e], self.steps[e], self.values[e])
                ],
            }
            for e, entry in enumerate(self.entries)
        ]


@dataclass(frozen=True)
class Spike:
    """A step where too many per-sample gradient norms exceeded the threshold.

    Attributes:
        step: the step.
        fraction: fraction of its samples whose norm exceeded the threshold.
        steps_before: the stored steps of the look-back window, ascending.
        sample_ids: ``(n,)`` the samples seen in them (unique, in the order seen).
    """

    step: int
    fraction: float
    steps_before: list[int]
    sample_ids: np.ndarray


@dataclass(frozen=True)
class Clusters:
    """k-means of gradient sketches: ``labels[n]`` is the cluster of occurrence ``sample_ids[n]``."""

    sample_ids: np.ndarray  # (N,)
    labels: np.ndarray  # (N,)
    centroids: np.ndarray  # (k, dim)
    inertia: float


@dataclass(frozen=True)
class LayerComparison:
    """One layer in two runs: mean per-sample gradient norms, ``ratio = mean_norm / other_mean_norm``,
    and the cosine between the cumulative updates ``sum_t lr_t g_t`` of the two runs."""

    layer: str
    mean_norm: float
    other_mean_norm: float
    ratio: float
    update_cosine: float


@dataclass(frozen=True)
class RunComparison:
    """:meth:`GradientStore.compare`: per layer, and per step (union of both runs' steps, NaN where absent)."""

    layers: list[LayerComparison]
    steps: np.ndarray  # (S,)
    norm: np.ndarray  # (S,) mean whole-model per-sample gradient norm of this run
    other_norm: np.ndarray
    loss: np.ndarray  # (S,) mean recorded loss
    other_loss: np.ndarray

    @staticmethod
    def build(mine: _Profile, theirs: _Profile) -> RunComparison:
        rows = []
        for layer in mine.layer_norm:
            a, b = mine.mean_norm(layer), theirs.mean_norm(layer)
            ratio = a / b if b > 0 else (math.inf if a > 0 else math.nan)
            rows.append(LayerComparison(layer, a, b, ratio, _cosine(mine.update.get(layer), theirs.update.get(layer))))
        steps = sorted(set(mine.step_count) | set(theirs.step_count))
        return RunComparison(
            rows,
            np.array(steps, dtype=np.int64),
            mine.per_step(steps, mine.step_norm),
            theirs.per_step(steps, theirs.step_norm),
            mine.per_step(steps, mine.step_loss, mine.loss_count),
            theirs.per_step(steps, theirs.step_loss, theirs.loss_count),
        )


def _cosine(a: Tensor | None, b: Tensor | None) -> float:
    if a is None or b is None:
        return math.nan
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else math.nan


@dataclass
class _Profile:
    layer_norm: dict[str, float]  # sum over occurrences of the layer's per-sample norm
    layer_count: dict[str, int]
    step_norm: dict[int, float]  # sum of whole-model per-sample norms
    step_count: dict[int, int]
    step_loss: dict[int, float]
    loss_count: dict[int, int]
    update: dict[str, Tensor]  # layer -> flattened sum_t lr_t g_t (float64)

    def mean_norm(self, layer: str) -> float:
        count = self.layer_count.get(layer, 0)
        return self.layer_norm.get(layer, 0.0) / count if count else math.nan

    def per_step(self, steps: list[int], sums: dict[int, float], counts: dict[int, int] | None = None) -> np.ndarray:
        counts = self.step_count if counts is None else counts
        return np.array([sums[s] / counts[s] if counts.get(s) else math.nan for s in steps])


def run_profile(store: GradientStore, capture_point: str, layers: list[str]) -> _Profile:
    """One pass over a capture point: per-layer and per-step norms, losses, cumulative updates."""
    selection = store.select(capture_point, layers=layers)
    step_size = Counter()
    for ref in selection.refs:
        step_size[ref.step] += ref.size
    profile = _Profile({}, {}, {}, {}, {}, {}, {})
    updates: dict[str, dict[str, Tensor]] = {layer: {} for layer in layers}
    for batch in selection.batches():
        step, lr = batch.ref.step, 1.0 if batch.ref.lr is None else float(batch.ref.lr)
        by_layer: dict[str, list] = {}
        for record in batch.records:
            by_layer.setdefault(record.layer, []).append(record)
        for layer, records in by_layer.items():
            norms = ops.total_sq_norms(records).double().clamp_min(0).sqrt()  # (B,)
            profile.layer_norm[layer] = profile.layer_norm.get(layer, 0.0) + float(norms.sum())
            profile.layer_count[layer] = profile.layer_count.get(layer, 0) + batch.size
            for name, grad in ops.batch_gradient(records, "sum").items():
                part = grad.double() * (lr / step_size[step])
                updates[layer][name] = updates[layer][name] + part if name in updates[layer] else part
        if batch.records:
            total = ops.total_sq_norms(batch.records).double().clamp_min(0).sqrt()  # (B,)
            profile.step_norm[step] = profile.step_norm.get(step, 0.0) + float(total.sum())
            profile.step_count[step] = profile.step_count.get(step, 0) + batch.size
        loss = batch.meta.get("loss")
        if loss is not None:
            profile.step_loss[step] = profile.step_loss.get(step, 0.0) + float(loss.double().sum())
            profile.loss_count[step] = profile.loss_count.get(step, 0) + batch.size
    for layer, grads in updates.items():
        if grads:
            profile.update[layer] = torch.cat([grads[name].reshape(-1) for name in sorted(grads)])
    return profile
