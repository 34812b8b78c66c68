"""The LDS harness's tasks: the digits MLP and CNN (:mod:`.digits`), the token transformer (:mod:`.tokens`), with
fixed sinusoidal positions (``tokens``) or a learned position table on its root module (``positions``), and a
2-layer GPT-2 on synthetic sequences (``lm``, :mod:`.lm_task`: a causal LM, run by :mod:`.lds_lm`).

Every attributor of :mod:`.lds` and :mod:`.lds_peers` gets its data and models here, so a task is one
entry per function. All but ``lm`` train with :func:`~.digits.train_model` (SGD, lr 0.1, momentum 0.9, batch 32);
``lm`` with :func:`~.lm_task.train_lm` (its labels are the token ids).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from .digits import load_digits_arrays, make_model
from .lm_task import load_lm_arrays, make_lm_model
from .tokens import load_token_arrays, make_token_model

Kind = Literal["mlp", "cnn", "tokens", "positions", "lm"]
KINDS: tuple[Kind, ...] = ("mlp", "cnn", "tokens", "positions", "lm")
TITLES: dict[Kind, str] = {
    "mlp": "digits MLP",
    "cnn": "digits CNN",
    "tokens": "token transformer",
    "positions": "token transformer, learned positions",
    "lm": "causal LM (2-layer GPT-2)",
}
#: the token tasks (one data set, 8 epochs)
TOKEN_KINDS: tuple[Kind, ...] = ("tokens", "positions")
# Layers Kronfluence leaves out (it tracks Linear and Conv2d): the embedding, and the root's position table ("").
EMBEDDINGS: dict[Kind, tuple[str, ...]] = {
    "mlp": (),
    "cnn": (),
    "tokens": ("embed",),
    "positions": ("embed", ""),
    "lm": (),
}


def load_arrays(kind: Kind, seed: int, train_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of the task: digits images or token ids (300 held out)."""
    if kind in TOKEN_KINDS:
        return load_token_arrays(seed, train_size)
    if kind == "lm":
        return load_lm_arrays(seed, train_size)
    return load_digits_arrays(seed, train_size)


def build_model(kind: Kind, seed: int) -> nn.Module:
    """The task's model, initialised from ``torch.manual_seed(seed)`` (the global RNG is left as it was)."""
    if kind in TOKEN_KINDS:
        return make_token_model(seed, learned_positions=kind == "positions")
    if kind == "lm":
        return make_lm_model(seed)
    return make_model(kind, seed)
