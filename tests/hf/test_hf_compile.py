"""``TrainingArguments(torch_compile=True)`` with the callback: refused when training starts, before the first step
(it crashed at the first step: "record of layer 'bert.embeddings.position_embeddings' holds 1 samples but 16 sample
ids were given"), with an error naming the setting; the same run trains without the callback."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from hf_cases import make_dataset, make_model, train  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback  # noqa: E402
from metastore_plugins.core.errors import CompiledModelError  # noqa: E402


def test_torch_compile_is_refused_before_the_first_step(tmp_path: Path) -> None:
    model, callback = make_model(), MetaStoreTrainerCallback()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(CompiledModelError, match=r"TrainingArguments\(torch_compile=True\)"):
        train(
            tmp_path, model, make_dataset(8, 1), make_dataset(4, 2), [callback], torch_compile=True, learning_rate=0.1
        )
    assert all(p.detach().equal(before[name]) for name, p in model.named_parameters())  # no step was taken
    assert not (tmp_path / "out" / "metastore").exists()  # no store was opened
