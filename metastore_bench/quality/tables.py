"""docs/quality.md's generated tables and plot, from the label-error rows of :mod:`.label_errors`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def _detectors(rows: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for row in rows:
        names += [name for name in row["detectors"] if name not in names]
    return names


def _mean(rows: list[dict[str, Any]], name: str, metric: str) -> float:
    values = [row["detectors"][name][metric] for row in rows if name in row["detectors"]]
    return float(np.mean(values)) if values else float("nan")


def metric_table(rows: list[dict[str, Any]], metric: str) -> str:
    """Markdown: a row per (task, detector), a column per (noise, rate); each cell the mean over seeds."""
    lines = []
    for task in sorted({row["task"] for row in rows}):
        mine = [row for row in rows if row["task"] == task]
        settings = sorted({(row["noise"], row["rate"]) for row in mine})
        head = [f"{noise} {rate:.0%}" for noise, rate in settings]
        lines += [f"**{task}** ({metric}, mean of {len({r['seed'] for r in mine})} seed(s))", ""]
        lines += ["| detector | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
        best = {s: max(_mean(_at(mine, s), n, metric) for n in _detectors(mine)) for s in settings}
        for name in _detectors(mine):
            cells = []
            for setting in settings:
                value = _mean(_at(mine, setting), name, metric)
                cells.append(
                    "" if np.isnan(value) else (f"**{value:.3f}**" if value >= best[setting] else f"{value:.3f}")
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _at(rows: list[dict[str, Any]], setting: tuple[str, float]) -> list[dict[str, Any]]:
    return [row for row in rows if (row["noise"], row["rate"]) == setting]


def cost_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per task, the trainings and mean seconds of one captured run against cleanlab's K folds."""
    lines = [
        "| task | captured run: trainings | seconds (train + score) | cleanlab: trainings | seconds | "
        "find_label_issues: flagged / flipped, precision, recall |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for task in sorted({row["task"] for row in rows}):
        mine = [row for row in rows if row["task"] == task]
        clean = [row for row in mine if "cleanlab_seconds" in row]
        issues = defaultdict(list)
        for row in clean:
            for key, value in row["cleanlab_find_label_issues"].items():
                issues[key].append(value)
        flipped = np.mean([row["flipped"] for row in clean]) if clean else float("nan")
        lines.append(
            f"| {task} | 1 | {np.mean([r['store_seconds'] for r in mine]):.1f} | "
            + (
                f"{clean[0]['cleanlab_trainings']} | {np.mean([r['cleanlab_seconds'] for r in clean]):.1f} | "
                f"{np.mean(issues['flagged']):.0f} / {flipped:.0f}, {np.mean(issues['precision']):.2f}, "
                f"{np.mean(issues['recall']):.2f} |"
                if clean
                else "- | - | - |"
            )
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], detectors: dict[str, str], path: Path) -> None:
    """Precision at k against the noise rate: a panel per (task, noise), a line per detector (``{name: label}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(row["task"], row["noise"]) for row in rows})
    columns = min(4, len(panels))
    grid_rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(3.6 * columns, 3.2 * grid_rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (task, noise) in zip(axes.flat, panels):
        mine = [row for row in rows if (row["task"], row["noise"]) == (task, noise)]
        rates = sorted({row["rate"] for row in mine})
        for name, label in detectors.items():
            values = [_mean([r for r in mine if r["rate"] == rate], name, "precision") for rate in rates]
            if not np.isnan(values).all():
                ax.plot([100 * r for r in rates], values, marker="o", label=label)
        ax.set_title(f"{task}: {noise}", fontsize=9)
        ax.set_xlabel("labels flipped (%)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    for row_axes in axes:
        row_axes[0].set_ylabel("precision at k = flipped")
    axes.flat[len(panels) - 1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
