"""What the framework adapters share beside their event mapping: a run's start and end, the step in flight, loaders.

The callbacks (``lightning_callback``, ``hf_callback``) translate their framework's events; the
framework-free pieces both need, or that would otherwise be spelled inside one adapter, live here:
claiming the store directory and opening the run (:func:`open_run`), the end-of-training reports
(:func:`run_end`, :func:`end_reports`), the training micro-batch between its forward and the event
after its backward (:class:`PendingStep`), sample ids of batches and samplers, the learning rate of an
optimizer, a trainer's loaders and datasets, a decision of rank 0 on every rank, and the model methods
a checkpoint pass silences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import torch
from torch import Tensor
from torch.utils.data import IterableDataset
from typing_extensions import Unpack

from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import CompiledModelError, ConfigError, SampleIdError
from metastore_plugins.core.model.rng import preserved_rng
from metastore_plugins.core.model.sample_ids import (
    SAMPLE_ID_KEYS,
    IndexedDataset,
    RecordingBatchSampler,
    batch_size_of,
    missing_ids_error,
    record_sampler_ids,
    take_sample_ids,
)
from metastore_plugins.core.process_group import group_up
from metastore_plugins.core.reports.files import RenderFn
from metastore_plugins.core.reports.render import dataset_lookup
from metastore_plugins.core.training.report_pass import ReportResult, build_reports
from metastore_plugins.core.training.run import RunCapture
from metastore_plugins.core.training.run_start import Decision, claim_store_dir, create_store_dir
from metastore_plugins.core.training.settings import CallbackOptions

T = TypeVar("T")


@dataclass
class PendingStep:
    """A training micro-batch between its forward and the event after its backward: what its records are stored with.

    ``watched``: the forward's loss was seen (the loss scale measured from it, once per micro-batch).
    """

    batch: Any
    ids: Tensor  # (B,) dataset indices
    step: int
    micro_batch: int
    epoch: int
    lr: float | None
    watched: bool = False

    def finish(self, run: RunCapture) -> None:
        """End the backward of ``run``'s step and queue its records with this batch's ids and metadata."""
        run.end_backward()
        run.finish_step(
            self.batch, self.ids, step=self.step, epoch=self.epoch, micro_batch=self.micro_batch, lr=self.lr
        )


class RunStart(TypedDict):
    """How a callback's run starts on this rank: :meth:`~.settings.CallbackOptions.run_capture`'s keywords."""

    rank: int
    world_size: int
    loss_reduction: LossReduction
    config: dict[str, Any]
    announce: Callable[[str], None] | None
    early_tags: list[tuple[str, dict[str, Any]]]


def open_run(
    options: CallbackOptions,
    dirpath: Path,
    *,
    setting: str,
    resume: str,
    continuing: bool,
    step: int,
    agree: Callable[[Decision], Decision],
    **start: Unpack[RunStart],
) -> tuple[RunCapture, Path | None]:
    """Claim ``dirpath`` for this run (:func:`~.run_start.claim_store_dir`) and open the run's capture on this rank.

    ``setting`` names ``dirpath`` where it cannot be written; ``resume`` says how the trainer resumes, for the
    error when ``dirpath`` holds another run's store. Returns the run, and where an earlier store moved
    (``overwrite=True``) or ``None``.
    """
    moved = claim_store_dir(
        dirpath,
        continuing=continuing,
        overwrite=options.overwrite,
        owner=options.owner,
        resume=resume,
        step=step,
        rank=start["rank"],
        agree=agree,
    )
    create_store_dir(dirpath, setting)  # after rank 0's decision: it may have moved the directory aside
    return options.run_capture(dirpath, start_step=step, **start), moved


def run_end(run: RunCapture | None) -> tuple[RecomputeFn | None, dict[str, float]]:
    """What the reports take from a run that ends: its exact recomputation (``None``: no pass) and its
    :attr:`~.run.RunCapture.seconds`; read before the run is closed."""
    return (run.recomputer(), run.seconds) if run is not None else (None, {})


def end_reports(
    options: CallbackOptions,
    dirpath: Path,
    writers: Sequence[Any],
    *,
    step: int,
    rank: int,
    datasets: Mapping[str, Any],
    recompute: RecomputeFn | None = None,
    render: RenderFn | None = None,
) -> ReportResult | None:
    """The end-of-training reports (:func:`~.report_pass.build_reports`), on every rank; rank 0 draws the
    samples of ``datasets`` (split -> dataset) where they are small images."""
    samples = dataset_lookup(datasets) if rank == 0 else None  # figures where samples are small images
    return build_reports(
        options, dirpath, writers, step=step, rank=rank, render=render, samples=samples, recompute=recompute
    )


def refuse_compiled(model: torch.nn.Module, compiled: bool, owner: str, setting: str) -> None:
    """Raise :class:`CompiledModelError` naming ``setting`` when ``compiled`` or ``model`` (or a module in it) was
    compiled (``torch.compile(module)``, ``module.compile()``, Lightning's ``from_compiled``): the capture's
    forward and tensor hooks are not run exactly inside a compiled graph, so training stops before its first step
    rather than part way through."""
    inside = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if hasattr(module, "_orig_mod")  # torch.compile(module): an OptimizedModule
        or getattr(module, "_compiled_call_impl", None) is not None  # module.compile()
        or getattr(module, "_compiler_ctx", None) is not None  # Lightning's from_compiled(torch.compile(module))
    ]
    if compiled or inside:
        where = f" ({', '.join(inside[:3])} compiled)" if inside else ""
        raise CompiledModelError(
            f"{owner} cannot capture per-sample gradients of a compiled model{where}: its hooks do not run exactly "
            f"inside a torch.compile graph. Train without {setting}, or keep {owner} for an uncompiled run"
        )


def first_lr(optimizer: Any) -> float | None:
    """The learning rate of ``optimizer``'s first parameter group (``None`` without an optimizer)."""
    return float(optimizer.param_groups[0]["lr"]) if optimizer is not None and optimizer.param_groups else None


def first_loader(loaders: Any) -> Any:
    """The first of a list or tuple of loaders, or ``loaders`` itself (a single loader, or ``None``)."""
    return loaders[0] if isinstance(loaders, (list, tuple)) and loaders else loaders


def loader_datasets(train_loader: Any, val_loader: Any) -> dict[str, Any]:
    """The report splits' datasets, ``{"train": ..., "val": ...}``, of a trainer's train and evaluation loaders."""
    return {"train": getattr(train_loader, "dataset", None), "val": getattr(val_loader, "dataset", None)}


def strip_index(loaders: Any, batch: Any, dataloader_idx: int) -> None:
    """Remove what an :class:`IndexedDataset` added to ``batch`` of loader ``dataloader_idx``, so that evaluation
    steps see the dataset's own items."""
    loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
    if isinstance(getattr(loader, "dataset", None), IndexedDataset):
        take_sample_ids(batch, strip=True)


def batch_ids(batch: Any, sampler: RecordingBatchSampler | None, *, strip: bool) -> Tensor:
    """The ``(B,)`` sample ids of a training ``batch``, on the CPU: those it carries (taken out with ``strip``: an
    :class:`IndexedDataset` added them), else the next ones ``sampler`` drew; ``SampleIdError`` without either."""
    ids = take_sample_ids(batch, strip=strip)
    drawn = sampler.next_ids(batch_size_of(batch)) if sampler is not None else None
    found = ids if ids is not None else drawn
    if found is None:
        raise missing_ids_error("training")
    return found.detach().cpu()


def sampler_recorder(loader: Any, owner: str) -> RecordingBatchSampler:
    """The recorder of the sample ids ``loader``'s sampler draws (:func:`~.sample_ids.record_sampler_ids`), or a
    ``SampleIdError`` naming the fix when the loader has none that can be read."""
    recorder = record_sampler_ids(loader)
    if recorder is None:
        raise SampleIdError(
            f"{owner} reads the dataset index of every training sample from the train "
            "loader's sampler, and this loader has none it can read (an IterableDataset, or "
            "dataloader_in_order=False); use a map-style dataset, or pass capture_train_steps=False"
        )
    return recorder


def check_item_ids(dataset: Any) -> None:
    """Raise before training when the items of a plain map-style ``dataset`` carry no sample id.

    Only where no sampler records the ids: an :class:`IndexedDataset` adds them and an iterable
    dataset is not read ahead. Reading item 0 may draw (augmentation): the global generators are restored.
    """
    if isinstance(dataset, (IndexedDataset, IterableDataset)) or not hasattr(dataset, "__len__"):
        return
    with preserved_rng():
        first = dataset[0]
    if not (isinstance(first, Mapping) and any(key in first for key in SAMPLE_ID_KEYS)):
        raise missing_ids_error("training")


def from_rank_zero(decision: T) -> T:
    """Rank 0's ``decision`` on every rank of the default process group (itself without one)."""
    if not group_up():
        return decision
    box = [decision]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank of the default process group (nothing without one)."""
    if group_up():
        torch.distributed.barrier()


def to_device(batch: T, device: torch.device) -> T:
    """A dict batch with its tensors on ``device`` (other values, and other batches, as they are)."""
    if isinstance(batch, Mapping):
        return {key: value.to(device) if isinstance(value, Tensor) else value for key, value in batch.items()}  # type: ignore[return-value]
    return batch


def model_loss(output: Any, missing: str) -> Tensor:
    """The ``loss`` of a model's output (``output["loss"]`` or ``output.loss``); a ``ValueError`` saying ``missing``
    (what the model needs to compute one) when it holds none."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, Tensor):
        raise ConfigError(missing)
    return loss


def resumed_batches(global_step: int, loader: Any, accumulation: int) -> int:
    """Micro-batches of ``loader`` a trainer resumed at ``global_step`` skips at the start of its epoch (its sampler
    still draws them): ``(global_step mod updates per epoch) * accumulation``, with
    ``updates per epoch = ceil(len(loader) / accumulation)``; 0 at step 0 or for a loader without a length."""
    if not global_step or not hasattr(loader, "__len__"):
        return 0
    accumulation = max(1, int(accumulation))
    updates_per_epoch = max(1, -(-len(loader) // accumulation))
    return (global_step % updates_per_epoch) * accumulation


def newest_event_dir(runs: Path, since: float) -> Path | None:
    """The most recently changed folder of ``runs`` holding a TensorBoard event file written at ``since`` - 60 s or
    later (a trainer's own writer, created when training started), or ``None``."""
    found = [
        d
        for d in runs.glob("*")
        if d.is_dir() and any(f.stat().st_mtime >= since - 60 for f in d.glob("events.out.tfevents.*"))
    ]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def patch_attribute(obj: object, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.name = value`` as an instance attribute; returns what undoes it (the instance's own earlier value
    again, or the class's showing through)."""
    own = vars(obj).get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)

    return undo


@contextmanager
def silenced(obj: object, names: Sequence[str]) -> Iterator[None]:
    """Within the block, instance attributes that do nothing hide ``obj``'s methods ``names`` (a model's logging
    during a checkpoint pass); the class's methods show through again after it."""
    for name in names:
        setattr(obj, name, _nothing)
    try:
        yield
    finally:
        for name in names:
            delattr(obj, name)


def _nothing(*args: Any, **kwargs: Any) -> None:
    """Stands in for a silenced method."""


__all__ = [
    "PendingStep",
    "RunStart",
    "barrier",
    "batch_ids",
    "check_item_ids",
    "end_reports",
    "first_loader",
    "first_lr",
    "from_rank_zero",
    "loader_datasets",
    "model_loss",
    "newest_event_dir",
    "open_run",
    "patch_attribute",
    "refuse_compiled",
    "resumed_batches",
    "run_end",
    "sampler_recorder",
    "silenced",
    "strip_index",
    "to_device",
]
