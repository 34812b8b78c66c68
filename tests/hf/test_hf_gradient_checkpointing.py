"""``TrainingArguments(gradient_checkpointing=True)``: the checkpointed layers run their forward again inside
``backward``, and the callback still stores each sample's own gradient (against per-sample autograd by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_cases import has_accelerate, make_dataset, make_model, reference_gradient, relative_error, train

from metastore_plugins import MetaStoreTrainerCallback, open_store

pytestmark = pytest.mark.skipif(not has_accelerate(), reason="transformers.Trainer needs accelerate")


@pytest.mark.parametrize("reentrant", [False, True])
def test_each_samples_own_gradient_under_gradient_checkpointing(tmp_path: Path, reentrant: bool) -> None:
    model, train_set = make_model(), make_dataset(12, 1)
    calls: list[bool] = []
    query = model.bert.encoder.layer[0].attention.self.query
    query.register_forward_hook(lambda module, args, output: calls.append(module.training))
    callback = MetaStoreTrainerCallback(encoding="fp32", reports=False, checkpoint_every_n_evals=0)
    trainer = train(
        tmp_path,
        model,
        train_set,
        make_dataset(4, 2),
        [callback],
        num_train_epochs=1,
        eval_strategy="no",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    steps = trainer.state.global_step
    assert calls.count(True) == 2 * steps  # each training forward ran again in backward: checkpointing was on
    store = open_store(callback.dirpath)
    meta = store.metadata("train")
    assert sorted(meta["sample_id"].tolist()) == list(range(12))
    worst = 0.0
    for sid, step in zip(meta["sample_id"].tolist(), meta["step"].tolist(), strict=True):
        item = train_set[sid]
        stored = store.restore(sid, capture_point="train", step=step)
        expected = reference_gradient(model, item["input_ids"], item["label"])
        assert set(stored) == set(expected)  # every trainable parameter, checkpointed layers included
        worst = max(worst, relative_error(stored, expected))
    assert worst < 1e-4
