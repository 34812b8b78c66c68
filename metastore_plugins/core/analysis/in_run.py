"""In-run influence: the training side from the gradients recorded *while training*, by ``method``.

Each training step ``t`` is paired with the test passes around it (:func:`step_windows`): the pass before it
(the weights its window started from) and the pass after it (the weights it led to), the pass's step ``s_c``
counting the steps done before it; steps before the first pass or after the last go with that pass twice. The
score of training sample ``i`` for test sample ``j``, summed over the step's pairs ``c(t)``:

- TracIn: ``sum_t lr_t <g_i(w_t), g_j(w_c(t))>`` (Pruthi et al.'s in-run TracIn; the train
  gradients were taken at the weights of each step, the test ones at the weights of its pass);
- ``"kfac"``, ``"ekfac"``: ``sum_t lr_t g_i(w_t)^T (F_c + delta I)^-1 g_j(w_c)`` with ``F_c`` the K-FAC /
  EK-FAC curvature fitted on the training steps paired with pass ``c`` (their stored factors: no
  checkpoint pass over the training set is needed).

Occurrences of a sample at several steps are summed (rows are sample ids).

Steps kept projected on a curvature eigenbasis (:mod:`~metastore_plugins.core.ops.eigenbasis`: a basis fitted
at each checkpoint, which the passes there and the steps after them use) are paired with the pass of their basis
only (the pass before them); steps before the first pass, kept on no basis, are left out. Each test record
is cut to the steps' block (the steps keep the top of the passes' block:
:func:`~metastore_plugins.core.ops.eigenbasis.truncated_record`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields

from metastore_plugins.core.analysis.method_table import TRACIN, MethodArgs, check_arguments
from metastore_plugins.core.analysis.methods import METHODS, method_entry
from metastore_plugins.core.analysis.queries import Pair
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.errors import QueryError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.eigenbasis import truncated_record
from metastore_plugins.core.store import Selection, StoreReader
from metastore_plugins.core.store.reading.selection import StoredBatch


def in_run_methods() -> tuple[str, ...]:
    """The methods in-run influence takes: those scoring paired selections (TRAK's kernel is fitted on checkpoint
    passes only)."""
    return tuple(name for name, entry in METHODS.items() if entry.pairs is not None)


#: the built-in methods in-run influence takes (:func:`in_run_methods`: with the registered ones)
IN_RUN_METHODS: tuple[str, ...] = in_run_methods()


def step_windows(
    store: StoreReader, train: str, tests: Sequence[str], steps: tuple[int, int] | None = None
) -> list[tuple[str, tuple[int, int]]]:
    """The test passes with the inclusive ranges of training steps paired with them (empty ranges left out).

    Pass ``c`` is taken at step ``s_c`` (the steps done before it). Each step is paired with the pass before it
    (``s_c <= t < s_{c+1}``: the weights its window started from) and with the pass after it
    (``s_{c-1} <= t < s_c``: the weights it led to), the two scores summed: the trapezoid rule over the window,
    where the test gradient at the step's own weights is not stored. Steps before the first pass go with the first
    in both, steps after the last with the last. Measured on the LDS tasks, each pairing alone wins on some tasks
    and loses up to 0.05 on others; their sum is never the worst and the best in total (docs/quality.md). Steps
    kept projected on curvature eigenbases go with the pass of their basis only (the pass before them; steps before
    the first pass with it where they are on its basis, as the HF callback keeps them), and steps before the first
    pass, kept on no basis, are left out.

    Raises:
        QueryError: a test capture point holding gradients of several steps, or passes not in step order.
    """
    taken: list[int] = []
    for point in tests:
        at = store.steps(point)
        if len(at) != 1:
            raise QueryError(
                f"in-run influence pairs the training steps with checkpoint passes, each taken at one step; {point!r} "
                f"holds gradients of {len(at)} steps"
            )
        if taken and at[0] <= taken[-1]:
            raise QueryError(
                f"the test passes must be given in step order; {point!r} (step {at[0]}) comes after step {taken[-1]}"
            )
        taken.append(at[0])
    trained = store.steps(train)
    lo_all, hi_all = steps if steps is not None else (trained[0], trained[-1]) if trained else (0, -1)
    on_bases = bool(taken) and bool(trained) and not pairs_with_last(store, train)
    from_first = not on_bases or (taken and _basis_of(store, train, lo_all) == _basis_of(store, tests[0]) is not None)
    last = len(tests) - 1
    after = [  # each pass with the steps after it, until the next pass
        (lo_all if c == 0 and from_first else max(lo_all, s), hi_all if c == last else min(hi_all, taken[c + 1] - 1))
        for c, s in enumerate(taken)
    ]
    before = [  # each pass with the steps before it, since the previous pass
        (lo_all if c == 0 else max(lo_all, taken[c - 1]), hi_all if c == last else min(hi_all, s - 1))
        for c, s in enumerate(taken)
    ]
    ranges = [*zip(tests, after), *([] if on_bases else zip(tests, before))]
    windows = [(point, (lo, hi)) for point, (lo, hi) in ranges if lo <= hi]
    return windows


def pairs_with_last(store: StoreReader, train: str = "train") -> bool:
    """Whether every training step can be paired with the last test pass alone: none is kept projected on a
    curvature eigenbasis (a basis is fitted at each checkpoint, so a step pairs only with the pass of its own; the
    last step is on one whenever any step is)."""
    trained = store.steps(train)
    return bool(trained) and _blocks(store, train, (trained[-1], trained[-1])) is None


def in_run_influence(
    store: StoreReader,
    test: str | Sequence[str],
    *,
    train: str = "train",
    method: str = TRACIN,
    damping: float | None = None,
    relative_damping: float | None = None,
    steps: int | tuple[int, int] | None = None,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Scores:
    """In-run influence of the training steps on the test passes, by ``method`` (module docstring).

    Args:
        test: one test capture point (every training step is scored against it, whatever its step), or
            several checkpoint passes in step order (each step against the pass it is paired with).
        train: the capture point of the training steps.
        method: one of :func:`in_run_methods`: TracIn (default), ``"kfac"`` or ``"ekfac"``; ``damping``,
            ``relative_damping`` as :func:`~metastore_plugins.core.analysis.methods.influence` takes them.
        steps: only the training steps in this inclusive range (or this one step).
        layers, train_ids, test_ids: restrict to these layers and samples (the curvature is still fitted on
            every sample of each step window).

    Raises:
        ValueError: naming an unknown method or a damping it does not take, a test point of several steps.
    """
    entry = method_entry(method, in_run_methods())
    args = MethodArgs(damping, relative_damping, layers, train_ids, test_ids, max_bytes)
    check_arguments(entry, args)
    window = (steps, steps) if isinstance(steps, int) else steps
    if isinstance(test, str):
        trained = store.steps(train)
        windows = [(test, window or ((trained[0], trained[-1]) if trained else (0, -1)))]
    else:
        windows = step_windows(store, train, test, window)
    if not windows:
        raise QueryError(f"no training step of {train!r} is paired with the test passes {test!r} (steps {steps})")
    single = isinstance(test, str)
    pairs: list[Pair] = [
        (
            train if single else f"{train} steps {lo}-{hi}",
            store.select(train, steps=(lo, hi), sample_ids=train_ids, layers=layers),
            point,
            _cut(store.select(point, sample_ids=test_ids, layers=layers), _blocks(store, train, (lo, hi), layers)),
        )
        for point, (lo, hi) in windows
    ]
    fitted_on = {
        label: store.select(train, steps=(lo, hi), layers=layers)
        for (label, _, _, _), (_, (lo, hi)) in zip(pairs, windows)
    }
    assert entry.pairs is not None  # in_run_methods() holds only such entries
    return entry.pairs(store, pairs, fitted_on, args)


def _basis_of(store: StoreReader, point: str, step: int | None = None) -> int | None:
    """The eigenbasis (its fit step) the first stored batch of ``point`` (at ``step``) is kept on; None: seeded,
    exact, or no such batch."""
    batch = _first_batch(store, point, None if step is None else (step, step))
    return next((r.basis for r in batch.records if r.basis is not None), None) if batch is not None else None


def _blocks(
    store: StoreReader, train: str, steps: tuple[int, int], layers: Sequence[str] | None = None
) -> dict[str, tuple[int, int]] | None:
    """Each layer's eigenbasis block in the first stored training batch of ``steps`` (None: it holds no eigenbasis
    record, or there is no such batch)."""
    batch = _first_batch(store, train, steps, layers)
    if batch is None:
        return None
    blocks = {r.layer: tuple(r.tensors["projected"].shape[1:]) for r in batch.records if r.basis is not None}
    return {layer: (int(block[0]), int(block[1])) for layer, block in blocks.items()} or None


def _first_batch(
    store: StoreReader, point: str, steps: tuple[int, int] | None, layers: Sequence[str] | None = None
) -> StoredBatch | None:
    """The first stored batch of ``point`` (within ``steps``, of ``layers``), or None."""
    return next(iter(store.select(point, steps=steps, layers=layers).batches()), None)


@dataclass(frozen=True)
class _CutSelection(Selection):
    """A test selection whose eigenbasis records are cut to the training steps' blocks (``blocks``)."""

    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def batches(self, with_records: bool = True) -> Iterator[StoredBatch]:
        for batch in super().batches(with_records):
            cut = [truncated_record(r, self.blocks[r.layer]) if r.layer in self.blocks else r for r in batch.records]
            yield StoredBatch(batch.ref, batch.meta, cut)


def _cut(selection: Selection, blocks: dict[str, tuple[int, int]] | None) -> Selection:
    """``selection``, its eigenbasis records cut to ``blocks`` where given."""
    if not blocks:
        return selection
    return _CutSelection(**{f.name: getattr(selection, f.name) for f in fields(selection)}, blocks=blocks)
