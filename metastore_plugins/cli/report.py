"""``metastore report``: the end-of-training report files (and TensorBoard events) rebuilt from a store."""

from __future__ import annotations

import argparse
from pathlib import Path

from metastore_plugins.cli.output import emit
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.errors import StoreError


def cmd_report(args: argparse.Namespace, store: GradientStore) -> None:
    """Files into --out (default ``<store>/reports``, where the callbacks write theirs), and TensorBoard
    events (tables, histograms, figures, dynamics, projector) into --logdir. Under torchrun every rank
    scores its share and rank 0 writes."""
    from metastore_plugins.core.reports.partitioned import writes
    from metastore_plugins.core.reports.tensorboard import summary_writer
    from metastore_plugins.core.training.report_pass import report_run

    out = Path(args.out) if args.out else store.path / "reports"
    writers = [summary_writer(args.logdir)] if args.logdir is not None and writes(store) else []
    try:
        result = report_run(store, out, writers, k=args.k, influence_method=args.method)
    finally:
        for writer in writers:
            writer.close()
    if result is None:
        raise StoreError(f"{store.path} holds no checkpoint passes to report on; see `metastore inspect`")
    files = [*result.get("files", []), *([] if args.logdir is None else [str(args.logdir)])]
    emit(args, {"files": files}, "\n".join(["wrote:", *(f"  {f}" for f in files)]))
