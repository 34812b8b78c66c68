"""The ``metastore`` command: inspect a store, build reports, answer queries.

Example::

    metastore inspect runs/text-classifier
    metastore outliers runs/text-classifier -k 10
    metastore influence runs/text-classifier --test 0,1,2 -k 5
    metastore restore runs/text-classifier --sample 17 --capture-point epoch-1/val --out g.safetensors
    metastore compact runs/text-classifier          # merge small shards (crash-safe)
    metastore verify runs/text-classifier --repair  # mend what a killed run left behind
    torchrun --nproc-per-node 4 -m metastore_plugins.cli influence runs/text-classifier  # partitioned

User mistakes (unknown run, sample, layer, step) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metastore_plugins.core.analysis import GradientStore, RunComparison, open_store
from metastore_plugins.core.analysis.queries import nearest_occurrences
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.distributed import (
    DistributedQueryError,
    init_from_env,
    launched,
    open_distributed_store,
    rank_of,
    shutdown,
)
from metastore_plugins.core.distributed.launch import DEFAULT_TIMEOUT_S
from metastore_plugins.core.policy.plan import CapturePlan
from metastore_plugins.core.reports import OUTLIER_COLUMNS, checkpoint_points, markdown_table
from metastore_plugins.core.reports.files import influence_markdown
from metastore_plugins.core.reports.stored import (
    budget_caption,
    dropped_message,
    outlier_ranking,
    stored_self_influence,
    with_gradients,
)
from metastore_plugins.core.reports.tables import OUTLIER_RANKINGS, influence_rows, outlier_markdown, outlier_table
from metastore_plugins.core.store import StoreError, find_store_dir, vector_files
from metastore_plugins.core.store.maintenance import compact, repair
from metastore_plugins.core.store.runs import repeated_batches
from metastore_plugins.core.store.snapshots import SnapshotInfo, check_snapshots
from metastore_plugins.core.store.tags import Tag, check_tags

#: Characters a terminal acts on (C0/C1 controls: ESC, BEL, CR, newlines; DEL; bidirectional overrides, line
#: separators): printed escaped (``\\x1b``, ``\\u202e``) wherever a stored string reaches the terminal.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
#: Text lines of tags ``metastore inspect`` prints at most (``--json`` lists them all).
TAG_LINES = 50


def printable(text: object) -> str:
    """``str(text)`` with every character a terminal would act on escaped, so stored strings print as data."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def _int64(text: str) -> int:
    """A sample id or step: a whole number from 0 to 2^63-1 (what the store's int64 columns hold)."""
    value = _whole(text, 0)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2^63-1, got {text!r}")
    return value


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sample ids such as 3,17,42; got {text!r}") from None


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1)


def _non_negative(text: str) -> int:
    return _whole(text, 0)


def _plain(value: Any) -> Any:
    """Dataclasses and named tuples as dicts (recursively), tuples as lists: ready for JSON and tables."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value.tolist() if hasattr(value, "tolist") else value


def _json_default(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    text = "\n".join(map(printable, text.split("\n")))  # stored names reach the terminal as data
    print(
        json.dumps(data, indent=1, default=_json_default) if args.json else text,
        end="" if text.endswith("\n") else "\n",
    )


def _train_points(store: GradientStore, given: Sequence[str] | None) -> list[str]:
    points = list(given or checkpoint_points(store, "train"))
    if not points:
        raise StoreError(
            f"the store has no checkpoint passes 'epoch-*/train'{_and(_damage(store))}; pass --capture-point NAME "
            f"(it has {', '.join(store.capture_points()) or 'no capture point'})"
        )
    return points


def _damage(store: GradientStore) -> str:
    """``""``, or the damage the store's opening found (journal lines it ignored): why something may be missing."""
    problems = store.open_problems
    if not problems:
        return ""
    return (
        f"the store's index is damaged: {problems[0]}"
        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        + f"; run `metastore verify {store.path}` to see the damage"
    )


