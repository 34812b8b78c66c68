"""``store.influence(test=..., method=...)`` with ``train`` left out: every training sample, passes and steps.

The store: two checkpoints (:mod:`kfaccases`); at each, passes over the training samples 0-7 only
(``epoch-c/train``, the pass's summed rate) and the test samples (``epoch-c/test``), then two training steps over
samples 0-11 and 12-23 (each its own rate), all at that checkpoint's weights (the pass at the start of its steps'
window, as the callbacks take them). Samples 0-7 are in the passes and the steps,
8-23 in the steps only. The reference knows nothing of the store: per-sample gradients and factors from
``torch.func``, K-FAC / EK-FAC as explicit ``(P, P)`` matrices solved with ``torch.linalg.solve`` (fitted on the
pass's 8 samples, or the window's 24 steps' samples), the rates by hand; the passes' rows for 0-7, the steps'
rows times the ratio of root-mean-square scores of the two on 0-7 for 8-23, the mean of the two for 0-7. Under
K-FAC / EK-FAC the steps' scores are, per test sample, the mean of the trapezoid pairing and every step with the
last pass (curvature fitted on all 48 step rows), each divided by its root-mean-square over the 24 rows.
"""

from __future__ import annotations

import kfaccases
import numpy as np
import pytest
import torch
from kfaccases import blocks, data, paired_scores, per_sample_ce, rel_err

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import DefaultScores, GradientStore
from metastore_plugins.core.training.passes import capture_step

