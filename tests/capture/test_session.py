"""CaptureSession: lifecycle, unsupported-layer policy, user rules, scaling conventions, arguments."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from capturecases import TOLERANCE, assert_exact, cross_entropy, squared_error
from torch import Tensor, nn

from metastore_plugins.core.capture import (
    CaptureSession,
    find_rule,
    register_capture,
    registered_types,
    unregister_capture,
)
from metastore_plugins.core.errors import UnsupportedLayerError
from metastore_plugins.core.records import dense_record
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients


class Gain(nn.Module):
    """``y = x * gain``: a custom module with its own parameter and no built-in rule."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


def gain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), Gain(6), nn.Tanh(), nn.Sequential(Gain(6), nn.Linear(6, 3)))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def vector_batch(batch: int = 4) -> tuple[Tensor, Tensor]:
    return torch.randn(batch, 5), torch.randint(0, 3, (batch,))


def all_hooks(model: nn.Module) -> list[Any]:
    return [
        hook
        for module in model.modules()
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
        for hook in hooks.values()
    ]


def capture_gain(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, ctx: Any) -> None:
    """``grad gain_i = sum_t D_i[t] * x_i[t]``."""
    x = ctx.batch_first(args[0]).detach()  # (B, ..., d)
    params = ctx.param_names(module)

    def records(grad: Tensor) -> list[Any]:  # (B, ..., d)
        per_sample = (grad * x).reshape(x.shape[0], -1, x.shape[-1]).sum(1)  # (B, d)
        return [dense_record(ctx.name, {"gain": per_sample}, params)]

    ctx.on_output_grad(output, records)


@pytest.fixture
def gain_rule() -> Iterator[None]:
    register_capture(Gain, params=("gain",))(capture_gain)
    yield
    unregister_capture(Gain)


# -- lifecycle ---------------------------------------------------------------------------


def test_attaching_twice_is_a_clear_error() -> None:
    model = mlp()
    with CaptureSession(model) as session:
        with pytest.raises(RuntimeError, match="already attached"):
            CaptureSession(model).attach()
        with pytest.raises(RuntimeError, match="already attached"):
            session.attach()
    with CaptureSession(model):  # closed sessions release the model
        pass


@pytest.mark.usefixtures("gain_rule")
def test_leaving_the_block_removes_every_hook() -> None:
    model = gain_model()  # Linear, user rule and nested modules
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with CaptureSession(model) as session:
        assert all_hooks(model)
        cross_entropy(model, (x, y)).backward()
    count = len(session.factors())
    assert count == 4 and all_hooks(model) == []
    cross_entropy(model, (x, y)).backward()  # a later forward and backward add nothing
    assert len(session.factors()) == count


def test_backward_after_the_block_adds_nothing() -> None:
    model = mlp()
    with CaptureSession(model) as session:
        loss = cross_entropy(model, vector_batch())  # forward inside ...
    loss.backward()  # ... backward outside
    assert session.factors() == []


def test_hooks_are_removed_when_the_block_raises() -> None:
    model = mlp()
    with pytest.raises(ZeroDivisionError):
        with CaptureSession(model):
            raise ZeroDivisionError
    assert all_hooks(model) == []
    with CaptureSession(model):  # and the model can be attached again
        pass


def test_reset_forgets_records() -> None:
    model = mlp()
    with CaptureSession(model) as session:
        cross_entropy(model, vector_batch()).backward()
        assert session.factors()
        session.reset()
        assert session.factors() == []


def test_a_paused_session_collects_nothing_and_resumes_exactly() -> None:
    model, batch = mlp(), vector_batch(5)
    expected = reference_per_sample_gradients(model, cross_entropy, batch)
    with CaptureSession(model) as session:
        session.pause()
        loss = cross_entropy(model, batch)  # a forward while paused hooks nothing ...
        session.resume()
        loss.backward()  # ... so its backward adds nothing either
        assert session.factors() == []
        session.rescale(0.5)  # the next step's loss is halved
        (cross_entropy(model, batch) * 0.5).backward()
        assert max_relative_error(session.per_sample_gradients(), expected) <= TOLERANCE
    with pytest.raises(ValueError, match="loss_scale"):
        session.rescale(0.0)