def _and(clause: str) -> str:
    return f", and {clause}" if clause else ""


def _holders(store: GradientStore, sample_id: int) -> list[str]:
    """The capture points that hold ``sample_id``."""
    return [cp for cp in store.capture_points() if sample_id in set(store.sample_ids(cp).tolist())]


def _not_stored(store: GradientStore, sample_ids: Sequence[int], where: Sequence[str], what: str) -> StoreError:
    """The error for samples missing from ``where`` (``what``: "sample 3 is"), naming the capture points that hold
    them and the ``--capture-point`` to pass."""
    holders = {cp for sid in sample_ids for cp in _holders(store, sid)}
    found = sorted(holders)
    suggested = TRAINING_STEPS if TRAINING_STEPS in holders else found[-1] if found else ""
    hint = (
        f"; stored in {', '.join(repr(cp) for cp in found)}: pass --capture-point {suggested}"
        if found
        else f"; no capture point holds it{_and(_damage(store))}"
    )
    return StoreError(f"{what} not stored in {', '.join(map(repr, where))}{hint}")


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
    plan_lines = _plan_lines(plan, problems)
    tags, tag_problems = check_tags(store.path)
    snapshots, snapshot_problems = check_snapshots(store.path, checksums=not args.no_checksums)
    problems += snapshot_problems + tag_problems
    data |= {
        "capture_plan": plan,
        "tags": [vars(tag) for tag in tags] if args.json else [],  # only printed with --json (300k tags: 1 s)
        "snapshots": [{**dataclasses.asdict(info), "path": str(info.path)} for info in snapshots],
    }
    more = f"  ... and {len(tags) - TAG_LINES:,} more (--json lists them all)" if len(tags) > TAG_LINES else ""
    ratio = summary["compression"]
    lines = [
        f"store      {summary['path']}",
        f"ranks      {summary['ranks']}   shards {summary['shards']}   encodings {', '.join(summary['encodings'])}",
        f"samples    {summary['samples']} stored over {summary['steps']} steps",
        f"bytes      {summary['bytes_on_disk']:,} on disk "
        f"vs {summary['dense_bytes']:,} as dense fp32 per-sample gradients"
        + (f" ({ratio:.1f}x smaller)" if ratio else ""),
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
        *(f"  {_tag_line(tag)}" for tag in tags[:TAG_LINES]),
        *([more] if more else []),
        "problems: " + ("none" if not problems else ""),
        *(f"  {p}" for p in problems),
    ]
    _emit(args, data, "\n".join(printable(line) for line in lines))  # one stored string never makes two lines
    return 1 if problems else 0


def _vector_index_lines(store: GradientStore) -> list[str]:
    """The kept nearest-gradient indexes: capture point, rows, width, type (flat, or IVF and its parameters)."""
    lines = vector_files.check(store.path, {entry.file: entry.sha256 for entry in store.index.shards}, False)[1]
    if not lines:
        return ["vector index: none (`metastore influence|similar --index build` builds one)"]
    return [f"vector index: {len(lines)}", *(f"  {line}" for line in lines)]


def _plan_lines(plan: Any, problems: list[str]) -> list[str]:
    """The capture plan's lines; one more problem (and no plan lines) when the recorded plan is not readable."""
    if not plan:
        return ["capture plan: none recorded (an older store)"]
    try:
        return CapturePlan.from_json(plan).lines()
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        problems.append(
            f"the capture_plan in the store's config is not a readable plan ({type(exc).__name__}: {exc}); "
            "`--json` shows it as recorded"
        )
        return ["capture plan: not readable (see problems)"]


def _snapshot_line(info: SnapshotInfo) -> str:
    checksum = "" if info.sha256 else " (no checksum: written before checksums were recorded)"
    return f"{info.name:<20} step {info.step}, rank {info.rank}{checksum}"


