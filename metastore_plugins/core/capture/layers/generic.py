"""The generic rule: dense per-sample gradients of any module's own parameters by ``torch.func``.

For a module ``f`` with own parameters ``theta`` (its children's parameters and all buffers held
constant), sample ``i``'s inputs ``x_i`` and the gradient ``delta_i`` of the loss with respect to
sample ``i``'s output, the per-sample gradient is a vector-Jacobian product::

    g_i = J_theta f(x_i; theta)^T delta_i        # (*theta.shape), one per sample

It is computed in backward, once ``delta`` is known, by re-running the module on a batch of one
for every sample at once: ``vmap`` over ``vjp(theta -> functional_call(f, theta, x_i))``. This is
exact whenever ``f``'s output for sample ``i`` depends only on sample ``i``'s inputs, and costs
about one more forward and backward of the module (in fp32).

The session uses it for every module that owns trainable parameters and has no registered rule
(``CaptureSession(generic=True)``, the default); ``capture_with_vmap`` registers it for norms.
What it cannot capture exactly is reported (``ctx.unsupported``), never silently wrong:

- a child BatchNorm that normalizes with batch statistics (training mode): samples are mixed;
- a child Dropout with ``p > 0`` in training mode: the recomputation would draw other masks;
- an output that is not per sample (no batch dimension, e.g. a model that returns its loss);
- a forward ``vmap`` cannot run (``.item()``, Python control flow on tensor values, random ops);
- a forward whose output, recomputed one sample at a time, differs from the batched one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from metastore_plugins.core.capture.build import as_computed
from metastore_plugins.core.capture.registry import CaptureRule, LayerContext, RecordsFn
from metastore_plugins.core.errors import NotPerSampleError
from metastore_plugins.core.records import LayerRecord, dense_record

#: How far the output recomputed one sample at a time may be from the batched one (relative to its
#: largest entry) before the module is reported: loose enough for rounding, tight for mixed samples.
RECOMPUTE_TOLERANCE = 1e-3


def _not_exact(layer: str, module: nn.Module, reason: str, params: Mapping[str, str], fix: str = "") -> str:
    """The report of a module the generic rule cannot capture exactly: where, why, and what to do."""
    return (
        f"per-sample gradients of '{layer or '<root>'}' ({type(module).__name__}) cannot be captured exactly by "
        f"re-running it one sample at a time (the generic rule): {reason}. Its parameters "
        f"{', '.join(params.values())} are not captured; {fix}register a specific rule with "
        "metastore_plugins.core.capture.register_capture, freeze them, or pass unsupported='skip' to accept it."
    )


def generic_rule(module: nn.Module) -> CaptureRule | None:
    """The generic rule for ``module``'s own trainable parameters (None when it owns none)."""
    own = tuple(name for name, param in module.named_parameters(recurse=False) if param.requires_grad)
    return CaptureRule(type(module), capture_generic, own) if own else None


def output_tensors(value: Any) -> list[Tensor]:
    """The tensors of a module output (tensor, tuple, list, dict or ``ModelOutput``), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in output_tensors(item)]
    return []


def capture_generic(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> None:
    """Hook body of the generic rule: one vjp per output tensor that carries the batch and requires grad.

    Several such outputs are handled one at a time (the vjp is linear in the output gradients:
    their records add up to the gradient of the loss through all of them).
    """
    outputs = output_tensors(output)
    differentiable = [k for k, t in enumerate(outputs) if t.requires_grad]
    if not differentiable:
        return
    dim = ctx.batch_dim
    batch = outputs[differentiable[0]].shape[dim] if outputs[differentiable[0]].dim() > dim else 0
    reason = mixing_reason(module) or _output_reason(outputs, differentiable, dim, batch)
    leaves, spec = tree_flatten((args, kwargs))
    batched = [k for k, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and _has_batch(leaf, dim, batch)]
    if reason is None and not batched:
        reason = f"none of its tensor inputs has the batch dimension (size {batch} at dim {dim}) of its output"
    if reason is not None:
        ctx.unsupported(_not_exact(ctx.name, module, reason, ctx.param_names(module), "fix that, or "))
        return
    call = ModuleCall(module, leaves, spec, batched, dim)
    params = ctx.param_names(module)
    for k in differentiable:
        ctx.on_output_grad(outputs[k], _records_fn(call, ctx, params, k, outputs[k]))


def _records_fn(call: ModuleCall, ctx: LayerContext, params: dict[str, str], k: int, output: Tensor) -> RecordsFn:
    """The gradient callback of output tensor ``k``, which keeps the output to check the recomputation."""
    saved, version, tolerance = output.detach(), output._version, recompute_tolerance(output)

    def records(grad: Tensor) -> list[LayerRecord]:  # grad: (B, ...) batch first
        check = (saved, tolerance) if saved._version == version else None  # not if modified in place since
        return generic_records(call, ctx, params, k, grad, check)

    return records


def mixing_reason(module: nn.Module) -> str | None:
    """Why ``module`` (or a descendant) makes a sample's output depend on other samples or on chance."""
    for path, child in module.named_modules():
        where = f"its child '{path}' ({type(child).__name__})" if path else f"it ({type(child).__name__})"
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and (child.training or child.running_mean is None):
            return (
                f"{where} normalizes with batch statistics (training mode, or no running statistics), so one "
                "sample's gradient depends on the whole batch (no per-sample gradient exists); call .eval() on it "
                "or use GroupNorm/LayerNorm"
            )
        if isinstance(child, nn.modules.dropout._DropoutNd) and child.training and child.p > 0:
            return (
                f"{where} is a dropout with p={child.p} in training mode, and re-running the module would draw "
                "other masks; set its p to 0 or call .eval() on it"
            )
    return None


