"""MetaStoreTrainerCallback observes and never disturbs: a seeded ``Trainer`` run ends the same with and without it.

Default settings (a checkpoint pass at every evaluation, or one at the end without any; reports
at the end), the Trainer's shuffled sampler, dropout on, ``eval_strategy="epoch"``, 2 epochs: bit-identical weights, the
same log history, and every random number generator where the run without the callback left it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tensorboard")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from hf_cases import make_dataset, make_model, train  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback, open_store  # noqa: E402

TIMINGS = ("runtime", "per_second", "total_flos")  # wall-clock entries of the log history


def _run(tmp_path: Path, evaluation: str, with_callback: bool) -> tuple[dict[str, Tensor], list[dict[str, Any]], Any]:
    model = make_model(dropout=0.1)
    callbacks = [MetaStoreTrainerCallback()] if with_callback else []
    data = make_dataset(18, 1), make_dataset(10, 2)
    trainer = train(tmp_path, model, *data, callbacks, learning_rate=1e-3, seed=11, eval_strategy=evaluation)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    history = [
        {key: value for key, value in entry.items() if not any(t in key for t in TIMINGS)}
        for entry in trainer.state.log_history
    ]
    return weights, history, (torch.get_rng_state(), np.random.get_state(), random.getstate())


@pytest.mark.parametrize("evaluation", ["epoch", "no"])  # "no": one checkpoint pass, at the end of training
def test_the_callback_does_not_change_the_run(tmp_path: Path, evaluation: str) -> None:
    plain_weights, plain_history, plain_rng = _run(tmp_path / "without", evaluation, with_callback=False)
    weights, history, rng = _run(tmp_path / "with", evaluation, with_callback=True)
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 2 * 5 and len({*losses}) > 1
    assert history == plain_history  # training losses, eval losses, grad norms, learning rates
    assert sum("eval_loss" in entry for entry in history) == (2 if evaluation == "epoch" else 0)
    for name, value in plain_weights.items():
        assert torch.equal(weights[name], value), name
    assert torch.equal(rng[0], plain_rng[0])
    assert np.array_equal(rng[1][1], plain_rng[1][1]) and rng[1][2:] == plain_rng[1][2:]  # numpy's key and position
    assert rng[2] == plain_rng[2]
    store = open_store(tmp_path / "with" / "out" / "metastore")  # and it did observe: every step, the passes, reports
    if evaluation == "epoch":
        assert store.capture_points() == ["epoch-0/train", "epoch-0/val", "epoch-1/train", "epoch-1/val", "train"]
    else:
        assert store.capture_points() == ["step-10/train", "train"]  # no evaluation loader: no val split
    meta = store.metadata("train")
    for epoch in (0, 1):
        assert sorted(meta["sample_id"][meta["epoch"] == epoch].tolist()) == list(range(18))
    np.testing.assert_array_equal(meta["label"], np.asarray(make_dataset(18, 1)["label"])[meta["sample_id"]])
    assert (tmp_path / "with" / "out" / "metastore" / "reports" / "summary.json").is_file()
