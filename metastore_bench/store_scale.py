"""The store at scale (issue 18): a long run of a tiny MLP, every step captured and written, then read back.

``python -m metastore_bench.store_scale [--steps 100000] [--batch 10] [--shard-bytes N] [--name NAME]``
(from the repository root) trains a 12-32-4 MLP for ``--steps`` SGD steps of
``--batch`` samples, each step captured for real (``CaptureSession`` around the backward pass)
and written with ``StoreWriter.write`` (writer defaults except ``shard_bytes`` when given). It
records the time of every ``write`` call and of every whole step, and compares the first 10% of
steps with the last 10% (a store whose index costs O(1) per shard stays flat). After
``close()`` it times ``open_store``, ``sample_ids``, ``metadata`` and ``norms`` on the finished
store, and ``compact`` with the open time after it when the store has one.

The figures are printed as a table and merged into ``metastore_bench/results/store_scale.json``
under ``--name`` (runs of other names are kept); ``--doc PATH`` rewrites the table of all the
JSON's runs between the ``store_scale`` markers of that markdown file. The script uses only
``metastore_plugins``' public API: to measure an older checkout, copy ``metastore_bench/`` into it
and run it there (how the "before" runs were made).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import metastore_plugins
from metastore_plugins import CaptureSession, StoreWriter, open_store

from .publish import RESULTS, write_section
from .timing import machine, timed, versions

START, END = "<!-- store_scale:start -->", "<!-- store_scale:end -->"
#: norms is run on the whole store when a probe on 1% of the steps predicts at most this many seconds
NORMS_BUDGET_S = 120.0


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True).stdout


def _code_version() -> dict[str, Any]:
    """The commit of the ``metastore_plugins`` that runs, and whether its tree has changes."""
    root = Path(metastore_plugins.__file__).resolve().parent.parent
    out: dict[str, Any] = {"path": str(root)}
    try:
        out["commit"] = _git(root, "rev-parse", "--short", "HEAD").strip()
        out["uncommitted_changes"] = bool(_git(root, "status", "--porcelain", "--", "metastore_plugins").strip())
    except (OSError, subprocess.SubprocessError):
        out["commit"] = "unknown"
    return out


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _dir_bytes(path: Path) -> tuple[int, int, int]:
    """``(all bytes, shard bytes, number of shards)`` of the files in ``path``."""
    total = shard_bytes = shards = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            size = entry.stat(follow_symlinks=False).st_size
            total += size
            if entry.name.endswith(".safetensors"):
                shard_bytes += size
                shards += 1
    return total, shard_bytes, shards


def _window(values: np.ndarray) -> dict[str, float]:
    return {"mean_ms": float(values.mean() * 1e3), "median_ms": float(np.median(values) * 1e3)}


def _over_time(seconds: np.ndarray) -> dict[str, Any]:
    """First and last 10% of the steps (mean, median, last/first), and the mean of each tenth of the run."""
    tenth = max(1, len(seconds) // 10)
    first, last = _window(seconds[:tenth]), _window(seconds[-tenth:])
    return {
        "first_10pct": first,
        "last_10pct": last,
        "ratio_mean": last["mean_ms"] / first["mean_ms"],
        "ratio_median": last["median_ms"] / first["median_ms"],
        "mean_ms_per_tenth": [float(part.mean() * 1e3) for part in np.array_split(seconds, 10) if len(part)],
        "max_ms": float(seconds.max() * 1e3),
    }


def train_and_write(store_dir: Path, steps: int, batch: int, shard_bytes: int | None, dataset: int) -> dict[str, Any]:
    """``steps`` captured SGD steps of a 12-32-4 MLP written to ``store_dir``; per-step times."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data_x = torch.randn(dataset, 12)
    data_y = (data_x[:, :4].argmax(1) + (torch.rand(dataset) < 0.1).long()) % 4  # learnable, 10% label noise
    kwargs: dict[str, Any] = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
    write_s = np.empty(steps)
    step_s = np.empty(steps)
    per_epoch = dataset // batch
    order = torch.randperm(dataset)
    gc.collect()
    start = time.perf_counter()
    writer = StoreWriter(store_dir, **kwargs)
    for step in range(steps):
        t0 = time.perf_counter()
        epoch, k = divmod(step, per_epoch)
        if k == 0 and step:
            order = torch.randperm(dataset)
        ids = order[k * batch : (k + 1) * batch]
        x, y = data_x[ids], data_y[ids]
        with CaptureSession(model) as session:
            logits = model(x)
            F.cross_entropy(logits, y).backward()
        losses = F.cross_entropy(logits.detach(), y, reduction="none")
        t1 = time.perf_counter()
        writer.write(session.factors(), sample_ids=ids, step=step, epoch=epoch, labels=y, losses=losses, lr=0.05)
        write_s[step] = time.perf_counter() - t1
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s[step] = time.perf_counter() - t0
    loop_s = time.perf_counter() - start
    _, close_s = timed(writer.close)
    return {
        "writer": {
            "shard_bytes": writer.shard_bytes,
            "flush_seconds": getattr(writer, "flush_seconds", None),  # absent before issue 18
            "encoding": writer.encoding,
        },
        "loop_s": loop_s,
        "close_s": close_s,
        "wall_s": loop_s + close_s,
        "steps_per_s": steps / loop_s,
        "write": _over_time(write_s),
        "step": _over_time(step_s),
    }