def _output_reason(outputs: list[Tensor], differentiable: list[int], dim: int, batch: int) -> str | None:
    """Why the differentiable outputs are not per sample (None when each has the batch at ``dim``)."""
    shapes = [tuple(outputs[k].shape) for k in differentiable]
    if batch == 0 or any(not _has_batch(outputs[k], dim, batch) for k in differentiable):
        return (
            f"its output is not per sample (differentiable tensors of shapes {shapes}, expected the batch size at "
            f"dim {dim} of each): a model returning its loss, say. Compute the loss outside the module, or move "
            "these parameters into a submodule whose output is per sample"
        )
    return None


def recompute_tolerance(output: Tensor) -> float:
    """How far, relative to its largest entry, ``output`` may be from its fp32 recomputation: rounding only.

    :data:`RECOMPUTE_TOLERANCE`, or 32 unit roundoffs of the output's dtype or of autocast's, if coarser.
    """
    dtype = output.dtype
    if torch.is_autocast_enabled(output.device.type):
        dtype = max(dtype, torch.get_autocast_dtype(output.device.type), key=lambda d: torch.finfo(d).eps)
    return max(RECOMPUTE_TOLERANCE, 16 * torch.finfo(dtype).eps)


def _has_batch(tensor: Tensor, dim: int, batch: int) -> bool:
    return tensor.dim() > dim and tensor.shape[dim] == batch


