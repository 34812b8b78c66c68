"""Tiny models declared as data, captured once, with torch.func reference gradients (float64).

Each :class:`Case` holds the records of a train batch and a test batch at the same
weights, and the reference per-sample gradients of both (``reference_per_sample_gradients``,
which knows nothing of factors). Reference quantities are computed from those only.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.core.ops import projection
from metastore_plugins.testing import reference_per_sample_gradients

TOLERANCE = 1e-5
LossFn = Callable[[nn.Module, Any], Tensor]


class MaskedSequence(nn.Module):
    """Linear on padded token sequences (padded rows have zero suffix and are pruned), then a head."""

    def __init__(self, d_in: int = 12, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x)) * mask.unsqueeze(-1)  # (B, T, hidden)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


class GroupedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, kernel_size=3, groups=2)  # 4 positions on 4x4 inputs: factored
        self.head = nn.Linear(16 * 2 * 2, 3)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


class BagOfTokens(nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.embed(ids)).mean(1))


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.norm(self.inp(x))).mean(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        out, _ = self.attn(x, x, x, need_weights=False)
        return self.head(out.mean(1))


class TransposedConv1D(nn.Module):
    """transformers' ``Conv1D`` (GPT-2), whose weight is ``(d_in, d_out)``: the ``"in_out"`` layout."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.proj = Conv1D(16, 12)  # Conv1D(nf=d_out, nx=d_in)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = torch.tanh(self.proj(x)) * mask.unsqueeze(-1)  # (B, T, 16)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


class TiedLinear(nn.Module):
    """One Linear called twice: two records share its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head(self.shared(torch.tanh(self.shared(x))).mean(1))


class TiedLanguageModel(nn.Module):
    """An embedding whose weight is also the output layer's: an embedding and an outer record share it."""

    def __init__(self, vocab: int = 13, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.out(torch.tanh(self.embed(ids)).mean(1))


def cross_entropy(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"], batch.get("mask")), batch["y"])


def _sequence_batch(batch: int, tokens: int, d_in: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (batch,), generator=g)
    lengths[0] = tokens
    mask = (torch.arange(tokens) < lengths[:, None]).double()  # (B, T)
    x = torch.randn(batch, tokens, d_in, generator=g, dtype=torch.float64)
    return {"x": x, "mask": mask, "y": torch.randint(0, 3, (batch,), generator=g)}


def _image_batch(batch: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, 4, 4, generator=g, dtype=torch.float64)
    return {"x": x, "y": torch.randint(0, 3, (batch,), generator=g)}


def _token_batch(batch: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 13, (batch, 6), generator=g)
    ids[1:, 4:] = 0  # padding
    ids[0, 1] = ids[0, 0]  # a repeated token within a sample
    ids[-1, 0] = ids[0, 0]  # a token shared across samples
    return {"x": ids, "y": torch.randint(0, 3, (batch,), generator=g)}


@dataclass
class Case:
    name: str
    model: nn.Module
    train_records: list[LayerRecord]
    test_records: list[LayerRecord]
    train_ref: dict[str, Tensor]
    test_ref: dict[str, Tensor]
    train_batch: dict[str, Tensor]
    train_grad: dict[str, Tensor]  # .grad after backward of the mean loss on the train batch

    def pairs(self) -> list[tuple[LayerRecord, LayerRecord]]:
        """(train record, test record) of each layer (first call of each)."""
        test = {r.layer: r for r in reversed(self.test_records)}
        return [(r, test[r.layer]) for r in self.train_records if r.layer in test]


def capture(model: nn.Module, batch: dict[str, Tensor]) -> tuple[list[LayerRecord], dict[str, Tensor]]:
    """Records of one backward of the mean loss, and the parameters' ``.grad``."""
    model.zero_grad()
    with CaptureSession(model) as session:
        cross_entropy(model, batch).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return session.factors(), grads


def _make(name: str, model: nn.Module, train: dict[str, Tensor], test: dict[str, Tensor]) -> Case:
    model = model.double()
    train_records, grads = capture(model, train)
    test_records, _ = capture(model, test)
    with warnings.catch_warnings():  # vmap over CPU flash attention warns that it is slow
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        train_ref = reference_per_sample_gradients(model, cross_entropy, train)
        test_ref = reference_per_sample_gradients(model, cross_entropy, test)
    return Case(name, model, train_records, test_records, train_ref, test_ref, train, grads)


_DECLARED: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], dict[str, Tensor]], tuple[int, int]]] = {
    # name: (model, batch(size, seed), (train size, test size))
    "linear-seq": (MaskedSequence, lambda n, s: _sequence_batch(n, 6, 12, s), (5, 3)),
    "conv-groups": (GroupedConv, _image_batch, (4, 3)),
    "embedding": (BagOfTokens, _token_batch, (5, 3)),
    "layernorm": (NormedMLP, lambda n, s: _sequence_batch(n, 3, 12, s), (4, 3)),
    "mha": (Attention, lambda n, s: _sequence_batch(n, 5, 16, s), (4, 2)),
    "conv1d-hf": (TransposedConv1D, lambda n, s: _sequence_batch(n, 5, 12, s), (4, 3)),
    "tied": (TiedLinear, lambda n, s: _sequence_batch(n, 3, 12, s), (4, 3)),
    "tied-lm": (TiedLanguageModel, _token_batch, (4, 3)),
}


