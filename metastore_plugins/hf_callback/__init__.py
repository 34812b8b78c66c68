"""``MetaStoreTrainerCallback``: exact per-sample gradients of a Hugging Face ``Trainer`` run, and reports on them.

A thin adapter: it maps ``transformers.TrainerCallback`` events onto the run facade,
:class:`~metastore_plugins.core.training.facade.RunFacade` (open, steps, checkpoint passes, end, reports),
with the sample ids the train loader's sampler draws and the loss scale measured in ``backward``
(:mod:`metastore_plugins.core.training.loss_scale`).

Example::

    from transformers import Trainer
    from metastore_plugins import MetaStoreTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[MetaStoreTrainerCallback()])   # the one extra line
    trainer.train()

See ``docs/hf.md`` for defaults, sample ids, loss scaling and the reports.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import logging as hf_logging
from typing_extensions import Unpack, override

from metastore_plugins.core.errors import SampleIdError
from metastore_plugins.core.model.sample_ids import RecordingBatchSampler, batch_size_of
from metastore_plugins.core.training.adapter_support import (
    PendingStep,
    barrier,
    first_lr,
    from_rank_zero,
    loader_datasets,
    model_loss,
    resumed_batches,
    sampler_recorder,
    to_device,
)
from metastore_plugins.core.training.facade import FacadeHolder, RunFacade
from metastore_plugins.core.training.loss_scale import MeasuredLossScale, batch_weight
from metastore_plugins.core.training.settings import CaptureSettings
from metastore_plugins.core.training.settings_doc import with_settings_doc
from metastore_plugins.hf_callback.trainer_run import report_logdirs, scheduled_evaluations, token_decoder

#: Under transformers' own logger, whose handler and level TrainingArguments(log_level=...) sets, as for the Trainer's
#: "***** Running training *****" (a logger outside it would show nothing without logging.basicConfig).
logger = hf_logging.get_logger(f"transformers.{__name__}")


@with_settings_doc
class MetaStoreTrainerCallback(TrainerCallback, FacadeHolder):
    """Stores per-sample gradient factors of every training micro-batch, checkpoint passes, and reports.

    Args:
        dirpath: the store directory; default ``<args.output_dir>/metastore``.
        checkpoint_every_n_evals: a checkpoint pass at every n-th evaluation during training
            (``epoch-{e}/val`` and ``epoch-{e}/train`` with ``eval_strategy="epoch"``,
            ``step-{global_step}/...`` otherwise); 0 turns them off. Without any evaluation
            during training, one pass runs at the end of training.
        tensorboard_dir: where the TensorBoard reports go; default the directory of the
            Trainer's own TensorBoard writer (``$TENSORBOARD_LOGGING_DIR`` or the newest
            ``<output_dir>/runs/*``).
        {settings}

    ``per_sample_loss`` receives the dict of tensors the model received as its batch, and its
    default reads ``batch["labels"]``: class cross-entropy (sequence classification), or for a language
    model (causal or masked LM, token classification, seq2seq) each sequence's sum of its token losses,
    whose weight in the model's loss (over every token of the batch) is measured at each step and pass.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        checkpoint_every_n_evals: int = 1,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        **settings: Unpack[CaptureSettings],
    ) -> None:
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.facade = RunFacade(
            "MetaStoreTrainerCallback", settings, every_n=checkpoint_every_n_evals,
            every_n_setting="checkpoint_every_n_evals", start_pass=False,  # no eval loader before the first evaluation
        )  # fmt: skip
        self.tensorboard_dir = None if tensorboard_dir is None else Path(tensorboard_dir)
        self.passes: list[str] = []
        self._val_passes = 0
        self._scale = MeasuredLossScale()
        self._sampler: RecordingBatchSampler | None = None
        self._hooks: list[Any] = []
        self._pending: PendingStep | None = None
        self._state: TrainerState | None = None
        self._optimizer: Any = None
        self._epoch = self._micro = self._evals = self._skip = 0
        self._started = 0.0
        self._say = logging.INFO  # the level of the start and end lines (see on_train_begin)

    # -- start ---------------------------------------------------------------------------

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model: nn.Module = kwargs["model"]
        if (
            self.facade.run is not None
        ):  # an earlier train() of this callback raised (the Trainer has no exception event)
            self._close(how="unfinished")
        if self.dirpath is None:
            self.dirpath = Path(args.output_dir or ".") / "metastore"
        # log_level="info" (or "debug") shows them as info, like the Trainer's own lines; by default ("passive",
        # transformers at warning level) they are logged at warning level, so a default run says where its store went
        self._say = logging.INFO if getattr(args, "log_level", "passive") != "passive" else logging.WARNING
        compiled = bool(getattr(args, "torch_compile", False))  # the Trainer compiles the model after this event
        self.facade.prepare(model, compiled=compiled, compile_setting="TrainingArguments(torch_compile=True)",
                            capturable=True)  # fmt: skip
        if self.options.capture_train_steps:
            loader = kwargs.get("train_dataloader")  # accelerate's DataLoaderShard iterates the DataLoader it wraps
            self._sampler = sampler_recorder(getattr(loader, "base_dataloader", loader), self.options.owner)
            skips = not getattr(args, "ignore_data_skip", False)  # a resumed Trainer skips the batches it trained on
            self._skip = resumed_batches(state.global_step, loader, args.gradient_accumulation_steps) if skips else 0
        config = {
            "framework": "transformers",
            "model": type(model).__name__,
            "world_size": args.world_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "seed": self.schedule.seed,
            "loss_scale": "measured from the gradient reaching the model's loss",
        }
        moved = self.facade.open(
            self.dirpath,
            model,
            setting="MetaStoreTrainerCallback(dirpath=...) or TrainingArguments(output_dir=...)",
            resume="trainer.train(resume_from_checkpoint=...)",
            continuing=state.global_step > 0,  # resume_from_checkpoint: the saved state is loaded before this event
            step=state.global_step,
            rank=args.process_index,
            world_size=args.world_size,
            agree=from_rank_zero,
            loss_reduction="mean",
            config=config,
            announce=logger.info if state.is_world_process_zero else None,
            train_loader=kwargs.get("train_dataloader"),
            val_loader=kwargs.get("eval_dataloader"),
            train_batches=int(state.max_steps) * max(1, int(args.gradient_accumulation_steps)),
            train_batch_size=args.per_device_train_batch_size,
            periods=scheduled_evaluations(args, state, kwargs.get("train_dataloader")),
            pass_at_end=True,  # on_train_end runs one when no evaluation made one
        )
        if moved is not None and state.is_world_process_zero:
            logger.log(self._say, f"MetaStoreTrainerCallback: overwrite=True: the earlier store moved to {moved}")
        if state.is_world_process_zero:
            logger.log(self._say, self.facade.start_line(self.dirpath, "evaluation(s)"))
        self._state, self._optimizer, self._started = state, kwargs.get("optimizer"), time.time()
        device = next(model.parameters()).device
        self.facade.start_basis(  # the basis the first evaluation's steps go on (that pass keeps it)
            model, kwargs.get("train_dataloader"), functools.partial(self._pass_loss, model),
            train_batch_size=args.per_device_train_batch_size, rank=args.process_index, world_size=args.world_size,
            to_device=lambda batch: to_device(batch, device), step=state.global_step, epoch=0,
            lr=first_lr(self._optimizer),
        )  # fmt: skip
        self._epoch, self._evals, self.passes = int(state.epoch or 0), 0, []
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    @override
    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._epoch = int(state.epoch or 0)

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._micro = 0

    # -- one micro-batch: forward hooks, then the event after its backward -----------------

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.facade.run is None or self._sampler is None or not module.training or not torch.is_grad_enabled():
            return  # evaluation, prediction and checkpoint passes run in eval mode or without grad
        if self._pending is not None:
            raise SampleIdError(
                f"{type(module).__name__} was called twice in one training micro-batch (a compute_loss override that "
                "runs the model more than once?); each training forward must take one batch the sampler drew, or the "
                "sample ids cannot be known. Pass capture_train_steps=False to keep only the checkpoint passes"
            )
        batch = dict(kwargs) if kwargs else {"input_ids": args[0]} if args else {}
        for _ in range(self._skip):  # drawn by the sampler, then skipped by the Trainer when resuming mid-epoch
            self._sampler.next_ids(None)
        self._skip = 0
        ids = self._sampler.next_ids(batch_size_of(batch))
        step = self._state.global_step if self._state else 0
        self._pending = PendingStep(batch, ids, step, self._micro, self._epoch, first_lr(self._optimizer))
        self._micro += 1
        self.facade.begin_step(module, grad_scaler=self._scale)

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        pending, run = self._pending, self.facade.run
        if pending is None or pending.watched or run is None:
            return
        pending.watched = True
        loss = model_loss(
            output,
            f"{type(module).__name__} returned no loss: MetaStoreTrainerCallback needs the model to compute its "
            "loss from `labels` in the batch. Check the dataset has a label column the Trainer keeps ('label' or "
            "'labels'), and do not set label_smoothing_factor or compute_loss_func (the Trainer then takes the "
            "labels away from the model)",
        )
        weight, size = batch_weight(run, output, pending.batch, loss, pending.batch.get("num_items_in_batch"))
        self._scale.watch(loss, weight, size)

    @override
    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._finish()

    @override
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._finish()
        self.facade.optimizer_step(first_lr(self._optimizer))  # the next checkpoint pass stands for this step

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and self.facade.run is not None:
            pending.finish(self.facade.run)

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.facade.epoch_ended()  # the epoch's steps go to disk without waiting for them

    @override
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.facade.checkpoint_saved()  # the store holds every step the checkpoint saw

    # -- checkpoint passes ---------------------------------------------------------------

    @override
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.facade.run is None:  # an evaluation outside training
            return
        self._evals += 1
        if self.facade.due(self._evals - 1):
            self._checkpoint_pass(args, state, kwargs)

    def _checkpoint_pass(self, args: TrainingArguments, state: TrainerState, kwargs: dict[str, Any]) -> None:
        model: nn.Module = kwargs["model"]
        by_epoch = str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "epoch"
        name = f"epoch-{max(0, math.ceil(state.epoch or 0) - 1)}" if by_epoch else f"step-{state.global_step}"
        device = next(model.parameters()).device
        self._pending = None
        sources = self.facade.checkpoint_passes(
            model,
            kwargs.get("train_dataloader"),
            kwargs.get("eval_dataloader"),
            functools.partial(self._pass_loss, model),
            train_batch_size=args.per_device_train_batch_size,
            val_batch_size=args.per_device_eval_batch_size,
            name=name,
            rank=args.process_index,
            world_size=args.world_size,
            to_device=lambda batch: to_device(batch, device),
            step=state.global_step,
            epoch=self._epoch,
            lr=first_lr(self._optimizer),
            attributes=dict(state.log_history[-1]) if state.log_history else None,
        )
        self.passes.append(name)
        self._val_passes += any(source.split == "val" for source in sources)

    def _pass_loss(self, model: nn.Module, batch: Any, k: int) -> Tensor:
        """The model's loss of a checkpoint-pass batch, rescaled to the mean of its per-sample losses."""
        output = model(**batch)
        loss = model_loss(
            output, f"{type(model).__name__} returned no loss for a checkpoint-pass batch; the batches need `labels`"
        )
        run = self.facade.run
        assert run is not None  # a pass runs while the run is open
        weight, size = batch_weight(run, output, batch, loss)  # a pass's model loss: no num_items_in_batch
        return loss / (weight * size)

    def tag(self, name: str, **options: Any) -> Any:
        """Tag the current step (or ``steps=(first, last)``) while training runs; ``keep=`` sets what those steps
        keep (see :meth:`MetaStoreCallback.tag <metastore_plugins.MetaStoreCallback.tag>`, docs/policies.md).
        Before ``train()``, a tag needs ``steps=`` and is written when training starts (it returns None then)."""
        step = self._state.global_step if self._state else 0
        return self.facade.tag(name, step, **options)

    # -- end of training -----------------------------------------------------------------

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        no_pass = self.facade.run is not None and not self.passes and self.schedule.every_n_epochs > 0
        if no_pass and kwargs.get("train_dataloader") is not None:
            self._checkpoint_pass(args, state, kwargs)  # no evaluation ran during training
        recompute = self.facade.end()
        self._close()
        barrier()
        if self.dirpath is None:
            return
        zero = state.is_world_process_zero  # under DDP every rank scores its share of the reports; rank 0 writes
        if zero and self.passes and not self._val_passes:
            logger.warning(
                "MetaStoreTrainerCallback: no evaluation ran during training (eval_strategy='no'?), so the checkpoint "
                "passes hold no evaluation samples and there is no influence report; set eval_strategy='epoch' (or "
                "'steps') with an eval_dataset to get one"
            )
        logdirs = report_logdirs(args, self.tensorboard_dir, self._started) if zero and self.options.reports else []
        datasets = loader_datasets(kwargs.get("train_dataloader"), kwargs.get("eval_dataloader"))
        self.facade.reports(
            self.dirpath,
            step=state.global_step,
            rank=args.process_index,
            datasets=datasets,
            recompute=recompute,
            logdirs=logdirs,
            decode=token_decoder(kwargs.get("processing_class")),  # the tables show decoded input_ids
        )
        if zero:
            logger.log(self._say, self.facade.end_line(self.dirpath, logdirs))

    def _close(self, how: str | None = None) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._pending = [], None
        self.facade.close(how=how)