# -- unsupported layers (generic=False: modules without a rule are reported at attach) ------------


def test_unsupported_warns_once_per_module_naming_path_and_type() -> None:
    model = gain_model()
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    with pytest.warns(UserWarning) as caught:
        with CaptureSession(model, generic=False) as session:
            for _ in range(2):  # two steps: still one warning per module
                cross_entropy(model, (x, y)).backward()
    messages = [str(w.message) for w in caught if "Gain" in str(w.message)]
    assert len(messages) == 2
    assert "'1' (Gain)" in messages[0] and "1.gain" in messages[0]
    assert "'3.0' (Gain)" in messages[1] and "3.0.gain" in messages[1]
    assert session.uncaptured_parameters() == ["1.gain", "3.0.gain"]
    assert set(session.per_sample_gradients()) == {"0.weight", "0.bias", "3.1.weight", "3.1.bias"}


def test_unsupported_error_raises_and_leaves_no_hooks() -> None:
    model = gain_model()
    session = CaptureSession(model, unsupported="error", generic=False)
    with pytest.raises(UnsupportedLayerError, match=r"'1' \(Gain\)"):
        session.attach()
    assert session.uncaptured_parameters() == ["1.gain"]
    assert all_hooks(model) == []
    with CaptureSession(model, unsupported="skip"):  # the failed attach released the model
        pass


def test_unsupported_skip_is_silent_and_still_listed() -> None:
    model = gain_model()
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CaptureSession(model, unsupported="skip", generic=False) as session:
            cross_entropy(model, (x, y)).backward()
    assert session.uncaptured_parameters() == ["1.gain", "3.0.gain"]


def test_frozen_parameters_are_not_reported() -> None:
    model = gain_model()
    for module in (model[1], model[3][0]):
        module.gain.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session = assert_exact(model, cross_entropy, (torch.randn(3, 4), torch.randint(0, 3, (3,))))
    assert set(session.per_sample_gradients()) == {"0.weight", "0.bias", "3.1.weight", "3.1.bias"}


# -- user rules --------------------------------------------------------------------------


