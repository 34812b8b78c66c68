"""Questions asked of a store: norms, influence, similarity, training dynamics, sketches.

Functions over a :class:`~metastore_plugins.core.store.StoreReader`'s public reading API
that call :mod:`metastore_plugins.core.ops`; :func:`open_store` returns a
:class:`GradientStore` on which each of them is a method.
"""

from metastore_plugins.core.analysis.gradient_store import GradientStore, open_store
from metastore_plugins.core.analysis.results import (
    Clusters,
    Contributors,
    DefaultScores,
    LayerComparison,
    RunComparison,
    Scores,
    Spike,
    WeightChange,
)

__all__ = [
    "Clusters",
    "Contributors",
    "DefaultScores",
    "GradientStore",
    "LayerComparison",
    "RunComparison",
    "Scores",
    "Spike",
    "WeightChange",
    "open_store",
]
