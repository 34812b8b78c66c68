"""The default answer: ``store.influence(test=..., method="auto")`` with the training side chosen by the store.

``influence(store, train, test, ...)`` is :func:`.methods.influence` when ``train`` is given (``method="auto"``
resolved on its passes: :func:`.methods.resolve_method`). With ``train`` left out, :func:`default_influence`:

- **passes**: each test point ``P/split`` paired with the training-set pass ``P/train`` where the store holds it
  with inner products (every batch with records, none of them norms only);
- **steps**: the training steps (``"train"``) through in-run influence against the test points
  (:func:`.in_run.in_run_influence`: each step with the passes before and after it), the start pass of their
  split first (``start/val``, the pass before the first step) where the store holds it; under K-FAC / EK-FAC over
  steps with exact factors, per test sample the mean with every step against the last pass (:func:`per_test_mean`);
- one row per training sample id the two hold: a sample both hold gets the mean of its two scores (the
  checkpoint's weights on both sides, and the weights of its steps: two estimates of one influence; the mean
  scored level with or above the passes alone on every LDS task measured, docs/quality.md), a sample only
  the steps hold its steps' score, both put on the passes' scale by one factor: the ratio of the two
  sides' root-mean-square scores on the samples both hold (over every row of each side when none is
  shared). The in-run score sums a sample's steps at each step's rate, the passes' at each pass's summed
  rate: the factor removes that difference, not the ranking;
- a sample with no scorable record (steps kept on no basis, before the first pass, under ``"ekfac"``) gets a
  row of zeros, counted in the notes;
- ``method="auto"``: :data:`.methods.AUTO_METHOD` on each side that can be preconditioned, else TracIn there
  (the notes say why); ``"trak"`` scores the passes, the steps by :data:`.methods.AUTO_METHOD` (TRAK's kernel
  is fitted on passes only).

The result is a :class:`~.results.DefaultScores`: the scores and what produced them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from metastore_plugins.core.analysis import in_run, methods
from metastore_plugins.core.analysis.method_table import AUTO, TRACIN, MethodArgs
from metastore_plugins.core.analysis.results import DefaultScores, Scores
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.errors import QueryError
from metastore_plugins.core.model.pass_sources import START_PASS, TRAIN_SPLIT
from metastore_plugins.core.store import StoreReader
from metastore_plugins.core.store.reading.record_memo import MEMO_BYTES, RECORDS

#: the warning a query gives when its capture points hold different samples: expected here (the steps' windows)
_DIFFERENT_SAMPLES = "the .* capture points hold different samples"


def influence(
    store: StoreReader,
    train: str | Sequence[str] | None = None,
    test: str | Sequence[str] | None = None,
    *,
    method: str = TRACIN,
    **options: Any,
) -> Scores:
    """:func:`.methods.influence` (``options``: its keyword arguments); ``method="auto"`` picks the method by the
    store (:func:`.methods.resolve_method`). ``train`` left out: :func:`default_influence`, the default answer."""
    if test is None:
        raise QueryError("influence() needs test= (the capture point or points of the test samples)")
    if train is None:
        return default_influence(store, test, method=method, **options)
    points = [train] if isinstance(train, str) else list(train)
    tests = [test] if isinstance(test, str) else list(test)
    chosen = methods.resolve_method(store, method, [*points, *tests], options.get("layers"))
    options["layers"] = chosen.layers_or(options.get("layers"))
    return methods.influence(store, train, test, method=chosen.method, **options)


#: the keywords of :func:`.methods.influence` the default answer takes (it scores every row: no top-k ones)
TAKEN = ("damping", "relative_damping", "layers", "train_ids", "test_ids", "max_bytes")


def default_influence(
    store: StoreReader, test: str | Sequence[str], *, method: str = AUTO, **options: Any
) -> DefaultScores:
    """Influence of every training sample the store holds on the samples of ``test`` (module docstring).

    Args:
        test: the test capture point, or points in step order (``["epoch-0/val", "epoch-1/val"]``).
        method: ``"auto"`` (default here), or one method for both sides (``"trak"``: the passes only).
        options: those of :data:`TAKEN`, as :func:`.methods.influence` takes them.

    Raises:
        ValueError: no test point, a store with neither passes nor steps paired with them, or an argument of
            TracIn's top-k (``k=``, ``index=``, ...: take ``.top(k)`` of the result).
    """
    methods.check_method(method, methods.method_choices())
    unknown = sorted(set(options) - set(TAKEN))
    if unknown:
        raise QueryError(
            f"{', '.join(f'{u}=' for u in unknown)} not taken with train= left out (the default answer scores "
            "every row: take .top(k) of its result)"
        )
    args = MethodArgs(**options)
    tests = [test] if isinstance(test, str) else list(test)
    if not tests:
        raise QueryError("influence() needs at least one test capture point")
    held = store.capture_points()
    missing = [t for t in tests if t not in held or t == TRAINING_STEPS]
    if missing:
        raise QueryError(f"test capture points {missing} are not checkpoint passes of this store; it has {held}")
    pairs = [(p, t) for t in tests if (p := f"{t.split('/')[0]}/{TRAIN_SPLIT}") in held and _scorable(store, p)]
    steps = TRAINING_STEPS in held and _scorable(store, TRAINING_STEPS)
    if not pairs and not steps:
        raise QueryError(
            f"no training side for {tests}: no pass 'P/{TRAIN_SPLIT}' beside them and no training steps "
            f"{TRAINING_STEPS!r} with per-sample records; the store has {held}"
        )
    common: dict[str, Any] = {
        "layers": args.layers,
        "train_ids": args.train_ids,
        "test_ids": args.test_ids,
        "max_bytes": args.max_bytes,
    }
    with RECORDS.active(min(MEMO_BYTES, args.max_bytes // 2)):  # the steps are read for each window's fit, then scored
        return _answer(store, tests, held, pairs, steps, method, args, common)


def _answer(
    store: StoreReader,
    tests: list[str],
    held: list[str],
    pairs: list[tuple[str, str]],
    steps: bool,
    method: str,
    args: MethodArgs,
    common: dict[str, Any],
) -> DefaultScores:
    """:func:`default_influence`'s scores, its arguments checked: the passes' ``pairs`` (train, test) and the
    training ``steps`` (whether the store holds them with records), joined per sample id."""
    notes: list[str] = []
    chosen: dict[str, str] = {}
    parts: dict[str, Scores] = {}
    if pairs:
        trains, paired = [p for p, _ in pairs], [t for _, t in pairs]
        resolved = methods.resolve_method(store, method, [*trains, *paired], args.layers)
        if resolved.fallback:
            notes.append(f"passes: TracIn, because K-FAC cannot precondition {resolved.fallback}")
        if resolved.left_out:
            notes.append(f"passes: {methods.left_out_words(resolved.left_out)}")
        chosen["passes"] = resolved.method
        with _expected_warnings():
            damped = resolved.entry.damping_options(args.damping, args.relative_damping)
            narrowed = {**common, "layers": resolved.layers_or(args.layers)}
            parts["passes"] = methods.influence(store, trains, paired, method=resolved.method, **damped, **narrowed)
    pass_ids = set(parts["passes"].row_ids.tolist()) if "passes" in parts else set()
    step_ids = set(store.sample_ids(TRAINING_STEPS).tolist()) if steps else set()
    if args.train_ids is not None:
        step_ids &= {int(i) for i in args.train_ids}
    if step_ids - pass_ids:
        wanted = method if method in in_run.in_run_methods() else methods.AUTO_METHOD
        step_tests = _with_start(tests, held)
        parts["steps"], chosen["steps"] = _steps(store, step_tests, wanted, args, common, notes)
    return _joined(parts, chosen, sorted(pass_ids | step_ids), notes)


def _with_start(tests: list[str], held: Sequence[str]) -> list[str]:
    """``tests`` with the start pass of their split first (``start/val``: the test side of the steps before the
    first epoch-end pass) where the store holds it and they do not name it."""
    splits = {t.split("/", 1)[-1] for t in tests}
    start = f"{START_PASS}/{next(iter(splits))}" if len(splits) == 1 else None
    return [start, *tests] if start is not None and start in held and start not in tests else tests


def _steps(
    store: StoreReader,
    tests: list[str],
    method: str,
    args: MethodArgs,
    common: dict[str, Any],
    notes: list[str],
) -> tuple[Scores, str]:
    """In-run influence of the training steps by ``method``, else TracIn with the reason in ``notes``."""
    test: str | list[str] = tests[0] if len(tests) == 1 else tests
    if method != TRACIN:
        try:
            with _expected_warnings():
                damped = methods.method_entry(method).damping_options(args.damping, args.relative_damping)
                scores = in_run.in_run_influence(store, test, method=method, **damped, **common)
                if len(tests) > 1 and in_run.pairs_with_last(store, TRAINING_STEPS):
                    end = in_run.in_run_influence(store, tests[-1], method=method, **damped, **common)
                    scores = per_test_mean(scores, end)
                    notes.append(
                        f"steps: per test sample, the mean of each step with the passes around it and every step with "
                        f"the last pass {tests[-1]!r} (its curvature fitted on every step)"
                    )
            return scores, method
        except ValueError as exc:  # the curvature refuses what the steps hold (a RepresentationError is one)
            notes.append(f"steps: TracIn, because {method} cannot precondition them: {exc}")
    with _expected_warnings():
        return in_run.in_run_influence(store, test, **common), TRACIN


def per_test_mean(trajectory: Scores, end: Scores) -> Scores:
    """Per test sample ``j``: ``(T_ij + E_ij rms_j(T) / rms_j(E)) / 2``, ``rms_j`` the root-mean-square over the
    rows: the mean of two estimates of one influence, each on the same footing for that test sample, on
    ``trajectory``'s scale (ranks within a column are all the query is read for).

    ``trajectory`` pairs each step with the passes around it (test gradients along the way), ``end`` every step
    with the last pass and a curvature fitted on every step (what the trained model's outputs respond to). Their
    column scales differ by the test gradients' norms along training, so a sum without the normalisation is the
    trajectory alone on most test samples. Measured on the LDS tasks (docs/quality.md): the mean kept the better
    of the two on the full digits tasks (+0.05 over the trajectory), and within 0.01 of it elsewhere. ``end``'s
    rows and columns are matched by id; a column it lacks, or holds as zeros, keeps ``trajectory``'s scores.
    """
    t = trajectory.scores  # (N, M)
    e = np.zeros_like(t)  # (N, M) end's scores on trajectory's rows and columns
    rows = {int(i): r for r, i in enumerate(end.row_ids)}
    cols = {int(c): k for k, c in enumerate(end.col_ids)}
    row_pairs = [(r, rows[int(i)]) for r, i in enumerate(trajectory.row_ids) if int(i) in rows]
    col_pairs = [(k, cols[int(c)]) for k, c in enumerate(trajectory.col_ids) if int(c) in cols]
    if row_pairs and col_pairs:
        (to_r, from_r), (to_c, from_c) = zip(*row_pairs), zip(*col_pairs)
        e[np.ix_(to_r, to_c)] = end.scores[np.ix_(from_r, from_c)]
    rms_t, rms_e = np.sqrt((t * t).mean(0)), np.sqrt((e * e).mean(0))  # (M,), (M,)
    both = (rms_t > 0) & (rms_e > 0)
    out = t.copy()
    out[:, both] = (t[:, both] + e[:, both] * (rms_t[both] / rms_e[both])) / 2
    return Scores(out, trajectory.row_ids, trajectory.col_ids)


def _joined(parts: dict[str, Scores], chosen: dict[str, str], ids: list[int], notes: list[str]) -> DefaultScores:
    """One row per id of ``ids``: the steps' on the passes' scale, the passes', or the mean of the two."""
    cols = np.array(list(dict.fromkeys(int(c) for part in parts.values() for c in part.col_ids)), dtype=np.int64)
    out = np.zeros((len(ids), len(cols)))  # (N, M)
    held = np.zeros(len(ids))  # (N,) how many sides score each row
    sources = np.full(len(ids), "none", dtype=object)
    where, at = {sid: r for r, sid in enumerate(ids)}, {int(c): k for k, c in enumerate(cols)}
    for name in ("passes", "steps"):
        if name not in parts:
            continue
        part = parts[name]
        factor = _scale(parts["passes"], part) if name == "steps" and "passes" in parts else 1.0
        if name == "steps" and "passes" in parts:
            notes.append(f"steps' scores x {factor:.4g}: the passes' scale (root-mean-square ratio)")
        rows = np.array([where[int(i)] for i in part.row_ids], dtype=np.int64)
        out[np.ix_(rows, np.array([at[int(c)] for c in part.col_ids], dtype=np.int64))] += factor * part.scores
        held[rows] += 1
        sources[rows] = np.where(sources[rows] == "none", name, "passes and steps")
    out /= np.maximum(held, 1)[:, None]  # the mean where both sides score a sample
    empty = int((sources == "none").sum())
    if empty:
        notes.append(f"{empty} sample(s) with no scorable record (steps on no eigenbasis): rows of zeros")
    side = " and ".join(name for name in ("passes", "steps") if name in parts)
    return DefaultScores(
        out, np.array(ids, dtype=np.int64), cols, train_side=side, methods=dict(chosen), sources=sources, notes=notes
    )


def _scale(passes: Scores, steps: Scores) -> float:
    """The factor putting ``steps`` on the scale of ``passes``: the ratio of their root-mean-square scores on the
    samples both hold (over every row of each when none is shared), columns matched by id; 1 where one is 0."""
    cols = np.intersect1d(passes.col_ids, steps.col_ids)
    shared = np.intersect1d(passes.row_ids, steps.row_ids)
    rows_p = np.isin(passes.row_ids, shared) if len(shared) else np.ones(len(passes.row_ids), bool)
    rows_s = np.isin(steps.row_ids, shared) if len(shared) else np.ones(len(steps.row_ids), bool)
    p = passes.scores[np.ix_(rows_p, np.isin(passes.col_ids, cols))]
    s = steps.scores[np.ix_(rows_s, np.isin(steps.col_ids, cols))]
    rms_p, rms_s = float(np.sqrt(np.mean(p * p))) if p.size else 0.0, float(np.sqrt(np.mean(s * s))) if s.size else 0.0
    return rms_p / rms_s if rms_p > 0 and rms_s > 0 else 1.0


def _scorable(store: StoreReader, point: str) -> bool:
    """Whether every batch of ``point`` holds per-sample records with inner products (none norms only)."""
    refs = store.batch_refs(point)
    return bool(refs) and all(
        ref.info["records"] and all(r["kind"] != "norms" for r in ref.info["records"]) for ref in refs
    )


@contextmanager
def _expected_warnings() -> Iterator[None]:
    """The queries' 'capture points hold different samples' warning silenced: the default answer expects it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DIFFERENT_SAMPLES)
        yield
