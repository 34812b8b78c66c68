"""nn.RNN (tanh, relu), nn.LSTM (proj_size too) and nn.GRU, captured through their unrolled recurrence.

References are independent of capture: one ordinary backward per sample through the unmodified module
on a batch of one (``torch.func.vmap`` cannot run the fused RNN/GRU kernels; it can run LSTM's, checked
too), or, for dropout between layers, per-sample autograd through the very forward that ran.

Numerical difference from the fused kernel (CPU, oneDNN for LSTM, ATen otherwise): outputs, states and
``.grad`` of the unrolled forward are within 1e-12 (float64; 5e-16 measured) and 1e-5 (float32; 1.3e-6
measured, LSTM through oneDNN) of the fused module's, relative to each tensor's largest entry.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from capturecases import assert_exact, max_model_relative_error, reference_per_sample_gradients_loop
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.capture.layers.recurrent import MAX_LAYERS
from metastore_plugins.testing import autocast_reference_per_sample_gradients, max_relative_error

pytestmark = [
    pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),  # vmap over the fused LSTM
]

MODES = ("rnn_tanh", "rnn_relu", "gru", "lstm", "lstm_proj")


@dataclass(frozen=True)
class RnnCase:
    """One recurrent module and how it is fed, as data."""

    mode: str = "lstm"
    batch: int = 3
    length: int = 4
    d_in: int = 5
    hidden: int = 4
    proj: int = 2  # lstm_proj only
    layers: int = 1
    bias: bool = True
    batch_first: bool = True
    bidirectional: bool = False
    initial: bool = False  # h0 (and c0) given; zeros by the module otherwise
    packed: int = 0  # 0: a padded tensor; PackedSequence 1: enforce_sorted=True, 2: enforce_sorted=False
    readout: str = "both"  # what the loss reads: "output", "state" (h_n, c_n) or "both"
    dropout: float = 0.0

    @property
    def width(self) -> int:
        """``P``: the width of ``h``."""
        return self.proj if self.mode == "lstm_proj" else self.hidden

    @property
    def states(self) -> int:
        return self.layers * (2 if self.bidirectional else 1)

    def module(self) -> nn.RNNBase:
        options: dict[str, Any] = dict(
            num_layers=self.layers, bias=self.bias, batch_first=self.batch_first,
            bidirectional=self.bidirectional, dropout=self.dropout,
        )  # fmt: skip
        if self.mode.startswith("rnn"):
            return nn.RNN(self.d_in, self.hidden, nonlinearity=self.mode[4:], **options)
        if self.mode == "gru":
            return nn.GRU(self.d_in, self.hidden, **options)
        return nn.LSTM(self.d_in, self.hidden, proj_size=self.proj if self.mode == "lstm_proj" else 0, **options)


class Recurrent(nn.Module):
    """Batch-first inputs -> the case's recurrent module -> one loss per sample ``(B,)``.

    The output term is zero at padded steps (so batches of one, padded to their own length, agree).
    """

    def __init__(self, case: RnnCase) -> None:
        super().__init__()
        self.case = case
        self.rnn = case.module()

    def forward(self, x: Tensor, lengths: Tensor, h0: Tensor, c0: Tensor) -> Tensor:
        """``(B, T, d_in)``, ``(B,)``, ``(B, L D, P)``, ``(B, L D, H)``."""
        case = self.case
        inputs: Tensor | PackedSequence = x if case.batch_first else x.transpose(0, 1)
        if case.packed:
            inputs = pack_padded_sequence(inputs, lengths, case.batch_first, enforce_sorted=case.packed == 1)
        hx: Any = None
        if case.initial:
            hx = (h0.transpose(0, 1), c0.transpose(0, 1)) if case.mode.startswith("lstm") else h0.transpose(0, 1)
        out, hidden = self.rnn(inputs, hx)
        if isinstance(out, PackedSequence):
            out = pad_packed_sequence(out, batch_first=True)[0]  # (B, T_max, D P), zeros after each end
        elif not case.batch_first:
            out = out.transpose(0, 1)  # (B, T, D P)
        weights = torch.linspace(-1, 1, out.shape[-1])  # (D P,)
        loss = (out * weights + out.pow(2)).sum((1, 2))  # (B,)
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        state_loss = sum(torch.sin(2 * s.transpose(0, 1)).sum((1, 2)) for s in states)  # (B,)
        return {"output": loss, "state": state_loss, "both": loss + state_loss}[case.readout]


def mean_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    return model(*batch).mean()


def case_batch(case: RnnCase, dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
    """``(x, lengths, h0, c0)``, samples first; lengths decrease for ``enforce_sorted=True``."""
    g = torch.Generator().manual_seed(case.batch * 100 + case.length)
    lengths = torch.randint(1, case.length + 1, (case.batch,), generator=g)
    lengths[torch.randint(0, case.batch, (1,), generator=g)] = case.length
    if case.packed == 1:
        lengths = lengths.sort(descending=True).values
    return (
        torch.randn(case.batch, case.length, case.d_in, generator=g, dtype=dtype),
        lengths,
        torch.randn(case.batch, case.states, case.width, generator=g, dtype=dtype),
        torch.randn(case.batch, case.states, case.hidden, generator=g, dtype=dtype),
    )


def record_names(case: RnnCase) -> set[str]:
    parts = ("ih", "hh", "hr") if case.mode == "lstm_proj" else ("ih", "hh")
    suffixes = ("", "_reverse") if case.bidirectional else ("",)
    return {f"rnn.{part}_l{k}{s}" for part in parts for k in range(case.layers) for s in suffixes}


# -- against the per-sample reference, on a grid wider than Opacus' ---------------------------------


@st.composite
def rnn_cases(draw: st.DrawFn) -> RnnCase:
    """Opacus' DPRNN/DPGRU/DPLSTM grid (N 1-5, T 1-6, D 4-10, H 3-10, layers 1-3, bias, batch_first,
    bidirectional, zero_init, packed_input_flag 0-2) and more: relu, proj_size, what the loss reads."""
    mode = draw(st.sampled_from(MODES))
    hidden = draw(st.integers(1, 10))
    return RnnCase(
        mode=mode, batch=draw(st.integers(1, 5)), length=draw(st.integers(1, 6)), d_in=draw(st.integers(1, 10)),
        hidden=hidden, proj=draw(st.integers(1, hidden - 1)) if mode == "lstm_proj" and hidden > 1 else 1,
        layers=draw(st.integers(1, 3)), bias=draw(st.booleans()), batch_first=draw(st.booleans()),
        bidirectional=draw(st.booleans()), initial=draw(st.booleans()), packed=draw(st.integers(0, 2)),
        readout=draw(st.sampled_from(["output", "state", "both"])),
    )  # fmt: skip


def _valid(case: RnnCase) -> RnnCase:
    """``proj_size`` must be smaller than ``hidden_size``: a hidden size of 1 has no projection."""
    return replace(case, mode="lstm") if case.mode == "lstm_proj" and case.hidden == 1 else case


@settings(max_examples=400, deadline=None)
@given(case=rnn_cases(), reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_every_recurrent_configuration_is_exact(case: RnnCase, reduction: str, seed: int) -> None:
    case = _valid(case)
    torch.manual_seed(seed)
    session = assert_exact(
        Recurrent(case), mean_loss, case_batch(case), reduction, reference=reference_per_sample_gradients_loop
    )
    assert {record.layer for record in session.factors()} == record_names(case)


@pytest.mark.parametrize("case", [RnnCase(batch=4, layers=2), RnnCase(batch=3, bidirectional=True, initial=True)])
def test_lstm_matches_torch_func(case: RnnCase) -> None:
    """``vmap(grad)`` over ``functional_call`` runs the fused LSTM (by a slow fallback): the same answer."""
    assert_exact(Recurrent(case), mean_loss, case_batch(case))


# -- the numerical difference from the fused kernel -----------------------------------------------


def _fused_and_unrolled(case: RnnCase, dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
    """Per-sample losses and every ``.grad`` (parameters, input, h0, c0) of the fused module and the captured one."""
    torch.manual_seed(0)
    fused = case.module().to(dtype)
    unrolled = copy.deepcopy(fused)
    x, lengths, h0, c0 = case_batch(case, dtype)
    results = []
    for module, capture in ((fused, False), (unrolled, True)):
        inputs, h, c = (t.clone().requires_grad_() for t in (x, h0, c0))
        model = Recurrent(case)
        model.rnn = module
        with CaptureSession(model, unsupported="error") if capture else nullcontext():
            losses = model(inputs, lengths, h, c)  # (B,)
            losses.sum().backward()
        outputs = [losses, *(p.grad for p in module.parameters()), inputs.grad, h.grad, c.grad]
        results.append([t.detach() for t in outputs if t is not None])
    return results[0], results[1]


FUSED_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("packed", [0, 2], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", MODES)
def test_unrolled_forward_and_grad_equal_the_fused_kernel(mode: str, packed: int, dtype: torch.dtype) -> None:
    """Same losses and ``.grad`` (parameters, input, h0, c0) to rounding; 2 bidirectional layers, h0 given."""
    case = RnnCase(mode, batch=8, length=12, d_in=6, hidden=16, proj=8, layers=2, bidirectional=True,
                   initial=True, packed=packed)  # fmt: skip
    fused, unrolled = _fused_and_unrolled(case, dtype)
    parameters = 2 * 2 * (5 if mode == "lstm_proj" else 4)  # layers x directions x weights and biases
    assert len(fused) == len(unrolled) == 1 + parameters + (3 if mode.startswith("lstm") else 2)
    for want, got in zip(fused, unrolled):
        assert float((got - want).abs().max() / want.abs().max()) <= FUSED_TOLERANCE[dtype]


def test_the_fused_result_stands_without_grad() -> None:
    """Under ``torch.no_grad`` nothing is back-propagated: the rule keeps the fused output and records nothing."""
    rnn = nn.LSTM(3, 4, num_layers=2)
    x = torch.randn(5, 2, 3)
    with CaptureSession(rnn) as session, torch.no_grad():
        out, (h, c) = rnn(x)
    with torch.no_grad():
        want, (h_want, c_want) = rnn(x)
    assert out.grad_fn is None and session.factors() == []
    for got, expected in ((out, want), (h, h_want), (c, c_want)):
        assert float((got - expected).abs().max()) <= 1e-12 * float(expected.abs().max())


# -- dropout, frozen parameters, unbatched input, coverage, a head, the store ------------------------


@pytest.mark.parametrize("mode", ["gru", "lstm_proj"])
def test_dropout_between_layers_is_exact_for_the_forward_that_ran(mode: str) -> None:
    """In training the unrolled forward draws its own masks; each sample's gradient is that of its own loss
    through that very forward (per-sample autograd on the retained graph), and eval mode is the fused module."""
    case = RnnCase(mode, batch=4, length=5, hidden=6, proj=3, layers=3, bidirectional=True, packed=2, dropout=0.5)
    model = Recurrent(case).train()
    batch = case_batch(case)
    with CaptureSession(model, unsupported="error") as session:
        losses = model(*batch)  # (B,)
        losses.mean().backward(retain_graph=True)
        actual = session.per_sample_gradients()
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True) for i in range(case.batch)]
    expected = {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(params)}
    assert max_model_relative_error(actual, expected) <= 1e-5
    model.eval()
    with torch.no_grad():
        fused = model(*batch)
    with CaptureSession(model):
        unrolled = model(*batch).detach()
    assert float((unrolled - fused).abs().max() / fused.abs().max()) <= 1e-5
    assert float((losses.detach() - fused).abs().max() / fused.abs().max()) >= 1e-3  # the masks were applied


def test_a_frozen_input_side_leaves_the_hidden_side_captured() -> None:
    """With ``W_ih``/``b_ih`` of the first layer frozen and an input without grad, ``W_hh`` is still captured."""
    case = RnnCase("gru", batch=3, layers=2, initial=True)
    model = Recurrent(case)
    model.rnn.weight_ih_l0.requires_grad_(False)
    model.rnn.bias_ih_l0.requires_grad_(False)
    session = assert_exact(model, mean_loss, case_batch(case), reference=reference_per_sample_gradients_loop)
    assert {record.layer for record in session.factors()} == record_names(case) - {"rnn.ih_l0"}


@pytest.mark.parametrize("mode", MODES)
def test_an_unbatched_sequence_is_one_sample(mode: str) -> None:
    """Input ``(T, d_in)`` and ``h0`` ``(L D, P)``: records of batch size 1, equal to ``.grad``."""
    case = RnnCase(mode, layers=2, bidirectional=True)
    rnn = case.module()
    fused = copy.deepcopy(rnn)
    x, h0, c0 = torch.randn(6, case.d_in), torch.randn(case.states, case.width), torch.randn(case.states, case.hidden)
    hx = (h0, c0) if mode.startswith("lstm") else h0

    def loss(module: nn.RNNBase) -> Tensor:
        out, hidden = module(x, hx)
        assert out.shape == (6, 2 * case.width)
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        return out.pow(2).sum() + sum(torch.sin(s).sum() for s in states)

    loss(fused).backward()
    with CaptureSession(rnn, unsupported="error") as session:
        loss(rnn).backward()
    grads = session.per_sample_gradients()
    assert {record.batch_size for record in session.factors()} == {1}
    expected = {name: p.grad.unsqueeze(0) for name, p in fused.named_parameters()}
    assert max_relative_error(grads, expected) <= 1e-5


class Twice(nn.Module):
    """One GRU applied to two sequences of each sample (shared weights: two calls, two sets of records)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, batch_first=True, bidirectional=True)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:  # (B, T_a, 3), (B, T_b, 3)
        return (self.gru(a)[0].mean(1) * self.gru(b)[0].mean(1)).sum(1)  # (B,)