def _build(name: str) -> Case:
    model, batch, (train, test) = _DECLARED[name]
    seed = 2 * list(_DECLARED).index(name) + 1
    return _make(name, model(), batch(train, seed), batch(test, seed + 1))


BUILDERS: dict[str, Callable[[], Case]] = {name: functools.partial(_build, name) for name in _DECLARED}
CASE_NAMES = [name for name in BUILDERS if not name.startswith("tied")]


@functools.cache
def get_case(name: str) -> Case:
    """The case ``name``, built once; the same whichever test asks first (its seeds are its own)."""
    with torch.random.fork_rng(devices=[]):  # the model's initialisation draws from the global RNG
        torch.manual_seed(sum(map(ord, name)))
        return BUILDERS[name]()


def flat_reference(ref: dict[str, Tensor], names: Sequence[str]) -> Tensor:
    """``(B, P)`` float64: the reference per-sample gradients of ``names``, concatenated."""
    return torch.cat([ref[n].reshape(ref[n].shape[0], -1).double() for n in names], 1)


def separating_thresholds(values: Tensor, margin: float) -> list[tuple[float, int]]:
    """Thresholds strictly between consecutive distinct ``values``, none within ``margin`` of a value.

    Returns ``(threshold, count of values above it)`` for the midpoint of every gap wider than
    ``2 * margin``. A computed value within ``margin`` of its reference is then on the same side
    of every threshold as the reference: no result depends on rounding at a threshold.
    """
    ordered = sorted(float(v) for v in values.flatten())
    found = []
    for k in range(len(ordered) - 1):
        low, high = ordered[k], ordered[k + 1]
        if high - low > 2 * margin:
            found.append((0.5 * (low + high), len(ordered) - 1 - k))
    return found


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """``max |a - e| / max |e|``."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-300)
    return float((actual.double() - expected).abs().max() / scale)


def reference_sketch(record: LayerRecord, ref: dict[str, Tensor], seed: int, k_in: int, k_out: int) -> Tensor:
    """``P_out [W | b] P_in^T`` (or a flat Gaussian projection) of the reference gradients, float64."""
    batch, device = ref[next(iter(record.params.values()))].shape[0], torch.device("cpu")
    shapes = record.param_shapes
    if "weight" in record.params and len(shapes["weight"]) >= 2:
        weight = ref[record.params["weight"]].double()  # (B, *shape)
        if record.layout == "in_out":  # transformers' Conv1D stores (d_in, d_out)
            weight = weight.transpose(1, 2)
        matrix = weight.reshape(batch, weight.shape[1], -1)  # (B, rows, cols)
        rows, cols = matrix.shape[1:]
        p_in = projection("in", record.layer, seed, (k_in, cols), k_in, device).double()
        if "bias" in record.params:
            matrix = torch.cat([matrix, ref[record.params["bias"]].double().reshape(batch, rows, 1)], 2)
            p_in = torch.cat([p_in, projection("bias", record.layer, seed, (k_in, 1), k_in, device).double()], 1)
        p_out = projection("out", record.layer, seed, (k_out, rows), k_out, device).double()
        return (p_out @ matrix @ p_in.T).reshape(batch, -1)
    roles = sorted(record.params)
    flat = torch.cat([ref[record.params[r]].double().reshape(batch, -1) for r in roles], 1)
    k = k_out * k_in
    p_vec = projection("vector:" + ",".join(roles), record.layer, seed, (k, flat.shape[1]), k, device).double()
    return flat @ p_vec.T