def _tag_line(tag: Tag) -> str:
    steps = f"step {tag.first_step}" if tag.first_step == tag.last_step else f"steps {tag.first_step}..{tag.last_step}"
    keep = f", keep {tag.keep}" if tag.keep else ""
    attributes = ", ".join(f"{key}={value}" for key, value in tag.attributes.items())
    return f"{tag.name:<20} {steps}{keep}" + (f" ({attributes})" if attributes else "")


def cmd_verify(args: argparse.Namespace, path: Path) -> int:
    """Exit status 1 when problems remain (after ``--repair``, the ones it cannot remove)."""
    removed = repair(path) if args.repair else []
    problems = open_store(path).verify(checksums=not args.no_checksums)
    lines = [
        *(f"repaired: {line}" for line in removed),
        *problems,
        "problems: " + ("none" if not problems else str(len(problems))),
    ]
    _emit(args, {"removed": removed, "problems": problems}, "\n".join(lines))
    return 1 if problems else 0


def cmd_compact(args: argparse.Namespace, path: Path) -> int:
    report = compact(path, target_bytes=args.target_mb * 2**20)
    text = (
        f"shards     {report.shards_before} -> {report.shards_after} "
        f"({len(report.merged)} merged into {len(report.written)})"
        + "".join(f"\nskipped    {line}" for line in report.skipped)
    )
    _emit(args, _plain(report), text)
    return 0


def cmd_report(args: argparse.Namespace, store: GradientStore) -> None:
    """Files into --out (default ``<store>/reports``, where the callbacks write theirs), and TensorBoard
    events (tables, histograms, figures, dynamics, projector) into --logdir. Under torchrun every rank
    scores its share and rank 0 writes."""
    from metastore_plugins.core.reports.partitioned import writes
    from metastore_plugins.core.reports.tensorboard import report_run, summary_writer

    out = Path(args.out) if args.out else store.path / "reports"
    writers = [summary_writer(args.logdir)] if args.logdir is not None and writes(store) else []
    try:
        result = report_run(store, out, writers, k=args.k)
    finally:
        for writer in writers:
            writer.close()
    if result is None:
        raise StoreError(f"{store.path} holds no checkpoint passes to report on; see `metastore inspect`")
    files = [*result.get("files", []), *([] if args.logdir is None else [str(args.logdir)])]
    _emit(args, {"files": files}, "\n".join(["wrote:", *(f"  {f}" for f in files)]))


def step_range(text: str) -> int | tuple[int, int]:
    """``N`` or ``LO:HI`` (inclusive), as ``--steps`` takes them; anything else is an argparse error."""
    parts = text.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        return values[0]
    if len(values) == 2 and values[0] <= values[1]:
        return values[0], values[1]
    raise argparse.ArgumentTypeError(f"expected a step N or an inclusive range LO:HI with LO <= HI, got {text!r}")


def cmd_query(args: argparse.Namespace, store: GradientStore) -> None:
    """The training-dynamics questions of docs/queries.md."""
    where: dict[str, Any] = {"capture_point": args.capture_point}
    steps = args.steps
    if args.question == "changed":
        rows = [_plain(r) for r in store.changed_most(args.layer, args.k, steps=steps, **where)]
        _emit(args, rows, markdown_table(rows, ("param", "index", "value")))
    elif args.question == "contributors":
        if args.layer is None:
            raise StoreError("query contributors needs --layer NAME (see `metastore inspect` for layer names)")
        rows = store.top_contributors(args.layer, args.k, steps=steps, **where).rows()
        _emit(args, rows, markdown_table(rows, list(rows[0]) if rows else ["entry"]))
    elif args.question == "spikes":
        if args.threshold is None:
            raise StoreError("query spikes needs --threshold (a per-sample gradient norm)")
        spikes = store.spikes(args.threshold, args.fraction, args.before, **where)
        rows = [_plain(s) for s in spikes]
        _emit(args, rows, markdown_table(rows, list(rows[0]) if rows else ["step"]))
    else:  # compare
        if args.other is None:
            raise StoreError("query compare needs --other RUN (a second run of the same model)")
        comparison = store.compare(open_store(args.other), args.capture_point)
        _emit(args, _plain(comparison), comparison_text(comparison, args.k))


