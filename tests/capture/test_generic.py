"""The generic rule (modules without a rule): exact against torch.func per-sample gradients of the whole model,
and every case it cannot capture exactly reported with the module's name and the fix."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from capturecases import assert_exact, cross_entropy, max_model_relative_error
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.errors import UnsupportedLayerError
from metastore_plugins.testing import autocast_reference_per_sample_gradients, reference_per_sample_gradients

TOKENS = 4  # B = 3 in most tests: no input's first dimension equals the batch size by chance


class Scale(nn.Module):
    """``y = x * gain``: a bare scale vector (as transformers' ``LlamaRMSNorm.weight``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.3 * torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:  # (B, ..., d)
        return x * self.gain


class ClsToken(nn.Module):
    """A learned token prepended to the sequence, learned positions, then a Linear child with its own rule
    (as transformers' ``ViTEmbeddings.cls_token`` / ``position_embeddings``)."""

    def __init__(self, dim: int, tokens: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, dim))
        self.positions = nn.Parameter(0.1 * torch.randn(1, tokens + 1, dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, offsets: Tensor) -> Tensor:  # (B, T, d), (T + 1, d) shared by all samples
        h = torch.cat([self.token.expand(x.shape[0], -1, -1), x], 1)  # (B, T + 1, d)
        return self.proj(h + self.positions + offsets)  # (B, T + 1, d)


class Gate(nn.Module):
    """Two tensor inputs and keyword arguments (one a per-sample mask, one a number)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: Tensor, context: Tensor, *, mask: Tensor | None = None, temperature: float = 1.0) -> Tensor:
        out = x * torch.sigmoid(context @ self.mix / temperature) + self.bias  # (B, T, d)
        return out if mask is None else out * mask.unsqueeze(-1)


class Nested(nn.Module):
    """A bare parameter whose module has a child with the generic rule and a child with a specific rule."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(0.1 * torch.randn(dim))
        self.inner = Scale(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.inner(x) + self.shift)


class TokenModel(nn.Module):
    """``(B, T, 3)`` tokens and a ``(B, T)`` mask -> ``(B, 3)`` logits of the masked mean of the tokens,
    or (``readout="cls"``) of the learned token alone: the layers before it then get no gradient."""

    def __init__(self, dim: int = 6, tokens: int = TOKENS, readout: str = "mean") -> None:
        super().__init__()
        self.readout = readout
        self.embed = nn.Linear(3, dim)
        self.scale = Scale(dim)
        self.cls = ClsToken(dim, tokens)
        self.gate = Gate(dim)
        self.nested = Nested(dim)
        self.head = nn.Linear(dim, 3)
        self.register_buffer("offsets", 0.1 * torch.randn(tokens + 1, dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.cls(self.scale(self.embed(x)), self.offsets)  # (B, T + 1, d)
        mask = torch.cat([torch.ones_like(mask[:, :1]), mask], 1)  # (B, T + 1)
        h = self.nested(self.gate(h, torch.tanh(h), mask=mask, temperature=2.0))  # (B, T + 1, d)
        if self.readout == "cls":
            return self.head(h[:, 0])  # (B, 3)
        return self.head((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))  # (B, 3)


def token_batch(batch: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    mask = torch.ones(batch, TOKENS)
    mask[0, 2:] = 0  # sample 0 is padded
    return torch.randn(batch, TOKENS, 3), mask, torch.randint(0, 3, (batch,))


def token_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0], batch[1]), batch[2])


GENERIC_OF_TOKEN_MODEL = [
    "scale.gain", "cls.token", "cls.positions", "gate.mix", "gate.bias", "nested.shift", "nested.inner.gain"
]  # fmt: skip


# -- exact -----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bare_parameters_are_exact_and_listed(batch_size: int, reduction: str) -> None:
    """Scale vector, learned token, two inputs with kwargs, nesting: all exact, all listed as generic."""
    model = TokenModel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is reported
        session = assert_exact(model, token_loss, token_batch(batch_size), reduction, unsupported="error")
    assert session.generic_parameters() == GENERIC_OF_TOKEN_MODEL
    kinds = {record.layer: record.kind for record in session.factors()}
    assert kinds["cls"] == kinds["nested"] == kinds["nested.inner"] == "dense"
    assert kinds["cls.proj"] in ("outer", "dense") and kinds["nested.norm"] == "dense"  # children: their own rules
    assert set(session.factors()[0].params) <= {"weight", "bias"}  # the head, by the Linear rule


class Pair(nn.Module):
    """A dict output with two differentiable tensors and one that is not."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(dim))
        self.b = nn.Parameter(torch.randn(dim))

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"first": x * self.a, "second": torch.tanh(x) * self.a * self.b, "mask": x.detach() > 0}


class PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.pair, self.head = nn.Linear(4, 4), Pair(4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pair(self.lin(x))
        return self.head(out["first"] + out["second"] ** 2)


class Tempered(nn.Module):
    """The root owns a bare parameter: the generic rule re-runs the whole model (children hooked by their rules)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) / self.temperature


