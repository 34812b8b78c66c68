"""The built-in influence methods, one :class:`~.method_table.Method` each (:data:`BUILT_IN`).

Score of training sample ``i`` for test sample ``j`` over paired checkpoint passes ``c``:

- TracIn (``"tracin"``): ``sum_c lr_c g_i^T g_j`` (:func:`.vector_index.influence`: exhaustive, or top-k);
- ``"kfac"``, ``"ekfac"``: ``sum_c lr_c g_i^T (F_c + delta I)^-1 g_j``, ``F_c`` the K-FAC / EK-FAC curvature
  of the pass's training factors (:func:`.curvature.kfac_influence`);
- ``"trak"``: ``sum_c lr_c s_i^T (S_c^T S_c + lambda_c I)^-1 t_j`` on Kronecker sketches
  (:func:`.sketches.kernel_influence`).

``relative_damping`` is one idea for the three preconditioned methods: the ridge as a fraction of the
mean eigenvalue of what is inverted (K-FAC / EK-FAC curvature, or the sketches' kernel: there
``regularization``); ``damping`` is an absolute ``delta`` (K-FAC / EK-FAC only). Their top-k path is
:func:`.index_methods.influence`, TracIn's :func:`.vector_index.influence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from metastore_plugins.core.analysis import curvature, curvature_self, index_methods, queries, sketches, vector_index
from metastore_plugins.core.analysis.method_table import NOT_REFINED, TRACIN, Method, MethodArgs, MethodWords, Points
from metastore_plugins.core.analysis.queries import Pair
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING, CurvatureMethod
from metastore_plugins.core.store import Selection, StoreReader


def _tracin_pairs(
    store: StoreReader, pairs: Sequence[Pair], fitted_on: dict[str, Selection], args: MethodArgs
) -> Scores:
    return queries.whole(queries.scored_pairs(store, pairs, max_bytes=args.max_bytes))


def _tracin_self(store: StoreReader, point: Points | None, args: MethodArgs, where: dict[str, Any]) -> np.ndarray:
    chosen = {} if args.layers is None else {"layers": args.layers}
    return queries.self_influence(store, point, max_bytes=args.max_bytes, scan=args.scan, **chosen, **where)


def _kfac(name: CurvatureMethod, store: StoreReader, train: Points, test: Points, args: MethodArgs) -> Scores:
    return curvature.kfac_influence(
        store, train, test, method=name, damping=args.damping, relative_damping=KFAC.relative(args),
        max_bytes=args.max_bytes, layers=args.layers, train_ids=args.train_ids, test_ids=args.test_ids,
    )  # fmt: skip


def _kfac_pairs(
    name: CurvatureMethod, store: StoreReader, pairs: Sequence[Pair], fitted_on: dict[str, Selection], args: MethodArgs
) -> Scores:
    relative = KFAC.relative(args)
    return curvature.preconditioned_scores(store, pairs, fitted_on, name, args.damping, relative, args.max_bytes)


def _kfac_self(
    name: CurvatureMethod, store: StoreReader, point: Points | None, args: MethodArgs, where: dict[str, Any]
) -> np.ndarray:
    return curvature_self.preconditioned_self_influence(
        store, _per_pass(name, point), method=name, damping=args.damping, relative_damping=KFAC.relative(args),
        layers=args.layers, max_bytes=args.max_bytes, **where,
    )  # fmt: skip


def _trak(store: StoreReader, train: Points, test: Points, args: MethodArgs) -> Scores:
    scores = sketches.kernel_influence(store, train, test, layers=args.layers, regularization=TRAK.relative(args))
    return restricted(scores, args.train_ids, args.test_ids)


def _trak_self(store: StoreReader, point: Points | None, args: MethodArgs, where: dict[str, Any]) -> np.ndarray:
    ridge = TRAK.relative(args)
    return curvature_self.kernel_self_influence(
        store, _per_pass("trak", point), regularization=ridge, layers=args.layers, **where
    )


def _per_pass(name: str, point: Points | None) -> Points:
    """``point``; a method that fits per pass refuses none."""
    if point is None:
        raise ConfigError(f"method={name!r} fits its curvature per pass: name the capture_point (or points)")
    return point


def restricted(scores: Scores, row_ids: Sequence[int] | None, col_ids: Sequence[int] | None) -> Scores:
    """The rows of ``scores`` whose ids are in ``row_ids``, and columns in ``col_ids`` (all when ``None``)."""
    rows = np.ones(len(scores.row_ids), bool) if row_ids is None else np.isin(scores.row_ids, list(row_ids))
    cols = np.ones(len(scores.col_ids), bool) if col_ids is None else np.isin(scores.col_ids, list(col_ids))
    return Scores(scores.scores[np.ix_(rows, cols)], scores.row_ids[rows], scores.col_ids[cols])


TRACIN_METHOD = Method(
    TRACIN,
    "TracIn",
    influence=vector_index.influence,  # every row, or with k each test sample's candidates (it decides which)
    top_k=vector_index.influence,
    pairs=_tracin_pairs,
    self_influence=_tracin_self,
    takes=frozenset({"recompute", "scan"}),
    words=MethodWords(
        formula=" (sum over passes of lr x gradient inner products)",
        estimate="Scores are estimates from projected gradients (the capture policy); rows recomputed exactly say "
        "so in influence.json (`exact`).",
    ),
)


def _curvature_method(name: CurvatureMethod, label: str) -> Method:
    """K-FAC or EK-FAC: the same entry but for the curvature's name."""
    return Method(
        name,
        label,
        influence=partial(_kfac, name),
        top_k=partial(index_methods.influence, name),
        pairs=partial(_kfac_pairs, name),
        self_influence=partial(_kfac_self, name),
        takes=frozenset({"damping", "relative_damping"}),
        default_relative=DEFAULT_RELATIVE_DAMPING,
        words=MethodWords(
            ridge=", damping {:g} x each layer's mean curvature eigenvalue",
            exact="Scores are exact given the fitted curvature (the passes hold exact factors; K-FAC / EK-FAC "
            "approximate the Fisher, which stands in for the Hessian).",
        ),
    )


KFAC = _curvature_method("kfac", "K-FAC")
EKFAC = _curvature_method("ekfac", "EK-FAC")
TRAK = Method(
    "trak",
    "TRAK",
    influence=_trak,
    top_k=partial(index_methods.influence, "trak"),
    self_influence=_trak_self,
    takes=frozenset({"relative_damping"}),
    default_relative=sketches.DEFAULT_REGULARIZATION,
    exact=False,
    words=MethodWords(
        formula=" (kernel inverse on Kronecker sketches)",
        ridge=", ridge {:g} x its mean eigenvalue",
        estimate=f"Scores are estimates (random Kronecker sketches); {NOT_REFINED}.",
        relative="its kernel's ridge as a fraction of the mean eigenvalue",
    ),
)
#: the built-in methods, in the order the choices name them
BUILT_IN: tuple[Method, ...] = (TRACIN_METHOD, KFAC, EKFAC, TRAK)