STEP_LRS = (0.7, 0.5, 0.2, 0.1)
PASS_LRS = (1.2, 0.3)
HALVES = (torch.arange(12), torch.arange(12, 24))
IN_PASSES = torch.arange(8)
TESTS = ["epoch-0/test", "epoch-1/test"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    path = tmp_path_factory.mktemp("default-answer-store")
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    with StoreWriter(path, encoding="fp32") as writer:
        for c, model in enumerate(kfaccases.checkpoints(model_seed=5, noise_seed=11)):
            for half, part in enumerate(HALVES):
                step = 2 * c + half
                forward = (lambda m, p: lambda: m(x[p]))(model, part)
                capture_step(model, forward, y[part], part, per_sample_ce, writer, capture_point="train",
                             step=step, lr=STEP_LRS[step])  # fmt: skip
            forward = (lambda m: lambda: m(x[IN_PASSES]))(model)
            capture_step(model, forward, y[IN_PASSES], IN_PASSES, per_sample_ce, writer,
                         capture_point=f"epoch-{c}/train", step=2 * c, lr=PASS_LRS[c])  # fmt: skip
            forward = (lambda m: lambda: m(xt))(model)
            capture_step(model, forward, yt, torch.arange(100, 108), per_sample_ce, writer,
                         capture_point=f"epoch-{c}/test", step=2 * c, lr=1.0)  # fmt: skip
            model.zero_grad()
    return open_store(path)


#: (test pass, the checkpoints whose steps it is paired with), as in test_in_run_curvature.py
STEP_PAIRS = ((0, (0,)), (1, (1,)), (1, (0, 1)))
#: every step with the last pass, the curvature fitted on them all (kfac / ekfac only)
END_PAIRS = ((1, (0, 1)),)


def reference(method: str | None) -> np.ndarray:
    """``(24, 8)``: the steps' on the passes' scale, for samples 0-7 the mean of that and the passes' scores."""
    (x, y), (xt, yt) = data(24, 1), data(8, 2)
    models = kfaccases.checkpoints(model_seed=5, noise_seed=11)
    with torch.no_grad():
        train, test = [blocks(m, x, y) for m in models], [blocks(m, xt, yt) for m in models]
        in_passes = [blocks(m, x[IN_PASSES], y[IN_PASSES]) for m in models]
    pass_rates = [torch.full((8,), r, dtype=torch.float64) for r in PASS_LRS]
    passes = paired_scores(method, in_passes, test, pass_rates, ((0, (0,)), (1, (1,))))  # (8, 8)
    step_rates = [torch.tensor([STEP_LRS[2 * c]] * 12 + [STEP_LRS[2 * c + 1]] * 12).double() for c in range(2)]
    steps = paired_scores(method, train, test, step_rates, STEP_PAIRS)  # (24, 8)
    if method is not None:  # and every step with the last pass, curvature on every step: the mean per test sample
        end = paired_scores(method, train, test, step_rates, END_PAIRS)  # (24, 8)
        steps = (steps + end * steps.pow(2).mean(0).sqrt() / end.pow(2).mean(0).sqrt()) / 2
    factor = passes.pow(2).mean().sqrt() / steps[IN_PASSES].pow(2).mean().sqrt()
    out = steps * factor
    out[IN_PASSES] = (passes + out[IN_PASSES]) / 2
    return out.numpy()


@pytest.mark.parametrize(("method", "ran"), [("auto", "ekfac"), ("kfac", "kfac"), ("tracin", None)])
def test_every_training_sample_gets_a_row_from_the_passes_or_its_steps(
    store: GradientStore, method: str, ran: str | None
) -> None:
    scores = store.influence(test=TESTS, method=method)
    assert isinstance(scores, DefaultScores)
    assert scores.row_ids.tolist() == list(range(24)) and scores.col_ids.tolist() == list(range(100, 108))
    assert scores.train_side == "passes and steps"
    assert scores.methods == {"passes": ran or "tracin", "steps": ran or "tracin"}
    assert scores.sources.tolist() == ["passes and steps"] * 8 + ["steps"] * 16
    assert rel_err(scores.scores, reference(ran)) <= 1e-5
    if ran is not None:  # the curvature changes the answer: the test can tell the methods apart
        plain = reference(None)
        assert rel_err(scores.scores / np.abs(scores.scores).max(), plain / np.abs(plain).max()) > 0.05


def test_one_test_point_pairs_its_own_pass_and_every_step(store: GradientStore) -> None:
    scores = store.influence(test="epoch-1/test", method="tracin")
    assert scores.row_ids.tolist() == list(range(24))
    assert isinstance(scores, DefaultScores) and scores.methods == {"passes": "tracin", "steps": "tracin"}


def test_auto_with_train_given_is_ekfac_on_those_passes(store: GradientStore) -> None:
    trains = ["epoch-0/train", "epoch-1/train"]
    auto = store.influence(trains, TESTS, method="auto")
    assert rel_err(auto.scores, store.influence(trains, TESTS, method="ekfac").scores) <= 1e-12
    assert auto.row_ids.tolist() == list(range(8))


def test_the_default_answer_refuses_what_it_cannot_take(store: GradientStore) -> None:
    with pytest.raises(ValueError, match="k= not taken"):
        store.influence(test=TESTS, method="auto", k=3)
    with pytest.raises(ValueError, match="needs test="):
        store.influence(method="auto")
    with pytest.raises(ValueError, match="not checkpoint passes"):
        store.influence(test=["train"], method="auto")


def test_the_default_answer_decodes_each_record_once(store: GradientStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps are read for each window's curvature fit and again to score them: inside the answer each record
    is decoded once (``record_memo``), and nothing is kept after it."""
    from collections import Counter

    from metastore_plugins.core.store.reading import batches
    from metastore_plugins.core.store.reading.record_memo import RECORDS

    decoded: Counter = Counter()
    decode = batches.BatchRef.record_at

    def counted(self: batches.BatchRef, data: object, k: int) -> object:
        decoded[(self.file.name, self.batch, k)] += 1
        return decode(self, data, k)  # type: ignore[arg-type]

    monkeypatch.setattr(batches.BatchRef, "record_at", counted)
    scores = store.influence(test=TESTS, method="ekfac")
    assert rel_err(scores.scores, reference("ekfac")) <= 1e-5
    assert decoded and max(decoded.values()) == 1
    assert RECORDS.max_bytes == 0
