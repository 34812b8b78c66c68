"""The table of capture rules, keyed by module type.

A capture rule says which of a module's own parameters it covers and how to hook
the module. Its ``forward`` function is called from a forward hook with a
:class:`LayerContext`; it registers gradient callbacks through the context, and
those callbacks emit :class:`~metastore_plugins.core.records.LayerRecord`.

Register a rule for your own layer with :func:`register_capture`::

    @register_capture(MyLinear, params=("weight", "bias"))
    def capture_my_linear(module, args, kwargs, output, ctx):
        x = ctx.batch_first(args[0]).detach()                        # (B, ..., d_in)
        ctx.on_output_grad(output, lambda grad: [outer_record(...)])  # grad: (B, ..., d_out)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from metastore_plugins.core.errors import ConfigTypeError
from metastore_plugins.core.records import LayerRecord

RecordsFn = Callable[[Tensor], list[LayerRecord]]


class LayerContext(Protocol):
    """What a capture rule sees of the session for one module."""

    @property
    def name(self) -> str:
        """Module path in ``model.named_modules()``."""
        ...

    @property
    def batch_dim(self) -> int:
        """Dimension of the module's inputs and outputs that indexes samples."""
        ...

    @property
    def pack_rows(self) -> bool:
        """Whether factor records should drop their zero rows: False for a layer the run only summarizes."""
        ...

    def param_names(self, module: nn.Module) -> dict[str, str]:
        """Local parameter name -> model parameter name, for the captured parameters."""
        ...

    def batch_first(self, tensor: Tensor) -> Tensor:
        """``tensor`` with its sample dimension moved to the front."""
        ...

    def on_output_grad(self, output: Tensor, records: RecordsFn) -> None:
        """Call ``records(grad of output, batch first)`` in backward and keep what it returns."""
        ...

    def on_node_grad(self, node: Any, records: RecordsFn) -> None:
        """Call ``records(grad of node's first output)`` when autograd reaches ``node``."""
        ...

    def after_model_forward(self, callback: Callable[[list[Tensor]], None]) -> None:
        """Call ``callback(tensors of the model's output)`` once the model's forward returns.

        For rules that need the part of the autograd graph built after their module ran.
        """
        ...

    def track(self, handle: RemovableHandle) -> None:
        """Remove ``handle`` when the session closes."""
        ...

    def unsupported(self, message: str, params: Sequence[str] | None = None) -> None:
        """Report that this call cannot be captured exactly (raises, warns or skips per policy).

        ``params`` (local names) limits the report to some of the module's parameters; all by default.
        """
        ...


#: A rule's hook body; what it returns other than None replaces the module's output (as a forward hook's would).
ForwardFn = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any, LayerContext], Any]


@dataclass(frozen=True)
class CaptureRule:
    """How to capture one module type.

    Attributes:
        module_type: the ``nn.Module`` subclass (or its qualified name) the rule applies to,
            and to its subclasses.
        forward: called after every forward of a matching module while capture is on.
        params: local names of the parameters the rule covers (those present are captured).
        covers_children: the rule also covers the parameters of the module's children
            (they are then not hooked on their own), e.g. ``nn.MultiheadAttention.out_proj``.
    """

    module_type: type[nn.Module] | str
    forward: ForwardFn
    params: tuple[str, ...]
    covers_children: bool = False


ModuleKey = type[nn.Module] | str

_RULES: dict[ModuleKey, CaptureRule] = {}


def _qualified_name(klass: type) -> str:
    return f"{klass.__module__}.{klass.__qualname__}"


def register_capture(
    *module_types: ModuleKey, params: Sequence[str] = ("weight", "bias"), covers_children: bool = False
) -> Callable[[ForwardFn], ForwardFn]:
    """Decorator registering ``forward`` as the capture rule of ``module_types``.

    A type may also be named by its qualified name (``"transformers.pytorch_utils.Conv1D"``)
    so that optional libraries need not be imported. A later registration for the same
    type replaces the earlier one, so users can override the built-in rules.
    """

    def decorate(forward: ForwardFn) -> ForwardFn:
        for module_type in module_types:
            if not (
                isinstance(module_type, str) or (isinstance(module_type, type) and issubclass(module_type, nn.Module))
            ):
                raise ConfigTypeError(
                    f"register_capture expects nn.Module subclasses or qualified names, got {module_type!r}"
                )
            _RULES[module_type] = CaptureRule(module_type, forward, tuple(params), covers_children)
        return forward

    return decorate


def unregister_capture(module_type: ModuleKey) -> None:
    """Remove the rule registered for exactly ``module_type`` (no error if none)."""
    _RULES.pop(module_type, None)


def find_rule(module: nn.Module) -> CaptureRule | None:
    """The rule of the most specific registered type in ``type(module)``'s MRO."""
    for klass in type(module).__mro__:
        rule = _RULES.get(klass) or _RULES.get(_qualified_name(klass))
        if rule is not None:
            return rule
    return None


def registered_types() -> list[ModuleKey]:
    """Module types that have a capture rule."""
    return list(_RULES)


def move_batch_first(tensor: Tensor, batch_dim: int) -> Tensor:
    """``tensor`` with dimension ``batch_dim`` moved to the front."""
    return tensor if batch_dim == 0 else torch.movedim(tensor, batch_dim, 0)


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """The module's first input, whether passed by position or by keyword."""
    if args:
        return args[0]
    for value in kwargs.values():
        if isinstance(value, Tensor):
            return value
    raise ConfigTypeError("the module was called without a tensor input")
