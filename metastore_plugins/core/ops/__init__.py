"""Operators on per-sample gradient records: exact maths on the factors, no I/O.

Every function here takes :class:`~metastore_plugins.core.records.LayerRecord`
objects (scaled to per-sample losses, as ``CaptureSession.factors()`` returns them) or
tensors derived from them; the store streams records chunk by chunk into them.

- :func:`sq_norms`, :func:`sq_norms_by_param` -- ``||g_i||^2`` without rebuilding ``g_i``;
- :func:`dots` -- ``<g_a_i, g_b_j>`` between two records of a layer, any kinds,
  with a cost model (:func:`plan_dots`, :func:`plan_total_dots`) choosing factored or
  rebuilt-dense per pair;
- :func:`total_dots`, :func:`total_sq_norms`, :func:`cosine`, :func:`influence_scores`
  (TracIn), :func:`self_influence`, :func:`topk`;
- :func:`sketch` -- seeded Kronecker random projections (:class:`Projections` keeps the
  drawn matrices over a pass), :func:`kmeans` on them;
- :func:`zscore_by_class`, :func:`rank_outliers`;
- :func:`batch_gradient`, :func:`abs_grad_accumulate`, :func:`entry_gradients`,
  :func:`top_contributors`, :func:`exceed_fraction`, :func:`step_exceed_fractions`, :func:`weight_exceed_fraction`;
- :func:`restore_chunk` (per-sample gradients of a range of samples), :func:`chunks` (the ranges).
"""

from metastore_plugins.core._moved import renamed
from metastore_plugins.core.ops._common import DEFAULT_MAX_BYTES, chunks, restore_chunk
from metastore_plugins.core.ops.cluster import KMeansResult, kmeans
from metastore_plugins.core.ops.cost import (
    ELEMENTWISE_COST,
    REBUILD_ELEMENT_COST,
    Method,
    Plan,
    plan_dots,
    plan_norms,
    plan_total_dots,
)
from metastore_plugins.core.ops.dots import dots
from metastore_plugins.core.ops.dynamics import (
    BatchContributors,
    abs_grad_accumulate,
    batch_gradient,
    entry_gradients,
    exceed_fraction,
    step_exceed_fractions,
    top_contributors,
    weight_exceed_fraction,
)
from metastore_plugins.core.ops.influence import (
    TopK,
    cosine,
    influence_scores,
    self_influence,
    topk,
    total_dots,
    total_sq_norms,
)
from metastore_plugins.core.ops.norms import sq_norms, sq_norms_by_param
from metastore_plugins.core.ops.outliers import Ranking, rank_outliers, zscore_by_class
from metastore_plugins.core.ops.sketch import Projections, projection, sketch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ELEMENTWISE_COST",
    "REBUILD_ELEMENT_COST",
    "BatchContributors",
    "KMeansResult",
    "Method",
    "Plan",
    "Projections",
    "Ranking",
    "TopK",
    "abs_grad_accumulate",
    "batch_gradient",
    "chunks",
    "cosine",
    "dots",
    "entry_gradients",
    "exceed_fraction",
    "step_exceed_fractions",
    "influence_scores",
    "kmeans",
    "plan_dots",
    "plan_norms",
    "plan_total_dots",
    "projection",
    "rank_outliers",
    "restore_chunk",
    "self_influence",
    "sketch",
    "sq_norms",
    "sq_norms_by_param",
    "top_contributors",
    "topk",
    "total_dots",
    "total_sq_norms",
    "weight_exceed_fraction",
    "zscore_by_class",
]


#: old names kept for one release, with a warning
__getattr__ = renamed(
    __name__,
    {
        "Contributors": (
            BatchContributors,
            "is now BatchContributors (metastore_plugins.core.analysis.Contributors is the store query's result)",
        )
    },
)
