"""``MetaStoreCallback``: capture exact per-sample gradients of a Lightning run and report on them.

A thin adapter: it maps Lightning's events onto the run facade,
:class:`~metastore_plugins.core.training.facade.RunFacade` (open, steps, checkpoint passes, end, reports).

Example::

    import lightning as L
    from metastore_plugins import IndexedDataset, MetaStoreCallback

    loader = DataLoader(IndexedDataset(train_set), batch_size=32, shuffle=True)
    trainer = L.Trainer(max_epochs=3, callbacks=[MetaStoreCallback()])   # the one extra line
    trainer.fit(model, loader, DataLoader(IndexedDataset(val_set), batch_size=64))

See ``docs/lightning.md`` for defaults, sample ids, loss reduction and the reports.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.model.pass_sources import START_PASS
from metastore_plugins.core.model.sample_ids import (
    IndexedDataset,
    RecordingBatchSampler,
    loader_batch_size,
    record_sampler_ids,
)
from metastore_plugins.core.training.adapter_support import (
    batch_ids,
    check_item_ids,
    first_loader,
    first_lr,
    loader_datasets,
    patch_attribute,
    silenced,
    strip_index,
)
from metastore_plugins.core.training.facade import FacadeHolder, RunFacade
from metastore_plugins.core.training.settings import CaptureSettings
from metastore_plugins.core.training.settings_doc import with_settings_doc


def _stripping(loaders: str) -> Callable[..., None]:
    """An ``on_<stage>_batch_start`` hook: :func:`strip_index` on the batches of ``trainer.<loaders>``."""

    def hook(
        self: Callback,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        strip_index(getattr(trainer, loaders), batch, dataloader_idx)

    return hook


@with_settings_doc
class MetaStoreCallback(Callback, FacadeHolder):
    """Stores per-sample gradient factors of every training step, checkpoint passes, and reports.

    Args:
        dirpath: the store directory; default ``<trainer.log_dir>/metastore``.
        loss_reduction: how ``training_step``'s loss combines per-sample losses: ``"mean"``
            (default) or ``"sum"``. Undone, with Lightning's division by
            ``accumulate_grad_batches`` and the 16-mixed GradScaler's scale.
        checkpoint_every_n_epochs: checkpoint passes (``epoch-{e}/val``, ``epoch-{e}/train``) at
            the end of every n-th epoch; 0 turns them off.
        {settings}
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        loss_reduction: LossReduction = "mean",
        checkpoint_every_n_epochs: int = 1,
        **settings: Unpack[CaptureSettings],
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"MetaStoreCallback(loss_reduction=...) must be 'mean' or 'sum', got {loss_reduction!r}")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.loss_reduction = loss_reduction
        self.facade = RunFacade(
            "MetaStoreCallback",
            settings,
            every_n=checkpoint_every_n_epochs,
            every_n_setting="checkpoint_every_n_epochs",
        )
        self._ids: Tensor | None = None
        self._sampler: RecordingBatchSampler | None = None
        self._unwatch: Callable[[], None] | None = None  # puts the strategy's process_dataloader back
        self._step = 0
        self._step_lr: float | None = None
        self._restored = False  # load_state_dict ran: this fit resumes from a checkpoint

    # -- setup ---------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None and trainer.logger is None:
            raise ConfigError(
                "MetaStoreCallback needs to know where to put the store: pass dirpath=... to MetaStoreCallback, "
                "or give the Trainer a logger (logger=TensorBoardLogger(...))"
            )
        self.facade.prepare(pl_module, compile_setting="torch.compile (fit the uncompiled LightningModule)")
        if not pl_module.automatic_optimization:
            raise ConfigError(
                f"MetaStoreCallback supports automatic optimization only; {type(pl_module).__name__} sets "
                "automatic_optimization=False"
            )
        self._watch_train_loaders(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "metastore"
        restored, self._restored = self._restored, False  # this fit's restore only
        config = {
            "framework": "lightning",
            "loss_reduction": self.loss_reduction,
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "world_size": trainer.world_size,
            "module": type(pl_module).__name__,
            "seed": self.schedule.seed,
        }
        stepping = trainer.estimated_stepping_batches
        batches = int(stepping * trainer.accumulate_grad_batches) if math.isfinite(stepping) else 0
        per_epoch = trainer.num_training_batches
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 0
        if not epochs and math.isfinite(per_epoch) and per_epoch:
            epochs = -(-batches // int(per_epoch))
        moved = self.facade.open(
            self.dirpath,
            pl_module,
            setting="MetaStoreCallback(dirpath=...)",
            resume="trainer.fit(model, ..., ckpt_path=...)",
            continuing=restored or trainer.global_step > 0,
            step=trainer.global_step,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            agree=lambda decision: trainer.strategy.broadcast(decision, src=0),
            loss_reduction=self.loss_reduction,
            config=config,
            announce=rank_zero_info,
            train_loader=trainer.train_dataloader,
            val_loader=first_loader(trainer.val_dataloaders),
            train_batches=batches,
            train_batch_size=loader_batch_size(trainer.train_dataloader) or 0,
            periods=epochs,
        )
        if moved is not None:
            rank_zero_info(f"MetaStoreCallback: overwrite=True: the earlier store in {self.dirpath} moved to {moved}")
        self._record_sampler(trainer)
        rank_zero_info(self.facade.start_line(self.dirpath, "epoch(s)"))
        if self._sampler is None:  # fail before training when no id can come
            check_item_ids(getattr(trainer.train_dataloader, "dataset", None))
        self._checkpoint_passes(trainer, pl_module, start=True)  # when the schedule makes one: a new run's step 0

    # -- training steps ------------------------------------------------------------------

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record_sampler(trainer)  # Lightning may have reloaded the train dataloader

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        indexed = isinstance(getattr(trainer.train_dataloader, "dataset", None), IndexedDataset)
        self._ids = batch_ids(batch, self._sampler, strip=indexed)
        self._step, self._step_lr = trainer.global_step, _lr(trainer)  # the step this (micro-)batch contributes to
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.facade.begin_step(pl_module, loss_scale=1.0 / trainer.accumulate_grad_batches, grad_scaler=scaler)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.facade.end_backward()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self.facade.optimizer_step(first_lr(optimizer))  # the next checkpoint pass stands for it

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._ids is None:
            return
        accumulate = trainer.accumulate_grad_batches
        loss = outputs.get("loss") if isinstance(outputs, dict) else None  # divided by accumulate for backward
        self.facade.finish_step(
            batch,
            self._ids,
            step=self._step,
            epoch=trainer.current_epoch,
            micro_batch=batch_idx % accumulate,
            lr=self._step_lr,
            output=outputs.get("logits") if isinstance(outputs, dict) and "logits" in outputs else None,
            batch_loss=loss * accumulate if isinstance(loss, Tensor) else None,
        )

    # evaluation batches of an IndexedDataset: its sample ids taken out before the step sees them
    on_validation_batch_start = _stripping("val_dataloaders")
    on_test_batch_start = _stripping("test_dataloaders")
    on_predict_batch_start = _stripping("predict_dataloaders")

    # -- checkpoint passes ---------------------------------------------------------------

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.facade.due(trainer.current_epoch):
            self._checkpoint_passes(trainer, pl_module)
        self.facade.epoch_ended()  # the epoch's steps (and the pass) go to disk without waiting for them

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.facade.checkpoint_saved()  # the store holds every step the checkpoint saw

    def _checkpoint_passes(self, trainer: pl.Trainer, pl_module: pl.LightningModule, start: bool = False) -> None:
        """The epoch-end pass, or (``start``) the pass before the first step."""
        epoch, loaders = trainer.current_epoch, (trainer.train_dataloader, first_loader(trainer.val_dataloaders))
        sizes = [loader_batch_size(loader) or 32 for loader in loaders]
        where: dict[str, Any] = dict(
            train_batch_size=sizes[0],
            val_batch_size=sizes[1],
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            to_device=lambda batch: move_data_to_device(batch, pl_module.device),
            step=trainer.global_step,
            epoch=epoch,
            lr=_lr(trainer),
            context=trainer.precision_plugin.train_step_context,
            attributes={key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1},
        )

        def loss_of(batch: Any, k: int) -> Tensor:
            return _quiet_loss(pl_module, batch, k)

        name = START_PASS if start else f"epoch-{epoch}"
        self.facade.checkpoint_passes(pl_module, *loaders, loss_of, name=name, **where)

    # -- end of fit ----------------------------------------------------------------------

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recompute = self.facade.end()
        self._close()
        trainer.strategy.barrier("metastore-reports")
        if self.dirpath is not None:  # every rank: under DDP each scores its share
            zero = trainer.is_global_zero  # writes; the others' loggers and datasets are not read
            experiments = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)] if zero else []
            datasets = loader_datasets(trainer.train_dataloader, first_loader(trainer.val_dataloaders))
            self.facade.reports(self.dirpath, step=trainer.global_step, rank=trainer.global_rank, datasets=datasets,
                                recompute=recompute, experiments=experiments)  # fmt: skip
        if trainer.is_global_zero and self.dirpath is not None:
            logdirs = [Path(lg.log_dir) for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
            rank_zero_info(self.facade.end_line(self.dirpath, logdirs))

    def tag(self, name: str, **options: Any) -> Any:
        """Tag the current step (or ``steps=(first, last)``) with ``name`` and attributes while training runs;
        ``keep="exact"`` (``"projected"``, ``"norms"``, ``"nothing"``, ``"snapshot"``) sets what those steps keep.
        Before ``fit``, a tag needs ``steps=`` and is written when training starts (it returns None then).

        Example: ``callback.tag("lr-drop", steps=(a, b), keep="exact", reason="plateau")``; see docs/policies.md.
        """
        return self.facade.tag(name, getattr(self, "_step", 0), **options)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(exception)  # what was captured is written; the store's run log names the exception

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    # -- resuming ------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": None if self.dirpath is None else str(self.dirpath),
            "train_indices": self.schedule.train_indices,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = True  # fit(ckpt_path=...): the store of the checkpoint's run is continued
        if state_dict.get("dirpath"):
            self.dirpath = Path(state_dict["dirpath"])
        self.schedule.train_indices = state_dict.get("train_indices")

    # -- helpers -------------------------------------------------------------------------

    def _watch_train_loaders(self, trainer: pl.Trainer) -> None:
        """Put a :class:`RecordingBatchSampler` on every train loader Lightning prepares, before it iterates it.

        The ids of plain datasets are the index lists the train loader's sampler draws, so the
        recorder must be in place before the loader's iterator is made. Lightning 2.6 makes the
        first epoch's iterator (and that of a reloaded loader) in ``FitLoop.setup_data``, before
        any callback hook: installing the recorder in ``on_train_start`` would need a second
        iterator, which draws a new shuffle and a new base seed from torch's global generator, and
        the run would train on other batches than it does without this callback. The one step
        between loading a train loader (``train_dataloader()``, ``DistributedSampler`` injection)
        and iterating it that can be reached is the strategy's public ``process_dataloader``: for
        the length of ``fit`` it is wrapped to install the recorder on the loader it returns. The
        recorder draws nothing itself, so every iterator Lightning makes (worker prefetch
        included) shuffles as it would without it, and none is made twice.
        """
        self._unwatch_train_loaders()
        strategy = trainer.strategy
        process = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            processed = process(dataloader)
            if trainer.training and not isinstance(getattr(processed, "dataset", None), IndexedDataset):
                record_sampler_ids(processed)  # IndexedDataset items carry their ids
            return processed

        self._unwatch = patch_attribute(strategy, "process_dataloader", process_dataloader)  # undone at teardown

    def _unwatch_train_loaders(self) -> None:
        undo, self._unwatch = self._unwatch, None
        if undo is not None:
            undo()

    def _record_sampler(self, trainer: pl.Trainer) -> None:
        """The recorder on the train loader this epoch iterates (:meth:`_watch_train_loaders`), if it has one."""
        batch_sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
        self._sampler = batch_sampler if isinstance(batch_sampler, RecordingBatchSampler) else None

    def _close(self, error: BaseException | None = None) -> None:
        self._unwatch_train_loaders()
        self.facade.close(error)


def _quiet_loss(pl_module: pl.LightningModule, batch: Any, k: int) -> Tensor:
    """The training step's loss of a checkpoint-pass (or recomputed) batch, which must not log."""
    with silenced(pl_module, ("log", "log_dict")):
        output = pl_module.training_step(batch, k)
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise ConfigError("training_step must return the loss (a tensor, or a dict with 'loss') for checkpoint passes")
    return loss


def _lr(trainer: pl.Trainer) -> float | None:
    return first_lr(trainer.optimizers[0] if trainer.optimizers else None)
