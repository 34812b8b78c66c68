"""What an influence method is: a :class:`Method` entry, and :class:`MethodArgs`, the one arguments object it is
called with.

An entry holds what the method accepts beyond the arguments every method takes (``takes``), how it scores
(``influence``: every training row; ``pairs``: given paired selections, what in-run influence calls;
``self_influence``), its top-k path through the nearest-gradient index (``top_k``:
:func:`.index_methods.influence` or :func:`.vector_index.influence`, which take the :class:`MethodArgs` too) and
how the reports name it (``label``, :class:`MethodWords`).
The built-in entries are :mod:`.method_entries`; the table every query looks a name up in is
:data:`.methods.METHODS`, which :func:`.methods.register_method` extends (docs/design.md, "A new influence
method").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from metastore_plugins.core.analysis.per_batch import positive_number
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES

if TYPE_CHECKING:
    from metastore_plugins.core.analysis.queries import Pair
    from metastore_plugins.core.analysis.refine import RecomputeFn
    from metastore_plugins.core.analysis.scan import Scan
    from metastore_plugins.core.store import Selection, StoreReader

#: the plain method (``sum_c lr_c <g_i, g_j>``): every query's default, and what ``"auto"`` falls back to
TRACIN = "tracin"
#: the reports' and command line's choice that picks by the store (:func:`.methods.resolve_method`)
AUTO = "auto"

#: the arguments only some methods take, and what each is for (the words of a refusal)
OPTIONAL = {
    "damping": "an absolute damping delta",
    "relative_damping": "the damping as a fraction of the mean eigenvalue",
    "recompute": "the exact TracIn refinement",
    "scan": "a partitioned read of the passes",
}
#: what the reports say of a method's estimates that the exact refinement does not apply to
NOT_REFINED = "the exact refinement (recompute) recomputes TracIn and is not applied to them"

Points = str | Sequence[str]


@dataclass(frozen=True)
class MethodArgs:
    """The arguments of one influence query, whatever its method (``store.influence``'s keywords).

    ``damping``, ``relative_damping``, ``recompute`` and ``scan`` are taken by the methods naming them in
    :attr:`Method.takes`; the others by every method.
    """

    damping: float | None = None
    relative_damping: float | None = None
    layers: Sequence[str] | None = None
    train_ids: Sequence[int] | None = None
    test_ids: Sequence[int] | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    k: int | None = None
    index: bool | None = None
    candidates: int | None = None
    recompute: RecomputeFn | None = None
    scan: Scan | None = None


#: ``influence(store, train, test, args)``: the ``(train rows, test columns)`` scores
Influence = Callable[["StoreReader", Points, Points, MethodArgs], Scores]
#: ``self_influence(store, capture_point, args, where)``: aligned with the first capture point's sample ids
SelfInfluence = Callable[["StoreReader", Points | None, MethodArgs, dict[str, Any]], np.ndarray]
#: ``pairs(store, pairs, fitted_on, args)``: the scores of paired selections, ``fitted_on`` the selection each
#: pair's train side is fitted on (its label: the pair's first item)
PairScores = Callable[["StoreReader", Sequence["Pair"], dict[str, "Selection"], MethodArgs], Scores]


@dataclass(frozen=True)
class MethodWords:
    """How the reports and refusals word a method (the ``{}`` of ``ridge``: its relative damping)."""

    formula: str = ""
    ridge: str = ", damping {:g} x its mean eigenvalue"
    exact: str | None = None
    estimate: str = f"Scores are estimates from projected gradients; {NOT_REFINED}."
    no_damping: str = "it inverts nothing"
    relative: str = "the damping as a fraction of the mean eigenvalue"


@dataclass(frozen=True)
class Method:
    """One influence method of the table.

    ``influence`` scores every training row; ``top_k`` (``k=`` given, ``train_ids`` not) scores each test sample's
    candidates from the nearest-gradient index (``None``: ``influence``, whose ``.top(k)`` is the answer);
    ``pairs`` scores paired selections (``None``: no in-run influence); ``self_influence`` (``None``: refused).
    ``takes``: the arguments of :data:`OPTIONAL` it accepts; ``default_relative``: the relative damping it runs
    with when none is given (``None``: it has none); ``exact``: whether its scores are exact where the passes
    hold exact records.
    """

    name: str
    label: str
    influence: Influence
    top_k: Influence | None = None
    pairs: PairScores | None = None
    self_influence: SelfInfluence | None = None
    takes: frozenset[str] = frozenset()
    default_relative: float | None = None
    exact: bool = True
    words: MethodWords = field(default_factory=MethodWords)

    def scores(self, store: StoreReader, train: Points, test: Points, args: MethodArgs) -> Scores:
        """The influence of ``train`` on ``test``: through ``top_k`` where it serves ``args``, else ``influence``."""
        if self.top_k is not None and args.k is not None and args.train_ids is None:
            return self.top_k(store, train, test, args)
        return self.influence(store, train, test, args)

    def relative(self, args: MethodArgs) -> float:
        """The relative damping the method runs with: the one asked, else its default."""
        chosen = args.relative_damping if args.relative_damping is not None else self.default_relative
        if chosen is None:
            raise ConfigError(f"method {self.name!r} has no relative damping")
        return chosen

    def ran_with(self, damping: float | None, relative_damping: float | None) -> tuple[float | None, float | None]:
        """``(damping, relative_damping)`` it ran with, defaults filled in: an absolute damping wins."""
        if self.default_relative is None:
            return None, None
        if damping is not None and "damping" in self.takes:
            return damping, None
        return None, relative_damping if relative_damping is not None else self.default_relative

    def damping_options(self, damping: float | None, relative_damping: float | None) -> dict[str, Any]:
        """The damping keywords it takes, of these two."""
        given = {"damping": damping, "relative_damping": relative_damping}
        return {name: value for name, value in given.items() if name in self.takes}

    def exactness(self, exact: bool) -> str:
        """The reports' sentence on its scores: ``exact`` where every shown row is exact."""
        if exact and self.exact:
            return self.words.exact or f"Scores are exact {self.label} scores."
        return self.words.estimate


def check_arguments(method: Method, args: MethodArgs, names: tuple[str, str] = ("damping", "relative_damping")) -> None:
    """Raise a :class:`ConfigError` naming the argument ``method`` does not take (``names``: how the caller spells
    the two dampings), or a ``ValueError`` for a damping that is not positive."""
    positive_number(names[0], args.damping)
    positive_number(names[1], args.relative_damping)
    damped = args.damping is not None or args.relative_damping is not None
    if damped and "relative_damping" not in method.takes:
        raise ConfigError(
            f"method {method.name!r} has no damping ({method.words.no_damping}): drop {names[0]} and {names[1]}"
        )
    if args.damping is not None and "damping" not in method.takes:
        raise ConfigError(
            f"method {method.name!r} takes {names[1]} ({method.words.relative}), not the absolute {names[0]}"
        )
    for option in ("recompute", "scan"):
        if getattr(args, option) is not None and option not in method.takes:
            raise ConfigError(
                f"{option}= belongs to method={TRACIN!r} ({OPTIONAL[option]}); method={method.name!r} does not take it"
            )
