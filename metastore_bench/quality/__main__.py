"""The quality harness: label-error detection and LDS, each against its peers.

``python -m metastore_bench.quality [--quick] [--only label-errors|lds] [--doc docs/quality.md]``

Label errors on the digits MLP, the digits CNN and the MiniLM review classifier, every noise
kind at 5-30%, each detector against cleanlab (:mod:`.label_errors`); LDS of TracIn against a
peer (:mod:`.lds`). Writes ``metastore_bench/results/quality*.json``, the tables of
``docs/quality.md`` and its plot. ``--quick`` is the CI smoke run (one small setting per task
family, no MiniLM).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..publish import RESULTS, write_section
from ..timing import machine, versions
from .digits_task import DigitsTask
from .label_errors import Setting, evaluate
from .tables import cost_table, metric_table, plot

NOISES = ("uniform", "class_conditional", "hard")
#: the detectors drawn in the plot, with their legend labels
PLOTTED = {
    "AUM": "AUM (the report's default)",
    "final loss": "final loss",
    "self-influence (checkpoints)": "self-influence (checkpoints)",
    "cleanlab label quality (5-fold)": "cleanlab, 5-fold",
}


def _settings(quick: bool) -> list[tuple[str, str, float, int]]:
    if quick:
        return [("digits-mlp", "uniform", 0.1, 0), ("digits-cnn", "hard", 0.1, 0)]
    digits = [
        (task, noise, rate, seed)
        for task in ("digits-mlp", "digits-cnn")
        for noise in NOISES
        for rate in (0.05, 0.1, 0.2, 0.3)
        for seed in range(5)
    ]
    return digits + [("minilm-reviews", "uniform", rate, 0) for rate in (0.1, 0.2)]


def label_errors(quick: bool, log: Any = print) -> list[dict[str, Any]]:
    """Every setting's row (:func:`~.label_errors.evaluate`)."""
    tasks: dict[str, Any] = {}
    clean: dict[tuple[str, int], np.ndarray] = {}
    rows = []
    for name, noise, rate, seed in _settings(quick):
        if name not in tasks:
            if name == "minilm-reviews":
                from .reviews import ReviewsTask

                tasks[name] = ReviewsTask()
            else:
                tasks[name] = DigitsTask(name.split("-")[1], train_size=600 if quick else 1497, epochs=4)
        task = tasks[name]
        probs = None
        if noise != "uniform":
            if (name, seed) not in clean:
                clean[(name, seed)] = task.clean_probs(seed)
            probs = clean[(name, seed)]
        start = time.perf_counter()
        row = evaluate(task, Setting(name, noise, rate, seed), clean_probs=probs)
        best = max(row["detectors"].items(), key=lambda item: item[1]["precision"])
        log(f"{name} {noise} {rate:.0%} seed {seed}: best {best[0]} {best[1]['precision']:.3f} "
            f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke run (a few minutes), no docs written")
    parser.add_argument("--only", choices=("label-errors", "lds"), default=None)
    parser.add_argument("--out", default=str(RESULTS), help="results directory")
    parser.add_argument("--doc", default=None, help="markdown file whose generated sections are replaced")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "versions": versions("torch", "transformers", "cleanlab", "dattri"),
        "quick": args.quick,
    }
    if args.only in (None, "label-errors"):
        start = time.perf_counter()
        rows = label_errors(args.quick)
        result["label_errors"] = {"rows": rows, "seconds": round(time.perf_counter() - start, 1)}
        (out / f"quality_label_errors{'_quick' if args.quick else ''}.json").write_text(json.dumps(result, indent=1))
        if args.doc:
            doc = Path(args.doc)
            body = "\n".join(
                [
                    f"Measured {result['date']} on {result['machine']} ({result['label_errors']['seconds']:.0f} s).",
                    "",
                    "### Precision at k (k = labels flipped)",
                    "",
                    metric_table(rows, "precision"),
                    "### AUROC",
                    "",
                    metric_table(rows, "auroc"),
                    "### Cost",
                    "",
                    cost_table(rows),
                ]
            )
            write_section(doc, body, "<!-- label-errors:start -->", "<!-- label-errors:end -->")
            plot(rows, PLOTTED, doc.parent / "quality-precision.png")
    if args.only in (None, "lds"):
        from . import lds

        path = out / f"quality_lds{'_quick' if args.quick else ''}.json"
        result["lds"] = lds.main([*(["--quick"] if args.quick else []), "--out", str(path)])
        if args.doc:
            kinds = [kind for kind in lds.KINDS if kind in result["lds"]]
            body = "\n\n".join(f"**{lds.TITLES[kind]}**\n\n{lds.table(result['lds'][kind])}" for kind in kinds)
            write_section(Path(args.doc), body + "\n", "<!-- lds:start -->", "<!-- lds:end -->")
    return result


if __name__ == "__main__":
    main()
