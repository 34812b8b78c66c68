"""Training-dynamics queries of a store, streamed batch by batch over selections.

Conventions shared by every method here:

- **Occurrences.** A sample seen at several steps (several epochs) counts once per
  occurrence; results that name samples give ``(sample id, step)`` pairs.
- **Steps.** ``steps`` is one step or an inclusive ``(first, last)`` range, ``epochs`` one
  epoch or several, as in :meth:`GradientStore.select`.
- **Learning rate.** "How much a weight changed" weights each step's gradients by the
  learning rate recorded with its batch (1 where none was): plain SGD moves a weight by
  ``-lr_t`` times the step's gradient. Momentum and adaptive optimizers are not modelled.
- **Parameters shared by layers** (a module called twice, tied weights) are handled per
  parameter: the per-sample gradient of a parameter sums every record that holds it.
- **Scans.** Each reads through the store's scan (:mod:`.scan`): partial sums are added, per-sample
  rows gathered in selection order, so a partitioned store gives the one-process results.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.analysis.per_batch import abs_sum, add_to, entry_values, positive_int, top_entries
from metastore_plugins.core.analysis.results import Contributors, RunComparison, Spike, WeightChange
from metastore_plugins.core.analysis.run_profile import compare_profiles, run_profile
from metastore_plugins.core.analysis.scan import Scan, scan_of
from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import Selection, StoreReader, find_store_dir

Steps = int | tuple[int, int] | None
Epochs = int | Iterable[int] | None
Reduction = Literal["mean", "sum", "mean_of_batches"]


# -- helpers -------------------------------------------------------------------------


def _layer_param(store: StoreReader, layer: str, role: str) -> str:
    params = store.layer_params(layer)
    if role not in params:
        raise StoreError(f"layer {layer!r} has no captured parameter role {role!r}; it has: {', '.join(params)}")
    return params[role]


def _layers_holding(store: StoreReader, names: Iterable[str]) -> list[str]:
    wanted = set(names)
    return [layer for layer in store.layers() if wanted & set(store.layer_params(layer).values())]


def _nonempty(store: StoreReader, capture_point: str, steps: Steps, epochs: Epochs, layers: list[str]) -> Selection:
    selection = store.select(capture_point, steps=steps, epochs=epochs, layers=layers)
    if not selection.refs:
        raise StoreError(
            f"no batch of capture point {capture_point!r} matches steps={steps!r}, epochs={epochs!r}; "
            f"stored steps: {store.steps(capture_point)[:20]}"
        )
    return selection


def _changes(names: list[str], selection: Selection, max_bytes: int, scan: Scan) -> dict[str, Tensor]:
    """``sum_t lr_t sum_{i in t} |g_i|`` per parameter over the selection (float64), summed over the scan's parts."""
    total: dict[str, Tensor] = {}
    for batch in scan.part(selection, "weight changes").selection.batches():
        for name, value in abs_sum(batch.records, names, max_bytes).items():
            add_to(total, name, batch.ref.lr_weight * value.double())
    return scan.sum(total, "weight changes")


# -- queries -------------------------------------------------------------------------


