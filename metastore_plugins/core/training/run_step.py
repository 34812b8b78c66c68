"""One training step's capture: hook the model, read the backward's factors, queue the step's records.

:class:`StepCapture` is :class:`~metastore_plugins.core.training.run.RunCapture`'s base: its methods run
one step (``begin_step``, the backward, ``end_backward``, ``finish_step``) on the state the run's
constructor sets.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import ConfigError, LossScaleError
from metastore_plugins.core.model.losses import (
    BatchLoss,
    DefaultPerSampleLoss,
    LabelsFn,
    PerSampleLossFn,
    logits_of,
    margins_of,
    predictions_of,
)
from metastore_plugins.core.model.rng import preserved_rng, weights_untouched
from metastore_plugins.core.policy.runtime import CapturePolicy
from metastore_plugins.core.records import BatchMeta
from metastore_plugins.core.store.writing.writer import StoreWriter
from metastore_plugins.core.training.loss_scale import check_loss_reduction, gradients_finite
from metastore_plugins.core.training.step_basis import StepSums


class Outcome(NamedTuple):
    """What a batch's forward gave besides its gradients, in :class:`~metastore_plugins.core.records.BatchMeta`'s
    order: labels, per-sample losses, predictions, margins."""

    labels: Tensor
    losses: Tensor
    predictions: Tensor | None
    margins: Tensor | None


class HeldBatch(NamedTuple):
    """A captured batch not yet kept: its sample ids, exact records (unscaled), their scaling and its outcome."""

    sample_ids: Tensor
    records: list[LayerRecord]
    scaling: Callable[[LayerRecord], LayerRecord]
    outcome: Outcome


class StepCapture:
    """The training-step half of :class:`~metastore_plugins.core.training.run.RunCapture` (its state is the
    run's, set in its constructor)."""

    loss_reduction: LossReduction
    per_sample_loss: PerSampleLossFn | None
    default_loss: DefaultPerSampleLoss  # used where per_sample_loss is None
    labels: LabelsFn
    session_options: dict[str, Any]
    writer: StoreWriter
    policy: CapturePolicy
    owner: str
    skipped_steps: int
    _session: CaptureSession | None
    _output_hook: Any
    _collecting: bool
    _output: Any
    _records: list[LayerRecord] | None
    _scaling: Callable[[LayerRecord], LayerRecord]
    _reduction_checked: bool
    step_sums: StepSums | None  # the steps' K-FAC sums, where the eigenbasis is fitted from them
    announce_at_first_step: Callable[[], None] | None  # the plan made in the start pass, said at the first step

    def begin_step(
        self,
        model: nn.Module,
        *,
        loss_scale: float = 1.0,
        grad_scaler: Any = None,
        capture_point: str = "train",
        capture_only: bool = False,
    ) -> None:
        """Collect the coming forward and backward of ``model`` at ``capture_point`` (dropping any step left open).

        The model is hooked once and stays hooked (paused between steps) until :meth:`close`.
        ``capture_only``: the backward will be :meth:`backward` (a checkpoint pass, a basis fit).
        """
        self.abort_step()
        if self._session is None or self._session.model is not model:
            self._close_session()
            self._session = CaptureSession(model, loss_reduction=self.loss_reduction, **self.session_options)
            self._session.attach()
            self._output_hook = model.register_forward_hook(self._keep_output)
        self._session.rescale(loss_scale, grad_scaler)
        self._session.summarized_layers = self.policy.summarized(capture_point)
        self._session.capture_only = capture_only
        self._session.resume()
        self._collecting = True

    def capture_only_steps(
        self,
        model: nn.Module,
        batches: Iterable[tuple[Tensor, Any]],
        loss_of: BatchLoss,
        *,
        capture_point: str,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> Generator[tuple[int, Tensor, Any], None, None]:
        """Forward and backward of each ``(ids, batch)`` for capture alone (a checkpoint pass, a basis fit), yielding
        ``(k, ids, batch)`` after each backward for the caller to read; weights, ``.grad``, mode and the global random
        state are left as they were (close the generator, :func:`contextlib.closing`, to restore them on a break)."""
        with weights_untouched(model), preserved_rng():
            try:
                for k, (ids, batch) in enumerate(batches):
                    self.begin_step(model, capture_point=capture_point, capture_only=True)
                    with torch.enable_grad(), context():
                        loss = loss_of(batch, k)
                    self.backward(loss)
                    yield k, ids, batch
            finally:
                self.abort_step()

    def backward(self, loss: Tensor) -> None:
        """The backward of a ``capture_only`` step: the gradients capture reads, no parameter's ``.grad``
        (:meth:`~metastore_plugins.core.capture.session.CaptureSession.backward`)."""
        if self._session is None:
            loss.backward()
        else:
            self._session.backward(loss)

    def end_backward(self) -> None:
        """Read the factors of the backward just done (before a GradScaler updates its scale)."""
        if self._session is not None and self._collecting:
            records = self._session.factors(scaled=False)  # scaled once kept: projections are cheaper to scale
            overflowed = self._session.grad_scaler is not None and not gradients_finite(records)
            self.skipped_steps += overflowed  # the GradScaler skips this step too: nothing is stored
            self._records, self._scaling = None if overflowed else records, self._session.scaling()
            self._pause()

    def factors_read(self) -> list[LayerRecord]:
        """The records of the backward just done, scaled to per-sample losses, kept nowhere (a basis fit)."""
        self.end_backward()
        records, self._records = self._records or [], None
        return [self._scaling(record) for record in records]

    def finish_step(
        self,
        batch: Any,
        sample_ids: Tensor,
        *,
        step: int,
        capture_point: str = "train",
        epoch: int = 0,
        micro_batch: int = 0,
        lr: float | None = None,
        output: Any = None,
        batch_loss: Tensor | None = None,
    ) -> None:
        """Queue the step's records with ids, labels, per-sample losses and predictions.

        ``batch_loss``: the loss the training step returned (before any division for
        accumulation). The first one given is checked against ``loss_reduction`` of the
        per-sample losses (:func:`~metastore_plugins.core.training.loss_scale.check_loss_reduction`):
        a wrong setting raises before anything is stored; a loss that is no mean or sum of
        them (label smoothing, a regulariser) cannot be checked, which is said once.
        """
        self._pause()
        records, self._records = self._records, None
        forward_output = self._output if output is None else output
        self._output = None
        if records is None:  # no backward happened (a skipped step)
            return
        outcome = self.outcome(forward_output, batch)
        if capture_point == "train" and self.announce_at_first_step is not None:  # train-mode layers now known
            announce, self.announce_at_first_step = self.announce_at_first_step, None
            announce()
        if self.step_sums is not None and capture_point == "train":  # the next checkpoint's basis (basis_from)
            self.step_sums.add(records, self._scaling, step * 1009 + micro_batch)
        if batch_loss is not None and not self._reduction_checked:
            self._reduction_checked = True
            try:
                check_loss_reduction(batch_loss.detach().cpu(), outcome.losses, self.loss_reduction, self.owner)
            except LossScaleError as exc:
                warnings.warn(f"{self.owner}: the loss reduction cannot be checked ({exc})", stacklevel=3)
        self.keep(HeldBatch(sample_ids, records, self._scaling, outcome), step=step, capture_point=capture_point,
                  epoch=epoch, micro_batch=micro_batch, lr=lr)  # fmt: skip

    def hold(self, batch: Any, sample_ids: Tensor) -> HeldBatch:
        """The records and outcome of the backward just done, to :meth:`keep` later (a pass whose basis is fitted on
        its own samples: :func:`~metastore_plugins.core.training.basis_fit.fit_on_pass`; a capture-only backward has
        no GradScaler, so none is skipped)."""
        self.end_backward()
        records, output, self._records, self._output = self._records or [], self._output, None, None
        return HeldBatch(sample_ids, records, self._scaling, self.outcome(output, batch))

    def keep(
        self, held: HeldBatch, *, step: int, capture_point: str, epoch: int, micro_batch: int, lr: float | None
    ) -> None:
        """Queue a batch's records as the plan keeps them at ``capture_point`` (projected on the bases it holds now)."""
        kept = self.policy.apply(held.records, capture_point=capture_point, step=step)
        if kept is None:  # the budget is spent
            return
        at = BatchMeta(held.sample_ids, step, capture_point, epoch, micro_batch, *held.outcome, lr)
        self.writer.write([held.scaling(record) for record in kept], at)

    def outcome(self, output: Any, batch: Any) -> Outcome:
        """A batch's labels, per-sample losses, predictions and margins, from the forward's output."""
        labels, losses = self.losses(output, batch)
        logits = logits_of(output)
        return Outcome(labels, losses, predictions_of(logits), margins_of(logits, labels))

    def abort_step(self) -> None:
        """Forget an unfinished step (the model stays hooked, paused)."""
        self._pause()
        self._records, self._output = None, None

    def losses(self, output: Any, batch: Any) -> tuple[Tensor, Tensor]:
        """Labels and per-sample losses of a batch, checked to hold one value per sample."""
        labels = torch.as_tensor(self.labels(batch)).detach()
        if self.per_sample_loss is not None:
            losses = self.per_sample_loss(output, batch)
        elif output is None:
            raise ConfigError(
                "no forward output was seen for this batch (the step did not call the module itself), so the default "
                "per-sample loss cannot be computed; pass per_sample_loss=callable(output, batch) -> (B,)"
            )
        else:
            losses = self.default_loss(output, labels)
        losses = torch.as_tensor(losses).detach().float().reshape(-1)
        if losses.shape[0] != labels.reshape(len(labels), -1).shape[0]:
            raise ConfigError(
                f"per_sample_loss returned {losses.shape[0]} values for {len(labels)} samples; return one per sample"
            )
        return labels.cpu(), losses.cpu()

    def _keep_output(self, module: nn.Module, args: Any, output: Any) -> None:
        # the first call that completes: Lightning's DDP runs the whole training_step through an outer
        # forward call of the module, which completes after the step's own call
        if self._collecting and self._output is None:
            self._output = output

    def _pause(self) -> None:
        self._collecting = False
        if self._session is not None:
            self._session.pause()
            self._session.reset()

    def _close_session(self) -> None:
        try:
            if self._session is not None:
                self._session.close()
        finally:
            self._session = None
            if self._output_hook is not None:
                self._output_hook.remove()
                self._output_hook = None
