"""K-FAC / EK-FAC influence with an embedding layer, partitioned over 2 gloo ranks, equals one process.

Each rank fits the curvature on the shards it reads, and the sums are added over the ranks before each
fit: an embedding's token counts, its ``sum d d^T`` and EK-FAC's ``(V, d)`` sums travel with the others.
The store is written by two ``StoreWriter`` ranks in small shards (several per rank), each rank holding
its half of every pass's samples; tokens are split so that some appear in one rank's samples only.

Tolerance: fp32 round-off, ``1e-6`` of the largest reference value (sums added in another order).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ddp_store import assert_close, run_ranks
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.distributed import open_distributed_store
from metastore_plugins.core.training.passes import capture_step

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)

N_TRAIN, N_TEST, BATCH, VOCAB = 32, 6, 4, 13


class TokenBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 5, padding_idx=0)
        self.head = nn.Linear(5, 3)

    def forward(self, ids: Tensor) -> Tensor:
        mask = ids.ne(0).float()  # (B, T)
        return self.head((torch.tanh(self.embed(ids)) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


def per_sample_ce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def write_store(path: Path) -> Path:
    """Two passes of train and test samples, each rank capturing its half; rank 1's train tokens include 9..12."""
    torch.manual_seed(0)
    model = TokenBag()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 9, (N_TRAIN + N_TEST, 5), generator=g)
    ids[1::2, 0] = torch.randint(9, VOCAB, (len(ids[1::2]),), generator=g)  # only odd samples: rank 1's
    ids[::3, 3:] = 0  # padding
    y = torch.randint(0, 3, (len(ids),), generator=g)
    writers = [StoreWriter(path, rank=r, encoding="fp32", shard_bytes=1500, flush_seconds=None) for r in (0, 1)]
    for epoch in range(2):
        if epoch:
            with torch.no_grad():
                for p in model.parameters():
                    p += 0.2 * torch.randn(p.shape, generator=g)
        for split, samples in (("train", torch.arange(N_TRAIN)), ("test", torch.arange(N_TRAIN, N_TRAIN + N_TEST))):
            for rank in (0, 1):
                for part in samples[rank::2].split(BATCH):
                    capture_step(
                        model,
                        lambda p=part: model(ids[p]),
                        y[part],
                        part,
                        per_sample_ce,
                        writers[rank],
                        step=epoch,
                        epoch=epoch,
                        lr=0.1 / (epoch + 1),
                        capture_point=f"epoch-{epoch}/{split}",
                    )
                model.zero_grad()
    for writer in writers:
        writer.close()
    return path


TRAINS, TESTS = ["epoch-0/train", "epoch-1/train"], ["epoch-0/test", "epoch-1/test"]


def _ask(store: Any) -> dict[str, Any]:
    return {method: store.kfac_influence(TRAINS, TESTS, method=method) for method in ("kfac", "ekfac")}


def _queries(rank: int, world: int, out: Path) -> str:
    got = _ask(open_distributed_store(out.parent / "store"))
    (out / f"got{rank}.pkl").write_bytes(pickle.dumps(got))
    return "done"


def test_partitioned_embedding_curvature_equals_one_process(tmp_path: Path) -> None:
    store_dir = write_store(tmp_path / "store")
    alone = _ask(open_store(store_dir))
    ranks = run_ranks(_queries, 2, tmp_path / "out")
    for rank in range(2):
        assert ranks.get(rank, {}).get("ok") == "done", ranks.get(rank)
        got = pickle.loads((tmp_path / "out" / f"got{rank}.pkl").read_bytes())
        for method, expected in alone.items():
            np.testing.assert_array_equal(got[method].row_ids, expected.row_ids)
            np.testing.assert_array_equal(got[method].col_ids, expected.col_ids)
            assert_close(got[method].scores, expected.scores)
