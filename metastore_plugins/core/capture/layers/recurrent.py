"""``nn.RNN`` (tanh, relu), ``nn.LSTM`` (``proj_size`` too) and ``nn.GRU``: every weight, exactly.

A recurrent weight is applied at every step, so its per-sample gradient is a sum over the
sample's own steps of outer products: a Linear over the sequence. With ``δg_t`` ``(G H,)`` the
gradient of the gate pre-activations at step ``t`` of one layer and direction:

- ``grad W_ih_i = Σ_t δg_t ⊗ x_t``, ``grad b_ih_i = Σ_t δg_t`` (``x_t`` the layer's input);
- ``grad W_hh_i = Σ_t δh̃_t ⊗ h_{t-1}``, ``grad b_hh_i = Σ_t δh̃_t``, where ``δh̃_t`` is the
  gradient of ``h_{t-1} W_hh^T + b_hh``: ``δg_t`` for RNN and LSTM, and for GRU, whose hidden
  side of the new gate is scaled by the reset gate (``n = tanh(x_n + r ⊙ (W_hn h + b_hn))``),
  ``[δr_t, δz_t, δn_t ⊙ r_t]``;
- LSTM ``proj_size``: ``grad W_hr_i = Σ_t δh_t ⊗ m_t``, ``m_t = σ(o_t) tanh(c_t)`` the state
  before projection and ``δh_t`` the whole gradient of the projected ``h_t``.

So each is one ``"outer"`` record (:func:`~.linear.linear_records`): prefix ``(B, T, d_in)``,
suffix ``(B, T, G H)``, records ``<path>.ih_l<k>[_reverse]``, ``.hh_l<k>[_reverse]``,
``.hr_l<k>[_reverse]``. Steps past a packed sequence's end have a zero suffix and are dropped.

The fused kernels do not expose ``δg``: the rule re-runs the module's forward unrolled over time
with its own parameters (:mod:`.unrolled`), hooks the input-side gates of each layer and direction
(one tensor ``(N, G H)`` whose gradient is ``δg`` at every step) and returns the unrolled result
in place of the fused one, with the module's own structure (tensor or ``PackedSequence``, ``h_n``
or ``(h_n, c_n)``). Backward then runs through the unrolled graph: ``.grad`` is the same up to
rounding. Between layers in training the unrolled forward draws its own dropout masks. Under
autocast its input and states take the dtype of the fused kernel's output and its matmuls autocast's
dtype: it returns the fused kernel's dtypes, within a few of their roundings. With ``torch.no_grad`` (or a paused
session) the fused result stands. The module's own ``batch_first`` (and packed or unbatched input) gives
the layout: ``batch_dims`` does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from metastore_plugins.core.capture.layers.linear import linear_records, part_name
from metastore_plugins.core.capture.layers.unrolled import (
    DirectionRun,
    Steps,
    direction_suffix,
    packed_steps,
    unrolled_forward,
)
from metastore_plugins.core.capture.registry import LayerContext, RecordsFn, register_capture
from metastore_plugins.core.records import LayerRecord, RecordHead

#: layers covered: the rule must name its parameters when it registers (deeper ones are reported at attach)
MAX_LAYERS = 64
#: record part -> its (weight, bias) parameter kinds
PARTS: dict[str, tuple[str, str | None]] = {
    "ih": ("weight_ih", "bias_ih"),
    "hh": ("weight_hh", "bias_hh"),
    "hr": ("weight_hr", None),
}


def parameter_names(layers: int = MAX_LAYERS) -> tuple[str, ...]:
    """Every parameter name of an ``nn.RNNBase`` of up to ``layers`` layers, both directions."""
    kinds = [kind for pair in PARTS.values() for kind in pair if kind is not None]
    return tuple(f"{kind}_l{k}{direction_suffix(d)}" for k in range(layers) for d in (0, 1) for kind in kinds)


@dataclass(frozen=True)
class Sequences:
    """The module's input as time-major rows, and the way back to its own layout."""

    rows: Tensor  # (N, d_in)
    steps: Steps
    packed: PackedSequence | None
    batched: bool
    batch_first: bool

    def output(self, rows: Tensor) -> Tensor | PackedSequence:
        """``(N, D P)`` rows as the module returns its output."""
        if self.packed is not None:
            packed = self.packed
            return PackedSequence(rows, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
        out = rows.view(self.steps.length, self.steps.batch, rows.shape[-1])  # (T, B, D P)
        if not self.batched:
            return out.squeeze(1)  # (T, D P)
        return out.transpose(0, 1).contiguous() if self.batch_first else out

    def state_in(self, state: Tensor) -> Tensor:
        """A user's ``h0``/``c0`` ``(L D, [B,] d)`` -> ``(L D, B, d)`` with sequences in row order (longest first)."""
        state = state if self.batched else state.unsqueeze(1)
        order = self.packed.sorted_indices if self.packed is not None else None
        return state if order is None else state.index_select(1, order)

    def state_out(self, state: Tensor) -> Tensor:
        """``(L D, B, d)`` in row order -> ``h_n``/``c_n`` as the module returns them."""
        order = self.packed.unsorted_indices if self.packed is not None else None
        state = state if order is None else state.index_select(1, order)
        return state if self.batched else state.squeeze(1)


def as_sequences(module: nn.RNNBase, x: Tensor | PackedSequence, dtype: torch.dtype) -> Sequences:
    """The module's input (packed, ``(B, T, d)``/``(T, B, d)``, or one sequence ``(T, d)``) as rows in ``dtype``."""
    if isinstance(x, PackedSequence):
        steps = packed_steps(x.batch_sizes, x.sorted_indices, x.data.device)
        return Sequences(x.data.to(dtype), steps, x, True, module.batch_first)
    batched = x.dim() == 3
    time_major = x.transpose(0, 1) if batched and module.batch_first else x if batched else x.unsqueeze(1)
    length, batch = time_major.shape[:2]
    rows = time_major.reshape(length * batch, time_major.shape[-1]).to(dtype)  # (T B, d_in)
    return Sequences(rows, Steps((batch,) * length), None, batched, module.batch_first)


def initial_states(
    module: nn.RNNBase, hx: Any, sequences: Sequences, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """``h0`` ``(L D, B, P)`` and, for LSTM, ``c0`` ``(L D, B, H)``: the user's, or zeros as the module makes them."""
    lstm = module.mode == "LSTM"
    if hx is None:
        states = module.num_layers * (2 if module.bidirectional else 1)
        batch = sequences.steps.batch
        h0 = sequences.rows.new_zeros(states, batch, module.proj_size or module.hidden_size)
        return h0, sequences.rows.new_zeros(states, batch, module.hidden_size) if lstm else None
    h, c = hx if lstm else (hx, None)
    return sequences.state_in(h).to(dtype), None if c is None else sequences.state_in(c).to(dtype)


def gru_hidden_gradient(gate_grad: Tensor, reset: Tensor) -> Tensor:
    """The gradient of ``h W_hh^T + b_hh`` ``(N, 3H)`` from the gates': ``[δr, δz, δn ⊙ r]``, ``r`` ``(N, H)``."""
    hidden = reset.shape[1]
    return torch.cat([gate_grad[:, : 2 * hidden], gate_grad[:, 2 * hidden :] * reset], dim=1)


class StepGradients:
    """The gradient reaching each step's output ``h_t``, kept until the direction's gate gradient arrives.

    The gates' input side feeds every step, so autograd reaches it after every ``h_t``.
    """

    def __init__(self, outputs: list[Tensor]) -> None:
        self.sizes = [output.shape[0] for output in outputs]  # s_t per step
        self.empty = outputs[0].detach().new_empty(0, outputs[0].shape[1])  # (0, P): dtype and device
        self.grads: dict[int, Tensor] = {}

    def keep(self, step: int) -> RecordsFn:
        def store(grad: Tensor) -> list[LayerRecord]:  # (s_t, P)
            self.grads[step] = grad
            return []

        return store

    def take(self) -> Tensor:
        """``(N, P)`` every step's gradient (zero where none arrived); forgotten, for another backward."""
        grads, self.grads = self.grads, {}
        zeros = self.empty.new_zeros
        return torch.cat(
            [grads[t] if t in grads else zeros(size, self.empty.shape[1]) for t, size in enumerate(self.sizes)]
        )


def part_parameters(part: str, suffix: str, captured: dict[str, str]) -> dict[str, str]:
    """Role (``weight``/``bias``) -> local name, of one record part's captured parameters (``suffix``: ``_l0``...)."""
    locals_ = {role: f"{kind}{suffix}" for role, kind in zip(("weight", "bias"), PARTS[part]) if kind is not None}
    return {role: local for role, local in locals_.items() if local in captured}


def hook_direction(
    module: nn.RNNBase, ctx: LayerContext, run: DirectionRun, x: Tensor, steps: Steps, layer: int, direction: int
) -> None:
    """Hook one layer and direction: its records are built when the gate gradient ``(N, G H)`` arrives."""
    suffix = f"_l{layer}{direction_suffix(direction)}"
    captured = ctx.param_names(module)  # local name -> model name
    parts = {part: part_parameters(part, suffix, captured) for part in PARTS}
    parts = {part: roles for part, roles in parts.items() if roles}
    if not parts:
        return
    params = {part: {role: captured[local] for role, local in roles.items()} for part, roles in parts.items()}
    shapes = {part: {role: tuple(module.get_parameter(local).shape) for role, local in roles.items()}
              for part, roles in parts.items()}  # fmt: skip
    inputs = x.detach()  # (N, d_in)
    previous = [h.detach() for h in run.previous]  # (s_t, P) per step
    extras = [e.detach() for e in run.extras]  # (s_t, H) per step
    projected = StepGradients(run.outputs) if "hr" in parts else None
    gru, pack = module.mode == "GRU", ctx.pack_rows

    def factors(part: str, gates: Tensor) -> tuple[Tensor, Tensor]:
        """Prefix ``(N, d_in)`` and suffix ``(N, d_out)`` rows of one part."""
        if part == "ih":
            return inputs, gates
        if part == "hh":
            return torch.cat(previous), gru_hidden_gradient(gates, torch.cat(extras)) if gru else gates
        assert projected is not None
        return torch.cat(extras), projected.take()

    def records(gates: Tensor) -> list[LayerRecord]:  # (N, G H): δg at every step
        out: list[LayerRecord] = []
        for part in parts:
            prefix, suffix_rows = factors(part, gates)
            name = part_name(ctx.name, f"{part}{suffix}")
            head = RecordHead(name, params[part], shapes[part])
            out += linear_records(head, steps.to_batch(prefix), steps.to_batch(suffix_rows), pack=pack)
        return out

    if projected is not None:
        for t, output in enumerate(run.outputs):
            ctx.on_node_grad(output.grad_fn, projected.keep(t))
    ctx.on_node_grad(run.input_gates.grad_fn, records)


@register_capture(nn.RNN, nn.LSTM, nn.GRU, params=parameter_names())
def capture_recurrent(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: LayerContext
) -> Any:
    """Hook body: re-run ``module`` unrolled, hook its gates, return the unrolled output in place of the fused one."""
    if not torch.is_grad_enabled() or not isinstance(module, nn.RNNBase):
        return None  # nothing will be back-propagated: the fused result stands
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    dtype = output[0].data.dtype  # the fused kernel's (autocast's, if it ran in it); `.data` of a tensor or packed
    sequences = as_sequences(module, x, dtype)
    h0, c0 = initial_states(module, hx, sequences, dtype)
    unrolled = unrolled_forward(module, sequences.rows, sequences.steps, h0, c0)
    directions = 2 if module.bidirectional else 1
    for index, run in enumerate(unrolled.runs):
        layer, direction = divmod(index, directions)
        hook_direction(module, ctx, run, unrolled.inputs[layer], sequences.steps, layer, direction)
    h_n = sequences.state_out(unrolled.h_n)
    hidden = h_n if unrolled.c_n is None else (h_n, sequences.state_out(unrolled.c_n))
    return sequences.output(unrolled.output), hidden
