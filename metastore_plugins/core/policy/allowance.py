"""The attribution allowance: which checkpoint passes a run makes, and how many samples each holds.

A checkpoint pass (and the curvature eigenbasis fit beside it) is a forward and backward the training does not
need. ``attribution_time`` bounds what they cost, as a share of the training, counted in samples so that the plan
is known before the first step and the same on every machine and on resuming:

- a training sample costs 1, a pass sample (or a basis-fit sample) :data:`PASS_SAMPLE_COST`;
- the run gets ``attribution_time x trained samples``;
- passes: at most :data:`MAX_CHECKPOINT_PASSES` of the periods the schedule makes one at, evenly spaced, the last
  always (so an HF run that evaluates every few steps does not pay a pass each time); in-run influence pairs each
  step with the passes around it, and three passes kept 0.97-1.05x of the LDS of one at every epoch on the quick
  harness tasks (docs/quality.md);
- each pass (the start pass too) gets an equal share, spent on the validation samples first (the test side of the
  default answer), then on the training samples (and the basis fit on them); each side keeps at least
  :data:`MIN_PASS_SAMPLES` (or what its set holds), even over the allowance, so that the reports' tables and the
  default answer always have both sides.

A size the user set (``checkpoint_val_samples=...``) is kept as set: the allowance sizes only the defaults. The
training side of the default answer does not need the passes: the training steps hold every sample.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

#: One pass (or basis-fit) sample's cost in training samples: a forward and backward in eval mode with per-sample
#: records, against a training sample's forward, backward and optimizer share. Measured on the HF 4-layer BERT
#: example (docs/benchmarks.md): 10.7 ms a pass sample, 8.0 ms a basis-fit sample, 3.8 ms a training sample.
PASS_SAMPLE_COST = 2.5
#: The most checkpoint passes the allowance keeps (the start pass besides).
MAX_CHECKPOINT_PASSES = 4
#: The fewest validation (and training) samples a pass holds whatever the allowance.
MIN_PASS_SAMPLES = 32
#: The default share of the training the passes may cost (``attribution_time``).
ATTRIBUTION_TIME = 0.25


@dataclass(frozen=True)
class PassAllowance:
    """What the allowance gives a run: the periods with a pass and each pass's sizes, and what they cost.

    ``periods``: 0-based epoch (or evaluation) indices that make a pass; ``val_samples``, ``train_samples``: the
    most of each split in one pass; ``cost``: the planned passes' samples times :data:`PASS_SAMPLE_COST`
    (the basis fits' included), ``allowed``: ``attribution_time x`` the trained samples.
    """

    periods: tuple[int, ...]
    val_samples: int
    train_samples: int
    cost: float
    allowed: float

    def line(self) -> str:
        """How the plan says it: passes, sizes, and the cost against the allowance."""
        share = f"{self.cost / self.allowed:.0%} of" if self.allowed > 0 else "beyond"
        return (
            f"{len(self.periods)} checkpoint pass(es) of at most {self.val_samples} validation and "
            f"{self.train_samples} training samples (cost {self.cost:,.0f} training samples, {share} the "
            "attribution allowance)"
        )


def spaced_periods(due: list[int], most: int = MAX_CHECKPOINT_PASSES) -> tuple[int, ...]:
    """At most ``most`` of the ``due`` periods, evenly spaced, the last always: ``due[ceil((i + 1) n / most) - 1]``."""
    if len(due) <= most:
        return tuple(due)
    return tuple(due[-(-(i + 1) * len(due) // most) - 1] for i in range(most))


def allot(
    attribution_time: float,
    trained_samples: int,
    due: list[int],
    *,
    val_size: int,
    val_most: int,
    train_most: int,
    basis_most: int,
    start_pass: bool,
    kept: Collection[str] = (),
) -> PassAllowance:
    """The passes and their sizes under ``attribution_time x trained_samples`` (module docstring).

    Args:
        due: the periods the schedule makes a pass at (0-based, in order).
        val_size: validation samples the pass can hold (its set's size, or ``val_most`` when unknown).
        val_most, train_most: the settings' most samples of each split; ``basis_most``: samples of the basis fit
            at each pass (0: none), taken from the training side.
        start_pass: a pass over the validation samples before the first step gets a share too.
        kept: settings the user gave (``"checkpoint_val_samples"``, ``"checkpoint_train_samples"``): kept as given.
    """
    periods = spaced_periods(due)
    passes = len(periods) + int(start_pass)
    allowed = attribution_time * max(0, trained_samples)
    share = allowed / PASS_SAMPLE_COST / max(1, passes)  # samples of one pass (the basis fit's included)
    val_held = min(val_most, val_size)
    val = val_held if "checkpoint_val_samples" in kept else min(val_held, max(MIN_PASS_SAMPLES, int(share)))
    left = max(0.0, share - val)
    fit_rate = 2 if basis_most else 1  # each training sample once in the pass, once in the basis fit
    train = (
        train_most
        if "checkpoint_train_samples" in kept
        else min(train_most, max(MIN_PASS_SAMPLES, int(left / fit_rate)))
    )
    fitted = min(basis_most, train)
    cost = PASS_SAMPLE_COST * (len(periods) * (val + train + fitted) + int(start_pass) * val)
    return PassAllowance(periods, val, train, cost, allowed)
