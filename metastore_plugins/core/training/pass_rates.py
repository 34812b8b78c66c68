"""The learning rates a checkpoint pass is recorded with.

A pass ``c`` stands for the optimizer steps since the previous one, so TracIn weights its gradients by
the sum of those steps' learning rates, ``sum_{t in (c-1, c]} lr_t`` (never by the rate at one instant,
which a linear decay brings to 0 at the last pass). The pass's tag records the rate its last step
trained at (not the rate a scheduler set since).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PassRates:
    """The optimizer steps' learning rates since the last checkpoint pass (``None`` until :meth:`step` is called)."""

    since_pass: float | None = None  # sum_t lr_t of the steps since the last pass
    last_step: float | None = None  # the rate the last step since the last pass applied

    def step(self, lr: float | None) -> None:
        """Note one optimizer step and the learning rate it applies (``None``: 1)."""
        self.since_pass = (self.since_pass or 0.0) + (1.0 if lr is None else float(lr))
        self.last_step = None if lr is None else float(lr)

    def start_pass(self, lr: float | None) -> tuple[float | None, float | None]:
        """``(weight, trained_at)`` of a pass starting now, ``lr`` the rate now; the sum starts again.

        ``weight``: ``sum_{t in (c-1, c]} lr_t`` (0 when no step ran since the previous pass; ``lr`` when
        :meth:`step` was never called). ``trained_at``: the rate of the last step since the previous pass
        (``lr`` when none ran).
        """
        weight = lr if self.since_pass is None else self.since_pass
        trained_at = lr if self.last_step is None else self.last_step
        if self.since_pass is not None:
            self.since_pass, self.last_step = 0.0, None
        return weight, trained_at
