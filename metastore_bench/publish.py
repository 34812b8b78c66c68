"""Where a benchmark's figures go: its JSON under ``metastore_bench/results``, its section of a markdown
doc (rewritten between two markers, the hand-written text around them kept), and the terminal.

The scripts that measure and publish share their ``main``'s first and last lines::

    parser = bench_parser("callback_bench", __doc__, "callbacks.json")  # --doc, --out
    ...
    return publish(args.out, {"meta": meta, "results": results}, markdown(results, meta), args.doc, (START, END))
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .timing import machine, versions

REPO = Path(__file__).resolve().parent.parent
#: Where every script writes its JSON by default (``--out``).
RESULTS = REPO / "metastore_bench" / "results"
#: The markdown file the scripts rewrite a section of by default (``--doc``).
DOC = REPO / "docs" / "benchmarks.md"


def bench_parser(module: str, doc: str | None, results_file: str) -> argparse.ArgumentParser:
    """``python -m metastore_bench.<module>``'s parser, described by the first line of ``doc``, with ``--doc``
    (default: docs/benchmarks.md) and ``--out`` (default: ``metastore_bench/results/<results_file>``)."""
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.{module}", description=(doc or "").splitlines()[0])
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--out", type=Path, default=RESULTS / results_file)
    return parser


def round_robin_parser(module: str, doc: str | None, results_file: str) -> argparse.ArgumentParser:
    """:func:`bench_parser` with the options of a round-robin timing (``timing.round_robin``): ``--size``,
    ``--repeats``, ``--warmup``, ``--threads``."""
    parser = bench_parser(module, doc, results_file)
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return parser


def visible_machine() -> str:
    """The machine and how many CPUs this process sees (a shared machine may show fewer than it has)."""
    return f"{machine()}, {os.cpu_count()} CPUs visible"


def round_robin_meta(args: argparse.Namespace, threads: int, *dists: str) -> dict[str, Any]:
    """What a :func:`round_robin_parser` run was: machine, ``threads``, versions of torch and ``dists``, when,
    size and repeats."""
    return {
        "machine": visible_machine(),
        "threads": threads,
        "versions": versions("torch", *dists),
        "measured": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "size": args.size,
        "repeats": args.repeats,
    }


def keep_previous(out: Path, results: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``results`` with the previous run's rows (``out``'s ``"results"``) of the ``names`` this run did not
    measure, in the order of ``names``."""
    previous = json.loads(out.read_text()).get("results", {})
    return {name: results.get(name, previous.get(name)) for name in names if name in results or name in previous}


def write_section(doc: Path, body: str, start: str, end: str) -> None:
    """Replace the text between the ``start`` and ``end`` markers of ``doc`` (appended when missing)."""
    text = doc.read_text()
    if start not in text or end not in text:
        text = text.rstrip() + f"\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    doc.write_text(f"{head}{start}\n{body}{end}{rest.split(end, 1)[1]}")


def publish(out: Path, data: Any, text: str, doc: Path | None, markers: tuple[str, str]) -> int:
    """Write ``data`` as JSON to ``out``, ``text`` between the ``markers`` of ``doc`` (none: no doc), and print
    ``text``; exit status 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    if doc is not None:
        write_section(doc, text, *markers)
    print(text)
    return 0
