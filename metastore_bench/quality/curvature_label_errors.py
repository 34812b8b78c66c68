"""A reduced label-error grid for the curvature self-influence detectors against AUM (issue 31, point 3).

``python -m metastore_bench.quality.curvature_label_errors [--seeds 1] [--rates 0.1 0.3]``

The full harness (``python -m metastore_bench.quality --only label-errors``) runs 120 digits settings
and MiniLM; this runs the digits MLP and CNN, every noise kind, the given rates and seeds, with the
store detectors only (no cleanlab folds), so that the choice of the outlier report's default can be
measured when the full run does not fit. Writes ``metastore_bench/results/quality_label_errors_curvature.json``
and prints the precision table (:func:`~.tables.metric_table`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from ..publish import RESULTS
from ..timing import machine, versions
from .digits import ModelKind
from .digits_task import DigitsTask
from .label_errors import Setting, evaluate
from .tables import metric_table

NOISES = ("uniform", "class_conditional", "hard")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="seeds per setting (0, 1, ...)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.3], help="shares of labels flipped")
    parser.add_argument("--out", default=str(RESULTS / "quality_label_errors_curvature.json"))
    args = parser.parse_args(argv)
    start, rows = time.perf_counter(), []
    kinds: tuple[ModelKind, ...] = ("mlp", "cnn")
    for kind in kinds:
        name, task = f"digits-{kind}", DigitsTask(kind, train_size=1497, epochs=4)
        for seed in range(args.seeds):
            clean = None
            for noise in NOISES:
                if noise != "uniform" and clean is None:
                    clean = task.clean_probs(seed)
                for rate in args.rates:
                    row = evaluate(task, Setting(name, noise, rate, seed), clean_probs=clean, cleanlab=False)
                    scores = {
                        k: round(v["precision"], 3) for k, v in row["detectors"].items() if "FAC" in k or k == "AUM"
                    }
                    print(f"{name} {noise} {rate:.0%} seed {seed}: {scores}", flush=True)
                    rows.append(row)
    result = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "versions": versions("torch"),
        "label_errors": {"rows": rows, "seconds": round(time.perf_counter() - start, 1)},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(metric_table(rows, "precision"))
    return result


if __name__ == "__main__":
    main()
