"""The attribution allowance: which periods make a pass, and how many samples each holds, worked out by hand."""

from __future__ import annotations

import pytest

from metastore_plugins.core.policy.allowance import (
    MAX_CHECKPOINT_PASSES,
    MIN_PASS_SAMPLES,
    PASS_SAMPLE_COST,
    allot,
    spaced_periods,
)


def test_few_periods_all_make_a_pass() -> None:
    assert spaced_periods([0, 1, 2]) == (0, 1, 2)


def test_many_periods_are_thinned_evenly_with_the_last_kept() -> None:
    # 12 evaluations, 4 passes: every third one, ending on the last (indices 2, 5, 8, 11)
    assert spaced_periods(list(range(12))) == (2, 5, 8, 11)
    # 10 epochs: ceil(10/4)=3 -> 2, ceil(20/4)=5 -> 4, ceil(30/4)=8 -> 7, 10 -> 9
    assert spaced_periods(list(range(10))) == (2, 4, 7, 9)
    assert spaced_periods([1, 3, 5, 7, 9, 11], most=2) == (5, 11)


def test_the_share_goes_to_validation_first_then_training() -> None:
    # 4,000 trained samples x 0.25 = 1,000; / 2.5 a pass sample = 400 samples over 2 passes + a start pass
    allowance = allot(0.25, 4000, [0, 1], val_size=1000, val_most=256, train_most=256, basis_most=0, start_pass=True)
    share = 0.25 * 4000 / PASS_SAMPLE_COST / 3  # 133.3 samples a pass
    assert allowance.periods == (0, 1)
    assert allowance.val_samples == int(share)  # 133: below the 256 asked
    assert allowance.train_samples == MIN_PASS_SAMPLES  # 0.33 left: the floor
    expected_cost = PASS_SAMPLE_COST * (2 * (133 + 32) + 133)
    assert abs(allowance.cost - expected_cost) < 1e-6
    assert abs(allowance.allowed - 1000.0) < 1e-6


def test_a_large_allowance_gives_the_sizes_asked_and_the_basis_fit_halves_the_training_share() -> None:
    big = allot(0.25, 10**6, [0], val_size=100, val_most=256, train_most=256, basis_most=0, start_pass=False)
    assert (big.val_samples, big.train_samples) == (100, 256)  # the set holds 100; the training side all 256
    # 0.25 x 4,000 / 2.5 = 400 a pass: 100 validation, 300 left, half for the pass, half for its basis fit
    fitted = allot(0.25, 4000, [0], val_size=100, val_most=256, train_most=256, basis_most=256, start_pass=False)
    assert fitted.train_samples == 150
    assert abs(fitted.cost - PASS_SAMPLE_COST * (100 + 150 + 150)) < 1e-6


def test_sizes_the_user_set_are_kept() -> None:
    kept = allot(
        0.25, 1000, [0, 1, 2], val_size=500, val_most=300, train_most=400, basis_most=0, start_pass=False,
        kept={"checkpoint_val_samples", "checkpoint_train_samples"},
    )  # fmt: skip
    assert (kept.val_samples, kept.train_samples) == (300, 400)
    assert kept.cost > kept.allowed  # said in the start line, not cut


@pytest.mark.parametrize("periods", [1, 5, 40])
def test_passes_never_exceed_the_most(periods: int) -> None:
    allowance = allot(
        0.25, 10_000, list(range(periods)), val_size=64, val_most=256, train_most=256, basis_most=0, start_pass=False
    )
    assert len(allowance.periods) == min(periods, MAX_CHECKPOINT_PASSES)
    assert allowance.periods[-1] == periods - 1
    assert "attribution allowance" in allowance.line()
