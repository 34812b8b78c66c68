"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` unrolled over time with the module's own parameters.

The fused kernels (cuDNN, oneDNN, ATen's) never expose the gradient of the gate pre-activations,
which is the suffix of every recurrent weight. This module recomputes the same function step by
step with ``F.linear`` and elementwise operations, so that autograd builds a graph whose tensors
capture can hook (:mod:`.recurrent`). Per layer and direction, with ``G`` gates of width ``H``:

- the input side of every step at once: ``xg = x W_ih^T + b_ih`` ``(N, G H)``;
- then a loop over time, ``hg_t = h_{t-1} W_hh^T + b_hh`` and, PyTorch's gate order,

  - ``RNN``: ``h_t = tanh(xg_t + hg_t)`` (or ``relu``);
  - ``LSTM``: ``i, f, g, o = xg_t + hg_t``; ``c_t = σ(f) c_{t-1} + σ(i) tanh(g)``;
    ``h_t = σ(o) tanh(c_t)``, then ``h_t = W_hr h_t`` with ``proj_size``;
  - ``GRU``: ``r = σ(xg_r + hg_r)``, ``z = σ(xg_z + hg_z)``, ``n = tanh(xg_n + r ⊙ hg_n)``,
    ``h_t = n + z ⊙ (h_{t-1} - n)`` (ATen's form of ``(1 - z) ⊙ n + z ⊙ h_{t-1}``).

Between layers, in training, the output goes through ``F.dropout(p=module.dropout)`` as in the
fused kernel (with masks of its own). Sequences are time-major rows, PackedSequence's layout: a
batch of ``B`` sequences is ``(N, d)`` rows, step ``t`` holding ``sizes[t]`` consecutive rows, those
of the first ``sizes[t]`` sequences (longest first); a padded batch is ``sizes[t] = B`` for every t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Steps:
    """Where the rows of a batch of sequences are.

    Attributes:
        sizes: sequences at each step (non-increasing); ``sizes[0]`` is the batch size ``B``.
        sample: ``(N,)`` the sample of the batch each row belongs to, for packed sequences (None: padded).
        time: ``(N,)`` the step of each row, for packed sequences.
    """

    sizes: tuple[int, ...]
    sample: Tensor | None = None
    time: Tensor | None = None

    @property
    def batch(self) -> int:
        return self.sizes[0]

    @property
    def length(self) -> int:
        return len(self.sizes)

    def to_batch(self, rows: Tensor) -> Tensor:
        """``(N, d)`` rows -> ``(B, T, d)`` per sample and step, zero after a sequence's end."""
        if self.sample is None or self.time is None:
            return rows.view(self.length, self.batch, rows.shape[-1]).transpose(0, 1)  # (B, T, d)
        padded = rows.new_zeros(self.batch, self.length, rows.shape[-1])  # (B, T, d)
        padded[self.sample, self.time] = rows
        return padded


def packed_steps(batch_sizes: Tensor, sorted_indices: Tensor | None, device: torch.device) -> Steps:
    """The :class:`Steps` of a ``PackedSequence`` (``sorted_indices[j]``: the sample of the j-th longest)."""
    sizes = [int(size) for size in batch_sizes.tolist()]
    counts = torch.tensor(sizes, device=device)  # (T,)
    time = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts)  # (N,)
    position = torch.arange(time.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[time]  # (N,)
    sample = position if sorted_indices is None else sorted_indices.to(device)[position]  # (N,)
    return Steps(tuple(sizes), sample, time)


@dataclass(frozen=True)
class CellWeights:
    """One layer and direction's parameters, in the dtype the recurrence runs in."""

    ih: Tensor  # (G H, d_in)
    hh: Tensor  # (G H, P)
    b_ih: Tensor | None  # (G H,)
    b_hh: Tensor | None  # (G H,)
    hr: Tensor | None  # (P, H), LSTM with proj_size only


def direction_suffix(direction: int) -> str:
    """``""`` for the forward direction, ``"_reverse"`` for the backward one (PyTorch's parameter names)."""
    return "_reverse" if direction else ""


def cell_weights(module: nn.RNNBase, layer: int, direction: int, dtype: torch.dtype) -> CellWeights:
    """The parameters of ``layer`` and ``direction``, cast to ``dtype`` (a no-op outside autocast)."""
    suffix = f"_l{layer}{direction_suffix(direction)}"

    def get(name: str) -> Tensor | None:
        value = getattr(module, name + suffix, None)
        return None if value is None else value.to(dtype)

    ih, hh = get("weight_ih"), get("weight_hh")
    assert ih is not None and hh is not None  # every RNNBase has them
    return CellWeights(ih, hh, get("bias_ih"), get("bias_hh"), get("weight_hr") if module.proj_size > 0 else None)


class Step(NamedTuple):
    """What one step of a cell computes: the new state, and what capture needs of it."""

    h: Tensor  # (s, P)
    c: Tensor | None  # (s, H), LSTM
    extra: Tensor | None  # GRU: the reset gate r (s, H); LSTM with proj_size: the state before projection (s, H)


def rnn_step(xg: Tensor, h: Tensor, w: CellWeights, relu: bool) -> Step:
    """``h' = act(xg + h W_hh^T + b_hh)`` for ``xg`` ``(s, H)``, ``h`` ``(s, H)``."""
    pre = xg + F.linear(h, w.hh, w.b_hh)  # (s, H)
    return Step(torch.relu(pre) if relu else torch.tanh(pre), None, None)


def lstm_step(xg: Tensor, h: Tensor, c: Tensor, w: CellWeights) -> Step:
    """``c' = σ(f) c + σ(i) tanh(g)``, ``h' = [W_hr] σ(o) tanh(c')`` for ``xg`` ``(s, 4H)``, ``h`` ``(s, P)``."""
    i, f, g, o = (xg + F.linear(h, w.hh, w.b_hh)).chunk(4, 1)  # (s, H) each
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (s, H)
    m = torch.sigmoid(o) * torch.tanh(c_new)  # (s, H)
    if w.hr is None:
        return Step(m, c_new, None)
    return Step(F.linear(m, w.hr), c_new, m)  # (s, P)


def gru_step(xg: Tensor, h: Tensor, w: CellWeights) -> Step:
    """``r, z = σ(xg_rz + hg_rz)``, ``n = tanh(xg_n + r ⊙ hg_n)``, ``h' = n + z ⊙ (h - n)``; ``xg`` ``(s, 3H)``."""
    x_r, x_z, x_n = xg.chunk(3, 1)  # (s, H) each
    h_r, h_z, h_n = F.linear(h, w.hh, w.b_hh).chunk(3, 1)  # (s, H) each
    r = torch.sigmoid(x_r + h_r)  # (s, H)
    z = torch.sigmoid(x_z + h_z)  # (s, H)
    n = torch.tanh(x_n + r * h_n)  # (s, H)
    return Step(n + z * (h - n), None, r)


def cell_step(mode: str, xg: Tensor, h: Tensor, c: Tensor | None, w: CellWeights) -> Step:
    """One step of the cell of ``mode`` on the ``s`` sequences still running."""
    if mode == "LSTM":
        assert c is not None
        return lstm_step(xg, h, c, w)
    if mode == "GRU":
        return gru_step(xg, h, w)
    return rnn_step(xg, h, w, relu=mode == "RNN_RELU")


def hookable(tensor: Tensor) -> Tensor:
    """``tensor`` as the output of an autograd node, so that the gradient reaching it can be hooked.

    A tensor none of whose inputs requires grad (the input side of a frozen first layer) becomes a
    view of a new leaf: the gradient of the hidden side still flows through it.
    """
    return tensor if tensor.grad_fn is not None else tensor.detach().requires_grad_().view_as(tensor)


def _running(state: Tensor, size: int) -> Tensor:
    """The first ``size`` rows of ``state`` ``(B, d)`` (no slice when all run: its backward would copy)."""
    return state if size == state.shape[0] else state[:size]


def _update(state: Tensor, new: Tensor) -> Tensor:
    """``state`` ``(B, d)`` with its first ``len(new)`` rows replaced (the sequences that ran this step)."""
    return new if new.shape[0] == state.shape[0] else torch.cat([new, state[new.shape[0] :]])


@dataclass(frozen=True)
class DirectionRun:
    """One layer and direction unrolled over the sequence; per-step lists are in time order.

    Attributes:
        input_gates: ``(N, G H)`` ``x W_ih^T + b_ih``; the gradient reaching it is each step's gate gradient.
        outputs: ``h_t`` ``(s_t, P)`` per step (after the projection, with ``proj_size``).
        previous: ``h_{t-1}`` ``(s_t, P)`` per step: the input of ``W_hh`` (``h0`` where a sequence starts).
        extras: GRU's ``r_t``, or LSTM's state before projection, ``(s_t, H)`` per step (else empty).
        h_n: ``(B, P)`` last state of every sequence; ``c_n`` ``(B, H)`` for LSTM.
    """

    input_gates: Tensor
    outputs: list[Tensor]
    previous: list[Tensor]
    extras: list[Tensor]
    h_n: Tensor
    c_n: Tensor | None


def run_direction(
    mode: str, x: Tensor, w: CellWeights, h0: Tensor, c0: Tensor | None, steps: Steps, reverse: bool
) -> DirectionRun:
    """Unroll one layer and direction over rows ``x`` ``(N, d_in)`` from states ``h0`` ``(B, P)``, ``c0`` ``(B, H)``.

    At step ``t`` only the first ``sizes[t]`` sequences run; the others keep their state (finished
    sequences in the forward direction, sequences not yet started in the reverse one).
    """
    xg = hookable(F.linear(x, w.ih, w.b_ih))  # (N, G H)
    per_step = xg.split(list(steps.sizes))  # (s_t, G H) each
    done: dict[int, tuple[Step, Tensor]] = {}  # step -> (what it computed, h_{t-1})
    h, c = h0, c0  # (B, P), (B, H)
    for t in reversed(range(steps.length)) if reverse else range(steps.length):
        size = steps.sizes[t]
        h_prev = _running(h, size)  # (s_t, P)
        step = cell_step(mode, per_step[t], h_prev, None if c is None else _running(c, size), w)
        done[t] = step, h_prev
        h = _update(h, step.h)  # (B, P)
        c = None if c is None or step.c is None else _update(c, step.c)  # (B, H)
    ordered = [done[t] for t in range(steps.length)]
    extras = [step.extra for step, _ in ordered if step.extra is not None]
    return DirectionRun(xg, [step.h for step, _ in ordered], [prev for _, prev in ordered], extras, h, c)


@dataclass(frozen=True)
class Unrolled:
    """The unrolled forward of a whole module.

    Attributes:
        output: ``(N, D P)`` the last layer's outputs, both directions concatenated.
        h_n: ``(L D, B, P)``; ``c_n`` ``(L D, B, H)`` for LSTM.
        runs: per layer and direction (index ``l D + d``), what capture hooks.
        inputs: per layer, its input rows ``(N, d_in)`` (after dropout): the input of ``W_ih``.
    """

    output: Tensor
    h_n: Tensor
    c_n: Tensor | None
    runs: list[DirectionRun]
    inputs: list[Tensor]


def unrolled_forward(module: nn.RNNBase, x: Tensor, steps: Steps, h0: Tensor, c0: Tensor | None) -> Unrolled:
    """The module's forward on rows ``x`` ``(N, d_in)`` from ``h0`` ``(L D, B, P)`` (and ``c0`` ``(L D, B, H)``).

    Parameters are cast to ``x``'s dtype, the states' (a no-op outside autocast); under autocast the
    matmuls run in autocast's dtype, as ``F.linear`` always does.
    """
    directions = 2 if module.bidirectional else 1
    runs: list[DirectionRun] = []
    inputs: list[Tensor] = []
    for layer in range(module.num_layers):
        if layer > 0 and module.training and module.dropout > 0:
            x = F.dropout(x, module.dropout, training=True)  # (N, D P)
        inputs.append(x)
        for d in range(directions):
            k = layer * directions + d
            w = cell_weights(module, layer, d, x.dtype)
            runs.append(run_direction(module.mode, x, w, h0[k], None if c0 is None else c0[k], steps, d == 1))
        outputs = [torch.cat(run.outputs) for run in runs[-directions:]]  # (N, P) per direction
        x = outputs[0] if directions == 1 else torch.cat(outputs, dim=1)  # (N, D P)
    h_n = torch.stack([run.h_n for run in runs])  # (L D, B, P)
    c_n = torch.stack([run.c_n for run in runs if run.c_n is not None]) if c0 is not None else None  # (L D, B, H)
    return Unrolled(x, h_n, c_n, runs, inputs)
