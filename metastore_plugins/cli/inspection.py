"""``metastore inspect|verify|compact``: what a store holds, its damage, and the maintenance that mends it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from metastore_plugins.cli.output import emit, plain, printable
from metastore_plugins.core.analysis import GradientStore, open_store
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.store.maintenance.compaction import compact, repair
from metastore_plugins.core.store.reading.plan_check import plan_problem
from metastore_plugins.core.store.reading.runs import repeated_batches
from metastore_plugins.core.store.snapshots.weights import SnapshotInfo, check_snapshots
from metastore_plugins.core.store.tags.book import check_tags
from metastore_plugins.core.store.tags.tag_line import Tag
from metastore_plugins.core.store.vectors import vector_check
from metastore_plugins.core.store.writing.run_log import Gap, Session

#: Text lines of tags ``metastore inspect`` prints at most (``--json`` lists them all).
TAG_LINES = 50


def cmd_inspect(args: argparse.Namespace, store: GradientStore) -> int:
    """Exit status 1 when the store is damaged."""
    summary = store.summary()
    layers = {name: store.layer_info(name) for name in store.layers()}
    problems = store.verify(checksums=not args.no_checksums) + repeated_batches(store.index)  # two runs in one
    data = {
        **summary,
        "capture_points_detail": {cp: store.steps(cp) for cp in store.capture_points()},
        "layers_detail": layers,
        "problems": problems,
    }
    plan = store.config.get("capture_plan")
    plan_lines = _plan_lines(plan)
    tags, tag_problems = check_tags(store.path)
    snapshots, snapshot_problems = check_snapshots(store.path, checksums=not args.no_checksums)
    problems += snapshot_problems + tag_problems
    data |= {
        "capture_plan": plan,
        "tags": [vars(tag) for tag in tags] if args.json else [],  # only printed with --json (300k tags: 1 s)
        "snapshots": [{**dataclasses.asdict(info), "path": str(info.path)} for info in snapshots],
        "runs": [{**dataclasses.asdict(s), "state": s.state()} for s in store.run_log.sessions],
        "incomplete": store.incomplete,
    }
    more = f"  ... and {len(tags) - TAG_LINES:,} more (--json lists them all)" if len(tags) > TAG_LINES else ""
    lines = [
        f"store      {summary['path']}",
        f"ranks      {summary['ranks']}   shards {summary['shards']}   encodings {', '.join(summary['encodings'])}",
        f"samples    {summary['samples']} stored over {summary['steps']} steps",
        *_run_lines(store.run_log.sessions),
        *([store.incomplete] if store.incomplete else []),
        *_bytes_lines(summary),
        "capture points:",
        *(
            f"  {cp:<20} {n} batches, steps {store.steps(cp)[0]}..{store.steps(cp)[-1]}"
            for cp, n in summary["capture_points"].items()
        ),
        "layers:",
        *(f"  {name:<40} {', '.join(f'{k}:{v}' for k, v in info['kinds'].items())}" for name, info in layers.items()),
        *plan_lines,
        f"snapshots  {len(snapshots)} ({sum(info.nbytes for info in snapshots):,} bytes)",
        *(f"  {_snapshot_line(info)}" for info in snapshots),
        *_vector_index_lines(store),
        f"tags       {len(tags)}",
        *(f"  {_tag_line(tag, store.gaps)}" for tag in tags[:TAG_LINES]),
        *([more] if more else []),
        "problems: " + ("none" if not problems else ""),
        *(f"  {p}" for p in problems),
    ]
    emit(args, data, "\n".join(printable(line) for line in lines))  # one stored string never makes two lines
    return 1 if problems else 0


def _run_lines(sessions: list[Session]) -> list[str]:
    """How the runs that wrote the store went: the latest run of each rank (one line when the ranks agree), then
    the earlier runs a resumed run continued."""
    if not sessions:
        return ["run        no run log (a store written before run logs, or by a StoreWriter outside a run)"]
    latest = {session.rank: session for session in sessions}
    states = {session.state() for session in latest.values()}
    lines = (
        [f"run        {states.pop()}"]
        if len(states) == 1
        else ["run        by rank:", *(f"  rank {rank}: {s.state()}" for rank, s in sorted(latest.items()))]
    )
    earlier = [s for s in sessions if s is not latest[s.rank]]
    return lines + [f"  earlier run on rank {s.rank}{_started(s)}: {s.state()}" for s in earlier]


def _started(session: Session) -> str:
    return "" if session.start is None else f" (started at step {session.start})"


def _bytes_lines(summary: dict[str, Any]) -> list[str]:
    """Every file of the store directory by part (``summary()["bytes_by_part"]``), then the listed shards against
    the dense fp32 per-sample gradients they stand for."""
    ratio = summary["compression"]
    parts = ", ".join(f"{part} {size:,}" for part, size in summary["bytes_by_part"].items())
    return [
        f"bytes      {summary['bytes_on_disk']:,} on disk ({parts})",
        f"           shards {summary['shard_bytes']:,} vs {summary['dense_bytes']:,} as dense fp32 per-sample "
        "gradients" + (f" ({ratio:.1f}x smaller)" if ratio else ""),
    ]


def _vector_index_lines(store: GradientStore) -> list[str]:
    """The kept nearest-gradient indexes: capture point, rows, width, type (flat, IVF or reduced, with parameters)."""
    lines = vector_check.check(store.path, {entry.file: entry.sha256 for entry in store.index.shards}, False)[1]
    if not lines:
        return ["vector index: none (`metastore influence|similar --index build` builds one)"]
    return [f"vector index: {len(lines)}", *(f"  {line}" for line in lines)]


def _plan_lines(plan: Any) -> list[str]:
    """The capture plan's lines; none when the recorded plan is damaged (``verify``'s problems name the manifest)."""
    if not plan:
        return ["capture plan: none recorded (a store written by a StoreWriter alone, or by an older version)"]
    if plan_problem(plan) is not None:
        return ["capture plan: not readable (see problems; `--json` shows it as recorded)"]
    return CapturePlan.from_json(plan).lines()


def _snapshot_line(info: SnapshotInfo) -> str:
    checksum = "" if info.sha256 else " (no checksum: written before checksums were recorded)"
    return f"{info.name:<20} step {info.step}, rank {info.rank}{checksum}"


def _tag_line(tag: Tag, gaps: list[Gap]) -> str:
    steps = f"step {tag.first_step}" if tag.first_step == tag.last_step else f"steps {tag.first_step}..{tag.last_step}"
    keep = f", keep {tag.keep}" if tag.keep else ""
    attributes = ", ".join(f"{key}={value}" for key, value in tag.attributes.items())
    lost = any(
        rank == tag.rank and first <= tag.first_step and (resumed is None or tag.first_step < resumed)
        for rank, first, resumed in gaps
    )
    stopped = " NOT STORED (capture had stopped: see incomplete)" if lost and tag.automatic else ""
    return f"{tag.name:<20} {steps}{keep}" + (f" ({attributes})" if attributes else "") + stopped


def cmd_verify(args: argparse.Namespace, path: Path) -> int:
    """Exit status 1 when problems remain (after ``--repair``, the ones it cannot remove)."""
    removed = repair(path) if args.repair else []
    store = open_store(path)
    problems = store.verify(checksums=not args.no_checksums)
    index_lines = _vector_index_lines(store)
    lines = [
        *(f"repaired: {line}" for line in removed),
        *index_lines,
        *problems,
        "problems: " + ("none" if not problems else str(len(problems))),
    ]
    data = {"removed": removed, "problems": problems, "vector_index": [line.strip() for line in index_lines[1:]]}
    emit(args, data, "\n".join(printable(line) for line in lines))
    return 1 if problems else 0


def cmd_compact(args: argparse.Namespace, path: Path) -> int:
    """Merge small shards (``--target-mb``); the shard counts before and after, and what was skipped."""
    report = compact(path, target_bytes=args.target_mb * 2**20)
    text = (
        f"shards     {report.shards_before} -> {report.shards_after} "
        f"({len(report.merged)} merged into {len(report.written)})"
        + "".join(f"\nskipped    {line}" for line in report.skipped)
    )
    emit(args, plain(report), text)
    return 0
