"""The curvature eigenbasis a checkpoint's projected passes are kept on, fitted before they run.

A projected pass keeps ``Q_D^T G_i Q_A``, the top of each layer's K-FAC eigenbasis
(:mod:`~metastore_plugins.core.ops.eigenbasis`), so the basis must be known before the pass's first
record is kept, and train and test passes of one checkpoint must share it. It is fitted on the
first :data:`BASIS_SAMPLES` training samples of the checkpoint, at its weights, in the passes' own
mode: a forward and backward of those samples whose factors only feed the K-FAC sums (nothing is
stored; weights, ``.grad`` and random state are left as they were). Where the pass's training side is those samples
(it holds no more than a fit takes, the allowance's 32-sample passes) and their exact factors fit
:data:`HELD_FIT_BYTES`, the fit and the pass share one forward and backward: the records wait in memory for the basis
fitted on them (:func:`fit_on_pass`). Under ``torch.distributed``
every rank takes its share of the samples and the sums are added, so every rank projects on the
same basis. Measured (docs/quality.md): fitting on 256 samples kept 0.95-1.0 of the LDS a basis of
the whole pass gives; the training steps' factors, at weights that moved through the epoch, gave
0.82-0.93.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, closing, nullcontext
from typing import Any, Literal, Protocol, get_args

import torch
import torch.distributed as dist
from torch import nn

from metastore_plugins.core.model.losses import BatchLoss
from metastore_plugins.core.model.pass_sources import TRAIN_SPLIT, PassSource
from metastore_plugins.core.ops.cost import PASS_BATCH_BYTES
from metastore_plugins.core.ops.curvature import CurvatureSums, LayerSums
from metastore_plugins.core.ops.eigenbasis import fit_bases, fittable
from metastore_plugins.core.policy.runtime import CapturePolicy
from metastore_plugins.core.process_group import group_up, world_size
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.training.run_step import HeldBatch

#: Training samples (over all ranks) the eigenbasis of a checkpoint's passes is fitted on.
BASIS_SAMPLES = 256
#: The most exact factor bytes a rank holds to fit the basis on a pass's own training samples (:func:`fit_on_pass`).
HELD_FIT_BYTES = 2 * PASS_BATCH_BYTES
#: Where a checkpoint's eigenbasis comes from: a fit on its samples, or the training steps' K-FAC sums.
BasisSource = Literal["checkpoint", "steps"]
BASIS_SOURCES: tuple[str, ...] = get_args(BasisSource)


class Capturing(Protocol):
    """What the fit needs of :class:`~metastore_plugins.core.training.run.RunCapture`."""

    policy: CapturePolicy

    def capture_only_steps(
        self,
        model: nn.Module,
        batches: Iterable[tuple[torch.Tensor, Any]],
        loss_of: BatchLoss,
        *,
        capture_point: str,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> Generator[tuple[int, torch.Tensor, Any], None, None]: ...

    def factors_read(self) -> list[LayerRecord]: ...

    def hold(self, batch: Any, sample_ids: torch.Tensor) -> HeldBatch: ...


def training_source(sources: Sequence[PassSource]) -> PassSource | None:
    """The pass source the basis is fitted on: the ``"train"`` split, else the first."""
    return next((s for s in sources if s.split == TRAIN_SPLIT), sources[0] if sources else None)


def fit_pass_bases(
    run: Capturing,
    model: nn.Module,
    source: PassSource,
    loss_of: BatchLoss,
    *,
    rank: int,
    world: int,
    to_device: Callable[[Any], Any],
    step: int,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    samples: int = BASIS_SAMPLES,
    planning: bool = False,
    for_passes: bool = False,
) -> None:
    """Fit the eigenbasis of the passes at ``step`` on ``source``'s first ``samples`` and give it to the policy.

    ``planning``: the run may have no plan yet (the pass before the first step): the first batch makes it, and
    nothing more is fitted unless it projects a layer of the passes or the steps (``for_passes``: of the passes,
    which will then be the steps' test side on it)."""
    sums, seen, share = CurvatureSums(torch.float32), 0, -(-samples // max(1, world))  # top eigenvectors only
    batches = ((ids, to_device(batch)) for ids, batch in source.batches(rank, world))
    steps = run.capture_only_steps(model, batches, loss_of, capture_point=f"basis/{source.split}", context=context)
    with closing(steps):  # at "basis/<split>": a pass's plan
        for _, ids, _ in steps:
            records = run.factors_read()
            if planning and not seen and not projects(run.policy, records, passes_only=for_passes):
                return  # every layer exact: no basis to fit
            sums.add(fittable(records))  # the batch's factors are let go before the next forward
            seen += len(ids)
            if seen >= share:
                break
    fit_from_sums(run.policy, sums, step)


def fits_on_pass(policy: CapturePolicy, source: PassSource, samples: int, world: int) -> bool:
    """Whether the basis can be fitted on the pass's own training side ``source`` (:func:`fit_on_pass`): a fit would
    take all its samples (no more than the fit's ``samples``) and a rank's share of their exact factors stays within
    :data:`HELD_FIT_BYTES`."""
    share = -(-source.samples // max(1, world))
    held = share * policy.factor_sample_bytes
    return policy.plan is not None and 0 < source.samples <= samples and 0 < held <= HELD_FIT_BYTES


def fit_on_pass(
    run: Capturing,
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, Any]],
    loss_of: BatchLoss,
    *,
    capture_point: str,
    step: int,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> list[HeldBatch]:
    """Fit the passes' eigenbasis at ``step`` on a pass's training ``batches`` and return their records, to keep
    once it is known: one forward and backward of those samples instead of two (:func:`fit_pass_bases`'s, then the
    pass's). Where :func:`fits_on_pass` says so, the same samples, sums and basis as :func:`fit_pass_bases`."""
    sums, held = CurvatureSums(torch.float32), []
    steps = run.capture_only_steps(model, batches, loss_of, capture_point=capture_point, context=context)
    with closing(steps):
        for _, ids, batch in steps:
            held.append(run.hold(batch, ids))
            sums.add(fittable([held[-1].scaling(record) for record in held[-1].records]))
    fit_from_sums(run.policy, sums, step)
    return held


def keeps_basis(policy: CapturePolicy, source: PassSource, samples: int) -> bool:
    """Whether the last planned pass keeps the latest eigenbasis instead of fitting its own.

    No training step is kept on a basis fitted there, so its fit would serve only the pass's own records on
    ``source``; where those are no more than the fit's ``samples``, the fit costs more than what it serves. The
    steps since the previous pass are on the latest basis, so the pass's validation records are on their basis too.
    """
    return bool(policy.bases) and policy.at_last_pass() and source.samples <= samples


def projects(policy: CapturePolicy, records: Sequence[LayerRecord], passes_only: bool = False) -> bool:
    """Whether the plan (made from ``records`` when none is yet) projects a layer of the passes (or the steps)."""
    policy.plan_for(records)
    return policy.projects_passes() or (not passes_only and policy.projects_steps())


def fit_from_sums(policy: CapturePolicy, sums: CurvatureSums, step: int) -> None:
    """Fit the eigenbasis of the passes at ``step`` (and of the steps after them) on K-FAC ``sums`` (a fit's, or the
    training steps': :class:`~metastore_plugins.core.training.step_basis.StepSums`), every rank's added, at the size
    the passes keep now (a lowered rung's), and give it to the policy."""
    _add_over_ranks(sums)
    if policy.plan is not None and sums.layers:
        policy.set_bases(fit_bases(sums, policy.pass_k(), step), step)


def _add_over_ranks(sums: CurvatureSums) -> None:
    """Add every rank's sums (in place), so that every rank fits the same basis.

    The ranks first agree on the layers and shapes (a rank that saw no batch of a layer adds zeros),
    then add each tensor in one order; under NCCL the tensors travel through this rank's GPU.
    """
    if not group_up() or world_size() == 1:
        return
    names = ("inputs", "outputs", "dense")
    mine = {layer: {n: tuple(getattr(s, n).shape) for n in names if getattr(s, n) is not None}
            for layer, s in sums.layers.items()}  # fmt: skip
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, (mine, {layer: (s.params, s.layout) for layer, s in sums.layers.items()}))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    for layer in sorted({layer for shapes, _ in everyone for layer in shapes}):
        params, layout = next(heads[layer] for _, heads in everyone if layer in heads)
        layer_sums = sums.layers.setdefault(layer, LayerSums(dict(params), layout=layout))
        shapes = next(shapes[layer] for shapes, _ in everyone if layer in shapes)
        for name in names:
            if name not in shapes:
                continue
            tensor = getattr(layer_sums, name)
            tensor = torch.zeros(shapes[name], dtype=sums.dtype) if tensor is None else tensor
            moved = tensor.to(device) if device is not None else tensor
            dist.all_reduce(moved)
            setattr(layer_sums, name, moved.to(tensor.device))
        counts = torch.tensor([layer_sums.rows, layer_sums.factored_samples, layer_sums.dense_samples],
                              dtype=torch.float64, device=device)  # fmt: skip
        dist.all_reduce(counts)
        layer_sums.rows, layer_sums.factored_samples, layer_sums.dense_samples = (int(c) for c in counts.tolist())
