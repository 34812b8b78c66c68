"""A synthetic language-model task and a 2-layer GPT-2: the LDS harness's causal LM (``lm``).

The data are generated, never downloaded (:func:`load_lm_arrays`): each sequence of ``LENGTH`` tokens belongs
to one of ``TOPICS`` seeded Markov chains over the word tokens ``TOPICS .. VOCAB - 1``; its first token names
the chain (token ``k`` for chain ``k``), the second is drawn uniformly, and each later one from the chain's row
of the previous token, which puts its mass on ``SUCCESSORS`` successors (Dirichlet weights). So the next token
needs the context (which chain: the first token, attention's job) and the previous token.

:func:`make_lm_model` is a ``GPT2LMHeadModel`` from a ``GPT2Config`` (2 layers, width ``WIDTH``, 2 heads,
dropout off; ``wte`` and ``lm_head`` tied, as GPT-2's are): nothing is downloaded. It trains with
:func:`train_lm`: SGD with momentum over seeded shuffles on the model's own loss, the mean token loss of the
batch (no padding: every sequence has ``LENGTH - 1`` predicted tokens). A sequence's loss in the store is the
sum of its token losses (:func:`sequence_losses`, what the callbacks' default records for a causal LM), so
the capture's batch loss is ``mean_i l_i`` scaled by ``1 / (LENGTH - 1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.training.passes import capture_step, checkpoint_pass

from .digits import Capture

TOPICS = 4
VOCAB = 28  # TOPICS marker tokens, then 24 word tokens
LENGTH = 16
SUCCESSORS = 3  # the likely successors of a word token in each chain
WIDTH = 32
TEST_SIZE = 300
PREDICTED = LENGTH - 1  # tokens with a loss per sequence (the causal shift)


def chains(seed: int = 0) -> np.ndarray:
    """``(TOPICS, W, W)`` row-stochastic transitions over the ``W = VOCAB - TOPICS`` word tokens."""
    rng = np.random.default_rng([seed, 3])
    words = VOCAB - TOPICS
    out = np.full((TOPICS, words, words), 0.02 / words)  # a little mass everywhere
    for k in range(TOPICS):
        for w in range(words):
            out[k, w, rng.choice(words, SUCCESSORS, replace=False)] += 0.98 * rng.dirichlet(np.ones(SUCCESSORS))
    return out / out.sum(-1, keepdims=True)


def sample_sequences(count: int, rng: np.random.Generator, transitions: np.ndarray) -> np.ndarray:
    """``(count, LENGTH)`` token ids: a topic marker, a uniform word, then the topic's chain."""
    words = VOCAB - TOPICS
    topic = rng.integers(0, TOPICS, count)  # (count,)
    out = np.zeros((count, LENGTH), dtype=np.int64)
    out[:, 0] = topic
    word = rng.integers(0, words, count)  # (count,)
    out[:, 1] = TOPICS + word
    cumulative = transitions.cumsum(-1)  # (TOPICS, W, W)
    for t in range(2, LENGTH):
        rows = cumulative[topic, word]  # (count, W)
        word = np.minimum((rng.random(count)[:, None] > rows).sum(1), words - 1)  # inverse CDF
        out[:, t] = TOPICS + word
    return out


def load_lm_arrays(seed: int = 0, train_size: int = 600) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)``: ``(N, LENGTH)`` int64 token ids, the labels the same ids (the
    model shifts them, as transformers' causal LMs do). ``TEST_SIZE`` held-out sequences, drawn first (the
    same whatever ``train_size``)."""
    rng = np.random.default_rng([seed, 4])
    transitions = chains(seed)
    test = torch.from_numpy(sample_sequences(TEST_SIZE, rng, transitions))
    train = torch.from_numpy(sample_sequences(train_size, rng, transitions))
    return train, train.clone(), test, test.clone()


def make_lm_model(seed: int) -> nn.Module:
    """A 2-layer ``GPT2LMHeadModel`` (width ``WIDTH``, 2 heads, dropout off, eager attention) from
    ``torch.manual_seed(seed)``; the global RNG is left as it was."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=WIDTH, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"  # plain ops: torch.func's vmap (the peers, the reference) runs them
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def sequence_losses(output: Any, labels: Tensor) -> Tensor:
    """``(B,)`` each sequence's sum of its token cross-entropies, the logits at ``t`` predicting ``labels[t + 1]``
    (differentiable: the capture's per-sample loss)."""
    logits = getattr(output, "logits", output)[:, :-1]  # (B, T - 1, V)
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="none")
    return flat.view(labels.shape[0], -1).sum(1)  # (B,)


def lm_losses(model: nn.Module, x: Tensor, batch_size: int = 256) -> np.ndarray:
    """``(M,)`` float64 per-sequence losses (token sums) of ``x`` under ``model`` (eval mode, no gradient)."""
    model.eval()
    with torch.no_grad():
        return torch.cat([sequence_losses(model(rows), rows) for rows in x.split(batch_size)]).double().numpy()


def _forward(model: nn.Module, x: Tensor, rows: Tensor) -> Any:
    return model(x[rows])  # .logits (B, T, V)


def train_lm(
    model: nn.Module,
    x: Tensor,
    *,
    epochs: int,
    seed: int,
    batch_size: int = 16,
    lr: float = 0.3,
    momentum: float = 0.9,
    capture: Capture | None = None,
    on_epoch_end: Callable[[int, nn.Module], None] | None = None,
) -> nn.Module:
    """The mean token loss of each batch (transformers' ``ForCausalLMLoss`` without padding), SGD with momentum,
    seeded shuffles; returns ``model`` trained in place, in eval mode.

    ``capture`` as :func:`~.digits.train_model`'s: every step as ``"train"``, a pass per named set at each epoch
    end as ``"epoch-{e}/{name}"`` (``lr``: the steps' summed rates), the per-sample loss :func:`sequence_losses`.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    ids = capture.ids if capture is not None and capture.ids is not None else torch.arange(len(x))  # (N,)
    step, lr_since_pass = 0, 0.0
    for epoch in range(epochs):
        model.train()
        for rows in torch.randperm(len(x), generator=generator).split(batch_size):
            if capture is not None and capture.steps:
                step_loss = partial(_forward, model, x, rows)
                scale = 1.0 / PREDICTED  # mean over sequences of token sums -> mean token loss
                capture_step(
                    model, step_loss, x[rows], ids[rows], sequence_losses, capture.writer, step=step, epoch=epoch,
                    lr=lr, loss_scale=scale,
                )  # fmt: skip
            else:
                (sequence_losses(model(x[rows]), x[rows]).mean() / PREDICTED).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr_since_pass += lr
            step += 1
        model.eval()
        if capture is not None and capture.passes:
            for name, (px, _) in capture.passes.items():
                batches = [
                    (r, partial(_forward, model, px, r), px[r])
                    for r in torch.arange(len(px)).split(capture.pass_batch_size)
                ]
                checkpoint_pass(
                    model, batches, sequence_losses, capture.writer, capture_point=f"epoch-{epoch}/{name}", step=step,
                    epoch=epoch, lr=lr_since_pass,
                )  # fmt: skip
            lr_since_pass = 0.0
        if on_epoch_end is not None:
            on_epoch_end(epoch, model)
    model.eval()
    return model
