"""``metastore query``: the training-dynamics questions (weights that changed most, contributors, spikes, compare)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from metastore_plugins.cli.output import emit, plain
from metastore_plugins.core.analysis import GradientStore, RunComparison, open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.reports import markdown_table


def cmd_query(args: argparse.Namespace, store: GradientStore) -> None:
    """The training-dynamics questions of docs/queries.md."""
    where: dict[str, Any] = {"capture_point": args.capture_point}
    steps = args.steps
    if args.question == "changed":
        rows = [plain(r) for r in store.changed_most(args.layer, args.k, steps=steps, **where)]
        emit(args, rows, markdown_table(rows, ("param", "index", "value")))
    elif args.question == "contributors":
        if args.layer is None:
            raise StoreError("query contributors needs --layer NAME (see `metastore inspect` for layer names)")
        rows = store.top_contributors(args.layer, args.k, steps=steps, **where).rows()
        emit(args, rows, markdown_table(rows, list(rows[0]) if rows else ["entry"]))
    elif args.question == "spikes":
        if args.threshold is None:
            raise StoreError("query spikes needs --threshold (a per-sample gradient norm)")
        spikes = store.spikes(args.threshold, args.fraction, args.before, **where)
        rows = [plain(s) for s in spikes]
        emit(args, rows, markdown_table(rows, list(rows[0]) if rows else ["step"]))
    else:  # compare
        if args.other is None:
            raise StoreError("query compare needs --other RUN (a second run of the same model)")
        comparison = store.compare(open_store(args.other), args.capture_point)
        emit(args, plain(comparison), comparison_text(comparison, args.k))


def comparison_text(comparison: RunComparison, k: int) -> str:
    """Per layer, and the ``k`` steps where the two runs' mean gradient norms differ most (``--json``: every step)."""
    layers = [plain(row) for row in comparison.layers]
    gap = np.abs(np.log(comparison.norm) - np.log(comparison.other_norm))  # (S,) NaN where a run lacks the step
    order = [int(i) for i in np.argsort(-np.nan_to_num(gap, nan=-1.0), kind="stable")[:k] if np.isfinite(gap[i])]
    steps = [
        {
            "step": int(comparison.steps[i]),
            "norm": float(comparison.norm[i]),
            "other_norm": float(comparison.other_norm[i]),
            "loss": float(comparison.loss[i]),
            "other_loss": float(comparison.other_loss[i]),
        }
        for i in sorted(order)
    ]
    return "\n".join(
        [
            markdown_table(layers, ("layer", "mean_norm", "other_mean_norm", "ratio", "update_cosine")),
            *comparison.notes,  # why an update_cosine is blank
            f"{len(comparison.steps)} steps; the {len(steps)} where the mean per-sample gradient norms differ most:",
            markdown_table(steps, ("step", "norm", "other_norm", "loss", "other_loss")),
        ]
    )
