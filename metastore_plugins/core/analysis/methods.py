"""One ``method=`` for every influence query: the table of methods, what ``"auto"`` picks, and the queries'
dispatch through it.

:data:`METHODS` maps each name to its :class:`~.method_table.Method` (the built-in ones: :mod:`.method_entries`,
where each formula is written): :func:`influence`, :func:`self_influence`, in-run influence, the default answer,
the reports' influence table and ``metastore influence`` look the name up here (:func:`method_entry`), so a method
added with :func:`register_method` is served by each of them. ``"auto"`` (reports, command line) is
:data:`AUTO_METHOD` where every layer of the passes can be preconditioned (:func:`.curvature.curvature_refusal`),
else TracIn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metastore_plugins.core.analysis import curvature, vector_index
from metastore_plugins.core.analysis.method_entries import BUILT_IN
from metastore_plugins.core.analysis.method_table import AUTO, TRACIN, Method, MethodArgs, check_arguments
from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import Scan
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import StoreReader

#: every influence method by name: the built-in ones, then those :func:`register_method` added
METHODS: dict[str, Method] = {method.name: method for method in BUILT_IN}
#: the built-in methods' names (:func:`method_choices`: with the registered ones)
INFLUENCE_METHODS: tuple[str, ...] = tuple(METHODS)
#: the built-in choices of the reports and the command line, ``"auto"`` first
METHOD_CHOICES: tuple[str, ...] = (AUTO, *INFLUENCE_METHODS)
#: a method's name, and a name or ``"auto"`` (the table takes registered names: no closed ``Literal``)
InfluenceMethod = str
MethodChoice = str
#: what ``"auto"`` picks where the passes can be preconditioned: EK-FAC at the default damping is within 0.007 LDS of
#: the best method the store offers on every task of the LDS harness (digits MLP and CNN, token transformers with
#: fixed or learned positions; 0.001 in the full setting), nothing tuned to a task (docs/quality.md, "A method
#: choice across architectures")
AUTO_METHOD = "ekfac"


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS`: every query, the reports and the command line then take its name."""
    if method.name in METHODS or method.name == AUTO:
        taken = "the choice that picks by the store" if method.name == AUTO else "already registered"
        raise ConfigError(f"an influence method named {method.name!r} is {taken}")
    METHODS[method.name] = method
    return method


def method_choices(auto: bool = True) -> tuple[str, ...]:
    """The names ``method=`` takes now (with ``"auto"`` first when ``auto``)."""
    return (AUTO, *METHODS) if auto else tuple(METHODS)


def check_method(name: object, choices: Sequence[str] | None = None, what: str = "method") -> str:
    """``name`` when it is one of ``choices`` (default: every method of :data:`METHODS`); else a
    :class:`ConfigError` naming ``what`` and the choices."""
    among = method_choices(auto=False) if choices is None else tuple(choices)
    if not isinstance(name, str) or name not in among:
        raise ConfigError(f"{what} must be one of {', '.join(map(repr, among))}; got {name!r}")
    return name


def method_entry(name: object, choices: Sequence[str] | None = None) -> Method:
    """The entry of method ``name``, one of ``choices`` (default: every method): :func:`check_method`."""
    return METHODS[check_method(name, [c for c in choices or METHODS if c in METHODS])]


@dataclass(frozen=True)
class ResolvedMethod:
    """The method a query runs: ``method``; ``fallback``: why ``"auto"`` could not take :data:`AUTO_METHOD`;
    ``layers``: the layers ``"auto"`` scores when it left tied layers out (``left_out``), else ``None`` (as asked)."""

    method: str
    fallback: str | None = None
    layers: tuple[str, ...] | None = None
    left_out: tuple[str, ...] = ()

    @property
    def entry(self) -> Method:
        """Its entry of :data:`METHODS`."""
        return method_entry(self.method)

    def layers_or(self, asked: Sequence[str] | None) -> Sequence[str] | None:
        """The layers to score: the ones ``"auto"`` chose, else ``asked``."""
        return asked if self.layers is None else list(self.layers)


def resolve_method(
    store: StoreReader, method: str, capture_points: Sequence[str], layers: Sequence[str] | None = None
) -> ResolvedMethod:
    """``method`` (one of :func:`method_choices`) as the method to run on these capture points.

    ``"auto"``: :data:`AUTO_METHOD` where K-FAC can precondition every layer of ``capture_points`` (the
    train and test passes); where layers share a parameter (an LM head tied to its embedding: K-FAC fits one
    block per layer), :data:`AUTO_METHOD` on every layer but the later ones of each tied group, when K-FAC can
    precondition those (:func:`.curvature.untied_layers`: 0.273 -> 0.319 LDS on the harness's GPT-2, as
    docs/quality.md measures); else TracIn with the reason (:func:`.curvature.curvature_refusal`).
    """
    if method != AUTO:
        return ResolvedMethod(method_entry(check_method(method, method_choices())).name)
    refusal = curvature.curvature_refusal(store, capture_points, layers)
    if refusal is None:
        return ResolvedMethod(AUTO_METHOD)
    untied = curvature.untied_layers(store, capture_points, layers)
    if untied is not None and untied[0] and curvature.curvature_refusal(store, capture_points, untied[0]) is None:
        return ResolvedMethod(AUTO_METHOD, layers=tuple(untied[0]), left_out=tuple(untied[1]))
    return ResolvedMethod(TRACIN, refusal)


