"""Callback overhead on the examples: training time with and without the callback, side by side.

``python -m benchmarks.callback_bench [--rounds 3] [--only lightning|hf] [--doc PATH] [--out JSON]``
runs each example as a
fresh process per variant, round-robin (every variant once per round, so that load from other
jobs hits them alike), reads the training time each example measures itself (``result.json``:
``Trainer.fit`` / ``Trainer.train``, reports included when they are built), and writes
``benchmarks/results/callbacks.json`` and the section of ``docs/benchmarks.md`` between the
``callbacks`` markers. With ``--only``, the other examples keep their rows of the previous run
(from the JSON), each example stating when it was measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .timing import machine, write_section

REPO = Path(__file__).resolve().parent.parent
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
}


def run_once(script: str, extra: list[str]) -> float:
    """Training seconds of one run of ``script`` (its ``result.json``), in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="msbench-cb-") as out:
        subprocess.run(
            [sys.executable, str(REPO / script), "--out", out, *extra],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        return float(json.loads((Path(out) / "result.json").read_text())["seconds"])


def measure(examples: list[str], rounds: int) -> dict[str, Any]:
    started = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {rounds} round(s)"
    times: dict[str, dict[str, list[float]]] = {name: {v: [] for v in EXAMPLES[name][1]} for name in examples}
    for _ in range(rounds):
        for name in examples:
            script, variants = EXAMPLES[name]
            for variant, extra in variants.items():
                print(f"[callbacks] {name}: {variant}", file=sys.stderr, flush=True)
                times[name][variant].append(run_once(script, extra))
    results: dict[str, Any] = {}
    for name, by_variant in times.items():
        base = statistics.median(next(iter(by_variant.values())))
        results[name] = {
            "script": EXAMPLES[name][0],
            "measured": started,
            "variants": {
                v: {"median_s": statistics.median(t), "times_s": t, "ratio": statistics.median(t) / base}
                for v, t in by_variant.items()
            },
        }
    return results


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"### {meta['machine']}", ""]
    lines += [f"- `{entry['script']}`: {entry.get('measured', '?')}" for entry in results.values()]
    lines += [
        "",
        "| example | variant | median training time | ratio to no callback | all runs |",
        "|---|---|---|---|---|",
    ]
    for entry in results.values():
        for variant, row in entry["variants"].items():
            runs = ", ".join(f"{t:.2f}" for t in row["times_s"])
            lines.append(
                f"| `{entry['script']}` | {variant} | {row['median_s']:.2f} s | {row['ratio']:.2f}x | {runs} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.callback_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(EXAMPLES), action="append", help="one example (repeatable)")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "callbacks.json")
    args = parser.parse_args(argv)

    results = measure(args.only or list(EXAMPLES), args.rounds)
    if args.only and args.out.exists():  # keep the other examples' rows of the previous run
        previous = json.loads(args.out.read_text()).get("results", {})
        results = {
            name: results.get(name, previous.get(name)) for name in EXAMPLES if name in results or name in previous
        }
    meta = {"machine": f"{machine()}, {os.cpu_count()} CPUs visible"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    write_section(args.doc, markdown(results, meta), START, END)
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
