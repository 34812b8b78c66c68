"""A synthetic token task and a tiny transformer: the LDS harness's task that is not an image MLP.

The data are generated, never downloaded (:func:`load_token_arrays`): sequences of ``LENGTH``
tokens drawn uniformly from a vocabulary of ``VOCAB``, labelled by a seeded rule with context:

- the ``KEYWORDS x CLASSES`` tokens ``1 .. KEYWORDS * CLASSES`` are keywords: token ``v`` votes 1 for
  class ``(v - 1) % CLASSES``; every token also votes a small seeded jitter ``0.1 * N(0, 1)`` per class
  (which breaks ties);
- a token right after the negation token ``NEGATION`` votes the opposite (the negation token votes
  nothing), so the label needs the previous token, not only a bag of words;
- the label is the class with the largest total vote; then a share ``noise`` (10%) of the labels,
  train and test alike, is changed to another class, uniformly.

On 1,000 training sequences, logistic regression on token counts reaches 79% held-out accuracy,
on negation-aware counts 82% (the noise caps it at about 90%).

:func:`make_token_model` is a one-block transformer over token embeddings plus fixed sinusoidal
positions: single-head self-attention with separate ``query``/``key``/``value``/``out`` ``nn.Linear``
layers (so every attributor sees the same layers: the store captures them, Kronfluence tracks
them), a residual, mean pooling, then ``Linear-ReLU-Linear``. 1,731 parameters at the defaults
(320 of them in the embedding). It trains with :func:`~.digits.train_model` (SGD, lr 0.1,
momentum 0.9, batch 32) for 8 epochs: about 1 s for 1,000 sequences on one core, 73% held-out
accuracy, so it can be retrained hundreds of times.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

VOCAB = 20
LENGTH = 12
CLASSES = 3
KEYWORDS = 3  # keyword tokens per class
NEGATION = 0  # the token that flips the vote of the token after it
TEST_SIZE = 300
WIDTH = 16


def token_rule(tokens: np.ndarray, seed: int = 0) -> np.ndarray:
    """``(N,)`` clean labels of ``(N, LENGTH)`` token ids under the seeded voting rule (module docstring)."""
    votes = 0.1 * np.random.default_rng([seed, 1]).standard_normal((VOCAB, CLASSES))  # (V, C)
    for v in range(1, 1 + KEYWORDS * CLASSES):
        votes[v, (v - 1) % CLASSES] += 1.0
    votes[NEGATION] = 0.0
    sign = np.ones(tokens.shape)  # (N, L)
    sign[:, 1:] = np.where(tokens[:, :-1] == NEGATION, -1.0, 1.0)
    return (votes[tokens] * sign[..., None]).sum(1).argmax(1)  # (N,)


def load_token_arrays(
    seed: int = 0, train_size: int = 1000, noise: float = 0.1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)``: token ids ``(N, LENGTH)`` int64 and labels ``(N,)`` int64.

    ``train_size`` training sequences and ``TEST_SIZE`` held-out ones, from one seeded draw; a share
    ``noise`` of every label is changed to another class (the same draws whatever ``train_size``
    for the test set: it is drawn first).
    """
    rng = np.random.default_rng([seed, 2])
    test = rng.integers(0, VOCAB, (TEST_SIZE, LENGTH))
    train = rng.integers(0, VOCAB, (train_size, LENGTH))
    labels = []
    for tokens in (test, train):
        clean = token_rule(tokens, seed)
        flip = rng.random(len(clean)) < noise
        labels.append(np.where(flip, (clean + rng.integers(1, CLASSES, len(clean))) % CLASSES, clean))
    return (
        torch.from_numpy(train).long(),
        torch.from_numpy(labels[1]).long(),
        torch.from_numpy(test).long(),
        torch.from_numpy(labels[0]).long(),
    )


def sinusoids(length: int, width: int) -> Tensor:
    """``(length, width)`` fixed sinusoidal positions (Vaswani et al.)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]  # (L, 1)
    rate = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(100.0) / width))  # (W/2,)
    out = torch.zeros(length, width)
    out[:, 0::2], out[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
    return out


class TinyTransformer(nn.Module):
    """Embedding + positions, one single-head self-attention block (residual), mean pool, ``Linear-ReLU-Linear``.

    ``learned_positions``: the positions are a learned ``(length, width)`` table, an ``nn.Parameter`` of this root
    module itself (not inside an ``nn.Embedding``: the capture's generic rule takes it, as a dense per-sample
    gradient of layer ``""``), initialised as the sinusoids; else the fixed sinusoids (a buffer).
    """

    def __init__(
        self,
        vocab: int = VOCAB,
        length: int = LENGTH,
        width: int = WIDTH,
        classes: int = CLASSES,
        learned_positions: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.query, self.key = nn.Linear(width, width), nn.Linear(width, width)
        self.value, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.hidden, self.head = nn.Linear(width, width), nn.Linear(width, classes)
        self.positions: Tensor
        if learned_positions:
            self.positions = nn.Parameter(sinusoids(length, width))  # (L, W)
        else:
            self.register_buffer("positions", sinusoids(length, width), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:  # (B, L) int64 -> (B, C)
        h = self.embed(tokens) + self.positions  # (B, L, W)
        attention = torch.softmax(self.query(h) @ self.key(h).transpose(1, 2) / math.sqrt(h.shape[-1]), -1)  # (B, L, L)
        h = h + self.out(attention @ self.value(h))  # (B, L, W)
        return self.head(torch.relu(self.hidden(h.mean(1))))  # (B, C)


def make_token_model(seed: int, learned_positions: bool = False) -> nn.Module:
    """:class:`TinyTransformer` initialised from ``torch.manual_seed(seed)``; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer(learned_positions=learned_positions)
