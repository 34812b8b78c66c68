"""Tiny models, torch.func references and synthetic records for the store tests.

Every expected value here is computed from first principles (``torch.func`` gradients,
``einsum`` of known factors), never by the store code under test.
"""

from __future__ import annotations

import base64
import copy
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad

from metastore_plugins.core.records import LayerRecord

VOCAB, PAD, TOKENS, CLASSES = 11, 0, 5, 3


class PooledTagger(nn.Module):
    """Embedding -> Linear -> LayerNorm per token, masked mean over tokens, Linear head.

    Yields every record kind: ``emb`` embedding, ``enc`` outer with padding rows dropped,
    ``norm`` dense, ``head`` outer with one row per sample.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.enc = nn.Linear(16, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, CLASSES)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.norm(torch.tanh(self.enc(self.emb(ids))))  # (B, T, 12)
        m = mask.unsqueeze(-1).float()  # (B, T, 1)
        pooled = (h * m).sum(1) / m.sum(1)  # (B, 12)
        return self.head(pooled)  # (B, C)


def tagger_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["ids"], batch["mask"]), batch["y"])


def tagger_batch(sample_ids: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
    """A padded batch whose content is a function of nothing but the generator state."""
    size = sample_ids.shape[0]
    lengths = torch.randint(1, TOKENS + 1, (size,), generator=generator)  # (B,)
    mask = (torch.arange(TOKENS) < lengths[:, None]).long()  # (B, T)
    ids = torch.randint(1, VOCAB, (size, TOKENS), generator=generator) * mask  # (B, T), PAD = 0
    return {"ids": ids, "mask": mask, "y": torch.randint(0, CLASSES, (size,), generator=generator)}


def per_sample_losses(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: dict[str, Tensor]
) -> Tensor:
    """``(B,)`` each sample's own loss, one forward per sample."""
    size = next(iter(batch.values())).shape[0]
    with torch.no_grad():
        return torch.stack([loss_fn(model, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(size)])


def reference_loop(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: dict[str, Tensor]
) -> dict[str, Tensor]:
    """``torch.func.grad`` of each sample's own loss, one sample at a time.

    For models whose forward ``vmap`` cannot run (BERT's data-dependent masking).
    """
    frozen = copy.deepcopy(model)
    params = {n: p.detach() for n, p in frozen.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in frozen.named_buffers()}

    def sample_loss(parameters: dict[str, Tensor], sample: dict[str, Tensor]) -> Tensor:
        return loss_fn(_Functional(frozen, parameters, buffers), sample)

    size = next(iter(batch.values())).shape[0]
    grads = [grad(sample_loss)(params, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(size)]
    return {name: torch.stack([g[name] for g in grads]) for name in params}


class _Functional:
    """Calls ``module`` with swapped parameters, standing in for the model inside ``loss_fn``."""

    def __init__(self, module: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor]) -> None:
        self.module, self.state = module, (params, buffers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.module, self.state, args, kwargs)


def flat(grads: dict[str, Tensor], names: list[str] | None = None) -> Tensor:
    """One sample's gradient as a float64 vector over ``names`` (all parameters by default)."""
    keys = sorted(grads) if names is None else names
    return torch.cat([grads[k].double().reshape(-1) for k in keys])


def rel_err(actual: Any, expected: Any) -> float:
    """``max |actual - expected| / max |expected|``."""
    a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-300))


# -- synthetic records with known gradients (for writer tests and the crash subprocess) ---------

#: Restored fp32 gradients against :func:`synthetic_batch`'s einsum: both sum a sample's rows in fp32,
#: each in the order its kernel (BLAS, vector width, threads) chooses, so they agree up to fp32 round-off
#: (torch's float32 defaults; the values are O(1)), not bit for bit. fp16 storage (2^-11) would fail this.
FP32_ROUNDOFF = {"rtol": 1.3e-6, "atol": 1e-5}


def synthetic_batch(
    seed: int, size: int = 4, d_in: int = 6, d_out: int = 5
) -> tuple[list[LayerRecord], dict[str, Tensor]]:
    """An outer record (2 rows per sample) and a dense record, with their gradients by einsum.

    Returns:
        records, and parameter name -> ``(B, *shape)`` expected per-sample gradients.
    """
    g = torch.Generator().manual_seed(seed)
    rows = 2 * size
    prefix = torch.randn(rows, 1, d_in, generator=g)  # (R, 1, d_in)
    suffix = torch.randn(rows, 1, d_out, generator=g)  # (R, 1, d_out)
    sample = torch.arange(size).repeat_interleave(2).int()  # (R,)
    outer = LayerRecord(
        layer="fc",
        kind="outer",
        batch_size=size,
        params={"weight": "fc.weight", "bias": "fc.bias"},
        param_shapes={"weight": (d_out, d_in), "bias": (d_out,)},
        tensors={"prefix": prefix, "suffix": suffix, "sample": sample, "position": torch.arange(rows).int() % 2},
    )
    scale = torch.randn(size, d_out, generator=g)  # (B, d_out)
    dense = LayerRecord(
        layer="ln",
        kind="dense",
        batch_size=size,
        params={"weight": "ln.weight"},
        param_shapes={"weight": (d_out,)},
        tensors={"grad.weight": scale},
    )
    a, d = prefix[:, 0].reshape(size, 2, d_in), suffix[:, 0].reshape(size, 2, d_out)
    expected = {
        "fc.weight": torch.einsum("bto,bti->boi", d, a),
        "fc.bias": d.sum(1),
        "ln.weight": scale.clone(),
    }
    return [outer, dense], expected


def journal_entries(path: Path, rank: int = 0) -> list[dict[str, Any]]:
    """A rank's index journal decoded by hand (docs/format.md), CRC checked; columns as ``(dtype, values)``."""
    entries = []
    for line in (path / f"index-rank{rank}.jsonl").read_bytes().splitlines():
        text, crc = line.rsplit(b" ", 1)
        assert int(crc, 16) == zlib.crc32(text)
        entry = json.loads(text)
        for group in ("batches", "records", "samples"):
            entry[group] = {
                key: (code, np.frombuffer(base64.b64decode(data), f"<{code}").tolist())
                for key, (code, data) in entry[group].items()
            }
        entries.append(entry)
    return entries
