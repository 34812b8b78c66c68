"""The K-FAC sums of the training steps' own factors, from which a checkpoint's eigenbasis can be fitted.

``C = E[a a^T]`` and ``G = E[d d^T]`` of each layer are sums over the factors every training step
already holds (:class:`~metastore_plugins.core.ops.curvature.CurvatureSums`), so the eigenbasis of a
checkpoint can be fitted from the steps since the previous one, with no forward or backward of its own
(``basis_from="steps"``). The rule that bounds their cost: each micro-batch adds at most
:data:`~metastore_plugins.core.ops.eigenbasis.STEP_BASIS_ROWS` token rows per layer, drawn uniformly
without replacement (seeded by the step; the output side rescaled so that the sums stay unbiased:
:func:`~metastore_plugins.core.ops.eigenbasis.sampled_rows`), in float32: ``O(r (d_in'^2 + d_out^2))`` per
layer and micro-batch, whatever the sequence length. Dense records (norms, small parameters) are added whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from metastore_plugins.core.ops.curvature import CurvatureSums
from metastore_plugins.core.ops.eigenbasis import STEP_BASIS_ROWS, fittable, sampled_rows
from metastore_plugins.core.records import LayerRecord


class StepSums:
    """K-FAC sums of the training steps since the last :meth:`take` (one rank's; the fit adds the ranks')."""

    def __init__(self, rows: int = STEP_BASIS_ROWS) -> None:
        self.rows = rows
        self.sums = CurvatureSums(torch.float32)  # top eigenvectors only: float32, as the pass's fit

    def add(self, records: Sequence[LayerRecord], scaling: Callable[[LayerRecord], LayerRecord], step: int) -> None:
        """Add one micro-batch's exact records (as the backward left them; ``scaling`` makes them per-sample)."""
        generator = torch.Generator().manual_seed(step)
        kept = sampled_rows(fittable(records), self.rows, generator)
        self.sums.add([scaling(record) for record in kept])

    def take(self) -> CurvatureSums:
        """The sums so far, and start again (the next basis is fitted on the steps after this one)."""
        sums, self.sums = self.sums, CurvatureSums(torch.float32)
        return sums
