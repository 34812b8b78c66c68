"""The LDS harness's tasks: the digits MLP and CNN (:mod:`.digits`) and the token transformer (:mod:`.tokens`), with
fixed sinusoidal positions (``tokens``) or a learned position table on its root module (``positions``).

Every attributor of :mod:`.lds` and :mod:`.lds_peers` gets its data and models here, so a task is one
entry per function. All train with :func:`~.digits.train_model` (SGD, lr 0.1, momentum 0.9, batch 32).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from .digits import load_digits_arrays, make_model
from .tokens import load_token_arrays, make_token_model

Kind = Literal["mlp", "cnn", "tokens", "positions"]
KINDS: tuple[Kind, ...] = ("mlp", "cnn", "tokens", "positions")
TITLES: dict[Kind, str] = {
    "mlp": "digits MLP",
    "cnn": "digits CNN",
    "tokens": "token transformer",
    "positions": "token transformer, learned positions",
}
#: the token tasks (one data set, 8 epochs)
TOKEN_KINDS: tuple[Kind, ...] = ("tokens", "positions")
# Layers Kronfluence leaves out (it tracks Linear and Conv2d): the embedding, and the root's position table ("").
EMBEDDINGS: dict[Kind, tuple[str, ...]] = {"mlp": (), "cnn": (), "tokens": ("embed",), "positions": ("embed", "")}


def load_arrays(kind: Kind, seed: int, train_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of the task: digits images or token ids (300 held out)."""
    if kind in TOKEN_KINDS:
        return load_token_arrays(seed, train_size)
    return load_digits_arrays(seed, train_size)


def build_model(kind: Kind, seed: int) -> nn.Module:
    """The task's model, initialised from ``torch.manual_seed(seed)`` (the global RNG is left as it was)."""
    if kind in TOKEN_KINDS:
        return make_token_model(seed, learned_positions=kind == "positions")
    return make_model(kind, seed)