class TiedHead(nn.Module):
    """transformers' ``BertLMPredictionHead``: its own ``bias`` is the ``bias`` of its Linear child."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(4, 3)
        self.bias = nn.Parameter(0.1 * torch.randn(3))
        self.decoder.bias = self.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(torch.tanh(x))


class SequenceFirst(nn.Module):
    """A generic module fed ``(T, B, d)`` tensors (``batch_dims={"inner": 1}``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), Scale(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4)
        return self.head(self.inner(x.transpose(0, 1)).mean(0))


@dataclass(frozen=True)
class ExactCase:
    id: str
    model: Callable[[], nn.Module]
    generic: list[str]
    session: dict[str, Any]


EXACT_CASES = [
    ExactCase("dict-output-two-tensors", PairModel, ["pair.a", "pair.b"], {}),
    ExactCase("root-parameter", Tempered, ["temperature"], {}),
    ExactCase("tied-with-ruled-child", lambda: nn.Sequential(nn.Linear(4, 4), TiedHead()), ["1.bias"], {}),
    ExactCase("sequence-first", SequenceFirst, ["inner.1.gain"], {"batch_dims": {"inner": 1}}),
]


@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: c.id)
def test_outputs_roots_ties_and_layouts_are_exact(case: ExactCase) -> None:
    x = torch.randn(3, TOKENS, 4) if case.id == "sequence-first" else torch.randn(3, 4)
    session = assert_exact(case.model(), cross_entropy, (x, torch.randint(0, 3, (3,))), **case.session)
    assert session.generic_parameters() == case.generic


