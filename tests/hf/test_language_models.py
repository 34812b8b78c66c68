"""Language models through a real ``transformers.Trainer`` with the callback and its defaults: each sequence's
stored gradient is the gradient of its own loss, the sum of its unmasked token losses, at the training steps
(with and without gradient accumulation, where the model divides by ``num_items_in_batch``) and in the
checkpoint passes.

References: ``torch.func`` per-sample gradients of a loss written here (the token cross-entropies of one
sequence, ``-100`` left out, the labels shifted by one for the causal LM), and that loss's value for the stored
loss column. The learning rate is 0, so the weights of every step and pass are the final ones. Sequences have one
length (no padding) and their numbers of unmasked tokens differ, so a mean over the batch's tokens is not a
mean over sequences.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from metastore_plugins import MetaStoreTrainerCallback, open_store  # noqa: E402
from metastore_plugins.testing import reference_per_sample_gradients  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over SDPA

N_TRAIN, N_VAL, LENGTH, TARGET, VOCAB, TAGS, MASK = 12, 6, 8, 5, 40, 5, 4
TOLERANCE = 1e-4  # fp32 capture against the fp32 reference; about 1e-6 is measured


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert_config(**extra: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra,
    )  # fmt: skip


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def causal_rows(g: torch.Generator, n: int) -> list[dict[str, Tensor]]:
    """Token ids, labels the same with a prompt of 0..3 tokens masked (as a completion's are)."""
    rows = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (LENGTH,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def masked_rows(g: torch.Generator, n: int) -> list[dict[str, Tensor]]:
    """1..4 positions masked in the input; the labels are their tokens, -100 elsewhere."""
    rows = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (LENGTH,), generator=g)
        where = torch.randperm(LENGTH, generator=g)[: int(torch.randint(1, 5, (1,), generator=g))]
        labels = torch.full_like(ids, -100)
        labels[where] = ids[where]
        rows.append({"input_ids": ids.index_fill(0, where, MASK), "labels": labels})
    return rows


def tagged_rows(g: torch.Generator, n: int) -> list[dict[str, Tensor]]:
    """A tag per token; the first token and a tail of 0..3 tokens are -100 (a special token, sub-words)."""
    rows = []
    for _ in range(n):
        labels = torch.randint(0, TAGS, (LENGTH,), generator=g)
        labels[0] = -100
        labels[LENGTH - int(torch.randint(0, 4, (1,), generator=g)) :] = -100
        rows.append({"input_ids": torch.randint(5, VOCAB, (LENGTH,), generator=g), "labels": labels})
    return rows


def seq2seq_rows(g: torch.Generator, n: int) -> list[dict[str, Tensor]]:
    """A source and a target of 2..5 tokens, padded with -100."""
    rows = []
    for _ in range(n):
        labels = torch.randint(5, VOCAB, (TARGET,), generator=g)
        labels[int(torch.randint(2, TARGET + 1, (1,), generator=g)) :] = -100
        rows.append({"input_ids": torch.randint(5, VOCAB, (LENGTH,), generator=g), "labels": labels})
    return rows


@dataclass(frozen=True)
class LMCase:
    make: Callable[[], nn.Module]
    rows: Callable[[torch.Generator, int], list[dict[str, Tensor]]]
    shift: bool  # the logits at t predict labels[t + 1]


CASES = {
    "gpt2-causal": LMCase(gpt2, causal_rows, True),
    "bert-mlm": LMCase(lambda: transformers.BertForMaskedLM(bert_config()), masked_rows, False),
    "bert-tokens": LMCase(
        lambda: transformers.BertForTokenClassification(bert_config(num_labels=TAGS)), tagged_rows, False
    ),
    "t5-seq2seq": LMCase(t5, seq2seq_rows, False),
}  # fmt: skip


def own_loss(shift: bool) -> Callable[[nn.Module, dict[str, Tensor]], Tensor]:
    """A sequence's own loss: the sum of its token cross-entropies, -100 left out (a batch of one)."""

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        logits, labels = model(**batch).logits, batch["labels"]  # (1, T, V), (1, T)
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")

    return loss


@dataclass
class Run:
    case: LMCase
    model: nn.Module
    store: Any
    train_rows: list[dict[str, Tensor]]
    val_rows: list[dict[str, Tensor]]


def train_lm(tmp_path: Path, case: LMCase, accumulation: int, **settings: Any) -> Run:
    """One epoch of a real Trainer with the callback (every layer exact, fp32), a checkpoint pass at its end."""
    g = torch.Generator().manual_seed(5)
    train_rows, val_rows = case.rows(g, N_TRAIN), case.rows(g, N_VAL)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = case.make()
    callback = MetaStoreTrainerCallback(encoding="fp32", policy="exact", reports=False, **settings)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=accumulation, learning_rate=0.0, num_train_epochs=1, eval_strategy="epoch",
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=3,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=train_rows, eval_dataset=val_rows, callbacks=[callback],
        data_collator=transformers.default_data_collator,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return Run(case, model, open_store(callback.dirpath), train_rows, val_rows)


@pytest.fixture(scope="module", params=[(name, acc) for name in CASES for acc in (1, 2)], ids=str)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    name, accumulation = request.param
    return train_lm(tmp_path_factory.mktemp(name), CASES[name], accumulation)


def stacked(rows: list[dict[str, Tensor]], ids: list[int]) -> dict[str, Tensor]:
    return {key: torch.stack([rows[i][key] for i in ids]) for key in rows[0]}


def worst_error(stored: dict[str, Tensor], expected: dict[str, Tensor], i: int) -> float:
    """``max|a - e| / max|e|`` over the parameters, each against the largest reference entry of the model."""
    overall = max(float(e[i].abs().max()) for e in expected.values())
    assert set(stored) == set(expected)
    return max(float((stored[name].float() - expected[name][i]).abs().max()) / overall for name in stored)


def check_capture_point(run: Run, rows: list[dict[str, Tensor]], capture_point: str) -> None:
    meta = run.store.metadata(capture_point)
    ids, steps = [int(i) for i in meta["sample_id"]], [int(s) for s in meta["step"]]
    assert sorted(set(ids)) == list(range(len(rows)))
    batch = stacked(rows, ids)
    expected = reference_per_sample_gradients(run.model, own_loss(run.case.shift), batch)
    values = torch.stack([own_loss(run.case.shift)(run.model, stacked(rows, [i])).detach() for i in ids])
    torch.testing.assert_close(torch.as_tensor(meta["loss"]).float(), values, rtol=1e-4, atol=1e-5)
    for k, (sid, step) in enumerate(zip(ids, steps)):
        stored = run.store.restore(sid, capture_point=capture_point, step=step)
        assert worst_error(stored, expected, k) < TOLERANCE, (sid, step)


def test_training_steps_store_each_sequences_own_gradient(run: Run) -> None:
    check_capture_point(run, run.train_rows, "train")


def test_checkpoint_passes_store_each_sequences_own_gradient(run: Run) -> None:
    assert run.store.capture_points() == ["epoch-0/train", "epoch-0/val", "train"]
    check_capture_point(run, run.val_rows, "epoch-0/val")
    check_capture_point(run, run.train_rows, "epoch-0/train")


def test_a_users_token_sum_loss_works_in_steps_and_passes(tmp_path: Path) -> None:
    """The per-sequence token sum the issue's filer passed: it got through the steps, then the first checkpoint
    pass (the model's loss there a mean over the batch's tokens, no num_items_in_batch) raised LossScaleError."""

    def token_sum(output: Any, batch: dict[str, Tensor]) -> Tensor:
        logits, labels = output.logits[:, :-1].float(), batch["labels"][:, 1:]  # (B, T - 1, V), (B, T - 1)
        flat = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        return flat.view(labels.shape).sum(1)

    run = train_lm(tmp_path, CASES["gpt2-causal"], 2, per_sample_loss=token_sum)
    check_capture_point(run, run.train_rows, "train")
    check_capture_point(run, run.val_rows, "epoch-0/val")
