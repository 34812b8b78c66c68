"""The ``metastore`` argument parser: one subparser per command, each bound to the function that runs it."""

from __future__ import annotations

import argparse
from typing import Any

from metastore_plugins.cli.arguments import (
    int64,
    layer_names,
    non_negative,
    positive,
    positive_float,
    sample_ids,
    step_range,
)
from metastore_plugins.cli.dynamics import cmd_query
from metastore_plugins.cli.inspection import cmd_compact, cmd_inspect, cmd_verify
from metastore_plugins.cli.queries import cmd_influence, cmd_outliers, cmd_restore, cmd_similar
from metastore_plugins.cli.report import cmd_report
from metastore_plugins.core.analysis.method_table import AUTO
from metastore_plugins.core.analysis.methods import method_choices
from metastore_plugins.core.distributed.launch import DEFAULT_TIMEOUT_S
from metastore_plugins.core.reports.tables import OUTLIER_RANKINGS


def build_parser() -> argparse.ArgumentParser:
    """The ``metastore`` parser: each subcommand sets ``func`` (and ``on_directory`` when it works on files)."""
    parser = argparse.ArgumentParser(prog="metastore", description="Inspect and query a metastore gradient store.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Any, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("run", help="the run directory or its store directory")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.set_defaults(func=func)
        return p

    p = add("inspect", cmd_inspect, "capture points, steps, samples, layers, bytes, damage")
    p.add_argument("--no-checksums", action="store_true", help="skip the sha256 check of every shard")
    p = add(
        "verify",
        cmd_verify,
        "check every shard against the index; --repair mends what a killed run or a damaged index left",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help=(
            "remove temporary files and untrusted index lines; re-list a readable shard the index lost "
            "(or move it to quarantine/), never delete one; remove only byte-for-byte copies"
        ),
    )
    p.add_argument("--no-checksums", action="store_true", help="skip the sha256 check of every shard")
    p.set_defaults(on_directory=True)
    p = add("compact", cmd_compact, "merge small shards into large ones (crash-safe; not while the run writes)")
    p.add_argument("--target-mb", type=positive, default=64, help="largest merged shard in MiB (default 64)")
    p.set_defaults(on_directory=True)
    p = add("report", cmd_report, "(re)build the report files")
    p.add_argument("--out", help="directory for the report files (default: STORE/reports, as the callbacks)")
    p.add_argument("-k", type=positive, default=20, help="rows of the outlier table")
    p.add_argument("--logdir", help="also write the reports as TensorBoard events into this directory")
    p.add_argument(
        "--method",
        choices=method_choices(),
        default=AUTO,
        help="what scores the influence table: auto (default: ekfac where the passes can be preconditioned, else "
        f"tracin), {', '.join(method_choices(auto=False))}",
    )
    p = add("outliers", cmd_outliers, "the training samples most likely mislabelled (lowest AUM, or self-influence)")
    p.add_argument("-k", type=positive, default=20, help="rows (default 20)")
    p.add_argument("--capture-point", action="append", help="capture point(s) to sum (default: epoch-*/train)")
    p.add_argument(
        "--by",
        choices=OUTLIER_RANKINGS,
        default="auto",
        help="ranking: auto (default: AUM where the training steps hold margins, else self-influence), aum, loss, "
        "self_influence",
    )
    p = add("influence", cmd_influence, "training samples that drove each test sample (EK-FAC, TracIn, ...)")
    p.add_argument("--test", type=sample_ids, help="comma-separated test sample ids (default: all)")
    p.add_argument("--capture-point", help="one test capture point, paired with the last train pass")
    p.add_argument("--train", action="append", help="train capture point(s) (default: epoch-*/train)")
    p.add_argument("--test-split", default="val", help="test split of the checkpoint passes (default: val)")
    p.add_argument("-k", type=positive, default=10, help="rows (default 10)")
    p.add_argument(
        "--method",
        choices=method_choices(),
        default=AUTO,
        help="what scores: auto (default: ekfac where every layer of the passes can be preconditioned, else "
        f"tracin), {', '.join(method_choices(auto=False))} (docs/queries.md#choosing-a-method)",
    )
    p.add_argument(
        "--damping",
        type=positive_float,
        help="kfac/ekfac: one absolute damping for every layer (default: --relative-damping x each layer's mean "
        "eigenvalue)",
    )
    p.add_argument(
        "--relative-damping",
        type=positive_float,
        help="kfac/ekfac/trak: the damping as a fraction of the mean eigenvalue (default 0.1 for kfac/ekfac, "
        "1.0 for trak)",
    )
    p.add_argument(
        "--layers",
        type=layer_names,
        help="comma-separated layers to score on (default: every layer; metastore inspect lists them): leave out a "
        "layer K-FAC cannot fit, such as one of two tied layers",
    )
    p = add("similar", cmd_similar, "samples whose gradients are most similar to one sample's")
    p.add_argument("--sample", type=int, required=True)
    p.add_argument("--capture-point", help="where the sample is stored (default: the last train pass)")
    p.add_argument("--candidates", help="capture point to search (default: the sample's)")
    p.add_argument("-k", type=positive, default=10, help="rows (default 10)")
    for name in ("influence", "similar"):
        sub.choices[name].add_argument(
            "--index",
            choices=["auto", "build", "off"],
            default="auto",
            help="the nearest-gradient index (docs/queries.md#top-k-at-any-scale): auto (default) scores only its "
            "candidates where one is kept, build builds it first, off scores every row"
            + ("; every --method: its candidates are scored exactly by it" if name == "influence" else ""),
        )
    for name in PARTITIONED:
        p = sub.choices[name]
        p.add_argument(
            "--device",
            help="where the queries compute (cuda, cuda:1; default: the CPU, or under "
            "torchrun with NCCL each rank's GPU)",
        )
        p.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT_S,
            help="under torchrun: seconds a rank waits for the others before naming the missing one",
        )
    p = add(
        "query",
        cmd_query,
        "training dynamics: weights that changed most, their top contributors, spikes, run comparison",
    )
    p.add_argument("question", choices=["changed", "contributors", "spikes", "compare"])
    p.add_argument("--layer", help="layer name (changed: all layers by default)")
    p.add_argument("--steps", type=step_range, help="one step N, or an inclusive step range LO:HI (default: all)")
    p.add_argument("--capture-point", default="train")
    p.add_argument("-k", type=positive, default=10, help="rows (default 10)")
    p.add_argument("--threshold", type=float, help="spikes: per-sample gradient norm threshold")
    p.add_argument("--fraction", type=float, default=0.1, help="spikes: fraction of samples above the threshold")
    p.add_argument("--before", type=non_negative, default=3, help="spikes: how many earlier steps to list samples of")
    p.add_argument("--other", help="compare: the other run")
    p = add("restore", cmd_restore, "write the exact dense gradient of one sample to a safetensors file")
    p.add_argument("--sample", type=int64, required=True)
    p.add_argument("--step", type=int64)
    p.add_argument("--capture-point")
    p.add_argument("--layer")
    p.add_argument("--out", required=True, help="output .safetensors file")
    return parser


#: Subcommands that run partitioned under ``torchrun`` (docs/distributed.md); the others refuse to.
PARTITIONED = ("outliers", "influence", "similar", "report")
