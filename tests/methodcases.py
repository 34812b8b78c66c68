"""Stores for the tests of ``method=`` in the reports and the command line (tests/reports, tests/cli).

:func:`write_passes` writes two epochs of paired checkpoint passes (``epoch-{e}/train``, ``epoch-{e}/val``)
of a small MLP straight through ``StoreWriter``: exact fp32 factors, seeded random projections made
by ``represent`` (what K-FAC cannot precondition), or projections on each pass's K-FAC eigenbasis
(``represent_on_bases``, fitted on that pass's training records: what K-FAC / EK-FAC accept).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter
from metastore_plugins.core.ops.curvature import CurvatureSums
from metastore_plugins.core.ops.eigenbasis import fit_bases, represent_on_bases
from metastore_plugins.core.ops.represent import represent

N_TRAIN, N_VAL = 16, 6
TRAIN, VAL = ["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"]


def write_passes(path: Path, projected: bool = False, eigenbasis: bool = False, shards: bool = False) -> Path:
    """The store at ``path``; train ids ``0..15``, val ids ``100..105``; ``projected``: ``2 x 2`` projections,
    seeded, or on the eigenbasis with ``eigenbasis``; ``shards``: each pass in a shard of its own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        x, y = torch.randn(N_TRAIN + N_VAL, 5), torch.randint(0, 3, (N_TRAIN + N_VAL,))
        ids = torch.cat([torch.arange(N_TRAIN), torch.arange(100, 100 + N_VAL)])
        with StoreWriter(path, encoding="fp32") as writer:
            for epoch in range(2):
                bases = None
                for split, rows in (("train", slice(0, N_TRAIN)), ("val", slice(N_TRAIN, None))):
                    with CaptureSession(model, loss_reduction="sum") as session:
                        F.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
                    records = session.factors()
                    if bases is None and eigenbasis:  # fitted on the train pass, used for both
                        sums = CurvatureSums()
                        sums.add(records)
                        bases = fit_bases(sums, 2, epoch)
                    if projected and eigenbasis:
                        records = represent_on_bases(records, dict.fromkeys(("0", "2"), "projected"), 2, None, bases)
                    elif projected:
                        records = represent(records, {"0": "projected", "2": "projected"}, 2, 2)
                    point = f"epoch-{epoch}/{split}"
                    writer.write(records, sample_ids=ids[rows], step=epoch, capture_point=point, labels=y[rows])
                    if shards:
                        writer.flush()
                    model.zero_grad()
                with torch.no_grad():
                    for p in model.parameters():
                        p += 0.2 * torch.randn_like(p)  # the next pass at other weights
    return path
