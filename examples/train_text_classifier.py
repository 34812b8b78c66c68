"""Train a small transformer text classifier with per-sample gradient capture, then build reports.

The data are synthetic token sequences of two classes, padded to different lengths, with
5% of the training labels flipped on purpose. The run writes a gradient store
(``runs/text-classifier/store``), checkpoint passes at every epoch end over the validation
set and the training set, and reports (``runs/text-classifier/store/reports``, where
the callbacks and ``metastore report`` put them too): the training
samples most likely mislabelled (lowest area under the margin, with their self-influence) and,
per validation sample, the training samples that drove its prediction, with the
loss-vs-self-influence figure as a PNG; the same reports, histograms and figure go to
TensorBoard (``runs/text-classifier/tb``).

Run::

    python examples/train_text_classifier.py [--out runs/text-classifier] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.reports.tensorboard import summary_writer
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass
from metastore_plugins.core.training.report_pass import report_run

VOCAB, PAD, MAX_LEN = 40, 0, 16


def make_data(n: int, seed: int, flip: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token ids ``(n, MAX_LEN)``, attention mask, labels, and which labels were flipped."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    lengths = torch.randint(6, MAX_LEN + 1, (n,), generator=g)
    # class 0 draws mostly from tokens 1..19, class 1 mostly from 20..39
    own = torch.randint(1, 20, (n, MAX_LEN), generator=g) + 19 * labels[:, None]
    other = torch.randint(1, VOCAB, (n, MAX_LEN), generator=g)
    ids = torch.where(torch.rand(n, MAX_LEN, generator=g) < 0.7, own, other)
    mask = torch.arange(MAX_LEN)[None, :] < lengths[:, None]  # (n, T)
    ids = ids.masked_fill(~mask, PAD)
    flipped = torch.rand(n, generator=g) < flip
    return ids, mask, torch.where(flipped, 1 - labels, labels), flipped


class TextClassifier(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.encoder = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=~mask)  # (B, T, dim)
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)  # (B, dim)
        return self.head(pooled)


def per_sample_ce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels, reduction="none")  # (B,)


def batches(model: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor, order: Tensor, size: int):
    for lo in range(0, len(order), size):
        rows = order[lo : lo + size]
        yield rows, (lambda r=rows: model(ids[r], mask[r])), labels[rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/text-classifier", help="run directory (replaced)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--encoding", default="fp16", choices=["fp32", "fp16", "bf16", "int8"])
    args = parser.parse_args()

    torch.manual_seed(0)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    train_ids, train_mask, train_labels, flipped = make_data(args.train_size, seed=1, flip=0.05)
    val_ids, val_mask, val_labels, _ = make_data(64, seed=2)
    model = TextClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lr = optimizer.param_groups[0]["lr"]

    start, step = time.perf_counter(), 0
    with StoreWriter(out / "store", encoding=args.encoding, config={"example": "text-classifier"}) as writer:
        for epoch in range(args.epochs):
            order = torch.randperm(args.train_size)  # shuffled; ids stay exact
            for rows, forward, labels in batches(model, train_ids, train_mask, train_labels, order, 32):
                loss = capture_step(model, forward, labels, rows, per_sample_ce, writer, step=step, epoch=epoch, lr=lr)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
            for split, (ids, mask, labels) in {
                "train": (train_ids, train_mask, train_labels),
                "val": (val_ids, val_mask, val_labels),
            }.items():
                passes = batches(model, ids, mask, labels, torch.arange(len(labels)), 64)
                checkpoint_pass(
                    model,
                    passes,
                    per_sample_ce,
                    writer,
                    capture_point=f"epoch-{epoch}/{split}",
                    step=step,
                    epoch=epoch,
                    lr=lr * len(order.split(32)),  # the pass stands for this epoch's steps: their summed rate
                )
            with torch.no_grad():
                accuracy = (model(val_ids, val_mask).argmax(1) == val_labels).float().mean()
            print(f"epoch {epoch}: last train loss {float(loss):.3f}, val accuracy {float(accuracy):.3f}")
    seconds = time.perf_counter() - start

    store = open_store(out / "store")
    board = summary_writer(out / "tb")  # tables, histograms, the scatter figure, dynamics, projector
    try:
        reports = report_run(out / "store", out / "store" / "reports", [board], step=step, k=25)
    finally:
        board.close()
    if reports is None:
        raise SystemExit("no checkpoint passes were stored, so there is nothing to report on")
    flipped_ids = set(flipped.nonzero().squeeze(1).tolist())
    found = sum(row["sample_id"] in flipped_ids for row in reports["outliers"])
    summary = store.summary()
    print(f"training with capture: {seconds:.1f} s, {step} steps")
    print(
        f"store: {summary['bytes_on_disk'] / 2**20:.2f} MiB on disk for {summary['samples']} stored samples "
        f"({summary['dense_bytes'] / 2**20:.1f} MiB as dense fp32 per-sample gradients), problems: {store.verify()}"
    )
    print(f"flipped labels among the outlier report's top {len(reports['outliers'])}: {found} of {len(flipped_ids)}")
    print("reports:", ", ".join(reports["files"]))
    print(f"TensorBoard: tensorboard --logdir {out / 'tb'}")
    (out / "store" / "reports" / "flipped.json").write_text(json.dumps(sorted(flipped_ids)))


if __name__ == "__main__":
    main()