def comparison_text(comparison: RunComparison, k: int) -> str:
    """Per layer, and the ``k`` steps where the two runs' mean gradient norms differ most (``--json``: every step)."""
    layers = [_plain(row) for row in comparison.layers]
    gap = np.abs(np.log(comparison.norm) - np.log(comparison.other_norm))  # (S,) NaN where a run lacks the step
    order = [int(i) for i in np.argsort(-np.nan_to_num(gap, nan=-1.0), kind="stable")[:k] if np.isfinite(gap[i])]
    steps = [
        {
            "step": int(comparison.steps[i]),
            "norm": float(comparison.norm[i]),
            "other_norm": float(comparison.other_norm[i]),
            "loss": float(comparison.loss[i]),
            "other_loss": float(comparison.other_loss[i]),
        }
        for i in sorted(order)
    ]
    return "\n".join(
        [
            markdown_table(layers, ("layer", "mean_norm", "other_mean_norm", "ratio", "update_cosine")),
            f"{len(comparison.steps)} steps; the {len(steps)} where the mean per-sample gradient norms differ most:",
            markdown_table(steps, ("step", "norm", "other_norm", "loss", "other_loss")),
        ]
    )


def cmd_outliers(args: argparse.Namespace, store: GradientStore) -> None:
    given = args.capture_point or checkpoint_points(store, "train")  # none left by the budget: AUM or loss alone
    points = list(given) if given or TRAINING_STEPS in store.capture_points() else _train_points(store, None)
    by = outlier_ranking(store, points, args.by)
    scores = stored_self_influence(store, points)
    table = outlier_table(store, points, args.k, scores, by)
    caption = budget_caption(store, table.caption, len(scores[0]))
    damage = [f"warning: {_damage(store)}: capture points may be missing"] if store.open_problems else []
    _emit(args, table.rows, outlier_markdown(table.rows, OUTLIER_COLUMNS, [*damage, *caption]))


def cmd_influence(args: argparse.Namespace, store: GradientStore) -> None:
    """TracIn over paired passes; a test sample stored several times in its capture point has its occurrences summed."""
    train = _train_points(store, args.train)
    test = [cp.split("/")[0] + "/" + args.test_split for cp in train]
    if args.capture_point:
        train, test = train[-1:], [args.capture_point]
    absent = [cp for cp in test if cp not in store.capture_points()]
    if absent and not args.capture_point:
        why = dropped_message(store) or (
            "influence needs test gradients, which the callbacks store when evaluation runs during training "
            "(HF: eval_strategy='epoch')"
        )
        raise StoreError(
            f"the store holds no '{args.test_split}' checkpoint passes ({', '.join(absent)}): {why}; pass "
            "--capture-point CP to use another capture point as the test side"
        )
    bare = [cp for cp in (*train, *test) if not with_gradients(store, [cp], inner=True)]
    if bare:
        why = dropped_message(store) or "they hold metadata only or exact norms only"
        named = bare[0] + (f" and {len(bare) - 1} more capture points" if len(bare) > 1 else "")
        raise StoreError(f"influence needs per-sample gradients with inner products, and {named} hold none: {why}")
    if args.test is not None:
        stored = {int(i) for cp in test for i in store.sample_ids(cp).tolist()}
        missing = sorted(set(args.test) - stored)
        if missing:
            raise _not_stored(store, missing, test, f"test sample(s) {missing} are")
    rows = influence_rows(store, train, test, args.k, index=_index_option(args))
    if args.test is not None:
        rows = [row for row in rows if row["test_id"] in set(args.test)]
    notes = _occurrence_notes(store, test, [row["test_id"] for row in rows])
    _emit(args, rows, "".join(f"{line}\n" for line in notes) + influence_markdown(rows))


