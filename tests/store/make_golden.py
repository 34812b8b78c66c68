"""Write the golden stores of tests/store/test_golden.py: ``python tests/store/make_golden.py``.

Each format version's store is written once, by the writer of that version, and committed
as test data (a few KB) that pins the on-disk format (docs/format.md): ``golden/store/``
(format version 1, with ``golden/expected.json``), ``golden/store_v2/`` and ``golden/store_v3/``
(versions 2 and 3, the same run). The script writes only the current version's store, and refuses to overwrite it:
do not rerun it to make a failing golden test pass, since a failure means old stores no
longer read the same.

The run is fixed by its seeds: a tiny model with every record kind (``emb`` embedding,
``enc`` outer with padding rows dropped, ``norm`` dense, ``head`` outer), two ranks:

- rank 0, ``fp32``: training steps 0 and 1 (one shard of two batches, an SGD step
  between them), then a ``final/test`` pass (a second shard);
- rank 1, ``int8``: training step 0, micro-batch 1 (one shard).

The expected gradients in ``expected.json`` come from ``torch.func``
(:func:`metastore_plugins.testing.reference_per_sample_gradients`), never from the store.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import CaptureSession, StoreWriter
from metastore_plugins.core.store.shards.manifest import SCHEMA_VERSION
from metastore_plugins.testing import reference_per_sample_gradients

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
VOCAB, TOKENS, CLASSES = 7, 3, 2  # 3 tokens: enc's factors never outgrow its dense gradient


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6, padding_idx=0)
        self.enc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        mask = ids.ne(0).unsqueeze(-1).float()  # (B, T, 1)
        h = self.norm(torch.tanh(self.enc(self.emb(ids))))  # (B, T, 6)
        return self.head((h * mask).sum(1) / mask.sum(1))  # (B, C)


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["ids"]), batch["y"])


def _batch(size: int, generator: torch.Generator) -> dict[str, Tensor]:
    lengths = torch.randint(1, TOKENS + 1, (size,), generator=generator)  # (B,)
    ids = torch.randint(1, VOCAB, (size, TOKENS), generator=generator) * (torch.arange(TOKENS) < lengths[:, None])
    return {"ids": ids, "y": torch.randint(0, CLASSES, (size,), generator=generator)}


def _rounded(tensor: Tensor) -> Any:
    """Nested lists of floats with 9 significant digits (float32 round-trips through them)."""
    if tensor.dim() == 0:
        return float(f"{float(tensor):.9g}")
    return [_rounded(t) for t in tensor]


def build(directory: Path) -> dict[str, Any]:
    """Write the golden store into ``directory``; return what a reader must find there."""
    generator = torch.Generator().manual_seed(1)
    with torch.random.fork_rng(devices=[]):  # the same weights as ever, and the caller's global RNG left alone
        torch.manual_seed(0)
        model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected: dict[str, Any] = {"samples": []}
    writers = {
        0: StoreWriter(directory, rank=0, encoding="fp32", shard_bytes=1 << 20, config={"golden": True, "seed": 0}),
        1: StoreWriter(directory, rank=1, encoding="int8", shard_bytes=1 << 20, config={"golden": True}),
    }

    def capture(rank: int, ids: list[int], cp: str, step: int, micro_batch: int = 0, train: bool = False) -> None:
        batch = _batch(len(ids), generator)
        reference = reference_per_sample_gradients(model, loss_fn, batch)
        with torch.no_grad():
            logits = model(batch["ids"])
        losses = F.cross_entropy(logits, batch["y"], reduction="none")
        with CaptureSession(model) as session:
            loss_fn(model, batch).backward()
        writers[rank].write(
            session.factors(),
            sample_ids=ids,
            step=step,
            capture_point=cp,
            micro_batch=micro_batch,
            labels=batch["y"],
            losses=losses,
            predictions=logits.argmax(1),
            lr=0.5,
        )
        if train:
            optimizer.step()
        optimizer.zero_grad()
        for pos, sample in enumerate(ids):
            expected["samples"].append(
                {
                    "capture_point": cp,
                    "step": step,
                    "micro_batch": micro_batch,
                    "rank": rank,
                    "sample_id": sample,
                    "label": int(batch["y"][pos]),
                    "loss": float(losses[pos]),
                    "prediction": int(logits[pos].argmax()),
                    "encoding": writers[rank].encoding,
                    "grads": {name: _rounded(g[pos]) for name, g in sorted(reference.items())},
                }
            )

    capture(1, [6, 7, 8], "train", step=0, micro_batch=1)  # rank 1 first: it sees the step-0 weights
    capture(0, [0, 1, 2], "train", step=0, train=True)
    capture(0, [3, 4, 5], "train", step=1, train=True)
    writers[0].flush()  # shard rank0-000000: two batches
    capture(0, [10, 11], "final/test", step=2)
    for writer in writers.values():
        writer.close()
    expected["parameters"] = {name: list(p.shape) for name, p in model.named_parameters()}
    return expected


def _same(old: Any, new: Any) -> bool:
    """Equal, floats to a relative 1e-5 (float rounding differs across torch versions)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and old.keys() == new.keys() and all(_same(old[k], new[k]) for k in old)
    if isinstance(old, list):
        return isinstance(new, list) and len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))
    if isinstance(old, float):
        return abs(old - new) <= 1e-5 * max(1.0, abs(old))
    return bool(old == new)


def main() -> None:
    store = GOLDEN / f"store_v{SCHEMA_VERSION}"
    if store.exists():
        sys.exit(f"{store} exists: golden stores are written once per format version")
    expected = build(store)
    if not _same(json.loads((GOLDEN / "expected.json").read_text()), json.loads(json.dumps(expected))):
        shutil.rmtree(store)
        sys.exit("this run no longer gives the values of golden/expected.json; nothing written")
    total = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    print(f"wrote {store} ({total} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
