"""Callback overhead on the examples: training time with and without the callback, side by side.

``python -m metastore_bench.callback_bench [--rounds 3] [--only lightning|hf] [--doc PATH] [--out JSON]``
runs each example as a
fresh process per variant, round-robin (every variant once per round, so that load from other
jobs hits them alike), reads the training time each example measures itself (``result.json``:
``Trainer.fit`` / ``Trainer.train``, reports included when they are built) with how long its checkpoint
passes, reports and their exact refinement took and its peak resident memory, and writes
``metastore_bench/results/callbacks.json`` and the section of ``docs/benchmarks.md`` between the
``callbacks`` markers. With ``--only``, the other examples keep their rows of the previous run
(from the JSON), each example stating when it was measured.
"""

from __future__ import annotations

import datetime as dt
import statistics
import sys
import tempfile
from typing import Any

from .example_runs import run_example
from .publish import bench_parser, keep_previous, publish, visible_machine

START, END = "<!-- callbacks:start -->", "<!-- callbacks:end -->"

#: example -> (script, {variant: extra arguments}); the first variant is the baseline
EXAMPLES: dict[str, tuple[str, dict[str, list[str]]]] = {
    "lightning": (
        "examples/lightning_digits.py",
        {
            "no callback": ["--no-callback"],
            "training steps captured": ["--no-passes"],
            "+ checkpoint passes": ["--no-reports"],
            "+ reports (the example)": [],
            "outliers from the training steps, 256-sample passes, reports": ["--outliers-from", "training"],
            "policy='exact': training steps captured": ["--no-passes", "--policy", "exact"],
        },
    ),
    "hf": (
        "examples/finetune_bert.py",
        {
            "no callback": ["--no-callback"],
            "training steps captured": ["--no-passes"],
            "+ passes + reports (the example)": [],
            "256-sample passes + reports": ["--checkpoint-train-samples", "256"],
            "policy='exact': training steps captured": ["--no-passes", "--policy", "exact"],
            "policy='exact': + passes + reports (the example)": ["--policy", "exact"],
        },
    ),
    "hf-bert4": (  # a 4-layer 256-wide BERT (random weights) under the HF callback as it comes
        "examples/hf_text_classifier.py",
        {
            "no callback": ["--no-callback", "--layers", "4", "--hidden", "256"],
            "the callback's defaults": ["--defaults", "--layers", "4", "--hidden", "256"],
        },
    ),
    "hf-defaults": (  # the MiniLM fine-tune under the HF callback as it comes (issue 45's target: 1.3x)
        "examples/finetune_bert.py",
        {"no callback": ["--no-callback"], "the callback's defaults": ["--defaults"]},
    ),
    "hf-bert4-steps5": (  # the 4-layer BERT evaluating every 5 steps (issue 45's target: 1.5x)
        "examples/hf_text_classifier.py",
        {
            "no callback": ["--no-callback", "--layers", "4", "--hidden", "256", "--eval-steps", "5"],
            "the callback's defaults": ["--defaults", "--layers", "4", "--hidden", "256", "--eval-steps", "5"],
        },
    ),
    "lightning-defaults": (  # the digits MLP under the Lightning callback as it comes
        "examples/lightning_digits.py",
        {"no callback": ["--no-callback"], "the callback's defaults": ["--defaults"]},
    ),
}


#: what each run's ``result.json`` says besides ``seconds``: where the time after the training steps went, and memory
PHASES = ("pass_seconds", "basis_seconds", "refine_seconds", "report_seconds", "peak_rss_mib")


def run_once(script: str, extra: list[str]) -> dict[str, float]:
    """Training seconds of one run of ``script`` and its :data:`PHASES` (its ``result.json``), in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="msbench-cb-") as out:
        result = run_example(script, out, extra)
        return {key: float(result[key]) for key in ("seconds", *PHASES) if key in result}


def measure(examples: list[str], rounds: int) -> dict[str, Any]:
    started = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {rounds} round(s)"
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {v: [] for v in EXAMPLES[name][1]} for name in examples}
    for _ in range(rounds):
        for name in examples:
            script, variants = EXAMPLES[name]
            for variant, extra in variants.items():
                print(f"[callbacks] {name}: {variant}", file=sys.stderr, flush=True)
                runs[name][variant].append(run_once(script, extra))
    results: dict[str, Any] = {}
    for name, by_variant in runs.items():
        base = statistics.median(r["seconds"] for r in next(iter(by_variant.values())))
        variants = {}
        for variant, found in by_variant.items():
            times = [r["seconds"] for r in found]
            row = {"median_s": statistics.median(times), "times_s": times, "ratio": statistics.median(times) / base}
            for key in PHASES:
                values = [r[key] for r in found if key in r]
                if values:
                    row[key] = statistics.median(values)
            variants[variant] = row
        results[name] = {"script": EXAMPLES[name][0], "measured": started, "variants": variants}
    return results


def _cell(row: dict[str, Any], key: str, unit: str) -> str:
    return f"{row[key]:.1f}{unit}" if key in row else ""


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"### {meta['machine']}", ""]
    lines += [f"- `{entry['script']}`: {entry.get('measured', '?')}" for entry in results.values()]
    lines += [
        "",
        "Medians over the rounds. *Passes*: the checkpoint passes, of which *basis fit* fits the curvature "
        "eigenbasis their projections are kept on (with the pass's training side where the fit is read from it); "
        "*reports*: building the reports at the end of training, of which "
        "*refinement* is the exact recomputation of influence candidates; all are inside the training time. "
        "*Peak RSS*: the process's peak resident memory.",
        "",
        "| example | variant | median training time | ratio to no callback | passes | basis fit | reports "
        "| refinement | peak RSS | all runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in results.values():
        for variant, row in entry["variants"].items():
            runs = ", ".join(f"{t:.2f}" for t in row["times_s"])
            phases = " | ".join(
                _cell(row, key, unit)
                for key, unit in (
                    ("pass_seconds", " s"),
                    ("basis_seconds", " s"),
                    ("report_seconds", " s"),
                    ("refine_seconds", " s"),
                )
            )
            rss = f"{row['peak_rss_mib']:,.0f} MiB" if "peak_rss_mib" in row else ""
            lines.append(
                f"| `{entry['script']}` | {variant} | {row['median_s']:.2f} s | {row['ratio']:.2f}x | {phases} "
                f"| {rss} | {runs} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("callback_bench", __doc__, "callbacks.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(EXAMPLES), action="append", help="one example (repeatable)")
    args = parser.parse_args(argv)

    results = measure(args.only or list(EXAMPLES), args.rounds)
    if args.only and args.out.exists():  # keep the other examples' rows of the previous run
        results = keep_previous(args.out, results, EXAMPLES)
    meta = {"machine": visible_machine()}
    return publish(args.out, {"meta": meta, "results": results}, markdown(results, meta), args.doc, (START, END))


if __name__ == "__main__":
    raise SystemExit(main())
