"""Leave every global random number generator as it was: what lets an observer of training never disturb it.

Work an observer does between training steps may draw random numbers without meaning to: a
``DataLoader`` draws its base seed from torch's global generator when its iterator is made, a
dataset's augmentation draws from torch, numpy or python ``random``, a ``training_step`` may draw
noise on the GPU. Each draw would move the generators training reads next (dropout, the next
epoch's shuffle) and change the run. :func:`preserved_rng` saves the state of them all and puts
it back, however the block ends.

Example::

    with preserved_rng():
        run.checkpoint_pass(model, batches, loss_of, capture_point="epoch-0/train", step=step, epoch=0, lr=lr)
    # torch (CPU and CUDA), numpy and python `random` are where training left them
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["RngState", "preserved_rng", "weights_untouched"]


@dataclass(frozen=True)
class RngState:
    """The states of torch's CPU generator, of every initialised CUDA device's, of numpy's and python's global ones."""

    torch_cpu: Tensor
    cuda: list[Tensor] | None  # one per device; None where CUDA was not initialised (reading it would initialise it)
    numpy: Any  # np.random.get_state()
    python: Any  # random.getstate()

    @classmethod
    def capture(cls) -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, np.random.get_state(), random.getstate())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@contextmanager
def preserved_rng() -> Iterator[RngState]:
    """Run a block that may draw random numbers; afterwards every global generator is where it was before.

    Covers torch's CPU generator, each CUDA device's (those initialised when the block starts),
    numpy's global ``RandomState`` and python's ``random``. Generators a block makes or is
    given (``torch.Generator()``, ``np.random.default_rng()``) are its own affair.
    """
    state = RngState.capture()
    try:
        yield state
    finally:
        state.restore()


@contextmanager
def weights_untouched(model: nn.Module) -> Iterator[None]:
    """Eval mode for a checkpoint pass; the parameters' ``.grad`` and the train/eval mode come back as they were."""
    saved = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.grad = saved[name]
