"""Find flipped labels in scikit-learn's handwritten digits with one extra line in a Lightning ``Trainer``.

The 8x8 digits ship with scikit-learn (no download). A fixed 10% of the training labels are
flipped to another digit on purpose; a small MLP is trained with ``MetaStoreCallback`` in the
trainer's callbacks, which captures per-sample gradients, runs a checkpoint pass over all
training samples (and the validation set) at every epoch end, and writes the reports at the
end of ``fit``. The example then reads the outlier report (the 10% of the training samples
with the lowest area under the margin over their training steps, each with its TracIn
self-influence) and prints how many of the flipped labels are in it, next to the 10% a random
pick would find.

Run (``pip install -e ".[examples]"``)::

    python examples/lightning_digits.py                                 # full: 1497 training samples, 4 epochs
    python examples/lightning_digits.py --train-size 600 --epochs 3     # fast (the test)
    python examples/lightning_digits.py --outliers-from training        # rank by the training steps; small passes
    # timing (metastore_bench/callback_bench.py):
    python examples/lightning_digits.py --no-callback | --no-passes | --no-reports
    tensorboard --logdir runs/lightning-digits/tb                       # TEXT, IMAGES, HISTOGRAMS, PROJECTOR

Writes ``<out>/tb`` (TensorBoard events, with a thumbnail grid of the top outliers),
``<out>/store`` (the gradient store), ``<out>/store/reports`` (outliers/influence as JSON, CSV,
markdown and PNG) and ``<out>/result.json`` (the figures printed).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from metastore_plugins import MetaStoreCallback, phase_seconds


def load_digits_split(train_size: int, seed: int, flip: float) -> tuple[TensorDataset, TensorDataset, np.ndarray]:
    """Training and validation sets of ``(1, 8, 8)`` images in [0, 1], and the ids of the flipped training labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.long)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    val_rows = order[-300:]
    train_rows = order[: min(train_size, len(order) - 300)]
    train_labels = labels[train_rows].clone()
    flipped = np.sort(rng.choice(len(train_rows), size=round(flip * len(train_rows)), replace=False))
    train_labels[flipped] = (
        train_labels[flipped] + torch.from_numpy(rng.integers(1, 10, len(flipped)))
    ) % 10  # another digit
    return TensorDataset(images[train_rows], train_labels), TensorDataset(images[val_rows], labels[val_rows]), flipped


class DigitsMLP(L.LightningModule):
    def __init__(self, lr: float = 0.1, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="runs/lightning-digits", help="run directory (its tb/ and store/ are replaced)"
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--train-size", type=int, default=1497, help="training samples (at most 1497; 300 are held out)"
    )
    parser.add_argument("--flip", type=float, default=0.1, help="fraction of training labels flipped")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--val-samples", type=int, default=32, help="validation samples in each checkpoint pass (influence report)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-callback", action="store_true", help="train without MetaStoreCallback (for timing)")
    parser.add_argument("--no-reports", action="store_true", help="capture only, build no reports (for timing)")
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="MetaStoreCallback with its defaults (passes of 256 training samples), report_k the top 10%%",
    )
    parser.add_argument(
        "--outliers-from",
        choices=("checkpoints", "training"),
        default="checkpoints",
        help="rank by self-influence over checkpoint passes of every training sample, or over the "
        "training steps (then the passes cover the callback's default 256-sample subset)",
    )
    parser.add_argument(
        "--no-passes", action="store_true", help="no checkpoint passes and no reports: training steps only (for timing)"
    )
    parser.add_argument(
        "--policy", choices=("auto", "exact"), default="auto", help="capture policy (docs/policies.md; default auto)"
    )
    parser.add_argument("--budget", default=None, help="the store's byte budget, e.g. 250MB (default: the policy's)")
    parser.add_argument("--encoding", choices=("fp16", "fp32", "bf16", "int8"), default="fp16", help="store encoding")
    args = parser.parse_args(argv)

    out = Path(args.out)
    for sub in ("tb", "store"):
        shutil.rmtree(out / sub, ignore_errors=True)
    L.seed_everything(args.seed, verbose=False)
    train, val, flipped = load_digits_split(args.train_size, args.seed, args.flip)
    top = len(train) // 10  # the top 10% of the training samples
    defaults = MetaStoreCallback(out / "store", seed=args.seed, report_k=top)  # report_k: the top 10% is scored
    callback = (
        defaults
        if args.defaults
        else MetaStoreCallback(
            out / "store",
            checkpoint_train_samples=len(train)
            if args.outliers_from == "checkpoints"
            else 256,  # every sample in each pass, or a subset
            checkpoint_val_samples=args.val_samples,  # influence rows for these validation samples
            checkpoint_every_n_epochs=0 if args.no_passes else 1,
            report_k=top,
            seed=args.seed,
            reports=not (args.no_reports or args.no_passes),
            outliers_from=args.outliers_from,
            policy=args.policy,
            budget=args.budget,
            encoding=args.encoding,
        )
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(out, name="tb", version=0),
        callbacks=[] if args.no_callback else [callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    model = DigitsMLP()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(
            model,
            DataLoader(train, batch_size=args.batch_size, shuffle=True),  # ids come from the sampler: no wrapper needed
            DataLoader(val, batch_size=128),
        )
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "train_size": len(train),
        "epochs": args.epochs,
        "flipped": len(flipped),
        "seconds": round(seconds, 2),
        "val_accuracy": round(float(trainer.callback_metrics.get("val_accuracy", float("nan"))), 4),
        "callback": not args.no_callback,
        "reports": not (args.no_callback or args.no_reports or args.no_passes),
    }
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB
    if not args.no_callback:
        result["store_bytes"] = sum(f.stat().st_size for f in (out / "store").rglob("*") if f.is_file())
        result.update(phase_seconds(callback.seconds, callback.report_result))
    if result["reports"]:
        reports = out / "store" / "reports"
        outliers = json.loads((reports / "outliers.json").read_text())  # the report's top 10%, ranked
        flipped_ids = set(flipped.tolist())
        found = sum(row["sample_id"] in flipped_ids for row in outliers)
        result.update(
            {
                "top": len(outliers),
                "found": found,
                "recall": round(found / max(1, len(flipped_ids)), 4),
                "precision": round(found / max(1, len(outliers)), 4),
                "random_baseline": round(len(outliers) / len(train), 4),
                "tb_tags": (callback.report_result or {}).get("tags", []),
            }
        )
        print(
            f"trained {args.epochs} epochs on {len(train)} digits ({len(flipped)} labels flipped) in {seconds:.1f} s "
            f"with MetaStoreCallback; val accuracy {result['val_accuracy']:.3f}"
        )
        print(
            f"the outlier report's top 10% ({len(outliers)} samples) "
            f"holds {found} of the {len(flipped_ids)} flipped labels "
            f"({100 * result['recall']:.0f}%); a random 10% would hold {100 * result['random_baseline']:.0f}%"
        )
        print(f"reports: {reports} (outliers.md, outliers.png); TensorBoard: tensorboard --logdir {out / 'tb'}")
    else:
        how = (
            "without the callback"
            if args.no_callback
            else "with MetaStoreCallback, no checkpoint passes or reports"
            if args.no_passes
            else "with MetaStoreCallback(reports=False)"
        )
        print(f"trained {args.epochs} epochs on {len(train)} digits in {seconds:.1f} s {how}")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
