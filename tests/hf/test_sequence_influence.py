"""``store.influence_of_sequences``: which training sequences raised or lowered the loss of new sequences (a text, or
a completion with its prompt labelled ``-100``) that the run never stored, after a real Trainer run of a tiny GPT-2.

Reference: TracIn computed by hand, ``sum_c lr_c <g_i(w_c), g_j(w_c)>`` over the two checkpoints, with ``torch.func``
per-sample gradients of each sequence's own loss (the sum of its unmasked token cross-entropies, labels shifted)
at weights this test copied at each evaluation (a callback of its own, not the store's snapshots), and
``lr_c`` the constant learning rate times the steps of the interval (3 per epoch).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from metastore_plugins import MetaStoreTrainerCallback, open_store  # noqa: E402
from metastore_plugins.core.errors import StoreError  # noqa: E402
from metastore_plugins.testing import reference_per_sample_gradients  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over SDPA

N_TRAIN, BATCH, EPOCHS, LR, LENGTH, VOCAB = 12, 4, 2, 0.05, 8, 40
TOLERANCE = 1e-4  # fp32 store and recompute against the fp32 reference, relative to the largest score


def causal_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The sum of the batch's token cross-entropies, the labels shifted by one, -100 left out."""
    logits, labels = model(**batch).logits[:, :-1], batch["labels"][:, 1:]  # (B, T-1, V), (B, T-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")


def rows(g: torch.Generator, n: int, prompts: list[int]) -> list[dict[str, Tensor]]:
    """``n`` sequences; the first ``prompts[k]`` labels of sequence ``k`` are -100 (a prompt), 0 for the rest."""
    out = []
    for k in range(n):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        labels = ids.clone()
        labels[: prompts[k] if k < len(prompts) else 0] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


class Weights(transformers.TrainerCallback):
    """Copies the model's weights at each evaluation (the weights of the checkpoint pass there) and before each
    training step."""

    def __init__(self) -> None:
        self.states: list[dict[str, Tensor]] = []
        self.steps: list[dict[str, Tensor]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        assert model is not None
        self.steps.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_evaluate(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        assert model is not None
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, nn.Module, list[dict[str, Tensor]], Weights, Path]:
    g = torch.Generator().manual_seed(11)
    train, val = rows(g, N_TRAIN, []), rows(g, 4, [])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    weights = Weights()
    out = tmp_path_factory.mktemp("seq-influence")
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, learning_rate=LR,
        lr_scheduler_type="constant", num_train_epochs=EPOCHS, eval_strategy="epoch", save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=3,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=train, eval_dataset=val, data_collator=transformers.default_data_collator,
        callbacks=[MetaStoreTrainerCallback(encoding="fp32", reports=False, budget="200MB"), weights],  # all exact
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return open_store(out), model, train, weights, out


def stacked(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def by_hand(model: nn.Module, states: list[dict[str, Tensor]], train: dict[str, Tensor], new: dict[str, Tensor]) -> Any:
    """``(N, B)`` TracIn: ``sum_c lr_c <g_i(w_c), g_j(w_c)>`` from torch.func per-sample gradients at each copy."""
    total = torch.zeros(len(train["input_ids"]), len(new["input_ids"]), dtype=torch.float64)
    for state in states:
        at = copy.deepcopy(model)
        at.load_state_dict(state)
        a = reference_per_sample_gradients(at, causal_loss, train)
        b = reference_per_sample_gradients(at, causal_loss, new)
        dots = sum(a[n].flatten(1).double() @ b[n].flatten(1).double().T for n in a)  # (N, B)
        total += LR * (N_TRAIN // BATCH) * dots  # the interval's summed learning rate
    return total.numpy()


def test_influence_of_new_sequences_is_tracin_by_hand(run: Any) -> None:
    store, model, train, weights, _ = run
    assert len(weights.states) == EPOCHS
    g = torch.Generator().manual_seed(12)
    new = stacked(rows(g, 3, [0, 3, 6]))  # a whole text, and two completions behind prompts of 3 and 6 tokens
    scores = store.influence_of_sequences(model, new, train_from="passes")
    expected = by_hand(model, weights.states, stacked(train), new)
    assert scores.row_ids.tolist() == list(range(N_TRAIN)) and scores.col_ids.tolist() == [0, 1, 2]
    error = np.abs(scores.scores - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE, error
    assert not np.allclose(expected[:, 1], expected[:, 2], rtol=0.1)  # the prompts change the scores
    top = scores.top(3)[2]["proponents"]
    assert [i for i, _ in top] == np.argsort(-expected[:, 2], kind="stable")[:3].tolist()


def test_influence_of_new_sequences_over_the_steps_is_in_run_tracin_by_hand(run: Any) -> None:
    store, model, train, weights, _ = run
    assert len(weights.steps) == EPOCHS * N_TRAIN // BATCH == 6
    new = stacked(rows(torch.Generator().manual_seed(12), 3, [0, 3, 6]))
    paired = {t: [0, 0] if t < 3 else [0, 1] for t in range(6)}  # the passes at steps 3 and 6 (evaluations 0, 1)
    new_grads = []
    for state in weights.states:
        at = copy.deepcopy(model)
        at.load_state_dict(state)
        new_grads.append(reference_per_sample_gradients(at, causal_loss, new))
    meta = store.metadata("train")
    expected = np.zeros((N_TRAIN, 3))
    for t, state in enumerate(weights.steps):
        ids = meta["sample_id"][meta["step"] == t].tolist()
        at = copy.deepcopy(model)
        at.load_state_dict(state)
        g = reference_per_sample_gradients(at, causal_loss, stacked([train[i] for i in ids]))
        for c in paired[t]:
            dots = sum(g[n].flatten(1).double() @ new_grads[c][n].flatten(1).double().T for n in g)  # (B, 3)
            expected[ids] += LR * dots.numpy()
    scores = store.influence_of_sequences(model, new)  # default: the steps
    assert sorted(scores.row_ids.tolist()) == list(range(N_TRAIN)) and scores.col_ids.tolist() == [0, 1, 2]
    got = np.zeros_like(expected)
    got[scores.row_ids] = scores.scores
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE, error
    passes = store.influence_of_sequences(model, new, train_from="passes")
    assert not np.allclose(passes.scores, got[passes.row_ids], rtol=0.05)  # the steps are another estimate


def test_a_store_without_snapshots_names_them(run: Any, tmp_path: Path) -> None:
    _, model, _, _, out = run
    snapshots = out / "metastore" / "snapshots"
    moved = [path.rename(tmp_path / path.name) for path in sorted(snapshots.iterdir())]
    try:
        with pytest.raises(StoreError, match=r"no weight snapshot \['epoch-0', 'epoch-1'\]"):
            open_store(out).influence_of_sequences(model, stacked(rows(torch.Generator().manual_seed(1), 1, [])))
    finally:
        for path in moved:
            path.rename(snapshots / path.name)
