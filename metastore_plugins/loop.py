"""``track``: capture a plain PyTorch training loop, with the callbacks' policy, budget, loss check, passes and reports.

The third adapter on the run facade (:class:`~metastore_plugins.core.training.facade.RunFacade`), beside the
Lightning and HF callbacks: the loop says where a step's batch comes from, when its backward is done and when
an epoch ends; everything else is the callbacks' own code.

Example::

    import metastore_plugins

    loader = DataLoader(train_set, batch_size=32, shuffle=True)  # sample ids: the indices its sampler draws
    with metastore_plugins.track(model, optimizer, loader, val_loader=val_loader, store_dir="runs/demo/store",
                                 epochs=3) as run:
        for epoch in range(3):
            for x, y in run.batches():        # the loader's batches; each one's capture begins
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                run.step(loss)                # its per-sample gradients, as the policy and the budget keep them
                optimizer.step()
                optimizer.zero_grad()
            run.checkpoint()                  # the epoch ends: a checkpoint pass (every n epochs)
    # leaving the block closes the store and writes the reports (store_dir/reports)

See ``docs/loop.md``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from typing_extensions import Unpack

from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import ConfigError, StateError
from metastore_plugins.core.model.losses import LossFn, default_labels, logits_of
from metastore_plugins.core.model.pass_sources import START_PASS
from metastore_plugins.core.model.sample_ids import IndexedDataset, RecordingBatchSampler, loader_batch_size
from metastore_plugins.core.process_group import group_up
from metastore_plugins.core.training.adapter_support import batch_ids, first_lr, loader_datasets, sampler_recorder
from metastore_plugins.core.training.facade import FacadeHolder, RunFacade
from metastore_plugins.core.training.settings import CaptureSettings
from metastore_plugins.core.training.settings_doc import with_settings_doc

#: The start and end lines (where the store went, how to open it) are logged here at info level.
logger = logging.getLogger(__name__)


def cross_entropy_loss(model: nn.Module, batch: Any, reduction: LossReduction = "mean") -> Tensor:
    """The default ``loss_fn`` of the checkpoint passes: cross-entropy of the model's ``(B, C)`` logits on the batch's
    labels (:func:`~metastore_plugins.core.model.losses.default_labels`), reduced by ``reduction``. The model runs
    on ``batch[0]`` of a list or tuple (``x, y``), on ``**batch`` of a dict, else on the batch."""
    if isinstance(batch, Mapping):
        output = model(**batch)
    else:
        output = model(batch[0] if isinstance(batch, (list, tuple)) else batch)
    logits = logits_of(output)
    if logits is None or logits.dim() != 2:
        raise ConfigError(
            "track()'s default checkpoint-pass loss is cross-entropy of (B, C) logits; this model's output is not "
            "that: pass loss_fn=callable(model, batch) -> the batch's loss, reduced as loss_reduction says"
        )
    labels = torch.as_tensor(default_labels(batch)).to(logits.device).long()  # (B,)
    return F.cross_entropy(logits.float(), labels, reduction=reduction)


@with_settings_doc
class TrackedRun(FacadeHolder):
    """The capture of a plain training loop: per-sample gradients of every step, checkpoint passes and reports.

    Inside the ``with`` block, iterate :meth:`batches` (the train loader's batches, each one's capture begun),
    call :meth:`step` after each backward (before ``optimizer.step()``) and :meth:`checkpoint` at each epoch's
    end. Leaving the block closes the store and writes the reports; an exception closes it and names the
    exception in the store's run log. One process (under ``torch.distributed`` use a callback).

    Args:
        model: the model the loop trains (hooked for the length of the block).
        optimizer: its optimizer, for the learning rate TracIn weighs each step by (None: 1).
        train_loader: a ``DataLoader`` of a map-style dataset. Sample ids are the indices its sampler draws
            (any dataset), or what an :class:`~metastore_plugins.IndexedDataset` adds (taken off the batch
            before the loop sees it).
        store_dir: the store directory.
        val_loader: the evaluation ``DataLoader``; its first ``checkpoint_val_samples`` go into each pass.
        epochs: the epochs the loop will run, for the capture plan (None: unknown; the plan then keeps a
            rate per sample).
        checkpoint_every_n_epochs: a checkpoint pass (``epoch-{e}/train``, ``epoch-{e}/val``) at every n-th
            :meth:`checkpoint`; 0 turns them off.
        loss_reduction: how the loop's loss combines the per-sample losses: ``"mean"`` (default) or ``"sum"``.
        loss_fn: ``(model, batch) -> loss`` of a checkpoint pass's batch (of the loaders' datasets), reduced as
            ``loss_reduction`` says; default :func:`cross_entropy_loss`.
        tensorboard_dir: where the TensorBoard reports go (default: none, the report files only).
        {settings}
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        train_loader: Any,
        *,
        store_dir: str | os.PathLike[str],
        val_loader: Any = None,
        epochs: int | None = None,
        checkpoint_every_n_epochs: int = 1,
        loss_reduction: LossReduction = "mean",
        loss_fn: LossFn | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        **settings: Unpack[CaptureSettings],
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"track(loss_reduction=...) must be 'mean' or 'sum'; got {loss_reduction!r}")
        self.facade = RunFacade(
            "track", settings, every_n=checkpoint_every_n_epochs, every_n_setting="checkpoint_every_n_epochs"
        )
        self.epochs = None if epochs is None else self.options.whole_number("epochs", epochs, 1)
        self.model, self.optimizer, self.train_loader, self.val_loader = model, optimizer, train_loader, val_loader
        self.store_dir = Path(store_dir)
        self.tensorboard_dir = None if tensorboard_dir is None else Path(tensorboard_dir)
        self.loss_reduction = loss_reduction
        self.loss_fn: LossFn = loss_fn or functools.partial(cross_entropy_loss, reduction=loss_reduction)
        self.global_step = 0  # the optimizer steps done (run.step() calls)
        self.epoch = 0  # the epochs ended (run.checkpoint() calls)
        self._indexed = isinstance(getattr(train_loader, "dataset", None), IndexedDataset)
        self._sampler: RecordingBatchSampler | None = None
        self._batch: Any = None  # the batch batches() handed out, until its step
        self._ids: Tensor | None = None

    def __enter__(self) -> TrackedRun:
        if group_up():
            raise StateError(
                "track() captures one process; under torch.distributed use MetaStoreCallback (Lightning) or "
                "MetaStoreTrainerCallback (Hugging Face), which split the store and the passes between ranks"
            )
        self.facade.prepare(self.model)
        if self.options.capture_train_steps and not self._indexed:  # installed before the loader's first iterator
            self._sampler = sampler_recorder(self.train_loader, "track")
        length = len(self.train_loader) if hasattr(self.train_loader, "__len__") else 0
        config = {"framework": "plain loop", "loss_reduction": self.loss_reduction,
                  "module": type(self.model).__name__, "seed": self.schedule.seed}  # fmt: skip
        moved = self.facade.open(
            self.store_dir, self.model, setting="track(store_dir=...)", resume="(a plain loop does not resume)",
            continuing=False, step=0, rank=0, world_size=1, agree=lambda decision: decision,
            loss_reduction=self.loss_reduction, config=config, announce=logger.info, train_loader=self.train_loader,
            val_loader=self.val_loader, train_batches=length * (self.epochs or 0),
            train_batch_size=loader_batch_size(self.train_loader) or 0, periods=self.epochs or 0,
        )  # fmt: skip
        if moved is not None:
            logger.info(f"track: overwrite=True: the earlier store in {self.store_dir} moved to {moved}")
        logger.info(self.facade.start_line(self.store_dir, "epoch(s)"))
        self._passes(start=True)  # the pass before the first step (validation samples)
        return self

    def batches(self) -> Iterator[Any]:
        """The train loader's batches for one epoch, their sample ids taken (and what an ``IndexedDataset`` added
        taken off); the capture of each batch's forward and backward begins as it is handed out."""
        for batch in self.train_loader:
            capturing = self.options.capture_train_steps
            self._ids = batch_ids(batch, self._sampler, strip=self._indexed) if capturing or self._indexed else None
            self._batch = batch
            self.facade.begin_step(self.model)
            yield batch
        self._batch, self._ids = None, None

    def step(self, loss: Tensor | None = None) -> None:
        """After the backward of the batch :meth:`batches` handed out, before ``optimizer.step()``: store its
        per-sample gradients as the capture policy and the budget say. ``loss``: the loss the loop
        back-propagated, checked once against ``loss_reduction`` of the per-sample losses."""
        if self._batch is None:
            raise StateError(
                "run.step() stores the step of a batch from run.batches(), after its loss.backward(); call it once "
                "per batch, inside `for batch in run.batches():`"
            )
        lr = first_lr(self.optimizer)
        self.facade.end_backward()
        if self._ids is not None:
            self.facade.finish_step(self._batch, self._ids, step=self.global_step, epoch=self.epoch, lr=lr,
                                    batch_loss=None if loss is None else loss.detach())  # fmt: skip
        self.facade.optimizer_step(lr)  # the next checkpoint pass stands for this step
        self._batch, self._ids = None, None
        self.global_step += 1

    def checkpoint(self) -> None:
        """At the end of an epoch: a checkpoint pass when the schedule says (``epoch-{e}/train``, ``epoch-{e}/val``
        at the weights now; weights, ``.grad`` and random generators left as they were), then the epoch's steps
        are written (without waiting)."""
        if self.facade.due(self.epoch):
            self._passes()
        self.facade.epoch_ended()
        self.epoch += 1

    def _passes(self, start: bool = False) -> None:
        """The epoch's checkpoint pass, or (``start``) the pass before the first step when the schedule makes one."""
        device = next(self.model.parameters()).device
        where: dict[str, Any] = dict(
            train_batch_size=loader_batch_size(self.train_loader) or 32,
            val_batch_size=loader_batch_size(self.val_loader) or 32, rank=0, world_size=1,
            to_device=lambda batch: _to_device(batch, device), step=self.global_step, epoch=self.epoch,
            lr=first_lr(self.optimizer),
        )  # fmt: skip
        name = START_PASS if start else f"epoch-{self.epoch}"
        self.facade.checkpoint_passes(
            self.model, self.train_loader, self.val_loader, self._pass_loss, name=name, **where
        )

    def tag(self, name: str, **options: Any) -> Any:
        """Tag the current step (or ``steps=(first, last)``) with ``name`` and attributes; ``keep=`` sets what those
        steps keep (see :meth:`MetaStoreCallback.tag <metastore_plugins.MetaStoreCallback.tag>`)."""
        return self.facade.tag(name, self.global_step, **options)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if error is not None:
            self.facade.close(error)  # what was captured is written; the run log names the exception
            return
        recompute = self.facade.end()
        logdirs = [self.tensorboard_dir] if self.tensorboard_dir is not None else []
        datasets = loader_datasets(self.train_loader, self.val_loader)
        self.facade.reports(self.store_dir, step=self.global_step, rank=0, datasets=datasets, recompute=recompute,
                            logdirs=logdirs)  # fmt: skip
        logger.info(self.facade.end_line(self.store_dir, logdirs))

    def _pass_loss(self, batch: Any, k: int) -> Tensor:
        """A checkpoint-pass batch's loss (``loss_fn``)."""
        return self.loss_fn(self.model, batch)


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (lists, tuples, dicts) on ``device``."""
    return tree_map(lambda value: value.to(device) if isinstance(value, Tensor) else value, batch)


#: ``with track(model, optimizer, loader, store_dir=..., ...) as run:``: the plain loop's adapter (:class:`TrackedRun`).
track = TrackedRun
