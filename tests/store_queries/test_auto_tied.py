"""``"auto"`` on a model whose output layer is tied to its embedding (every causal LM of transformers): K-FAC fits
one block per layer and refuses a parameter two layers share, so ``"auto"`` ran TracIn over every layer. It now runs
EK-FAC over every layer but the others of each tied group (the embedding keeps the parameter), what the refusal
tells a user to do by hand with ``layers=``, and says so. The reference is that by-hand call,
``store.kfac_influence(layers=[...])``, whose EK-FAC is checked against an explicit dense ``(F + delta I)^-1`` in
``test_kfac_embedding.py``; the test fails on the code before, where ``"auto"`` gave TracIn's scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.methods import resolve_method
from metastore_plugins.core.reports.influence_method import method_line
from metastore_plugins.core.reports.influence_table import influence_rows
from metastore_plugins.core.training.passes import checkpoint_pass

TRAIN, TEST = ["epoch-0/train"], ["epoch-0/val"]


class TiedBag(nn.Module):
    """Token embedding, tanh, mean over tokens, an output layer whose weight is the embedding's (vocabulary 9)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 5)
        self.hidden = nn.Linear(5, 5)
        self.out = nn.Linear(5, 9, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(ids))).mean(1))  # (B, 9)


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    path: Path = tmp_path_factory.mktemp("tied") / "store"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 9, (30, 4), generator=generator), torch.randint(0, 9, (30,), generator=generator)
        model = TiedBag()
        with StoreWriter(path, encoding="fp32") as writer:
            for split, ids in (("train", torch.arange(20)), ("val", torch.arange(20, 30))):
                batches = [(ids, lambda ids=ids: model(x[ids]), y[ids])]
                checkpoint_pass(model, batches, per_sample_ce, writer, capture_point=f"epoch-0/{split}", step=3, lr=0.1)
    return open_store(path)


def test_auto_leaves_the_tied_output_layer_out(store: GradientStore) -> None:
    assert sorted(store.layers()) == ["embed", "hidden", "out"]
    chosen = resolve_method(store, "auto", [*TRAIN, *TEST])
    assert (chosen.method, chosen.layers, chosen.left_out, chosen.fallback) == (
        "ekfac",
        tuple(layer for layer in store.layers() if layer != "out"),
        ("out",),
        None,
    )
    auto = store.influence(TRAIN, TEST, method="auto")
    by_hand = store.kfac_influence(TRAIN, TEST, method="ekfac", layers=["embed", "hidden"])
    tracin = store.influence(TRAIN, TEST)
    assert auto.row_ids.tolist() == by_hand.row_ids.tolist() and auto.col_ids.tolist() == by_hand.col_ids.tolist()
    scale = np.abs(by_hand.scores).max()
    assert np.abs(auto.scores - by_hand.scores).max() <= 1e-6 * scale
    assert np.abs(auto.scores / scale - tracin.scores / np.abs(tracin.scores).max()).max() > 1e-2  # not TracIn


def test_the_report_says_which_layer_auto_left_out(store: GradientStore) -> None:
    rows = influence_rows(store, TRAIN, TEST, k=3, samples=2, method="auto")
    line = method_line(rows[0])
    assert line.startswith("Method: EK-FAC"), line
    assert "over every layer but 'out' (tied to another layer's parameter" in line, line


def test_layers_asked_for_are_kept_when_nothing_is_tied(store: GradientStore) -> None:
    chosen = resolve_method(store, "auto", [*TRAIN, *TEST], ["hidden"])
    assert (chosen.method, chosen.layers, chosen.left_out) == ("ekfac", None, ())