def left_out_words(left_out: Sequence[str]) -> str:
    """What ``"auto"`` left out for tied weights, in words (the reports' method line, the default answer's notes)."""
    names = ", ".join(repr(layer) for layer in left_out)
    return f"every layer but {names} (tied to another layer's parameter: K-FAC fits one block per layer)"


def influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    method: str = TRACIN,
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
        method: a name of :data:`METHODS`: ``"tracin"`` (default: ``sum_c lr_c <g_i, g_j>``, what the name always
            gave), ``"kfac"``/``"ekfac"`` (:meth:`kfac_influence`), ``"trak"`` (:meth:`kernel_influence`); the
            module docstring of :mod:`metastore_plugins.core.analysis.method_entries` gives each formula.
        damping: K-FAC / EK-FAC's absolute ``delta`` for every layer.
        relative_damping: the ridge as a fraction of the mean eigenvalue: K-FAC / EK-FAC's (default 0.1),
            TRAK's ``regularization`` (default 1.0).
        layers, train_ids, test_ids: restrict to these layers and samples (the curvature and the kernel
            are still fitted on all of the train pass's samples).
        k, index, candidates: top-k through the nearest-gradient index: only each test sample's candidates are
            scored, exactly by ``method`` (its entry's ``top_k``: TracIn
            :func:`~metastore_plugins.core.analysis.vector_index.influence`, K-FAC / EK-FAC / TRAK
            :func:`~metastore_plugins.core.analysis.index_methods.influence`); ``.top(k)`` of the result is the
            answer. ``train_ids`` scores those rows instead.
        recompute: TracIn's exact refinement of estimated scores (refused by the other methods).

    Raises:
        ConfigError: naming an unknown method, a damping the method does not take, or ``recompute`` given to
            another method than TracIn; ``ValueError`` for a damping that is not positive.
    """
    entry = method_entry(method)
    args = MethodArgs(
        damping, relative_damping, layers, train_ids, test_ids, max_bytes, k, index, candidates, recompute
    )  # fmt: skip
    check_arguments(entry, args)
    return entry.scores(store, train, test, args)


def self_influence(
    store: StoreReader,
    capture_point: str | Sequence[str] | None = None,
    *,
    method: str = TRACIN,
    damping: float | None = None,
    relative_damping: float | None = None,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    **where: Any,
) -> np.ndarray:
    """Self-influence ``sum_c lr_c g_i(w_c)^T P_c g_i(w_c)``, aligned with ``sample_ids`` of the first capture point.

    ``P_c`` by ``method``, as :func:`influence` takes it: the identity (TracIn, default:
    :func:`~metastore_plugins.core.analysis.queries.self_influence`), ``(F_c + delta I)^-1`` (``"kfac"``,
    ``"ekfac"``) or TRAK's kernel inverse on sketches (``"trak"``). Several capture points are summed per
    sample id (aligned with :meth:`self_influence_ids`); ``where``: ``store.select``'s filters.
    ``scan``: TracIn's partitioned read (the other methods read through the store's own).
    """
    entry = method_entry(method)
    args = MethodArgs(damping, relative_damping, layers, max_bytes=max_bytes, scan=scan)
    check_arguments(entry, args)
    if entry.self_influence is None:
        raise ConfigError(f"method {method!r} has no self-influence; choose one of {_with_self()}")
    return entry.self_influence(store, capture_point, args, where)


def _with_self() -> str:
    return ", ".join(repr(name) for name, entry in METHODS.items() if entry.self_influence is not None)


def similar(store: StoreReader, query: str, candidates: str, *, method: str = TRACIN, **options: Any) -> Scores:
    """:func:`~metastore_plugins.core.analysis.vector_index.similar` (``options``: its arguments): the cosine
    (or inner product) of plain gradients, TracIn's.

    Other methods are refused: the preconditioned cosine ``<g_i, P g_j> / sqrt(<g_i, P g_i> <g_j, P g_j>)``
    would need every candidate's own preconditioned norm, a second pass over the candidates with the
    curvature (docs/queries.md, "Choosing a method").
    """
    if method_entry(method).name != TRACIN:
        raise ConfigError(
            f"similar() compares plain gradients (method={TRACIN!r}); method={method!r} is not supported: use "
            f"influence(..., method={method!r}) for preconditioned scores"
        )
    return vector_index.similar(store, query, candidates, **options)
