"""``metastore outliers|influence|similar|restore``: the per-sample questions asked of the checkpoint passes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from metastore_plugins.cli.hints import not_stored, store_damage, train_points
from metastore_plugins.cli.output import emit
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.method_table import AUTO, MethodArgs, check_arguments
from metastore_plugins.core.analysis.methods import ResolvedMethod, resolve_method
from metastore_plugins.core.analysis.queries import nearest_occurrences
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.reports import OUTLIER_COLUMNS, checkpoint_points, markdown_table
from metastore_plugins.core.reports.files import influence_markdown
from metastore_plugins.core.reports.influence_table import default_rows, influence_rows
from metastore_plugins.core.reports.stored import (
    budget_caption,
    default_test_points,
    dropped_message,
    outlier_ranking,
    paired_passes,
    stored_self_influence,
    with_gradients,
)
from metastore_plugins.core.reports.tables import outlier_markdown, outlier_table
from metastore_plugins.core.store.writable import writing


def cmd_outliers(args: argparse.Namespace, store: GradientStore) -> None:
    """The outlier table over the train checkpoint passes (or ``--capture-point``), ranked ``--by``."""
    given = args.capture_point or checkpoint_points(store, "train")  # none left by the budget: AUM or loss alone
    points = list(given) if given or TRAINING_STEPS in store.capture_points() else train_points(store, None)
    by = outlier_ranking(store, points, args.by)
    scores = stored_self_influence(store, points)
    table = outlier_table(store, points, args.k, scores, by)
    caption = budget_caption(store, table.caption, len(scores[0]))
    damage = [f"warning: {store_damage(store)}: capture points may be missing"] if store.open_problems else []
    emit(args, table.rows, outlier_markdown(table.rows, OUTLIER_COLUMNS, [*damage, *caption]))


def cmd_influence(args: argparse.Namespace, store: GradientStore) -> None:
    """Influence by ``--method``: ``auto`` (default) over every training sample (the default answer) where the
    training steps hold inner products and neither ``--train``, ``--capture-point`` nor ``--index build`` is given;
    else over paired passes (``auto``: EK-FAC where they can be preconditioned, else TracIn); a test sample stored
    several times in its capture point has its occurrences summed."""
    if args.method == AUTO and not (args.train or args.capture_point or args.index == "build"):
        tests = default_test_points(store, checkpoint_points(store, args.test_split))
        if tests:
            _check_tests(store, args.test, tests)
            rows = default_rows(
                store, tests, args.k, test_ids=args.test, method=args.method, damping=args.damping,
                relative_damping=args.relative_damping, layers=args.layers,
            )  # fmt: skip
            notes = _occurrence_notes(store, tests, [row["test_id"] for row in rows])
            emit(args, rows, "".join(f"{line}\n" for line in notes) + influence_markdown(rows))
            return
    train = train_points(store, args.train)
    test = [cp.split("/")[0] + "/" + args.test_split for cp in train]
    if args.capture_point:
        train, test = train[-1:], [args.capture_point]
    elif not args.train and (paired := paired_passes(store, train, args.test_split)):
        train, test = [a for a, _ in paired], [b for _, b in paired]  # the passes the budget kept both sides of
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
    _check_tests(store, args.test, test)
    rows = influence_rows(
        store,
        train,
        test,
        args.k,
        index=_index_option(args),
        method=_checked_method(args, store, [*train, *test]),  # auto's own choice keeps its note
        damping=args.damping,
        relative_damping=args.relative_damping,
        layers=args.layers,
    )
    if args.test is not None:
        rows = [row for row in rows if row["test_id"] in set(args.test)]
    notes = _occurrence_notes(store, test, [row["test_id"] for row in rows])
    emit(args, rows, "".join(f"{line}\n" for line in notes) + influence_markdown(rows))


def _check_tests(store: GradientStore, wanted: Sequence[int] | None, test: Sequence[str]) -> None:
    """Raise naming the ``--test`` ids that no test capture point holds."""
    if wanted is not None:
        stored = {int(i) for cp in test for i in store.sample_ids(cp).tolist()}
        missing = sorted(set(wanted) - stored)
        if missing:
            raise not_stored(store, missing, test, f"test sample(s) {missing} are")


def _checked_method(args: argparse.Namespace, store: GradientStore, points: Sequence[str]) -> ResolvedMethod:
    """The method ``--method`` runs on these passes, resolved once for the call; a flag it does not take raises
    naming the flag."""
    chosen = resolve_method(store, args.method, points, args.layers)
    why = f"--method auto chose {chosen.method} ({chosen.fallback}): " if chosen.fallback else ""
    try:
        check_arguments(
            chosen.entry, MethodArgs(args.damping, args.relative_damping), ("--damping", "--relative-damping")
        )
    except ConfigError as exc:
        raise ConfigError(f"{why}{exc}") from None
    return chosen


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
    query_point = args.capture_point or train_points(store, None)[-1]
    candidates = args.candidates or query_point
    if args.sample not in set(store.sample_ids(query_point).tolist()):
        raise not_stored(store, [args.sample], [query_point], f"sample {args.sample} is")
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
    emit(args, rows, note + "\n" + markdown_table(rows, ("sample_id", "cosine", "step")))


def _index_option(args: argparse.Namespace) -> bool | None:
    """``--index build``: build the nearest-gradient index (True); ``off``: scan every row (False); else a kept one."""
    return {"build": True, "off": False}.get(args.index)


def cmd_restore(args: argparse.Namespace, store: GradientStore) -> None:
    """The exact dense gradients of one sample occurrence, written to ``--out`` (safetensors)."""
    from safetensors.torch import save

    grads = store.restore(args.sample, capture_point=args.capture_point, step=args.step, layer=args.layer)
    data = save({name: g.contiguous() for name, g in grads.items()})  # one sample's dense gradients
    with writing(Path(args.out).parent, "pass --out a file in a writable folder"):
        Path(args.out).write_bytes(data)
    shapes = {name: list(g.shape) for name, g in grads.items()}
    emit(
        args,
        {"file": args.out, "tensors": shapes},
        f"wrote {args.out}: " + ", ".join(f"{n} {s}" for n, s in shapes.items()),
    )