@pytest.mark.usefixtures("gain_rule")
@pytest.mark.parametrize("shape", [(4, 4), (3, 5, 4)], ids=["vector", "sequence"])
def test_registered_rule_captures_a_custom_module_exactly(shape: tuple[int, ...]) -> None:
    model = gain_model()
    x = torch.randn(shape)
    y = torch.randn(*shape[:-1], 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session = assert_exact(model, squared_error, (x, y))
    assert {r.layer: r.kind for r in session.factors()}["3.0"] == "dense"


def test_unregister_capture_cleans_up() -> None:
    register_capture(Gain, params=("gain",))(capture_gain)
    try:
        assert find_rule(Gain(2)) is not None
    finally:  # a failure here must not leave the rule registered for the tests that run next
        unregister_capture(Gain)
    assert find_rule(Gain(2)) is None
    with pytest.warns(UserWarning, match="Gain"):
        with CaptureSession(gain_model(), generic=False) as session:
            pass
    assert session.uncaptured_parameters() == ["1.gain", "3.0.gain"]
    unregister_capture(Gain)  # no error when there is nothing to remove


def test_register_capture_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        register_capture(int)(capture_gain)  # type: ignore[arg-type]


def test_docs_examples_run() -> None:
    """Every Python block of docs/capture.md runs (the custom-rule example checks itself)."""
    text = (Path(__file__).parents[2] / "docs" / "capture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    before = set(registered_types())
    try:
        for block in blocks:
            exec(compile(block, "docs/capture.md", "exec"), {"__name__": "docs_capture"})
    finally:  # rules the examples registered (they unregister them at the end, unless they failed first)
        for module_type in set(registered_types()) - before:
            unregister_capture(module_type)


# -- scaling conventions -----------------------------------------------------------------


class StubScaler:
    """The part of ``torch.amp.GradScaler`` capture relies on."""

    def get_scale(self) -> float:
        return 1024.0


def _sum_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="sum")


@pytest.mark.parametrize(
    "reduction,multiplier,session_kwargs",
    [
        ("mean", 1.0, {}),
        ("sum", 1.0, {}),
        ("mean", 0.25, {"loss_scale": 0.25}),
        ("mean", 1024.0, {"grad_scaler": StubScaler()}),
        ("sum", 1024.0 * 0.5, {"grad_scaler": StubScaler(), "loss_scale": 0.5}),
    ],
    ids=["mean", "sum", "loss-scale", "grad-scaler-stub", "sum-scaler-and-scale"],
)
def test_scaling_is_undone(reduction: str, multiplier: float, session_kwargs: dict[str, Any]) -> None:
    model, batch = mlp(), vector_batch(5)
    loss_fn = cross_entropy if reduction == "mean" else _sum_loss
    expected = reference_per_sample_gradients(model, cross_entropy, batch)  # each sample's own loss
    with CaptureSession(model, loss_reduction=reduction, **session_kwargs) as session:
        (loss_fn(model, batch) * multiplier).backward()
    assert max_relative_error(session.per_sample_gradients(), expected) <= TOLERANCE


def test_wrong_reduction_is_visible() -> None:
    """The convention matters: a mean loss declared as a sum gives gradients B times too small."""
    model, batch = mlp(), vector_batch(4)
    expected = reference_per_sample_gradients(model, cross_entropy, batch)
    with CaptureSession(model, loss_reduction="sum") as session:
        cross_entropy(model, batch).backward()
    actual = {name: 4 * grad for name, grad in session.per_sample_gradients().items()}
    assert max_relative_error(actual, expected) <= TOLERANCE


def test_real_grad_scaler_is_undone() -> None:
    model, batch = mlp(), vector_batch(4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    expected = reference_per_sample_gradients(model, cross_entropy, batch)
    with CaptureSession(model, grad_scaler=scaler) as session:
        scaler.scale(cross_entropy(model, batch)).backward()
        actual = session.per_sample_gradients()  # before scaler.update()
    assert max_relative_error(actual, expected) <= TOLERANCE


# -- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"loss_reduction": "avg"}, "loss_reduction"),
        ({"unsupported": "ignore"}, "unsupported"),
        ({"loss_scale": 0.0}, "loss_scale"),
        ({"loss_scale": float("inf")}, "loss_scale"),
        ({"loss_scale": "a lot"}, "loss_scale"),
        ({"grad_scaler": 1024.0}, "grad_scaler"),
        ({"modules": "0"}, "modules"),
    ],
    ids=["reduction", "unsupported", "zero-scale", "inf-scale", "str-scale", "scaler", "modules-str"],
)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        CaptureSession(mlp(), **kwargs)


@pytest.mark.parametrize(
    "kwargs,argument", [({"modules": ["1", "4"]}, "modules"), ({"batch_dims": {"x": 1}}, "batch_dims")]
)
def test_unknown_module_paths_are_rejected_at_attach(kwargs: dict[str, Any], argument: str) -> None:
    model = mlp()
    with pytest.raises(ValueError, match=rf"{argument} names modules .*'(4|x)'"):
        CaptureSession(model, **kwargs).attach()
    assert all_hooks(model) == []


def test_modules_restricts_capture() -> None:
    model, batch = mlp(), vector_batch()
    expected = reference_per_sample_gradients(model, cross_entropy, batch)
    with CaptureSession(model, modules=["2"]) as session:
        cross_entropy(model, batch).backward()
    actual = session.per_sample_gradients()
    assert set(actual) == {"2.weight", "2.bias"}
    assert session.uncaptured_parameters() == []
    assert max_relative_error(actual, {name: expected[name] for name in actual}) <= TOLERANCE