def batch_gradient(
    store: StoreReader,
    step: int,
    capture_point: str = "train",
    reduction: Reduction = "mean",
    *,
    layers: Sequence[str] | None = None,
) -> dict[str, Tensor]:
    """The restored mini-batch gradient of one step: parameter name -> ``param.shape``.

    Every stored batch of the step (all micro-batches of gradient accumulation, all
    ranks) contributes. With ``N`` samples in the step and ``n_b`` in stored batch ``b``:

    - ``"mean"``: ``sum_i g_i / N``. This is ``.grad`` when the loss averaged the whole
      step's samples: one batch, or accumulation where each micro-batch's mean loss was
      divided by the accumulation count and micro-batches (and ranks) are equally large.
    - ``"mean_of_batches"``: the mean over stored batches of ``sum_{i in b} g_i / n_b``:
      ``.grad`` of accumulation (``loss / accumulation_steps``) and DDP averaging when
      batch sizes differ (a short last micro-batch).
    - ``"sum"``: ``sum_i g_i``.

    Only captured parameters appear. Raises ``StoreError`` if the step is not stored.
    """
    if reduction not in ("mean", "sum", "mean_of_batches"):
        raise ConfigError(f"reduction must be 'mean', 'sum' or 'mean_of_batches', got {reduction!r}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"step must be one training step (an int), got {step!r}")
    selection = store.select(capture_point, steps=int(step), layers=layers)
    if not selection.refs:
        shown = store.steps(capture_point)
        raise StoreError(
            f"step {step} is not stored at capture point {capture_point!r}; stored steps: "
            f"{shown[:20]}{' ...' if len(shown) > 20 else ''}"
        )
    scan = scan_of(store)
    total: dict[str, Tensor] = {}
    what, count, batches = f"batch_gradient of step {step}", 0, 0
    for batch in scan.part(selection, what).selection.batches():
        factor = 1.0 / batch.size if reduction == "mean_of_batches" else 1.0
        for name, grad in ops.batch_gradient(batch.records, "sum").items():
            add_to(total, name, grad * factor)
        count, batches = count + batch.size, batches + 1
    counts = scan.every((count, batches), f"{what} (counts)")
    divisor = {"mean": sum(c for c, _ in counts), "sum": 1, "mean_of_batches": sum(b for _, b in counts)}[reduction]
    return {name: grad / divisor for name, grad in scan.sum(total, what).items()}


def changed_most(
    store: StoreReader,
    layer: str | None = None,
    k: int = 10,
    *,
    steps: Steps = None,
    epochs: Epochs = None,
    capture_point: str = "train",
    per_param: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[WeightChange]:
    """The weights that changed most: largest ``sum_t lr_t sum_{i in t} |g_i|`` over the range.

    Args:
        layer: restrict to this layer's parameters (every captured parameter by default).
        k: entries per parameter (``per_param=True``), or in all (``per_param=False``).

    Returns:
        ``WeightChange(param, index, value)`` rows, grouped by parameter, largest first.
    """
    k = positive_int("k", k)
    names = list(store.parameters()) if layer is None else list(store.layer_params(layer).values())
    selection = _nonempty(store, capture_point, steps, epochs, _layers_holding(store, names))
    totals = _changes(names, selection, max_bytes, scan_of(store))
    rows: list[WeightChange] = []
    for name in names:
        if name in totals:
            index, values = top_entries(totals[name], k)
            rows.extend(WeightChange(name, i, v) for i, v in zip(index, values))
    if not per_param:
        rows = sorted(rows, key=lambda row: -row.value)[:k]
        rows = sorted(rows, key=lambda row: (names.index(row.param), -row.value))
    return rows


def top_contributors(
    store: StoreReader,
    layer: str,
    k: int = 5,
    *,
    role: str = "weight",
    entries: Any = None,
    steps: Steps = None,
    epochs: Epochs = None,
    capture_point: str = "train",
    n_entries: int = 10,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Contributors:
    """Per weight entry, the ``k`` sample occurrences with the largest ``|g_i[entry]|`` in the range.

    Args:
        layer, role: the parameter (``"weight"``, ``"bias"``, ...).
        entries: index tuples into the parameter's shape (``[(o, i), ...]``); by default
            the ``n_entries`` that changed most (:meth:`changed_most`'s measure).
        k: contributors per entry (fewer if the range holds fewer occurrences).

    Returns:
        :class:`Contributors`: ``sample_ids``, ``steps`` and signed per-sample
        gradients ``values`` (raw, not lr-weighted), each ``(E, k)``, largest ``|value|`` first.
    """
    k = positive_int("k", k)
    name = _layer_param(store, layer, role)
    selection, scan = _nonempty(store, capture_point, steps, epochs, _layers_holding(store, [name])), scan_of(store)
    if entries is None:
        changes = _changes([name], selection, max_bytes, scan)[name]
        entries, _ = top_entries(changes, positive_int("n_entries", n_entries))
    shape = store.parameters()[name]
    try:
        flat_entries = torch.as_tensor(entries)
    except (RuntimeError, TypeError, ValueError):
        flat_entries = torch.zeros(0)
    if flat_entries.dim() == 1:
        flat_entries = flat_entries.unsqueeze(0)  # one index tuple
    if flat_entries.dim() != 2 or flat_entries.shape[1] != len(shape) or flat_entries.is_floating_point():
        raise ConfigError(f"entries must be index tuples into {name} of shape {shape}, got {entries!r}")
    flat_entries = flat_entries.long()
    n, part = flat_entries.shape[0], scan.part(selection, f"top_contributors of {name!r}")
    at = torch.from_numpy(part.positions)  # (n_p,) where each occurrence stands in the selection
    kept = [torch.zeros(n, 0, dtype=torch.float64)] + [torch.zeros(n, 0, dtype=torch.long)] * 3  # value,id,step,at
    for batch in part.selection.batches():
        block = entry_values(batch.records, name, flat_entries, max_bytes).T.double()  # (E, B)
        new = [block, batch.meta["sample_id"].long().expand(n, -1), torch.full((n, batch.size), batch.ref.step)]
        new.append(at[: batch.size].expand(n, -1))
        at = at[batch.size :]
        kept = _largest([torch.cat(pair, 1) for pair in zip(kept, new)], k)
    found = scan.every(kept, f"top_contributors of {name!r}")
    merged = [torch.cat(columns, 1) for columns in zip(*found)]  # every part's, ordered as one process meets them
    first = torch.sort(merged[3], dim=1, stable=True).indices
    values, ids, step_of, _ = _largest([m.gather(1, first) for m in merged], k)
    chosen = [tuple(e) for e in flat_entries.tolist()]
    return Contributors(name, chosen, ids.numpy(), step_of.numpy(), values.numpy())


def _largest(columns: list[Tensor], k: int) -> list[Tensor]:
    """``(E, n)`` columns ``[values, ...]`` cut to each row's ``k`` largest ``|values|`` (ties: the earlier first)."""
    order = torch.sort(columns[0].abs(), dim=1, descending=True, stable=True).indices[:, :k]  # (E, k)
    return [c.gather(1, order) for c in columns]


def exceed_fractions(
    store: StoreReader,
    threshold: float,
    capture_point: str = "train",
    *,
    of: Literal["samples", "weights"] = "samples",
    layers: Sequence[str] | None = None,
    steps: Steps = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per stored step, the fraction of per-sample gradient norms ``> threshold`` (``of="samples"``),
    or of entries of the step's mean batch gradient with ``|g| > threshold`` (``of="weights"``).

    Returns:
        ``(steps, fractions)``, both ``(S,)``.
    """
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"threshold must be a finite number >= 0, got {threshold!r}")
    threshold = value
    if of not in ("samples", "weights"):
        raise ConfigError(f"of must be 'samples' or 'weights', got {of!r}")
    if of == "weights":
        at_steps = sorted({ref.step for ref in store.select(capture_point, steps=steps).refs})
        grads = (batch_gradient(store, step, capture_point, layers=layers) for step in at_steps)
        return np.array(at_steps, dtype=np.int64), np.array([ops.weight_exceed_fraction(g, threshold) for g in grads])
    scan, what = scan_of(store), f"exceed_fractions of {capture_point!r}"
    selection = store.select(capture_point, steps=steps, layers=layers)
    part, rows, dtype = scan.part(selection, what), [], torch.float32  # the norms' own dtype, compared in it
    for batch in part.selection.batches():
        kept = bool(batch.records)  # a batch kept as "nothing" by the capture policy counts for nothing
        norms = ops.total_sq_norms(batch.records).clamp_min(0).sqrt() if kept else torch.zeros(batch.size)  # (B,)
        dtype, norms = norms.dtype if kept else dtype, norms.double()
        rows.append(torch.stack([norms, torch.full_like(norms, batch.ref.step), torch.full_like(norms, kept)], 1))
    block = torch.cat(rows).numpy() if rows else np.zeros((0, 3))
    found = torch.from_numpy(scan.gather(block, part, what))  # (N, 3): norm, step, kept
    found = found[found[:, 2] > 0]
    if not len(found):
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    stored, fractions = ops.step_exceed_fractions(found[:, 0].to(dtype), found[:, 1].long(), threshold)
    return stored.numpy(), fractions.numpy()


def spikes(
    store: StoreReader,
    threshold: float,
    fraction: float = 0.1,
    before: int = 3,
    capture_point: str = "train",
    *,
    layers: Sequence[str] | None = None,
) -> list[Spike]:
    """Steps where more than ``fraction`` of per-sample gradient norms exceed ``threshold``.

    For each such step ``s`` (first first), the sample ids seen at training steps
    ``s - before .. s - 1`` (those steps that are stored; unique, in the order seen).
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.number)) or not 0 <= fraction < 1:
        raise ConfigError(f"fraction must be a number in [0, 1), got {fraction!r}")
    if isinstance(before, bool) or not isinstance(before, (int, np.integer)) or before < 0:
        raise ConfigError(f"before must be an integer >= 0 (steps to look back), got {before!r}")
    steps, fractions = exceed_fractions(store, threshold, capture_point, layers=layers)
    out = []
    for step, frac in zip(steps.tolist(), fractions.tolist()):
        if frac <= fraction:
            continue
        window = store.select(capture_point, steps=(step - before, step - 1)) if before else None
        found = sorted({ref.step for ref in window.refs}) if window is not None else []
        ids = window.sample_ids() if window is not None else np.zeros(0, dtype=np.int64)
        out.append(Spike(step, frac, found, np.array(list(dict.fromkeys(ids.tolist())), dtype=np.int64)))
    return out


def compare(
    store: StoreReader,
    other: StoreReader | str | os.PathLike[str],
    capture_point: str = "train",
    *,
    layers: Sequence[str] | None = None,
) -> RunComparison:
    """Compare two runs of the same model: per layer mean gradient norms, their ratio
    (this run / other) and the cosine between cumulative SGD updates ``sum_t lr_t g_t``
    (``g_t``: the step's mean gradient); per step, mean gradient norm and loss side by side.

    Raises:
        StoreError: if the runs share no layer of equal parameter shapes.
    """
    if not isinstance(other, StoreReader):
        other = StoreReader(find_store_dir(other))
    shapes, other_shapes = store.parameters(), other.parameters()
    common = [
        layer
        for layer in (store.layers() if layers is None else list(layers))
        if layer in other.layers()
        and all(shapes.get(n) == other_shapes.get(n) for n in store.layer_params(layer).values())
        and set(store.layer_params(layer).values()) == set(other.layer_params(layer).values())
    ]
    missing = [] if layers is None else [layer for layer in layers if layer not in common]
    if not common or missing:
        what = f"layer(s) {', '.join(map(repr, missing))} are not" if missing else "no layer is"
        raise StoreError(
            f"{what} in both {store.path} and {other.path} with the same parameters; compare runs of one model"
        )
    scan = scan_of(store)  # the other run is read the same way
    return compare_profiles(
        run_profile(store, capture_point, common, scan), run_profile(other, capture_point, common, scan), capture_point
    )