def _occurrence_notes(store: GradientStore, test: Sequence[str], test_ids: Sequence[int]) -> list[str]:
    """One line per capture point where the shown test samples occur more than once: their scores are summed."""
    notes = []
    for cp in test:
        counts = np.unique(store.sample_ids(cp, sample_ids=list(test_ids)), return_counts=True)[1]  # per test id
        if len(counts) and counts.max() > 1:
            notes.append(
                f"test samples occur up to {int(counts.max())} times in {cp!r} (once per step they were trained "
                "at): each score sums every occurrence of the test sample against every occurrence of the train one"
            )
    return notes


def cmd_similar(args: argparse.Namespace, store: GradientStore) -> None:
    """The query is the sample's last occurrence in its capture point (the latest weights); each candidate sample
    is compared through its occurrence nearest in step to it (the later on a tie), one row per candidate."""
    query_point = args.capture_point or _train_points(store, None)[-1]
    candidates = args.candidates or query_point
    if args.sample not in set(store.sample_ids(query_point).tolist()):
        raise _not_stored(store, [args.sample], [query_point], f"sample {args.sample} is")
    query_steps = store.metadata(query_point, sample_ids=[args.sample])["step"]  # (Q,) in column order
    column = int(np.flatnonzero(query_steps == query_steps.max())[-1])
    scores = store.similar(query_point, candidates, query_ids=[args.sample], k=args.k + 1, index=_index_option(args))
    steps = store.metadata(candidates, sample_ids=np.unique(scores.row_ids))["step"]  # (N,) aligned with row_ids
    ids, cosine, at = nearest_occurrences(scores.row_ids, steps, scores.scores[:, column], int(query_steps[column]))
    order = [i for i in np.argsort(-cosine, kind="stable") if ids[i] != args.sample][: args.k]
    rows = [{"sample_id": int(ids[i]), "cosine": float(cosine[i]), "step": int(at[i])} for i in order]
    occurrences = len(query_steps)
    note = (
        f"query: sample {args.sample} at step {int(query_steps[column])} in {query_point!r}"
        + (f" (the last of its {occurrences} occurrences)" if occurrences > 1 else "")
        + f"; each candidate of {candidates!r} at its occurrence nearest that step"
    )
    _emit(args, rows, note + "\n" + markdown_table(rows, ("sample_id", "cosine", "step")))


def _index_option(args: argparse.Namespace) -> bool | None:
    """``--index build``: build the nearest-gradient index (True); ``off``: scan every row (False); else a kept one."""
    return {"build": True, "off": False}.get(args.index)


