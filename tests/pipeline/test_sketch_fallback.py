"""``sketched_influence`` picks the cheaper form: where no captured parameter is larger than the
``dim x dim`` sketch (a small MLP at the default 64 x 64) it returns exact influence, against
``torch.func`` per-sample gradients (fp32 capture and store: relative error ``1e-5``, tests/README.md);
where the sketch compresses it stays an estimate (and builds its cache file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.testing import reference_per_sample_gradients

TOL = 1e-5


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_small_layers_get_exact_influence(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    data = {split: (torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for split, n in
            (("train", 24), ("val", 5))}  # fmt: skip
    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        for split, (x, y) in data.items():
            with CaptureSession(model, loss_reduction="mean") as session:
                _loss(model, (x, y)).backward()
            writer.write(session.factors(), sample_ids=torch.arange(len(y)), step=0, capture_point=split, labels=y)
            model.zero_grad()
    flat = {
        split: torch.cat(
            [gr.reshape(len(b[1]), -1) for gr in reference_per_sample_gradients(model, _loss, b).values()], 1
        )
        for split, b in data.items()
    }
    reference = (flat["train"] @ flat["val"].T).double().numpy()  # (24, 5)
    store = open_store(tmp_path / "store")

    exact = store.sketched_influence("train", "val")  # dim 64: 64 x 64 > every parameter (5 x 6, 3 x 5)
    assert np.abs(exact.scores - reference).max() <= TOL * np.abs(reference).max()
    assert not (tmp_path / "store" / "sketches").exists()

    sketched = store.sketched_influence("train", "val", dim=2)  # 2 x 2 < 5 x 6: a real sketch
    assert np.abs(sketched.scores - reference).max() > 100 * TOL * np.abs(reference).max()
    assert (tmp_path / "store" / "sketches").exists()