def test_a_module_called_twice_sums_its_records() -> None:
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(3, 4, 3, generator=g), torch.randn(3, 6, 3, generator=g))
    session = assert_exact(Twice(), mean_loss, batch, reference=reference_per_sample_gradients_loop)
    assert [record.layer for record in session.factors()].count("gru.hh_l0_reverse") == 2


class Holder(nn.Module):
    """One of each recurrent module and configuration (never called)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(3, 4, num_layers=2, nonlinearity="relu", bias=False)
        self.gru = nn.GRU(3, 4, num_layers=3, bidirectional=True, batch_first=True)
        self.lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, dropout=0.1)
        self.projected = nn.LSTM(3, 4, proj_size=2, num_layers=2, bidirectional=True)


def test_every_recurrent_parameter_is_covered() -> None:
    model = Holder()
    with CaptureSession(model, unsupported="error") as session:
        assert session.uncaptured_parameters() == []
        assert session.generic_parameters() == []


def test_layers_past_the_rule_bound_are_reported() -> None:
    """The rule names its parameters for up to ``MAX_LAYERS`` layers; deeper ones are reported, never wrong."""
    rnn = nn.RNN(1, 1, num_layers=MAX_LAYERS + 1)
    with CaptureSession(rnn, unsupported="skip") as session:
        assert session.uncaptured_parameters() == [f"{kind}_l{MAX_LAYERS}" for kind in
                                                   ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]  # fmt: skip


class Tagger(nn.Module):
    """Embedding -> packed bidirectional LSTM with projections -> GRU -> Linear head on the last valid step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6, padding_idx=0)
        self.lstm = nn.LSTM(6, 8, proj_size=4, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(8, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = self.gru(out)
        h, _ = pad_packed_sequence(out, batch_first=True)  # (B, T_max, 5)
        return self.head(h[torch.arange(len(lengths)), lengths - 1])  # (B, 3)


def tagger_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    ids, lengths, y = batch
    return nn.functional.cross_entropy(model(ids, lengths), y)


def tagger_batch() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([4, 7, 2, 7, 5])
    ids = torch.randint(1, 20, (5, 7), generator=g) * (torch.arange(7) < lengths[:, None])
    return ids, lengths, torch.randint(0, 3, (5,), generator=g)


def test_a_linear_head_after_recurrent_layers_keeps_its_own_rule() -> None:
    session = assert_exact(Tagger(), tagger_loss, tagger_batch(), reference=reference_per_sample_gradients_loop)
    layers = {record.layer: record for record in session.factors()}
    assert set(layers) == {"embed", "lstm.ih_l0", "lstm.hh_l0", "lstm.hr_l0", "lstm.ih_l0_reverse",
                           "lstm.hh_l0_reverse", "lstm.hr_l0_reverse", "gru.ih_l0", "gru.hh_l0", "head"}  # fmt: skip
    assert layers["head"].params == {"weight": "head.weight", "bias": "head.bias"}


#: max |restored - reference| / max |reference| per encoding (as tests/store/test_layer_families.py)
STORE_BOUNDS = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 2e-2, "int8": 2e-2}


@pytest.mark.parametrize("encoding", list(STORE_BOUNDS))
def test_recurrent_records_round_trip_through_the_store(tmp_path: Path, encoding: str) -> None:
    model, batch = Tagger(), tagger_batch()
    with CaptureSession(model, unsupported="error") as session:
        tagger_loss(model, batch).backward()
    with StoreWriter(tmp_path, encoding=encoding) as writer:
        writer.write(session.factors(), sample_ids=[10, 11, 12, 13, 14], step=0)
    reference = reference_per_sample_gradients_loop(model, tagger_loss, batch)
    store = open_store(tmp_path)
    for i, sid in enumerate(range(10, 15)):
        restored = store.restore(sid)
        assert set(restored) == set(reference)
        for name, grad in restored.items():
            expected = reference[name][i]
            error = float((grad - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
            assert error <= STORE_BOUNDS[encoding], (encoding, sid, name, error)


# -- mixed precision -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [(m, torch.bfloat16) for m in MODES] + [(m, torch.float16) for m in ("rnn_tanh", "gru")],  # no fp16 oneDNN LSTM
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_under_autocast_the_recurrence_runs_in_the_fused_kernels_dtype(mode: str, dtype: torch.dtype) -> None:
    """Under CPU autocast the unrolled forward returns the fused kernel's dtype and runs its matmuls in autocast's.
    With ``u`` the dtype's unit roundoff: outputs within ``8u`` of the fused ones (3.1u measured), per-sample
    gradients within ``8u`` of each parameter's largest entry of per-sample autograd through the fused autocast
    forward (3.8u measured). Not against fp32: a ReLU RNN's activations round across the kink (136u measured)."""
    case = RnnCase(mode, batch=4, length=5, d_in=6, hidden=8, proj=3, layers=2, bidirectional=True, packed=2)
    model, batch = Recurrent(case), case_batch(case)
    bound = 8 * torch.finfo(dtype).eps / 2
    with torch.autocast("cpu", dtype=dtype):
        fused_out = model.rnn(batch[0])[0].detach()
        with CaptureSession(model):
            unrolled_out = model.rnn(batch[0])[0].detach()
    assert unrolled_out.dtype == fused_out.dtype
    assert float((unrolled_out.float() - fused_out.float()).abs().max() / fused_out.float().abs().max()) <= bound
    expected = autocast_reference_per_sample_gradients(model, mean_loss, batch, dtype)
    with CaptureSession(model, unsupported="error") as session:
        with torch.autocast("cpu", dtype=dtype):
            loss = mean_loss(model, batch)
        loss.backward()
    assert max_relative_error(session.per_sample_gradients(), expected) <= bound