def cmd_restore(args: argparse.Namespace, store: GradientStore) -> None:
    from safetensors.torch import save_file

    grads = store.restore(args.sample, capture_point=args.capture_point, step=args.step, layer=args.layer)
    save_file({name: g.contiguous() for name, g in grads.items()}, args.out)
    shapes = {name: list(g.shape) for name, g in grads.items()}
    _emit(
        args,
        {"file": args.out, "tensors": shapes},
        f"wrote {args.out}: " + ", ".join(f"{n} {s}" for n, s in shapes.items()),
    )


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--target-mb", type=_positive, default=64, help="largest merged shard in MiB (default 64)")
    p.set_defaults(on_directory=True)
    p = add("report", cmd_report, "(re)build the report files")
    p.add_argument("--out", help="directory for the report files (default: STORE/reports, as the callbacks)")
    p.add_argument("-k", type=_positive, default=20, help="rows of the outlier table")
    p.add_argument("--logdir", help="also write the reports as TensorBoard events into this directory")
    p = add("outliers", cmd_outliers, "the training samples most likely mislabelled (lowest AUM, or self-influence)")
    p.add_argument("-k", type=_positive, default=20, help="rows (default 20)")
    p.add_argument("--capture-point", action="append", help="capture point(s) to sum (default: epoch-*/train)")
    p.add_argument(
        "--by",
        choices=OUTLIER_RANKINGS,
        default="auto",
        help="ranking: auto (default: AUM where the training steps hold margins, else self-influence), aum, loss, "
        "self_influence",
    )
    p = add("influence", cmd_influence, "training samples that drove each test sample (TracIn)")
    p.add_argument("--test", type=_ids, help="comma-separated test sample ids (default: all)")
    p.add_argument("--capture-point", help="one test capture point, paired with the last train pass")
    p.add_argument("--train", action="append", help="train capture point(s) (default: epoch-*/train)")
    p.add_argument("--test-split", default="val", help="test split of the checkpoint passes (default: val)")
    p.add_argument("-k", type=_positive, default=10, help="rows (default 10)")
    p = add("similar", cmd_similar, "samples whose gradients are most similar to one sample's")
    p.add_argument("--sample", type=int, required=True)
    p.add_argument("--capture-point", help="where the sample is stored (default: the last train pass)")
    p.add_argument("--candidates", help="capture point to search (default: the sample's)")
    p.add_argument("-k", type=_positive, default=10, help="rows (default 10)")
    for name in ("influence", "similar"):
        sub.choices[name].add_argument(
            "--index",
            choices=["auto", "build", "off"],
            default="auto",
            help="the nearest-gradient index (docs/queries.md#top-k-at-any-scale): auto (default) scores only its "
            "candidates where one is kept, build builds it first, off scores every row",
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
    p.add_argument("-k", type=_positive, default=10, help="rows (default 10)")
    p.add_argument("--threshold", type=float, help="spikes: per-sample gradient norm threshold")
    p.add_argument("--fraction", type=float, default=0.1, help="spikes: fraction of samples above the threshold")
    p.add_argument("--before", type=_non_negative, default=3, help="spikes: how many earlier steps to list samples of")
    p.add_argument("--other", help="compare: the other run")
    p = add("restore", cmd_restore, "write the exact dense gradient of one sample to a safetensors file")
    p.add_argument("--sample", type=_int64, required=True)
    p.add_argument("--step", type=_int64)
    p.add_argument("--capture-point")
    p.add_argument("--layer")
    p.add_argument("--out", required=True, help="output .safetensors file")
    return parser


#: Subcommands that run partitioned under ``torchrun`` (docs/distributed.md); the others refuse to.
PARTITIONED = ("outliers", "influence", "similar", "report")


def _open(args: argparse.Namespace) -> Any:
    """The store (a partitioned one under ``torchrun`` or with ``--device``), or the directory for maintenance."""
    if getattr(args, "on_directory", False):
        return find_store_dir(args.run)
    if launched() or getattr(args, "device", None):
        init_from_env(timeout_s=args.timeout)
        return open_distributed_store(args.run, device=args.device)
    return open_store(args.run)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Output cut short by its reader (``| head``) is not an error."""
    try:
        status = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # what is left to flush at exit goes nowhere, quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return status


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if launched() and args.command not in PARTITIONED:
        print(
            f"metastore {args.command}: error: it does not run partitioned; run it without torchrun "
            f"(partitioned: {', '.join(PARTITIONED)})",
            file=sys.stderr,
        )
        return 2
    try:
        target = _open(args)
        quiet = rank_of() != 0  # every rank computes, rank 0 prints
        with open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stdout) as out:
            with contextlib.redirect_stdout(out):
                status = args.func(args, target) or 0
    except (StoreError, ValueError, FileNotFoundError) as exc:
        print(f"metastore {args.command}: error: {printable(exc)}", file=sys.stderr)
        return 2
    except DistributedQueryError as exc:
        print(f"metastore {args.command}: error: {printable(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("metastore: interrupted", file=sys.stderr)
        return 130
    finally:
        if launched():  # under torchrun the command owns its process group
            shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
