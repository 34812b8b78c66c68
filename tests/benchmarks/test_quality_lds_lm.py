"""LDS harness, the causal-LM task (``lm``): its data, the store's per-sample gradients of a GPT-2 layer against
torch.func, and a tiny run. A smoke test (seconds), not a measurement: the figures are in docs/quality.md."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # ``metastore_bench`` is not installed: found from the repository

pytest.importorskip("transformers")

from metastore_bench.quality import lds, lm_task  # noqa: E402
from metastore_bench.quality.digits import Capture  # noqa: E402
from metastore_bench.quality.lds_lm import run_lm  # noqa: E402
from metastore_plugins import StoreWriter, open_store  # noqa: E402
from metastore_plugins.testing import reference_per_sample_gradients  # noqa: E402

LAYER = "transformer.h.0.mlp.c_fc"  # a Conv1D of the first block


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def token_sum(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The summed token losses of a batch of sequences, the causal shift by hand."""
    logits = model(tokens).logits  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum")


def test_the_sequences_follow_their_chains() -> None:
    x, y, x_test, _ = lm_task.load_lm_arrays(seed=0, train_size=300)
    assert x.shape == (300, lm_task.LENGTH) and x_test.shape == (lm_task.TEST_SIZE, lm_task.LENGTH)
    assert torch.equal(x, y) and torch.equal(lm_task.load_lm_arrays(seed=0, train_size=50)[2], x_test)
    tokens = x.numpy()
    assert (tokens[:, 0] < lm_task.TOPICS).all() and (tokens[:, 1:] >= lm_task.TOPICS).all()
    assert tokens.max() < lm_task.VOCAB
    transitions = lm_task.chains(0)  # (TOPICS, W, W)
    words = tokens[:, 1:] - lm_task.TOPICS  # (N, T - 1)
    topic = np.repeat(tokens[:, 0], lm_task.LENGTH - 2)  # (N (T - 2),)
    probability = transitions[topic, words[:, :-1].reshape(-1), words[:, 1:].reshape(-1)]
    likely = np.sort(transitions, -1)[..., -lm_task.SUCCESSORS :].sum(-1).mean()  # the successors' share
    assert abs((probability > 0.02).mean() - likely) < 0.05  # the drawn steps are the chains' likely ones


def test_the_store_holds_each_sequence_s_own_gradient_of_a_gpt2_layer(tmp_path: Path) -> None:
    """Training steps and a checkpoint pass: the stored ``c_fc`` gradients of each sequence's token-sum loss against
    torch.func's per-sample gradients at the weights of that step (a copy of the model taken before it)."""
    x, _, x_test, _ = lm_task.load_lm_arrays(seed=0, train_size=6)
    model = lm_task.make_lm_model(0)
    before = lm_task.make_lm_model(0)  # the weights of the one training step
    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        capture = Capture(writer, passes={"test": (x_test[:4], x_test[:4])})
        lm_task.train_lm(model, x, epochs=1, batch_size=6, seed=0, capture=capture)
    store = open_store(tmp_path / "store")
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0))  # train_lm's shuffle
    for point, weights, tokens in (("train", before, x[order]), ("epoch-0/test", model, x_test[:4])):
        (batch,) = list(store.select(point, layers=[LAYER]).batches())
        (record,) = batch.records
        expected = reference_per_sample_gradients(weights, token_sum, tokens)
        got = record.restore()
        assert set(got) == {f"{LAYER}.weight", f"{LAYER}.bias"}
        for name, value in got.items():
            reference = expected[name]  # (B, *shape)
            assert value.shape == reference.shape
            assert torch.allclose(value.double(), reference.double(), rtol=1e-4, atol=1e-6 * reference.abs().max())


@pytest.mark.slow  # 40 trainings of a GPT-2, a capture and dattri: about 20 s on one core
def test_a_tiny_run_scores_the_store_and_the_peer() -> None:
    setup = lds.Setup(
        kind="lm", train_size=60, test_samples=8, tune_samples=0, subsets=50, epochs=2, trak_regularizations=(1.0,),
        kfac_dampings=(0.1,), influence_functions=False, kronfluence=False, bootstrap=100,
    )  # fmt: skip
    result = run_lm(setup)
    rows = {row["attributor"]: row for row in result["attributors"]}
    refused = rows["EK-FAC, every layer (checkpoint passes)"]["error"]
    assert "tied" in refused and "lm_head" in refused and "transformer.wte" in refused
    auto = rows["auto, every layer: ekfac without lm_head (checkpoint passes), default damping: what the reports use"]
    by_hand = rows["auto, every layer but lm_head: ekfac (checkpoint passes), default damping: what the reports use"]
    assert "auto_fallback" not in auto and abs(auto["lds"] - by_hand["lds"]) < 1e-9  # the same scores, the same LDS
    for name in (
        "TracIn exact (checkpoint passes)",
        "auto, every layer but lm_head: ekfac (checkpoint passes), default damping: what the reports use",
        "auto, every layer but transformer.wte: ekfac (checkpoint passes), default damping: what the reports use",
        "dattri TRAK (final model)",
        "dattri TRAK (2 epoch checkpoints)",
    ):
        row = rows[name]
        assert "error" not in row, row.get("trace")
        assert -1 <= row["ci95"][0] <= row["lds"] <= row["ci95"][1] <= 1 and row["trainings"] == 1
    assert result["subset_trainings"] == 50 and "lm_head" in result["store_layers"]
    assert "| TracIn exact (checkpoint passes) |" in lds.table(result)
