"""The tag book and the snapshot journal at scale (issue 44 item 3).

``python -m metastore_bench.tags_scale [--tags 1000000] [--snapshot-lines 330000] [--name NAME]`` (from the
repository root) writes a tiny store, ``--tags`` tag lines in ``tags-rank0.jsonl`` (about 185 bytes each, as
the callbacks' automatic tags: epoch, step, learning rate, two metrics) and ``--snapshot-lines`` lines in
``snapshots-rank0.jsonl`` beside one real snapshot (about 200 bytes each: 65 MB for 330,000), then times,
each in a fresh process (what a training start or a query pays):

- ``TagBook(store)``: what every training start does (then one ``add`` and one ``keep_for``);
- ``read_tags``; ``GradientStore.find()`` on a store without its tag cache (it parses every line and writes
  ``tag_cache/``), then ``find(name)`` (one name, 1 tag in 1000) and ``find()`` (every tag) answered from the
  cache, with the process's peak RSS;
- three ``write_snapshot`` calls in one process and ``list_snapshots`` (each read the snapshot journal).

The figures are printed and merged into ``metastore_bench/results/tags_scale.json`` under ``--name``. Lines are
written with ``journal.encode_line`` (the format, not the code that reads it), so an older checkout can be
measured by copying this script into it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch
from torch import nn

from metastore_plugins import StoreWriter
from metastore_plugins.core.store.shards.journal import encode_line

from .publish import RESULTS
from .timing import machine, versions

#: Timed in a fresh process: prints ``{"seconds": ..., "after_imports": ..., "peak_rss_mb": ...}`` (``seconds``
#: counts the imports of the probe's first lines, about 2 s of torch; ``after_imports`` the rest).
_PROBE = """
import json, resource, sys, time
sys.path[:0] = {paths!r}
start = time.perf_counter()
{imports}
imported = time.perf_counter()
{body}
end = time.perf_counter()
print(json.dumps({{"seconds": end - start, "after_imports": end - imported,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""

PROBES = {
    "training_start_tagbook": """
        from metastore_plugins.core.store.tags.book import TagBook
        book = TagBook(STORE)
        book.add("start", steps=0)
        book.keep_for(5, "train")
    """,
    "read_tags": """
        from metastore_plugins.core.store.tags.book import read_tags
        assert len(read_tags(STORE)) >= TAGS
    """,
    "find_all_building_cache": """
        from metastore_plugins import open_store
        assert len(open_store(STORE).find()) >= TAGS
    """,
    "find_one_name": """
        from metastore_plugins import open_store
        assert len(open_store(STORE).find("rare")) == TAGS // 1000
    """,
    "find_all": """
        from metastore_plugins import open_store
        assert len(open_store(STORE).find()) >= TAGS
    """,
    "three_write_snapshot": """
        import torch
        from metastore_plugins.core.store.snapshots.weights import write_snapshot
        model = torch.nn.Linear(4, 3)
        for i in range(3):
            write_snapshot(STORE, model, name=f"extra-{i}", step=100 + i)
    """,
    "list_snapshots": """
        from metastore_plugins.core.store.snapshots.weights import list_snapshots
        assert len(list_snapshots(STORE)) >= 1
    """,
}


def tag_line(seq: int) -> bytes:
    """An automatic checkpoint tag as the callbacks write it (about 185 bytes); 1 in 1000 named ``rare``."""
    entry = {
        "name": "rare" if seq % 1000 == 0 else "epoch-end",
        "first_step": seq,
        "last_step": seq,
        "keep": None,
        "capture_point": None,
        "attributes": {"epoch": seq // 100, "lr": 0.001, "val_loss": 0.4375, "val_acc": 0.8125},
        "rank": 0,
        "seq": seq,
        "automatic": True,
    }
    return encode_line(entry)


def snapshot_line(i: int) -> bytes:
    name = f"old-{i}"
    entry = {"name": name, "file": f"{name}-rank0.safetensors", "step": i, "bytes": 12345678, "sha256": "ab" * 32}
    return encode_line(entry)


def build(path: Path, tags: int, snapshot_lines: int) -> dict[str, int]:
    from metastore_plugins.core.store.snapshots.weights import write_snapshot

    with StoreWriter(path) as writer:  # a store of one outer record: find() needs capture points and steps
        from metastore_plugins.core.records import LayerRecord

        for step in range(4):
            record = LayerRecord(
                "fc",
                "outer",
                2,
                {"weight": "fc.weight"},
                {"weight": (3, 4)},
                {
                    "prefix": torch.ones(2, 1, 4),
                    "suffix": torch.ones(2, 1, 3),
                    "sample": torch.arange(2).int(),
                    "position": torch.zeros(2).int(),
                },
            )
            writer.write([record], sample_ids=torch.arange(2), step=step)
    with open(path / "tags-rank0.jsonl", "wb") as handle:
        for start in range(0, tags, 10000):
            handle.write(b"".join(tag_line(seq) for seq in range(start, min(tags, start + 10000))))
    write_snapshot(path, nn.Linear(4, 3), name="first", step=0)
    with open(path / "snapshots-rank0.jsonl", "rb") as handle:
        real = handle.read()
    with open(path / "snapshots-rank0.jsonl", "wb") as handle:
        handle.write(b"".join(snapshot_line(i) for i in range(snapshot_lines)) + real)
    return {
        "tags_bytes": (path / "tags-rank0.jsonl").stat().st_size,
        "snapshot_journal_bytes": (path / "snapshots-rank0.jsonl").stat().st_size,
    }


def probe(path: Path, tags: int, body: str) -> dict[str, float]:
    lines = textwrap.dedent(body).strip().splitlines()
    imports = "\n".join(line for line in lines if line.startswith(("from ", "import ")))
    code = f"STORE, TAGS = {str(path)!r}, {tags}\n" + "\n".join(line for line in lines if line not in imports)
    script = _PROBE.format(paths=sys.path, imports=imports, body=code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m metastore_bench.tags_scale", description=__doc__)
    parser.add_argument("--tags", type=int, default=10**6)
    parser.add_argument("--snapshot-lines", type=int, default=330_000)
    parser.add_argument("--name", default="after")
    parser.add_argument("--out", type=Path, default=RESULTS / "tags_scale.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        sizes = build(path, args.tags, args.snapshot_lines)
        timings = {}
        for name, body in PROBES.items():
            timings[name] = probe(path, args.tags, body)
            took = timings[name]
            print(f"{name:<24} {took['seconds']:8.2f} s ({took['after_imports']:.2f} s after the imports)   "
                  f"peak RSS {took['peak_rss_mb']:8.0f} MB")  # fmt: skip
    run = {
        "measured": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": [round(x, 2) for x in os.getloadavg()],  # 1, 5, 15 minutes, at the end
        "tags": args.tags,
        "snapshot_lines": args.snapshot_lines,
        **sizes,
        "timings": timings,
    }
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    results["meta"] = {"machine": machine(), "versions": versions("torch", "numpy")}
    results["runs"][args.name] = run
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