def read_back(store_dir: Path, steps: int, rows: int, repeats: int) -> dict[str, Any]:
    """Open, ``sample_ids``, ``metadata`` and ``norms`` of the finished store (first call, and median of repeats)."""
    out: dict[str, Any] = {}
    opens = []
    store: Any = None
    for _ in range(repeats):
        store = None
        gc.collect()
        store, seconds = timed(lambda: open_store(store_dir))
        opens.append(seconds)
    out["open_store_s"] = {"first": opens[0], "median": statistics.median(opens)}
    for name, fn in (("sample_ids", lambda: store.sample_ids("train")), ("metadata", lambda: store.metadata("train"))):
        times = []
        for _ in range(repeats):
            value, seconds = timed(fn)
            times.append(seconds)
        out[f"{name}_s"] = {"first": times[0], "median": statistics.median(times)}
        if name == "sample_ids":
            out["sample_ids_rows"] = int(len(value))
        else:
            out["metadata_columns"] = sorted(value)
    # norms: a probe on the first 1% of steps predicts the whole store's time; too long -> a step range
    probe_hi = max(0, steps // 100 - 1)
    probe, probe_s = timed(lambda: store.norms("train", steps=(0, probe_hi)))
    rate = len(probe) / max(probe_s, 1e-9)
    if rows / rate <= NORMS_BUDGET_S:
        values, seconds = timed(lambda: store.norms("train"))
        span = "whole store"
    else:
        hi = max(probe_hi, int(steps * min(1.0, rate * NORMS_BUDGET_S / 2 / rows)) - 1)
        values, seconds = timed(lambda: store.norms("train", steps=(0, hi)))
        span = f"steps 0..{hi}"
    out["norms"] = {
        "span": span,
        "rows": int(len(values)),
        "seconds": seconds,
        "rows_per_s": len(values) / seconds,
        "finite": bool(np.isfinite(values).all()),
    }
    if out["sample_ids_rows"] != rows:
        raise RuntimeError(f"the store holds {out['sample_ids_rows']} train rows; {rows} were written")
    return out


def compact_and_reopen(store_dir: Path, repeats: int) -> dict[str, Any] | None:
    """Time ``compact`` (``core.store.maintenance.compaction``) and ``open_store`` after it; ``None`` without one."""
    try:
        from metastore_plugins.core.store.maintenance.compaction import (  # type: ignore[import-not-found,unused-ignore]
            compact,
        )
    except ImportError:
        return None
    try:
        report, seconds = timed(lambda: compact(store_dir))
    except Exception as error:  # a failed compaction is a figure too; the figures before it are kept
        print(f"[store_scale] compact failed: {error!r}", file=sys.stderr, flush=True)
        return {"error": f"{type(error).__name__}: {error}"}
    _, bytes_, shards = _dir_bytes(store_dir)
    opens = []
    for _ in range(repeats):
        gc.collect()
        store, open_s = timed(lambda: open_store(store_dir))
        opens.append(open_s)
    ids, ids_s = timed(lambda: store.sample_ids("train"))
    return {
        "seconds": seconds,
        "shards_after": shards,
        "shard_bytes_after": bytes_,
        "merged": len(getattr(report, "merged", [])),
        "written": len(getattr(report, "written", [])),
        "skipped": [str(line) for line in getattr(report, "skipped", [])],
        "open_store_s": {"first": opens[0], "median": statistics.median(opens)},
        "sample_ids_s": ids_s,
        "sample_ids_rows": int(len(ids)),
    }


def run(
    steps: int, batch: int, shard_bytes: int | None, store_dir: Path, *, dataset: int, repeats: int, compact: bool
) -> dict[str, Any]:
    rows = steps * batch
    result: dict[str, Any] = {
        "measured": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "code": _code_version(),
        "steps": steps,
        "batch": batch,
        "rows": rows,
        "model": "Linear(12, 32) - Tanh - Linear(32, 4), 548 parameters, SGD lr 0.05",
        "torch_threads": torch.get_num_threads(),
    }
    print(f"[store_scale] writing {steps} steps x {batch} samples to {store_dir}", file=sys.stderr, flush=True)
    result.update(train_and_write(store_dir, steps, batch, shard_bytes, dataset))
    total, shard_total, shards = _dir_bytes(store_dir)
    result["disk"] = {"bytes": total, "shard_bytes": shard_total, "index_bytes": total - shard_total, "shards": shards}
    print("[store_scale] reading back", file=sys.stderr, flush=True)
    result["read"] = read_back(store_dir, steps, rows, repeats)
    result["compact"] = compact_and_reopen(store_dir, repeats) if compact else None
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


# -- output ---------------------------------------------------------------------------------


def _ms(row: dict[str, float]) -> str:
    return f"{row['mean_ms']:.3f} / {row['median_ms']:.3f}"


def _s(value: float) -> str:
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def _rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    read, disk, comp = r["read"], r["disk"], r.get("compact")
    shard = r["writer"]["shard_bytes"]
    flush = r["writer"].get("flush_seconds")
    rows = [
        ("code", f"{r['code'].get('commit', '?')}{' + changes' if r['code'].get('uncommitted_changes') else ''}"),
        ("steps x batch = rows", f"{r['steps']:,} x {r['batch']} = {r['rows']:,}"),
        (
            "writer: shard_bytes, flush_seconds",
            f"{shard // 1024:,} KiB, {'none' if flush is None else f'{flush:g} s'}",
        ),
        ("write(): first 10% mean / median (ms)", _ms(r["write"]["first_10pct"])),
        ("write(): last 10% mean / median (ms)", _ms(r["write"]["last_10pct"])),
        ("write(): last / first (mean, median)", f"{r['write']['ratio_mean']:.2f}x, {r['write']['ratio_median']:.2f}x"),
        ("whole step: first 10% mean / median (ms)", _ms(r["step"]["first_10pct"])),
        ("whole step: last 10% mean / median (ms)", _ms(r["step"]["last_10pct"])),
        (
            "whole step: last / first (mean, median)",
            f"{r['step']['ratio_mean']:.2f}x, {r['step']['ratio_median']:.2f}x",
        ),
        ("wall time (training loop + close)", f"{_s(r['loop_s'])} + {_s(r['close_s'])}"),
        ("shards", f"{disk['shards']:,}"),
        (
            "bytes on disk (index, manifests and journals)",
            f"{disk['bytes'] / 2**20:.1f} MiB ({disk['index_bytes'] / 2**20:.2f} MiB)",
        ),
        ("open_store (first, median)", f"{_s(read['open_store_s']['first'])}, {_s(read['open_store_s']['median'])}"),
        (
            'sample_ids("train") (first, median)',
            f"{_s(read['sample_ids_s']['first'])}, {_s(read['sample_ids_s']['median'])}",
        ),
        ('metadata("train") (first, median)', f"{_s(read['metadata_s']['first'])}, {_s(read['metadata_s']['median'])}"),
        (
            'norms("train")',
            f"{read['norms']['rows_per_s']:,.0f} rows/s ({read['norms']['rows']:,} rows in "
            f"{_s(read['norms']['seconds'])}, {read['norms']['span']})",
        ),
    ]
    if comp is None:
        rows.append(("compact", "not in this code"))
    elif "error" in comp:
        rows.append(("compact", f"failed: {comp['error'][:120]}"))
    else:
        rows += [
            ("compact: time, shards after", f"{_s(comp['seconds'])}, {comp['shards_after']:,}"),
            (
                "open_store after compact (first, median)",
                f"{_s(comp['open_store_s']['first'])}, {_s(comp['open_store_s']['median'])}",
            ),
            ('sample_ids("train") after compact', _s(comp["sample_ids_s"])),
        ]
    rows.append(("peak memory (RSS)", f"{r['peak_rss_mib']:.0f} MiB"))
    return rows


def table(runs: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one column per run."""
    names = list(runs)
    cells = {name: dict(_rows(run)) for name, run in runs.items()}
    labels = list(dict.fromkeys(label for name in names for label, _ in _rows(runs[name])))
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(cells[name].get(label, "") for name in names) + " |")
    return "\n".join(lines) + "\n"


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metastore_bench.store_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_positive, default=100_000, help="training steps (default 10^5)")
    parser.add_argument("--batch", type=_positive, default=10, help="samples per step (default 10)")
    parser.add_argument(
        "--shard-bytes", type=_positive, default=None, help="StoreWriter shard_bytes (default: the writer's, 64 MiB)"
    )
    parser.add_argument("--dataset", type=_positive, default=10_000, help="distinct samples (ids), default 10^4")
    parser.add_argument("--repeats", type=_positive, default=3, help="timings of open/sample_ids/metadata (median)")
    parser.add_argument("--threads", type=_positive, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--dir", type=Path, default=None, help="store directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the store written in --dir or a temporary one")
    parser.add_argument("--no-compact", action="store_true", help="do not run compact even when the store has it")
    parser.add_argument("--name", default=None, help="key of this run in the JSON (default from the settings)")
    parser.add_argument("--out", type=Path, default=RESULTS / "store_scale.json")
    parser.add_argument("--doc", type=Path, default=None, help="markdown file whose store_scale section to rewrite")
    args = parser.parse_args(argv)
    if args.dataset < args.batch:
        parser.error("--dataset must hold at least one batch")
    torch.set_num_threads(args.threads)
    name = args.name or (
        f"{args.steps} steps x {args.batch}, "
        + ("default shards" if args.shard_bytes is None else f"{args.shard_bytes} B shards")
    )
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="msbench-scale-")
        store_dir = Path(tmp) / "store"
    else:
        store_dir = args.dir
        if store_dir.exists() and any(store_dir.iterdir()):
            parser.error(f"--dir {store_dir} is not empty: the writer would continue the store there")
    try:
        result = run(
            args.steps,
            args.batch,
            args.shard_bytes,
            store_dir,
            dataset=args.dataset,
            repeats=args.repeats,
            compact=not args.no_compact,
        )
    finally:
        if args.keep:
            print(f"kept the store in {store_dir}", file=sys.stderr)
        else:
            shutil.rmtree(tmp if tmp is not None else store_dir, ignore_errors=True)
    previous = json.loads(args.out.read_text()).get("runs", {}) if args.out.exists() else {}
    runs = {**previous, name: result}
    meta: dict[str, Any] = {"machine": machine(), "versions": versions("torch", "numpy", "safetensors")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(table({name: result}))
    print(f"wrote {args.out} (run {name!r})", file=sys.stderr)
    if args.doc is not None:
        write_section(
            args.doc, f"Machine: {meta['machine']}; torch {meta['versions']['torch']}.\n\n" + table(runs), START, END
        )
        print(f"rewrote the store_scale section of {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