def test_generic_false_reports_modules_without_a_rule_at_attach() -> None:
    with pytest.warns(UserWarning) as caught:
        with CaptureSession(TokenModel(), generic=False) as session:
            pass
    assert "no capture rule for module 'scale' (Scale)" in str(caught[0].message) and len(caught) == 5
    assert session.uncaptured_parameters() == GENERIC_OF_TOKEN_MODEL
    assert session.generic_parameters() == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_generic_rule_under_autocast_is_within_one_rounding(dtype: torch.dtype) -> None:
    """As every rule: within 4u of per-sample autograd of the same autocast forward (docs/capture.md)."""
    model, batch = TokenModel(), token_batch()

    def loss(m: nn.Module, b: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return token_loss(m, b)

    expected = autocast_reference_per_sample_gradients(model, token_loss, batch, dtype)
    with CaptureSession(model, unsupported="error") as session:
        loss(model, batch).backward()
    actual = session.per_sample_gradients()
    bound = 4 * torch.finfo(dtype).eps / 2
    for name in GENERIC_OF_TOKEN_MODEL:
        error = (actual[name].double() - expected[name].double()).abs().flatten(1).amax(1)  # (B,)
        scale = expected[name].double().abs().flatten(1).amax(1)  # (B,)
        assert (error <= bound * scale + 1e-5 * scale.max()).all(), (name, (error / scale).max().item())


# -- what it cannot capture exactly ---------------------------------------------------------


class ScaleBlock(nn.Module):
    """``x * scale``, in the ways below that the generic rule cannot capture exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class WithDropout(ScaleBlock):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(x * self.scale)


class WithBatchNorm(ScaleBlock):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x) * self.scale


class WithItem(ScaleBlock):
    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale / float(x.detach().abs().max())  # .item(): not vmappable


class WithBranch(ScaleBlock):
    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale if x.sum() > 0 else -x * self.scale  # control flow on a tensor value


class Centered(ScaleBlock):
    """Subtracts the batch mean: vmappable, but a sample's output depends on the other samples."""

    def forward(self, x: Tensor) -> Tensor:
        return (x - x.mean(0)) * self.scale


@dataclass(frozen=True)
class UnsupportedCase:
    id: str
    block: Callable[[], nn.Module]
    message: str
    uncaptured: list[str]


UNSUPPORTED_CASES = [
    UnsupportedCase("dropout", WithDropout, r"'1' \(WithDropout\).*child 'drop' \(Dropout\).*p=0.5.*\.eval\(\)", []),
    UnsupportedCase(
        "batchnorm-training", WithBatchNorm, r"'1' \(WithBatchNorm\).*'bn' \(BatchNorm1d\).*batch statistics", []
    ),
    UnsupportedCase("item", WithItem, r"'1' \(WithItem\).*torch.func.vmap cannot run its forward.*\.item\(\)", []),
    UnsupportedCase("branch", WithBranch, r"'1' \(WithBranch\).*vmap cannot run.*branch on tensor values", []),
    UnsupportedCase("mixes-samples", Centered, r"'1' \(Centered\).*another output than the batched forward", []),
]


@pytest.mark.parametrize("case", UNSUPPORTED_CASES, ids=lambda c: c.id)
def test_what_it_cannot_capture_is_reported_with_the_fix(case: UnsupportedCase) -> None:
    model = nn.Sequential(nn.Linear(4, 4), case.block(), nn.Linear(4, 3)).train()
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    with pytest.warns(UserWarning) as caught:
        with CaptureSession(model) as session:
            cross_entropy(model, (x, y)).backward()
    messages = [str(w.message) for w in caught if "'1' (" in str(w.message)]
    assert len(messages) == 1 and re.search(case.message, messages[0])
    assert "register_capture" in messages[0] and "unsupported='skip'" in messages[0]
    expected = ["1.scale"] + [f"{prefix}.{role}" for prefix in case.uncaptured for role in ("weight", "bias")]
    assert sorted(session.uncaptured_parameters()) == sorted(expected)
    assert session.generic_parameters() == []
    # a training BatchNorm: its own rule captures it, and '0' is below it (tests/capture/test_batchnorm_mixing.py)
    first = {"1.bn.weight", "1.bn.bias"} if case.id == "batchnorm-training" else {"0.weight", "0.bias"}
    assert set(session.per_sample_gradients()) == {*first, "2.weight", "2.bias"}


@pytest.mark.parametrize("case", [UNSUPPORTED_CASES[0], UNSUPPORTED_CASES[2]], ids=["at-forward", "at-backward"])
def test_unsupported_error_raises_and_skip_is_silent(case: UnsupportedCase) -> None:
    model = nn.Sequential(nn.Linear(4, 4), case.block(), nn.Linear(4, 3)).train()
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    with pytest.raises(UnsupportedLayerError, match=case.message):
        with CaptureSession(model, unsupported="error"):
            cross_entropy(model, (x, y)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad=True to a scalar")  # WithItem
        with CaptureSession(model, unsupported="skip") as session:
            cross_entropy(model, (x, y)).backward()
    assert session.uncaptured_parameters() == ["1.scale"]


class LossModel(nn.Module):
    """A model that returns its loss and owns a bare parameter: its output is not per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.linear(x) / self.temperature, y)


def test_a_root_returning_its_loss_is_reported_and_the_rest_stays_exact() -> None:
    model = LossModel()
    batch = (torch.randn(3, 4), torch.randint(0, 3, (3,)))
    loss_fn = lambda m, b: m(*b)  # noqa: E731
    with pytest.warns(UserWarning, match=r"'<root>' \(LossModel\).*output is not per sample.*shapes \[\(\)\]"):
        with CaptureSession(model) as session:
            loss_fn(model, batch).backward()
    assert session.uncaptured_parameters() == ["temperature"]
    expected = reference_per_sample_gradients(model, loss_fn, batch)
    expected.pop("temperature")
    assert max_model_relative_error(session.per_sample_gradients(), expected) <= 1e-5


# -- the capture summary ----------------------------------------------------------------------


def test_the_capture_plan_message_names_the_generic_parameters(tmp_path: Path) -> None:
    """Through RunCapture into a store and back; the layers before the token read no gradient (empty records)."""
    from metastore_plugins import open_store
    from metastore_plugins.core.training.run import RunCapture

    model, (x, mask, y) = TokenModel(readout="cls"), token_batch()
    announced: list[str] = []
    run = RunCapture(tmp_path, encoding="fp32", labels=lambda batch: batch[2], announce=announced.append)
    try:
        run.begin_step(model)
        output = model(x, mask)
        F.cross_entropy(output, y).backward()
        run.end_backward()
        run.finish_step((x, mask, y), torch.arange(3), step=0, output=output)
    finally:
        run.close()
    (message,) = announced
    line = next(line for line in message.splitlines() if "generic rule" in line)
    assert "for 7 parameters: scale.gain, cls.token, cls.positions, gate.mix and 3 more" in line
    expected = reference_per_sample_gradients(model, token_loss, (x, mask, y))
    store = open_store(tmp_path)
    restored = [store.restore(i, capture_point="train", step=0) for i in range(3)]
    actual = {name: torch.stack([sample[name] for sample in restored]) for name in expected}
    assert not expected["embed.weight"].any()  # the loss never reads the tokens: no row kept
    assert max_model_relative_error(actual, expected) <= 1e-5


def test_check_model_accepts_a_model_only_the_generic_rule_covers() -> None:
    from metastore_plugins.core.training.settings import CallbackOptions

    model = TokenModel()
    for module in (model.embed, model.cls.proj, model.nested.norm, model.head):
        module.requires_grad_(False)
    CallbackOptions("Callback").check_model(model, capturable=True)  # no error: the generic rule captures it all
