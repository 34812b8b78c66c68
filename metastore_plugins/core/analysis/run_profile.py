"""The run profile behind ``GradientStore.compare``: one pass over a capture point of each run."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.analysis.results import LayerComparison, RunComparison
from metastore_plugins.core.analysis.scan import LOCAL, Scan
from metastore_plugins.core.records import EXACT_KINDS
from metastore_plugins.core.store import StoreReader


@dataclass
class Profile:
    layer_norm: dict[str, float]  # sum over occurrences of the layer's per-sample norm
    layer_count: dict[str, int]
    step_norm: dict[int, float]  # sum of whole-model per-sample norms
    step_count: dict[int, int]
    step_loss: dict[int, float]
    loss_count: dict[int, int]
    update: dict[str, Tensor]  # layer -> flattened sum_t lr_t g_t (float64)
    inexact: dict[str, int] = field(default_factory=dict)  # layer -> batches kept projected or as norms only

    def mean_norm(self, layer: str) -> float:
        count = self.layer_count.get(layer, 0)
        return self.layer_norm.get(layer, 0.0) / count if count else math.nan

    def per_step(self, steps: list[int], sums: dict[int, float], counts: dict[int, int] | None = None) -> np.ndarray:
        counts = self.step_count if counts is None else counts
        return np.array([sums[s] / counts[s] if counts.get(s) else math.nan for s in steps])


def run_profile(store: StoreReader, capture_point: str, layers: list[str], scan: Scan = LOCAL) -> Profile:
    """One pass over a capture point: per-layer and per-step norms, losses, cumulative updates (summed over
    the scan's parts)."""
    selection = store.select(capture_point, layers=layers)
    what = f"compare: profile of {capture_point!r} in {store.path.name}"
    step_size: Counter[int] = Counter()
    for ref in selection.refs:
        step_size[ref.step] += ref.size
    profile = Profile({}, {}, {}, {}, {}, {}, {})
    updates: dict[str, dict[str, Tensor]] = {layer: {} for layer in layers}
    for batch in scan.part(selection, what).selection.batches():
        step, lr = batch.ref.step, batch.ref.lr_weight
        by_layer: dict[str, list] = {}
        for record in batch.records:
            by_layer.setdefault(record.layer, []).append(record)
        for layer, records in by_layer.items():
            norms = ops.total_sq_norms(records).double().clamp_min(0).sqrt()  # (B,)
            profile.layer_norm[layer] = profile.layer_norm.get(layer, 0.0) + float(norms.sum())
            profile.layer_count[layer] = profile.layer_count.get(layer, 0) + batch.size
            if any(record.kind not in EXACT_KINDS for record in records):
                profile.inexact[layer] = profile.inexact.get(layer, 0) + 1  # no weight update: none for the layer
                continue
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
    sums = [profile.layer_norm, profile.layer_count, profile.step_norm, profile.step_count]
    every = scan.every([*sums, profile.step_loss, profile.loss_count, profile.inexact], what)
    layer_norm, layer_count, step_norm, step_count, step_loss, loss_count, inexact = (_added(p) for p in zip(*every))
    profile = Profile(layer_norm, layer_count, step_norm, step_count, step_loss, loss_count, {}, inexact)
    for layer in layers:
        grads = scan.sum(updates[layer], f"{what} ({layer})")  # every rank calls it (a collective)
        if grads and not inexact.get(layer):  # some steps' updates missing: no cumulative update
            profile.update[layer] = torch.cat([grads[name].reshape(-1) for name in sorted(grads)])
    return profile


def _added(parts: tuple[dict[Any, Any], ...]) -> dict[Any, Any]:
    """Per key, the sum of its values over the parts (a key some part lacks counts as zero there)."""
    out: dict[Any, Any] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out


def compare_profiles(mine: Profile, theirs: Profile, capture_point: str = "train") -> RunComparison:
    """The :class:`RunComparison` of two runs' profiles over the same layers; a note per kind of missing cosine."""
    rows, zero = [], []
    kept: dict[str, list[str]] = {"this run": [], "the other run": []}
    for layer in mine.layer_norm:
        a, b = mine.mean_norm(layer), theirs.mean_norm(layer)
        ratio = a / b if b > 0 else (math.inf if a > 0 else math.nan)
        cosine = _cosine(mine.update.get(layer), theirs.update.get(layer))
        for run, profile in (("this run", mine), ("the other run", theirs)):
            if profile.inexact.get(layer):
                kept[run].append(layer)
        if cosine is None and not (mine.inexact.get(layer) or theirs.inexact.get(layer)):
            zero.append(layer)
        rows.append(LayerComparison(layer, a, b, ratio, cosine))
    notes = _notes(kept, zero, capture_point)
    steps = sorted(set(mine.step_count) | set(theirs.step_count))
    return RunComparison(
        rows,
        np.array(steps, dtype=np.int64),
        mine.per_step(steps, mine.step_norm),
        theirs.per_step(steps, theirs.step_norm),
        mine.per_step(steps, mine.step_loss, mine.loss_count),
        theirs.per_step(steps, theirs.step_loss, theirs.loss_count),
        notes,
    )


def _notes(kept: dict[str, list[str]], zero: list[str], capture_point: str) -> list[str]:
    """Why ``update_cosine`` is missing: layers a run keeps projected or as norms only at some step, layers whose
    cumulative update is zero."""
    notes = []
    inexact = sorted({layer for layers in kept.values() for layer in layers})
    if inexact:
        runs = " and ".join(run for run, layers in kept.items() if layers)
        notes.append(
            f"update_cosine is blank for {_named(inexact)}: {runs} keep(s) them projected or as norms only at some "
            f"steps of {capture_point!r}, which hold no weight update; capture them exactly to compare updates "
            "(policy='exact', or a budget that keeps them exact)"
        )
    if zero:
        notes.append(f"update_cosine is blank for {_named(zero)}: a run's cumulative update of them is zero")
    return notes


def _named(layers: list[str], shown: int = 5) -> str:
    more = f" and {len(layers) - shown} more" if len(layers) > shown else ""
    return f"{len(layers)} layer(s) ({', '.join(layers[:shown])}{more})"


def _cosine(a: Tensor | None, b: Tensor | None) -> float | None:
    """The cosine of two cumulative updates; None where one is missing or zero."""
    if a is None or b is None:
        return None
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else None
