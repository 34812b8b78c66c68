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
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.store._dynamics_support import (
    Contributors,
    RunComparison,
    Spike,
    WeightChange,
    abs_sum,
    add_to,
    entry_values,
    positive_int,
    run_profile,
    top_entries,
)
from metastore_plugins.core.store.queries import DEFAULT_MAX_BYTES
from metastore_plugins.core.store.selection import Selection, StoredBatch

if TYPE_CHECKING:
    from metastore_plugins.core.store.reader import GradientStore

Steps = int | tuple[int, int] | None
Epochs = int | Iterable[int] | None
Reduction = Literal["mean", "sum", "mean_of_batches"]


def _store_error(message: str) -> ValueError:
    from metastore_plugins.core.store.reader import StoreError  # reader imports this module

    return StoreError(message)


def _lr(batch: StoredBatch) -> float:
    return 1.0 if batch.ref.lr is None else float(batch.ref.lr)


class DynamicsMixin:
    """Training-dynamics queries of :class:`~metastore_plugins.core.store.reader.GradientStore`."""

    # -- helpers -------------------------------------------------------------------------

    def _layer_param(self: GradientStore, layer: str, role: str) -> str:
        self._check_layers([layer])
        params = self._layers[layer]["params"]
        if role not in params:
            raise _store_error(f"layer {layer!r} has no captured parameter role {role!r}; it has: {', '.join(params)}")
        return params[role]

    def _layers_params(self: GradientStore, layer: str) -> list[str]:
        self._check_layers([layer])
        return list(self._layers[layer]["params"].values())

    def _layers_holding(self: GradientStore, names: Iterable[str]) -> list[str]:
        wanted = set(names)
        return [layer for layer, info in self._layers.items() if wanted & set(info["params"].values())]

    def _nonempty(
        self: GradientStore, capture_point: str, steps: Steps, epochs: Epochs, layers: list[str]
    ) -> Selection:
        selection = self.select(capture_point, steps=steps, epochs=epochs, layers=layers)
        if not selection.refs:
            raise _store_error(
                f"no batch of capture point {capture_point!r} matches steps={steps!r}, epochs={epochs!r}; "
                f"stored steps: {self.steps(capture_point)[:20]}"
            )
        return selection

    def _changes(self: GradientStore, names: list[str], selection: Selection, max_bytes: int) -> dict[str, Tensor]:
        """``sum_t lr_t sum_{i in t} |g_i|`` per parameter over the selection (float64)."""
        total: dict[str, Tensor] = {}
        for batch in selection.batches():
            for name, value in abs_sum(batch.records, names, max_bytes).items():
                add_to(total, name, _lr(batch) * value.double())
        return total

    # -- queries -------------------------------------------------------------------------

    def batch_gradient(
        self: GradientStore,
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
            raise ValueError(f"reduction must be 'mean', 'sum' or 'mean_of_batches', got {reduction!r}")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"step must be one training step (an int), got {step!r}")
        selection = self.select(capture_point, steps=int(step), layers=layers)
        if not selection.refs:
            shown = self.steps(capture_point)
            raise _store_error(
                f"step {step} is not stored at capture point {capture_point!r}; stored steps: "
                f"{shown[:20]}{' ...' if len(shown) > 20 else ''}"
            )
        total: dict[str, Tensor] = {}
        count, batches = 0, 0
        for batch in selection.batches():
            factor = 1.0 / batch.size if reduction == "mean_of_batches" else 1.0
            for name, grad in ops.batch_gradient(batch.records, "sum").items():
                add_to(total, name, grad * factor)
            count, batches = count + batch.size, batches + 1
        divisor = {"mean": count, "sum": 1, "mean_of_batches": batches}[reduction]
        return {name: grad / divisor for name, grad in total.items()}

    def changed_most(
        self: GradientStore,
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
        names = list(self.parameters()) if layer is None else list(self._layers_params(layer))
        selection = self._nonempty(capture_point, steps, epochs, self._layers_holding(names))
        totals = self._changes(names, selection, max_bytes)
        rows = []
        for name in names:
            if name in totals:
                index, values = top_entries(totals[name], k)
                rows.extend(WeightChange(name, i, v) for i, v in zip(index, values))
        if not per_param:
            rows = sorted(rows, key=lambda row: -row.value)[:k]
            rows = sorted(rows, key=lambda row: (names.index(row.param), -row.value))
        return rows

    def top_contributors(
        self: GradientStore,
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
        name = self._layer_param(layer, role)
        selection = self._nonempty(capture_point, steps, epochs, self._layers_holding([name]))
        if entries is None:
            changes = self._changes([name], selection, max_bytes)[name]
            entries, _ = top_entries(changes, positive_int("n_entries", n_entries))
        shape = self.parameters()[name]
        try:
            flat_entries = torch.as_tensor(entries)
        except (RuntimeError, TypeError, ValueError):
            flat_entries = torch.zeros(0)
        if flat_entries.dim() == 1:
            flat_entries = flat_entries.unsqueeze(0)  # one index tuple
        if flat_entries.dim() != 2 or flat_entries.shape[1] != len(shape) or flat_entries.is_floating_point():
            raise ValueError(f"entries must be index tuples into {name} of shape {shape}, got {entries!r}")
        flat_entries = flat_entries.long()
        n = flat_entries.shape[0]
        values = torch.zeros(n, 0, dtype=torch.float64)
        ids = torch.zeros(n, 0, dtype=torch.long)
        step_of = torch.zeros(n, 0, dtype=torch.long)
        for batch in selection.batches():
            part = entry_values(batch.records, name, flat_entries, max_bytes).T.double()  # (E, B)
            values = torch.cat([values, part], 1)
            ids = torch.cat([ids, batch.meta["sample_id"].long().expand(n, -1)], 1)
            step_of = torch.cat([step_of, torch.full((n, batch.size), batch.ref.step)], 1)
            order = torch.sort(values.abs(), dim=1, descending=True, stable=True).indices[:, :k]  # (E, k)
            values, ids, step_of = values.gather(1, order), ids.gather(1, order), step_of.gather(1, order)
        chosen = [tuple(e) for e in flat_entries.tolist()]
        return Contributors(name, chosen, ids.numpy(), step_of.numpy(), values.numpy())

    def exceed_fractions(
        self: GradientStore,
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
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
        threshold = value
        if of not in ("samples", "weights"):
            raise ValueError(f"of must be 'samples' or 'weights', got {of!r}")
        if of == "weights":
            stored = sorted({ref.step for ref in self.select(capture_point, steps=steps).refs})
            grads = (self.batch_gradient(step, capture_point, layers=layers) for step in stored)
            return np.array(stored, dtype=np.int64), np.array([ops.weight_exceed_fraction(g, threshold) for g in grads])
        norms, at = [], []
        for batch in self.select(capture_point, steps=steps, layers=layers).batches():
            if not batch.records:
                raise ValueError(f"the batch at step {batch.ref.step} holds no records of the selected layers {layers}")
            norms.append(ops.total_sq_norms(batch.records).clamp_min(0).sqrt())  # (B,)
            at.append(torch.full((batch.size,), batch.ref.step, dtype=torch.int64))
        if not norms:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        stored, fractions = ops.step_exceed_fractions(torch.cat(norms), torch.cat(at), threshold)
        return stored.numpy(), fractions.numpy()

    def spikes(
        self: GradientStore,
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
            raise ValueError(f"fraction must be a number in [0, 1), got {fraction!r}")
        if isinstance(before, bool) or not isinstance(before, (int, np.integer)) or before < 0:
            raise ValueError(f"before must be an integer >= 0 (steps to look back), got {before!r}")
        steps, fractions = self.exceed_fractions(threshold, capture_point, layers=layers)
        out = []
        for step, frac in zip(steps.tolist(), fractions.tolist()):
            if frac <= fraction:
                continue
            window = self.select(capture_point, steps=(step - before, step - 1)) if before else None
            found = sorted({ref.step for ref in window.refs}) if window is not None else []
            ids = window.sample_ids() if window is not None else np.zeros(0, dtype=np.int64)
            out.append(Spike(step, frac, found, np.array(list(dict.fromkeys(ids.tolist())), dtype=np.int64)))
        return out

    def compare(
        self: GradientStore,
        other: GradientStore | str | os.PathLike[str],
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
        if not hasattr(other, "select"):
            from metastore_plugins.core.store.reader import open_store

            other = open_store(other)
        shapes, other_shapes = self.parameters(), other.parameters()
        common = [
            layer
            for layer in (self.layers() if layers is None else list(layers))
            if layer in other.layers()
            and all(shapes.get(n) == other_shapes.get(n) for n in self._layers_params(layer))
            and set(self._layers_params(layer)) == set(other._layers_params(layer))
        ]
        missing = [] if layers is None else [layer for layer in layers if layer not in common]
        if not common or missing:
            what = f"layer(s) {', '.join(map(repr, missing))} are not" if missing else "no layer is"
            raise _store_error(
                f"{what} in both {self.path} and {other.path} with the same parameters; compare runs of one model"
            )
        return RunComparison.build(run_profile(self, capture_point, common), run_profile(other, capture_point, common))
