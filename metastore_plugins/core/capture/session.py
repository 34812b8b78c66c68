"""``CaptureSession``: hooks a model and collects exact per-sample gradient factors.

Example::

    with CaptureSession(model, loss_reduction="mean") as session:
        loss = loss_fn(model(x), y)          # mean over the batch of per-sample losses
        loss.backward()
        grads = session.per_sample_gradients()  # {parameter name: (B, *param.shape)}
        records = session.factors()              # per-layer records for the store

How the session hooks the model's modules (the walk, the rules, what is reported) is its base,
:class:`~metastore_plugins.core.capture.module_hooks.ModuleHooks`.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, get_args

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from metastore_plugins.core.capture.autograd_graph import nodes_reaching
from metastore_plugins.core.capture.batch_mixing import batch_mixed_message, parameters_below, uses_batch_statistics
from metastore_plugins.core.capture.context import SessionLink
from metastore_plugins.core.capture.layers.generic import output_tensors
from metastore_plugins.core.capture.module_hooks import ModuleHooks
from metastore_plugins.core.capture.registry import RecordsFn, first_input
from metastore_plugins.core.errors import ConfigError, StateError, UnsupportedLayerError
from metastore_plugins.core.records import LayerRecord, restore_all

LossReduction = Literal["mean", "sum"]
UnsupportedPolicy = Literal["warn", "error", "skip"]
UNSUPPORTED_POLICIES: tuple[str, ...] = get_args(UnsupportedPolicy)


class _GradScalerLike(Protocol):
    def get_scale(self) -> float: ...


_ATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class CaptureSession(ModuleHooks):
    """Owns the hooks that turn back-propagation into per-sample gradient factors.

    Args:
        model: the model to hook. Parameter names are ``model.named_parameters()`` names.
        loss_reduction: how the loss combines per-sample losses: ``"mean"`` (divided by
            the batch size B, undone by multiplying by B) or ``"sum"``.
        loss_scale: a constant the loss was multiplied by before ``backward`` (for
            example ``1 / accumulation_steps``); divided out.
        grad_scaler: a ``torch.amp.GradScaler`` whose scale is divided out. Read the
            factors before ``scaler.update()`` changes the scale.
        unsupported: what to do with trainable parameters no rule covers (or that cannot be
            captured exactly): ``"warn"`` once per module, ``"error"``, or ``"skip"`` silently.
            They are listed by :meth:`uncaptured_parameters` in every case. The same policy reports
            parameters below a BatchNorm that uses batch statistics (:meth:`batch_mixed_parameters`).
        batch_dims: module path -> dimension that indexes samples in its inputs, for
            modules fed ``(T, B, ...)`` tensors. Applies to the module and its children.
            Children of ``nn.Transformer``, ``nn.TransformerEncoder``/``Decoder`` and their
            layers with ``batch_first=False`` are detected without it.
        modules: capture only modules whose path starts with one of these (all by default).
        generic: capture the own parameters of modules without a registered rule by the generic
            rule (a per-sample ``vmap`` of the module, :mod:`~metastore_plugins.core.capture.layers.generic`;
            listed by :meth:`generic_parameters`). ``False``: report them at attach instead.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: LossReduction = "mean",
        loss_scale: float = 1.0,
        grad_scaler: _GradScalerLike | None = None,
        unsupported: UnsupportedPolicy = "warn",
        batch_dims: Mapping[str, int] | None = None,
        modules: Sequence[str] | None = None,
        generic: bool = True,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if unsupported not in UNSUPPORTED_POLICIES:
            raise ConfigError(f"unsupported must be 'warn', 'error' or 'skip', got {unsupported!r}")
        if isinstance(modules, str):
            raise ConfigError(
                f"modules must be a list of module paths, got the string {modules!r}; write [{modules!r}]"
            )
        self.model = model
        self.loss_reduction = loss_reduction
        self.loss_scale: float = 1.0
        self.grad_scaler: _GradScalerLike | None = None
        self.rescale(loss_scale, grad_scaler)
        self.unsupported = unsupported
        self.batch_dims = dict(batch_dims or {})
        self.modules = tuple(modules) if modules is not None else None
        self.generic = generic
        self._handles: list[RemovableHandle] = []
        self._records: list[LayerRecord] = []
        self._uncaptured: dict[str, None] = {}
        self._generic: dict[str, None] = {}  # parameters hooked by the generic rule
        self._hooked: set[str] = set()  # parameters some rule captures
        self._mixed: dict[str, str] = {}  # parameter -> the BatchNorm that mixed it, since attach
        self._mixed_now: dict[str, str] = {}  # the same, for the forwards since the last reset()
        self._norms_now: set[str] = set()  # BatchNorms that used batch statistics since the last reset()
        self._below: dict[str, list[str]] = {}  # BatchNorm path -> hooked parameters below it (graph walked once)
        self._reported: set[str] = set()
        self._attached = False
        self._paused = False
        self._in_records = False
        self._after_forward: list[Callable[[list[Tensor]], None]] = []
        #: layers whose records will only be summarized (projected, norms): their factors keep zero rows
        self.summarized_layers: frozenset[str] = frozenset()
        #: the coming backward is for capture alone (:meth:`backward`): the hooked tensors are kept for it
        self.capture_only = False
        self._grad_targets: dict[int, Tensor] = {}  # id -> hooked output, this step (capture_only)
        self._hooked_nodes: list[Any] = []  # autograd nodes hooked this step (capture_only)
        self._link = SessionLink(
            self._collect,
            lambda layer: layer not in self.summarized_layers,
            lambda callback: self._after_forward.append(callback),
            self._handles.append,
            self._report_unsupported,
            self._wants_grad,
        )

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> CaptureSession:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach(self) -> None:
        """Hook every covered module of the model."""
        if self._attached or self.model in _ATTACHED:
            raise StateError(
                f"a CaptureSession is already attached to this {type(self.model).__name__}; "
                "close it (leave its `with` block) before starting another"
            )
        known = {path for path, _ in self.model.named_modules()}
        for argument, paths in (("modules", self.modules or ()), ("batch_dims", self.batch_dims)):
            unknown = sorted(set(paths) - known)
            if unknown:
                raise ConfigError(
                    f"{argument} names modules that {type(self.model).__name__} does not have: {unknown}; "
                    "use paths from model.named_modules()"
                )
        _ATTACHED.add(self.model)
        self._attached = True
        try:
            self._hook_modules()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove every hook; records already collected stay readable."""
        try:
            for handle in self._handles:
                handle.remove()
        finally:
            self._handles.clear()
            self._after_forward.clear()
            if self._attached:
                _ATTACHED.discard(self.model)
                self._attached = False

    def reset(self) -> None:
        """Forget the records collected so far (call between optimizer steps)."""
        self._records.clear()
        self._grad_targets, self._hooked_nodes = {}, []
        self._mixed_now.clear()
        self._norms_now.clear()

    def pause(self) -> None:
        """Stop collecting while staying attached: forward passes until :meth:`resume` cost nothing.

        Cheaper than closing and attaching again for every step of a training loop.
        """
        self._paused = True

    def resume(self) -> None:
        """Collect again after :meth:`pause`."""
        self._paused = False

    def rescale(self, loss_scale: float = 1.0, grad_scaler: _GradScalerLike | None = None) -> None:
        """Set the constant and the ``GradScaler`` divided out of the records (as in the constructor)."""
        try:
            scale = float(loss_scale)
        except (TypeError, ValueError):
            scale = math.nan
        if not math.isfinite(scale) or scale == 0:
            raise ConfigError(
                "loss_scale must be a finite non-zero number (the factor the loss was multiplied by), "
                f"got {loss_scale!r}"
            )
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise ConfigError(
                f"grad_scaler must have a get_scale() method (a torch.amp.GradScaler), got {grad_scaler!r}"
            )
        self.loss_scale, self.grad_scaler = scale, grad_scaler

    def backward(self, loss: Tensor) -> None:
        """The backward of a forward run for capture alone (``capture_only``): the gradients the hooks read, no more.

        ``torch.autograd.grad(loss, hooked outputs)`` instead of ``loss.backward()``: the weight-gradient
        products of every layer (a third of a Linear layer's forward and backward) and the parameters'
        ``.grad`` are never computed. Hooks on autograd nodes (attention, recurrent, broadcast embedding
        rules) fire only on nodes such a backward runs: those from which a hooked output is reached
        (:func:`nodes_reaching`); if some hooked node is not one of them, or outside ``capture_only``,
        it is ``loss.backward()``.
        """
        tensors, nodes = self._grad_targets, self._hooked_nodes
        self._grad_targets, self._hooked_nodes = {}, []
        if not self.capture_only or not tensors or loss.grad_fn is None:
            loss.backward()
            return
        if nodes:
            reached = nodes_reaching(loss.grad_fn, {t.grad_fn for t in tensors.values() if t.grad_fn is not None})
            if not all(node in reached for node in nodes):
                loss.backward()
                return
        torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)

    # -- results ---------------------------------------------------------------------

    def factors(self, scaled: bool = True) -> list[LayerRecord]:
        """Records since the last :meth:`reset`, scaled to gradients of each sample's own loss.

        ``scaled=False``: as the backward left them; :meth:`scaling` turns them (or anything derived
        from them linearly, such as their projections) into per-sample loss gradients later.
        """
        return [self.scaling()(record) for record in self._records] if scaled else list(self._records)

    def scaling(self) -> Callable[[LayerRecord], LayerRecord]:
        """What turns a record of this backward into one of per-sample losses (the scale read now)."""
        scale = self.loss_scale * (self.grad_scaler.get_scale() if self.grad_scaler is not None else 1.0)
        per_sample = self.loss_reduction == "mean"
        return lambda record: record.scale((record.batch_size if per_sample else 1.0) / scale)

    def per_sample_gradients(self) -> dict[str, Tensor]:
        """Parameter name -> ``(B, *param.shape)``: each sample's own loss gradient."""
        records = self.factors()
        sizes = {record.batch_size for record in records}
        if len(sizes) > 1:
            by_layer = ", ".join(sorted({f"{r.layer or '<root>'}: {r.batch_size}" for r in records}))
            raise StateError(
                f"layers saw different batch sizes ({by_layer}); either reset() between batches or "
                "pass batch_dims={module path: dim} for modules fed sequence-first tensors"
            )
        return restore_all(records)

    def uncaptured_parameters(self) -> list[str]:
        """Names of trainable parameters whose per-sample gradients are not captured."""
        return list(self._uncaptured)

    def batch_mixed_parameters(self) -> dict[str, str]:
        """Parameter -> the BatchNorm above it that used batch statistics in a captured forward.

        Their gradients in such forwards are not per sample (see
        :mod:`~metastore_plugins.core.capture.batch_mixing`): those records are dropped.
        """
        return dict(self._mixed)

    def generic_parameters(self) -> list[str]:
        """Names of trainable parameters captured by the generic rule (where a specific rule would be faster)."""
        return [name for name in self._generic if name not in self._uncaptured]

    # -- internals -------------------------------------------------------------------

    def _collect(self, records: RecordsFn, grad: Tensor, params: Mapping[str, str] | None = None) -> None:
        if not self._attached:  # gradients reaching a closed session are not collected
            return
        mixed = self._mixed_now
        if mixed and params and all(name in mixed for name in params.values()):
            return  # not per sample in this forward: not computed
        self._in_records = True  # a rule that re-runs its module (capture_with_vmap) must not re-hook it
        try:
            collected = records(grad)
        finally:
            self._in_records = False
        if not mixed:
            self._records.extend(collected)
            return
        for record in collected:
            names = list(record.params.values())
            norm = next((mixed[name] for name in names if name in mixed), None)
            if norm is None:
                self._records.append(record)
            else:  # dropped whole: its other parameters are named too
                self._mixed.update({name: self._mixed.get(name, norm) for name in names})

    def _batch_norm_called(
        self, path: str, canonical: dict[int, str], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Mark the captured parameters below a BatchNorm that normalizes with batch statistics (walked once)."""
        if not self._attached or self._paused or self._in_records or not uses_batch_statistics(module):
            return
        below = self._below.get(path)
        if below is None:
            x = first_input(args, kwargs)
            if x.grad_fn is None:  # nothing below it requires grad (in this call)
                return
            found = set(parameters_below(x, canonical))
            below = self._below[path] = [n for n in canonical.values() if n in found and n in self._hooked]
        if not below or (path in self._norms_now and self.unsupported != "error"):
            return  # nothing below it, or marked already since the last reset()
        self._norms_now.add(path)
        self._mixed_now.update({name: path for name in below if name not in self._mixed_now})
        new = [name for name in below if name not in self._mixed]
        self._mixed.update(dict.fromkeys(new, path))
        if self.unsupported == "error" or (self.unsupported == "warn" and new):
            message = batch_mixed_message(path or "<root>", type(module).__name__, new or below)
            if self.unsupported == "error":
                raise UnsupportedLayerError(message)
            warnings.warn(message, stacklevel=3)

    def _model_forward_done(self, model: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Run the callbacks rules deferred until the whole graph of this forward exists."""
        if self._in_records:
            return
        callbacks, self._after_forward = self._after_forward, []
        if self._attached:
            outputs = output_tensors(output)
            for callback in callbacks:
                callback(outputs)

    def _wants_grad(self, target: Any) -> None:
        """Keep a hooked output tensor or autograd node for :meth:`backward` (``capture_only`` steps only)."""
        if not self.capture_only or self._paused:
            return
        if isinstance(target, Tensor):
            self._grad_targets[id(target)] = target
        else:
            self._hooked_nodes.append(target)

    def _report_unsupported(self, where: str, message: str, params: list[str]) -> None:
        for name in params:
            self._uncaptured[name] = None
        if self.unsupported == "error":
            raise UnsupportedLayerError(message)
        if self.unsupported == "warn" and where not in self._reported:
            self._reported.add(where)
            warnings.warn(message, stacklevel=3)
