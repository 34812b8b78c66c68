"""One ``method=`` for every influence query: the methods' names, the dispatch, and what ``"auto"`` picks.

Score of training sample ``i`` for test sample ``j`` over paired checkpoint passes ``c``:

- ``"tracin"``: ``sum_c lr_c g_i^T g_j`` (:func:`.vector_index.influence`: exhaustive, or top-k);
- ``"kfac"``, ``"ekfac"``: ``sum_c lr_c g_i^T (F_c + delta I)^-1 g_j``, ``F_c`` the K-FAC / EK-FAC curvature
  of the pass's training factors (:func:`.curvature.kfac_influence`);
- ``"trak"``: ``sum_c lr_c s_i^T (S_c^T S_c + lambda_c I)^-1 t_j`` on Kronecker sketches
  (:func:`.sketches.kernel_influence`).

``relative_damping`` is one idea for the three preconditioned methods: the ridge as a fraction of the
mean eigenvalue of what is inverted (K-FAC / EK-FAC curvature, or the sketches' kernel: there
``regularization``); ``None`` is each method's own default. ``damping`` is an absolute ``delta`` (K-FAC /
EK-FAC only). ``"auto"`` (reports, command line) is :data:`AUTO_METHOD` where every layer of the passes
can be preconditioned (:func:`.curvature.curvature_refusal`), else ``"tracin"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from metastore_plugins.core.analysis import curvature, curvature_self, index_methods, queries, sketches, vector_index
from metastore_plugins.core.analysis.per_batch import positive_number
from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import Scan
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.curvature import CURVATURE_METHODS, DEFAULT_RELATIVE_DAMPING, CurvatureMethod
from metastore_plugins.core.store import StoreReader

InfluenceMethod = Literal["tracin", CurvatureMethod, "trak"]
#: every influence method: the one tuple the queries, settings and command line check against
INFLUENCE_METHODS: tuple[InfluenceMethod, ...] = get_args(InfluenceMethod)
#: the reports' and command line's choice that picks by the store: :func:`resolve_method`
AUTO = "auto"
MethodChoice = Literal["auto", InfluenceMethod]
METHOD_CHOICES: tuple[str, ...] = get_args(MethodChoice)
#: what ``"auto"`` picks where the passes can be preconditioned: EK-FAC at the default damping is within 0.007 LDS of
#: the best method the store offers on every task of the LDS harness (digits MLP and CNN, token transformers with
#: fixed or learned positions; 0.001 in the full setting), nothing tuned to a task (docs/quality.md, "A method
#: choice across architectures")
AUTO_METHOD: InfluenceMethod = "ekfac"


def check_method(method: str, choices: Sequence[str] = INFLUENCE_METHODS, name: str = "method") -> str:
    """``method`` when it is one of ``choices``; else a ``ValueError`` naming ``name`` and the choices."""
    if not isinstance(method, str) or method not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}; got {method!r}")
    return method


@dataclass(frozen=True)
class ResolvedMethod:
    """The method a query runs: ``method``; ``fallback``: why ``"auto"`` could not take :data:`AUTO_METHOD`;
    ``layers``: the layers ``"auto"`` scores when it left tied layers out (``left_out``), else ``None`` (as asked)."""

    method: InfluenceMethod
    fallback: str | None = None
    layers: tuple[str, ...] | None = None
    left_out: tuple[str, ...] = ()

    def layers_or(self, asked: Sequence[str] | None) -> Sequence[str] | None:
        """The layers to score: the ones ``"auto"`` chose, else ``asked``."""
        return asked if self.layers is None else list(self.layers)


def resolve_method(
    store: StoreReader, method: str, capture_points: Sequence[str], layers: Sequence[str] | None = None
) -> ResolvedMethod:
    """``method`` (one of :data:`METHOD_CHOICES`) as the method to run on these capture points.

    ``"auto"``: :data:`AUTO_METHOD` where K-FAC can precondition every layer of ``capture_points`` (the
    train and test passes); where layers share a parameter (an LM head tied to its embedding: K-FAC fits one
    block per layer), :data:`AUTO_METHOD` on every layer but the later ones of each tied group, when K-FAC can
    precondition those (:func:`.curvature.untied_layers`: 0.273 -> 0.319 LDS on the harness's GPT-2, as
    docs/quality.md measures); else ``"tracin"`` with the reason (:func:`.curvature.curvature_refusal`).
    """
    check_method(method, METHOD_CHOICES)
    if method != AUTO:
        return ResolvedMethod(method)  # type: ignore[arg-type]
    refusal = curvature.curvature_refusal(store, capture_points, layers)
    if refusal is None:
        return ResolvedMethod(AUTO_METHOD)
    untied = curvature.untied_layers(store, capture_points, layers)
    if untied is not None and untied[0] and curvature.curvature_refusal(store, capture_points, untied[0]) is None:
        return ResolvedMethod(AUTO_METHOD, layers=tuple(untied[0]), left_out=tuple(untied[1]))
    return ResolvedMethod("tracin", refusal)


def left_out_words(left_out: Sequence[str]) -> str:
    """What ``"auto"`` left out for tied weights, in words (the reports' method line, the default answer's notes)."""
    names = ", ".join(repr(layer) for layer in left_out)
    return f"every layer but {names} (tied to another layer's parameter: K-FAC fits one block per layer)"


def check_damping(
    method: str,
    damping: float | None,
    relative_damping: float | None,
    names: tuple[str, str] = ("damping", "relative_damping"),
) -> None:
    """Raise naming the argument (``names``: how the caller spells the two) when ``method`` takes no such damping
    or a value is not positive."""
    positive_number(names[0], damping)
    positive_number(names[1], relative_damping)
    if method == "tracin" and (damping is not None or relative_damping is not None):
        raise ConfigError(f"method 'tracin' has no damping (it inverts nothing): drop {names[0]} and {names[1]}")
    if method == "trak" and damping is not None:
        raise ConfigError(
            f"method 'trak' takes {names[1]} (its kernel's ridge as a fraction of the mean eigenvalue), "
            f"not the absolute {names[0]}"
        )


def restricted(scores: Scores, row_ids: Sequence[int] | None, col_ids: Sequence[int] | None) -> Scores:
    """The rows of ``scores`` whose ids are in ``row_ids``, and columns in ``col_ids`` (all when ``None``)."""
    rows = np.ones(len(scores.row_ids), bool) if row_ids is None else np.isin(scores.row_ids, list(row_ids))
    cols = np.ones(len(scores.col_ids), bool) if col_ids is None else np.isin(scores.col_ids, list(col_ids))
    return Scores(scores.scores[np.ix_(rows, cols)], scores.row_ids[rows], scores.col_ids[cols])


def influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    method: InfluenceMethod = "tracin",
    damping: float | None = None,
    relative_damping: float | None = None,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    k: int | None = None,
    index: bool | None = None,
    candidates: int | None = None,
    recompute: RecomputeFn | None = None,
) -> Scores:
    """Influence of every training sample on every test sample over paired passes, by ``method``.

    Args:
        train, test: capture points paired in order (``["epoch-0/train", "epoch-1/train"]`` with
            ``["epoch-0/val", "epoch-1/val"]``): train and test gradients of a pair were taken at the
            same weights; ``lr_c`` is the one recorded with the train pass.
        method: ``"tracin"`` (default: ``sum_c lr_c <g_i, g_j>``, what the name always gave),
            ``"kfac"``/``"ekfac"`` (:meth:`kfac_influence`), ``"trak"`` (:meth:`kernel_influence`); the
            module docstring of :mod:`metastore_plugins.core.analysis.methods` gives each formula.
        damping: K-FAC / EK-FAC's absolute ``delta`` for every layer.
        relative_damping: the ridge as a fraction of the mean eigenvalue: K-FAC / EK-FAC's (default 0.1),
            TRAK's ``regularization`` (default 1.0).
        layers, train_ids, test_ids: restrict to these layers and samples (the curvature and the kernel
            are still fitted on all of the train pass's samples).
        k, index, candidates: top-k through the nearest-gradient index: only each test sample's candidates are
            scored, exactly by ``method`` (TracIn: :func:`~metastore_plugins.core.analysis.vector_index.influence`;
            K-FAC / EK-FAC / TRAK: :func:`~metastore_plugins.core.analysis.index_methods.influence`); ``.top(k)``
            of the result is the answer. ``train_ids`` scores those rows instead.
        recompute: TracIn's exact refinement of estimated scores (refused by the other methods).

    Raises:
        ValueError: naming an unknown method, a damping the method does not take or that is not positive,
            or ``recompute`` given to another method than TracIn.
    """
    check_method(method)
    check_damping(method, damping, relative_damping)
    if method == "tracin":
        return vector_index.influence(
            store,
            train,
            test,
            k=k,
            index=index,
            candidates=candidates,
            recompute=recompute,
            layers=layers,
            train_ids=train_ids,
            test_ids=test_ids,
            max_bytes=max_bytes,
        )
    if recompute is not None:
        raise ConfigError(
            f"recompute= belongs to method='tracin' (the exact TracIn refinement); method={method!r} is not refined"
        )
    if k is not None and train_ids is None:  # the same index, searched with the preconditioned test side
        return index_methods.influence(
            store, train, test, method=method, k=k, index=index, candidates=candidates, damping=damping,
            relative_damping=relative_damping, layers=layers, test_ids=test_ids, max_bytes=max_bytes,
        )  # fmt: skip
    if method in CURVATURE_METHODS:
        relative = DEFAULT_RELATIVE_DAMPING if relative_damping is None else relative_damping
        return curvature.kfac_influence(
            store,
            train,
            test,
            method=method,
            damping=damping,
            relative_damping=relative,
            max_bytes=max_bytes,
            layers=layers,
            train_ids=train_ids,
            test_ids=test_ids,
        )
    ridge = sketches.DEFAULT_REGULARIZATION if relative_damping is None else relative_damping
    scores = sketches.kernel_influence(store, train, test, layers=layers, regularization=ridge)
    return restricted(scores, train_ids, test_ids)


def self_influence(
    store: StoreReader,
    capture_point: str | Sequence[str] | None = None,
    *,
    method: InfluenceMethod = "tracin",
    damping: float | None = None,
    relative_damping: float | None = None,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    **where: Any,
) -> np.ndarray:
    """Self-influence ``sum_c lr_c g_i(w_c)^T P_c g_i(w_c)``, aligned with ``sample_ids`` of the first capture point.

    ``P_c`` by ``method``, as :func:`influence` takes it: the identity (``"tracin"``, default:
    :func:`~metastore_plugins.core.analysis.queries.self_influence`), ``(F_c + delta I)^-1`` (``"kfac"``,
    ``"ekfac"``) or TRAK's kernel inverse on sketches (``"trak"``). Several capture points are summed per
    sample id (aligned with :meth:`self_influence_ids`); ``where``: ``store.select``'s filters.
    ``scan``: TracIn's partitioned read (the other methods read through the store's own).
    """
    check_method(method)
    check_damping(method, damping, relative_damping)
    if method == "tracin":
        chosen = {} if layers is None else {"layers": layers}
        return queries.self_influence(store, capture_point, max_bytes=max_bytes, scan=scan, **chosen, **where)
    if scan is not None:
        raise ConfigError(f"scan= is TracIn's; method={method!r} reads through the store's own scan")
    if capture_point is None:
        raise ConfigError(f"method={method!r} fits its curvature per pass: name the capture_point (or points)")
    if method in CURVATURE_METHODS:
        relative = DEFAULT_RELATIVE_DAMPING if relative_damping is None else relative_damping
        return curvature_self.preconditioned_self_influence(
            store,
            capture_point,
            method=method,
            damping=damping,
            relative_damping=relative,
            layers=layers,
            max_bytes=max_bytes,
            **where,
        )
    ridge = sketches.DEFAULT_REGULARIZATION if relative_damping is None else relative_damping
    return curvature_self.kernel_self_influence(store, capture_point, regularization=ridge, layers=layers, **where)


def similar(store: StoreReader, query: str, candidates: str, *, method: str = "tracin", **options: Any) -> Scores:
    """:func:`~metastore_plugins.core.analysis.vector_index.similar` (``options``: its arguments): the cosine
    (or inner product) of plain gradients, ``method="tracin"``.

    Other methods are refused: the preconditioned cosine ``<g_i, P g_j> / sqrt(<g_i, P g_i> <g_j, P g_j>)``
    would need every candidate's own preconditioned norm, a second pass over the candidates with the
    curvature (docs/queries.md, "Choosing a method").
    """
    check_method(method)
    if method != "tracin":
        raise ConfigError(
            f"similar() compares plain gradients (method='tracin'); method={method!r} is not supported: use "
            f"influence(..., method={method!r}) for preconditioned scores"
        )
    return vector_index.similar(store, query, candidates, **options)
