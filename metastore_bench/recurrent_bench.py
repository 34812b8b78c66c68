"""Recurrent layers: the fused kernel without capture against the unrolled recurrence capture runs.

``python -m metastore_bench.recurrent_bench [--size full|tiny] [--repeats 11] [--threads N] [--doc PATH] [--out JSON]``

Per module (``nn.LSTM``, ``nn.GRU``; 2 layers, ``B = 32``, ``T = 64``, ``d_in = H = 256``; a padded batch and a
``PackedSequence`` of random lengths), forward + backward of one batch two ways, round-robin (one step each
per round, median over rounds, :func:`metastore_bench.timing.round_robin`), each on its own copy of the module:

- ``fused``: plain autograd through the fused kernel (oneDNN for LSTM on the CPU, ATen's for GRU);
- ``captured``: a :class:`CaptureSession`: the fused forward, then the unrolled recurrence that replaces its
  output, hooked, and the records (read and reset every step, as a training loop does).

Also, outside the timing: the memory autograd keeps for backward after the forward (distinct storages
saved for backward and still alive, which the fused forward's discarded graph is not) and the bytes of
the records; and the numerical difference of the captured run from the fused one (its ``.grad`` and the
sum of its per-sample gradients against the fused ``.grad``, relative to each parameter's largest entry).

Writes ``metastore_bench/results/recurrent.json`` and the ``recurrent`` section of ``docs/benchmarks.md``.
``--size tiny`` is a smoke run (seconds), not a measurement.
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from metastore_plugins.core.capture import CaptureSession, restore_all

from .publish import publish, round_robin_meta, round_robin_parser
from .timing import median, round_robin

START, END = "<!-- recurrent:start -->", "<!-- recurrent:end -->"

Batch = Tensor | PackedSequence


@dataclass(frozen=True)
class Case:
    """One module and one batch."""

    name: str
    module: type[nn.RNNBase]
    packed: bool
    batch: int
    length: int
    hidden: int
    layers: int = 2

    def build(self) -> nn.RNNBase:
        return self.module(self.hidden, self.hidden, num_layers=self.layers, batch_first=True)

    def inputs(self, g: torch.Generator) -> Batch:
        x = torch.randn(self.batch, self.length, self.hidden, generator=g)  # (B, T, d_in)
        if not self.packed:
            return x
        lengths = torch.randint(1, self.length + 1, (self.batch,), generator=g)
        lengths[0] = self.length
        return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)


def cases(size: str) -> list[Case]:
    b, t, h = (32, 64, 256) if size == "full" else (2, 3, 4)
    return [Case(f"{m.__name__}, {'packed' if p else 'padded'}", m, p, b, t, h) for m in (nn.LSTM, nn.GRU)
            for p in (False, True)]  # fmt: skip


def loss_of(module: nn.RNNBase, x: Batch) -> Tensor:
    """Mean over samples of a loss that reads every output and the last state."""
    out, hidden = module(x)
    data = out.data if isinstance(out, PackedSequence) else out  # (N, H) or (B, T, H)
    h_n = hidden[0] if isinstance(hidden, tuple) else hidden  # (L, B, H)
    weights = torch.linspace(-1, 1, data.shape[-1])  # (H,)
    return ((data * weights).sum() + h_n.pow(2).sum()) / h_n.shape[1]


def step_of(module: nn.RNNBase, x: Batch, session: CaptureSession | None) -> Callable[[], Any]:
    """One forward + backward (and the records read and dropped, as a training step does)."""

    def step() -> Any:
        module.zero_grad(set_to_none=True)
        loss_of(module, x).backward()
        if session is None:
            return None
        records = session.factors()
        session.reset()
        return records

    return step


def saved_bytes(module: nn.RNNBase, x: Batch) -> int:
    """Bytes of the distinct storages autograd keeps for backward once the forward has returned."""
    saved: list[weakref.ref[Tensor]] = []

    def pack(tensor: Tensor) -> Tensor:  # a new tensor object: returning `tensor` itself would make a
        kept = tensor.detach()  # reference cycle through its grad_fn and keep a discarded graph alive
        saved.append(weakref.ref(kept))
        return kept

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(module, x)
    storages = {}
    for ref in saved:
        tensor = ref()
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    del loss
    return sum(storages.values())


def measure(case: Case, repeats: int, warmup: int) -> dict[str, Any]:
    """Median seconds per step of both variants, memory, and the numerical difference."""
    torch.manual_seed(0)
    fused = case.build()
    captured = copy.deepcopy(fused)
    x = case.inputs(torch.Generator().manual_seed(1))
    fused_bytes = saved_bytes(fused, x)
    with CaptureSession(captured, unsupported="error") as session:
        captured_bytes = saved_bytes(captured, x)
        times = round_robin({"fused": step_of(fused, x, None), "captured": step_of(captured, x, session)}, repeats,
                            warmup)  # fmt: skip
        records = step_of(captured, x, session)()
    step_of(fused, x, None)()
    per_sample = restore_all(records)
    names = dict(captured.named_parameters())
    want = {name: p.grad for name, p in fused.named_parameters() if p.grad is not None}
    grad_error = max(_rel(names[n].grad, g) for n, g in want.items())
    sum_error = max(_rel(per_sample[n].mean(0), g) for n, g in want.items())
    fused_s, captured_s = median(times["fused"]), median(times["captured"])
    return {
        "module": f"nn.{case.module.__name__}",
        "input": "PackedSequence" if case.packed else "padded",
        "shape": f"B={case.batch}, T={case.length}, d_in=H={case.hidden}, {case.layers} layers",
        "fused": {"median_s": fused_s, "times_s": times["fused"]},
        "captured": {"median_s": captured_s, "times_s": times["captured"], "overhead": captured_s / fused_s},
        "saved_bytes": {"fused": fused_bytes, "captured": captured_bytes},
        "record_bytes": sum(record.nbytes for record in records),
        "grad_vs_fused": grad_error,
        "per_sample_sum_vs_fused": sum_error,
    }


def _rel(actual: Tensor | None, expected: Tensor) -> float:
    assert actual is not None
    return float((actual - expected).abs().max() / expected.abs().max())


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"### {meta['machine']}, {meta['threads']} thread(s); torch {meta['versions'].get('torch')}",
        "",
        f"`python -m metastore_bench.recurrent_bench` ({meta['measured']}, size `{meta['size']}`): median of "
        f"{meta['repeats']} round-robin rounds of forward + backward of one batch, each variant on its own copy "
        "of the module; records read and reset every step. *Saved* is what autograd keeps for backward once the "
        "forward has returned (distinct storages); *records* the bytes of one step's records. The last two "
        "columns compare the captured run with the fused one: its `.grad`, and the mean of its per-sample "
        "gradients, against the fused `.grad` (largest difference relative to each parameter's largest entry).",
        "",
        "| module | input | batch | fused | captured | saved: fused / captured | records | `.grad` | "
        "mean of per-sample |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in results.values():
        fused, captured, saved = entry["fused"], entry["captured"], entry["saved_bytes"]
        lines.append(
            f"| `{entry['module']}` | {entry['input']} | {entry['shape']} | {_ms(fused)} | "
            f"{_ms(captured)} ({captured['overhead']:.2f}x) | {_mib(saved['fused'])} / {_mib(saved['captured'])} | "
            f"{_mib(entry['record_bytes'])} | {entry['grad_vs_fused']:.1e} | {entry['per_sample_sum_vs_fused']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _ms(row: dict[str, Any]) -> str:
    return f"{1000 * row['median_s']:.1f} ms"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = round_robin_parser("recurrent_bench", __doc__, "recurrent.json").parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for case in cases(args.size):
        print(f"[recurrent] {case.name}", file=sys.stderr, flush=True)
        results[case.name] = measure(case, args.repeats, args.warmup)
    meta = round_robin_meta(args, torch.get_num_threads())
    return publish(args.out, {"meta": meta, "results": results}, markdown(results, meta), args.doc, (START, END))


if __name__ == "__main__":
    raise SystemExit(main())
