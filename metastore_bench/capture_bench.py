"""Capture: step time (forward + backward + SGD step) of plain training and of each way
to get per-sample gradients, side by side on the same model and batch.

- ``plain``: no per-sample gradients;
- ``capture+store``: :class:`RunCapture` as the callbacks use it (the model hooked once; records,
  per-sample losses and labels to a :class:`StoreWriter`, fp16, background thread);
- ``torch.func``: ``vmap(grad(per-sample loss))``, then the mean gradient for the step;
- ``opacus``: ``GradSampleModule`` (hooks); ``backpack``: ``extend`` + ``BatchGrad``.

A peer that is not installed is reported as ``skipped``; one that raises on the model
is reported as ``failed`` with its error. Nothing is estimated.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from metastore_plugins.core.training.run import RunCapture

from .models import Workload, parameter_count
from .timing import median, round_robin

LR = 1e-4


def functional_batch(workload: Workload, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch torch.func can vmap over: for BERT a ready additive (B, 1, 1, T) mask, because
    transformers' 2-D mask handling branches on the mask's content (``mask.all()``)."""
    if workload.kind != "text":
        return batch
    mask = batch["attention_mask"][:, None, None, :].float()  # (B, 1, 1, T)
    return {**batch, "attention_mask": (1.0 - mask) * torch.finfo(torch.float32).min}


class _SampleLoss(nn.Module):
    def __init__(self, model: nn.Module, workload: Workload) -> None:
        super().__init__()
        self.model, self.workload = model, workload

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.workload.loss(self.model, batch)


def func_per_sample_grads(model: nn.Module, workload: Workload, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``name -> (B, *shape)`` by ``torch.func.vmap(grad(...))`` over single-sample batches."""
    wrapper = _SampleLoss(model, workload)
    params = {n: p.detach() for n, p in wrapper.named_parameters() if p.requires_grad}

    def loss_of(parameters: dict[str, Tensor], sample: dict[str, Tensor]) -> Tensor:
        return functional_call(wrapper, parameters, (tree_map(lambda t: t.unsqueeze(0), sample),))

    grads = vmap(grad(loss_of), in_dims=(None, 0))(params, functional_batch(workload, batch))
    return {name.removeprefix("model."): g for name, g in grads.items()}


def per_sample_ce(logits: Any, labels: Tensor) -> Tensor:
    return F.cross_entropy(getattr(logits, "logits", logits), labels, reduction="none")


def _plain(workload: Workload, batch: dict[str, Tensor], _: dict[str, Any]) -> Callable[[], None]:
    model = workload.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()
        opt.step()

    return step


def _capture_store(workload: Workload, batch: dict[str, Tensor], state: dict[str, Any]) -> Callable[[], None]:
    """What the Lightning and HF callbacks run per step: :class:`RunCapture` (model hooked once)."""
    model = workload.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tmp = tempfile.TemporaryDirectory(prefix="msbench-")
    run = RunCapture(tmp.name, encoding="fp16")

    def cleanup() -> None:  # what is still queued when timing ends is written here, and timed
        start = time.perf_counter()
        run.close()
        state.update(writer=run.writer.stats, flush_s=time.perf_counter() - start)
        tmp.cleanup()

    state["cleanup"] = cleanup
    counter = iter(range(10**9))
    size = batch["labels"].shape[0]

    def step() -> None:
        k = next(counter)
        opt.zero_grad(set_to_none=True)
        run.begin_step(model)
        logits = workload.forward(model, batch)
        F.cross_entropy(logits, batch["labels"]).backward()
        run.end_backward()
        run.finish_step(batch, torch.arange(size) + k * size, step=k, lr=LR, output=logits)
        opt.step()

    return step


def _torch_func(workload: Workload, batch: dict[str, Tensor], _: dict[str, Any]) -> Callable[[], None]:
    model = workload.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    named = dict(model.named_parameters())

    def step() -> None:
        grads = func_per_sample_grads(model, workload, batch)
        for name, g in grads.items():
            named[name].grad = g.mean(0)
        opt.step()

    return step


def _opacus(workload: Workload, batch: dict[str, Tensor], state: dict[str, Any]) -> Callable[[], None]:
    from opacus import GradSampleModule

    model = workload.build()
    wrapped = GradSampleModule(model, loss_reduction="mean")
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        for p in model.parameters():
            p.grad, p.grad_sample = None, None
        workload.loss(wrapped, batch).backward()
        opt.step()

    return step


def _backpack(workload: Workload, batch: dict[str, Tensor], state: dict[str, Any]) -> Callable[[], None]:
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    model = extend(workload.build(), use_converter=False)
    loss_fn = extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with backpack(BatchGrad()):
            loss_fn(workload.forward(model, batch), batch["labels"]).backward()
        opt.step()

    return step


METHODS: dict[str, tuple[Callable[..., Callable[[], None]], str | None]] = {
    "plain": (_plain, None),
    "capture+store": (_capture_store, None),
    "torch.func": (_torch_func, None),
    "opacus": (_opacus, "opacus"),
    "backpack": (_backpack, "backpack"),
}


def run(workload: Workload, repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Median step seconds per method and each method's ratio to plain."""
    batch = workload.batch(workload.batch_size, seed=0)
    steps: dict[str, Callable[[], None]] = {}
    states: dict[str, dict[str, Any]] = {}
    methods: dict[str, dict[str, Any]] = {}
    for name, (setup, module) in METHODS.items():
        if module is not None and importlib.util.find_spec(module) is None:
            methods[name] = {"status": "skipped (not installed)"}
            continue
        states[name] = {}
        try:
            step = setup(workload, batch, states[name])
            step()  # a method that cannot run on this model fails here, before any timing
        except Exception as exc:  # noqa: BLE001 - reported, never hidden
            methods[name] = {"status": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            continue
        steps[name] = step
    times = round_robin(steps, repeats, warmup)
    for state in states.values():
        if "cleanup" in state:
            state["cleanup"]()
    plain = median(times.get("plain", []))
    for name, values in times.items():
        methods[name] = {
            "status": "ok",
            "median_s": median(values),
            "times_s": values,
            "ratio_to_plain": median(values) / plain,
        }
    stats = states.get("capture+store", {}).get("writer")
    if stats is not None:
        methods["capture+store"]["writer_wait_s"] = stats.wait_seconds
        methods["capture+store"]["bytes_written"] = stats.bytes_written
        methods["capture+store"]["final_flush_s"] = states["capture+store"]["flush_s"]
    return {
        "workload": workload.name,
        "batch_size": workload.batch_size,
        "tokens": workload.tokens,
        "parameters": parameter_count(workload.build()),
        "repeats": repeats,
        "warmup": warmup,
        "methods": {name: methods[name] for name in METHODS},
    }
