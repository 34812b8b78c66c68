"""What a capture rule sees of its session: the context of one hooked module, and which dimension holds samples.

A rule reaches its session only through :class:`ModuleContext` (the
:class:`~metastore_plugins.core.capture.registry.LayerContext` protocol), and the context reaches
it only through the callables of a :class:`SessionLink`: rules never touch the session itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from metastore_plugins.core.capture.registry import RecordsFn, move_batch_first


@dataclass(frozen=True)
class SessionLink:
    """The session's side of every module context.

    Attributes:
        collect: ``(records, grad, params)``: run ``records(grad)`` (``grad`` batch first) and keep the records.
        packs_rows: whether a layer's factors drop their zero rows (not when they will only be summarized).
        defer: run a callback with the model's output tensors once its whole forward graph exists.
        track: remove a hook handle when the session closes.
        report: ``(where, message, parameter names)``: those parameters are not captured, by the session's policy.
        wants_grad: a tensor whose gradient a hook reads, or an autograd node a hook waits for (what a
            capture-only backward must reach: :meth:`~metastore_plugins.core.capture.session.CaptureSession.backward`).
    """

    collect: Callable[[RecordsFn, Tensor, Mapping[str, str]], None]
    packs_rows: Callable[[str], bool]
    defer: Callable[[Callable[[list[Tensor]], None]], None]
    track: Callable[[RemovableHandle], None]
    report: Callable[[str, str, list[str]], None]
    wants_grad: Callable[[Any], None]


class ModuleContext:
    """The :class:`~metastore_plugins.core.capture.registry.LayerContext` of one hooked module."""

    def __init__(self, link: SessionLink, name: str, batch_dim: int, params: dict[str, str]) -> None:
        self._link = link
        self.name = name
        self.batch_dim = batch_dim
        self._params = params

    @property
    def pack_rows(self) -> bool:
        return self._link.packs_rows(self.name)

    def param_names(self, module: nn.Module) -> dict[str, str]:
        return self._params

    def batch_first(self, tensor: Tensor) -> Tensor:
        return move_batch_first(tensor, self.batch_dim)

    def on_output_grad(self, output: Tensor, records: RecordsFn) -> None:
        if isinstance(output, Tensor) and output.requires_grad:
            batch_dim, collect = self.batch_dim, self._link.collect
            output.register_hook(lambda grad: collect(records, move_batch_first(grad, batch_dim), self._params))
            self._link.wants_grad(output)

    def on_node_grad(self, node: Any, records: RecordsFn) -> None:
        node.register_prehook(lambda grads: self._link.collect(records, grads[0], self._params))
        self._link.wants_grad(node)

    def after_model_forward(self, callback: Callable[[list[Tensor]], None]) -> None:
        self._link.defer(callback)

    def track(self, handle: RemovableHandle) -> None:
        self._link.track(handle)

    def unsupported(self, message: str, params: Sequence[str] | None = None) -> None:
        """Report that this call cannot be captured exactly; its parameters become uncaptured."""
        names = [self._params[p] for p in params if p in self._params] if params is not None else self._params.values()
        self._link.report(self.name, message, list(names))


def sequence_first(module: nn.Module) -> bool:
    """Whether a built-in transformer container feeds its children ``(T, B, ...)`` tensors."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not module.self_attn.batch_first
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):  # e.g. its final `norm`
        return len(module.layers) > 0 and not module.layers[0].self_attn.batch_first
    if isinstance(module, nn.Transformer):
        return not module.batch_first
    return False


def batch_dim_of(path: str, ancestors: list[nn.Module], batch_dims: Mapping[str, int]) -> int:
    """The dimension holding samples in the inputs of module ``path``: the longest ``batch_dims`` prefix's,
    else 1 below a sequence-first transformer container, else 0."""
    for prefix in sorted(batch_dims, key=len, reverse=True):
        if path == prefix or path.startswith(prefix + ".") or prefix == "":
            return batch_dims[prefix]
    return 1 if any(sequence_first(m) for m in ancestors) else 0


def missed_parameters(path: str, module: nn.Module, names: list[str], has_rule: bool) -> tuple[list[str], str]:
    """The full names of parameters ``names`` of ``module`` no rule captures, and the message that says so.

    ``has_rule``: the module's rule leaves them out (e.g. MHA ``bias_k``); else no rule knows the module.
    """
    full = [f"{path}.{name}" if path else name for name in names]
    where, listed = f"'{path or '<root>'}' ({type(module).__name__})", ", ".join(full)
    if has_rule:
        return full, (
            f"the capture rule for {where} does not cover {listed}: their per-sample gradients are not captured. "
            "Freeze them, register a rule that covers them, or pass unsupported='skip' to accept it."
        )
    return full, (
        f"no capture rule for module {where}: per-sample gradients of {listed} are not captured. Register one "
        "with metastore_plugins.core.capture.register_capture, freeze these parameters, or pass "
        "unsupported='skip' to accept it."
    )