class ModuleCall:
    """One call of a module, to re-run it one sample at a time: the batched inputs, and all the others.

    Tensor inputs whose dimension ``dim`` has the batch size are split into samples; every other
    argument (tensors without the batch dimension, numbers, ``None``, caches) is passed as it was.
    """

    def __init__(self, module: nn.Module, leaves: list[Any], spec: Any, batched: list[int], dim: int) -> None:
        self.module, self.spec, self.batched, self.dim = module, spec, batched, dim
        self.inputs = [move_to_front(leaves[k].detach(), dim) for k in batched]  # each (B, ...)
        self.constants = [None if k in batched else _detached_fp32(leaf) for k, leaf in enumerate(leaves)]

    def arguments(self, samples: Sequence[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of a batch of one, from one sample of each batched input."""
        leaves = list(self.constants)
        for k, sample in zip(self.batched, samples):
            leaves[k] = sample.unsqueeze(self.dim)  # (..., 1 at dim, ...)
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs


def move_to_front(tensor: Tensor, dim: int) -> Tensor:
    return tensor if dim == 0 else torch.movedim(tensor, dim, 0)


def _detached_fp32(value: Any) -> Any:
    """Tensors detached and, if floating, in fp32 (the recomputation runs in fp32); anything else as it is."""
    if not isinstance(value, Tensor):
        return value
    return value.detach().float() if value.is_floating_point() else value.detach()


def per_sample_vjp(
    call: ModuleCall, params: Mapping[str, str], output_index: int, grad_output: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """``g_i = J_theta f(x_i)^T delta_i`` for every sample ``i``, and the recomputed outputs.

    Args:
        call: the module call to re-run (its own parameters ``theta`` are the roles of ``params``).
        params: local role -> model name of the parameters to differentiate.
        output_index: which tensor of the module's output ``delta`` is the gradient of.
        grad_output: ``delta``, batch first ``(B, ...)``.

    Returns:
        role -> ``(B, *param_shape)`` fp32 per-sample gradients, and the ``(B, ...)`` recomputed output.
        The module runs in fp32 with autocast off, on the inputs as it read them (:func:`as_computed`).
    """
    module, dim = call.module, call.dim
    own = {role: as_computed(module.get_parameter(role).detach(), torch.float32) for role in params}
    state = {  # children's parameters and all buffers: constants (buffers copied: a re-run must not update them)
        **{name: _detached_fp32(p) for name, p in module.named_parameters(remove_duplicate=False) if name not in own},
        **{name: _detached_fp32(b).clone() for name, b in module.named_buffers(remove_duplicate=False)},
    }

    def one_sample(samples: list[Tensor], grad_i: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        args, kwargs = call.arguments(samples)

        def forward(theta: dict[str, Tensor]) -> Tensor:
            out = functional_call(module, {**state, **theta}, args, kwargs, strict=False, tie_weights=False)
            return output_tensors(out)[output_index]  # (..., 1 at dim, ...)

        out_i, pullback = vjp(forward, own)[:2]  # (..., 1 at dim, ...), the vector-Jacobian product
        cotangent = grad_i.unsqueeze(dim)  # (..., 1 at dim, ...)
        if out_i.shape != cotangent.shape:
            raise NotPerSampleError(
                f"a batch of one gives an output of shape {tuple(out_i.shape)}, not {tuple(cotangent.shape)}"
            )
        (grads,) = pullback(cotangent.to(out_i.dtype))
        return grads, out_i.squeeze(dim)

    computed_in = grad_output.dtype
    inputs = [as_computed(x, computed_in) for x in call.inputs]  # each (B, ...), fp32 when floating
    with torch.enable_grad(), torch.autocast(grad_output.device.type, enabled=False):
        return vmap(one_sample)(inputs, as_computed(grad_output, computed_in))


def generic_records(
    call: ModuleCall,
    ctx: LayerContext,
    params: dict[str, str],
    output_index: int,
    grad_output: Tensor,
    check: tuple[Tensor, float] | None = None,
) -> list[LayerRecord]:
    """The dense record of :func:`per_sample_vjp`, or ``[]`` after reporting why it cannot be exact.

    ``check``: the module's batched output and a relative tolerance (:func:`recompute_tolerance`), to
    compare with the recomputed output: a difference means samples were mixed or randomness drawn.
    """
    module = call.module
    try:
        grads, recomputed = per_sample_vjp(call, params, output_index, grad_output)
    except NotPerSampleError as exc:
        ctx.unsupported(_not_exact(ctx.name, module, f"its output is not per sample ({exc})", params))
        return []
    except Exception as exc:  # noqa: BLE001  (vmap's failures have many types; each is reported)
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        reason = (
            f"torch.func.vmap cannot run its forward ({error}); it may call .item(), branch on tensor values or "
            "draw random numbers"
        )
        ctx.unsupported(_not_exact(ctx.name, module, reason, params))
        return []
    if check is not None:
        expected = move_to_front(check[0], call.dim).float()  # (B, ...)
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        difference = float((recomputed - expected).abs().max()) if expected.shape == recomputed.shape else float("inf")
        if not difference <= check[1] * scale:
            reason = (
                f"re-run one sample at a time, it gives another output than the batched forward (largest "
                f"difference {difference:.3g}, largest entry {scale:.3g}): a sample's output depends on other "
                "samples or on chance"
            )
            ctx.unsupported(_not_exact(ctx.name, module, reason, params))
            return []
    return [dense_record(ctx.name, grads, params)]


def generic_rule_lines(names: Sequence[str], shown: int = 4) -> list[str]:
    """The capture summary's line naming parameters captured by the generic rule (none when there are none)."""
    if not names:
        return []
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return [
        f"  generic rule (a per-sample vmap of the module; a specific rule would be faster) for {len(names)} "
        f"parameter{'s' * (len(names) != 1)}: {', '.join(names[:shown])}{more}"
    ]
