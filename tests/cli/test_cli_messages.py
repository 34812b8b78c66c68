"""What the ``metastore`` command says about a store whose checkpoint passes hold only some of the trained samples
(issue 28, items 9-12): which capture point holds a sample, which occurrence a query used, one quantity per column
of the outlier table, and damage named as damage.

The store is written by the real capture code (``capture_step``, ``checkpoint_pass``) while a small MLP trains; the
references are ``torch.func`` per-sample gradients taken at the same weights, kept apart from the store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reportcases import assert_top_ranking
from torch import Tensor, nn

from metastore_plugins import StoreWriter
from metastore_plugins.cli import main
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass
from metastore_plugins.testing import reference_per_sample_gradients

TRAIN, PASS_TRAIN, VAL = range(24), range(12), range(24, 30)  # the passes hold half the trained samples
BATCH, EPOCHS, LR = 8, 3, 0.1
COLUMNS = ("pass_prediction", "pass_loss", "last_step_loss", "aum", "self_influence")  # the quantities of a row


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


@dataclass
class Run:
    """The store, and per ``(capture point, step, sample id)`` the flat torch.func gradient and the loss."""

    path: Path
    grads: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)
    losses: dict[tuple[str, int, int], float] = field(default_factory=dict)


def _keep(run: Run, model: nn.Module, x: Tensor, y: Tensor, ids: Tensor, cp: str, step: int) -> None:
    loss = lambda m, batch: F.cross_entropy(m(batch["x"]), batch["y"])  # noqa: E731
    refs = reference_per_sample_gradients(model, loss, {"x": x[ids], "y": y[ids]})
    flat = torch.cat([refs[name].flatten(1).double() for name in sorted(refs)], 1)  # (B, P)
    with torch.no_grad():
        losses = per_sample_ce(model(x[ids]), y[ids])  # (B,)
    for k, sid in enumerate(ids.tolist()):
        run.grads[(cp, step, sid)], run.losses[(cp, step, sid)] = flat[k], float(losses[k])


def write_run(path: Path) -> Run:
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(30, 5, generator=generator), torch.randint(0, 3, (30,), generator=generator)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    run, step = Run(path), 0
    with StoreWriter(path, encoding="fp32") as writer:
        for epoch in range(EPOCHS):
            order = torch.randperm(len(TRAIN), generator=generator)
            for lo in range(0, len(TRAIN), BATCH):
                ids = order[lo : lo + BATCH]
                _keep(run, model, x, y, ids, "train", step)
                forward = lambda ids=ids: model(x[ids])  # noqa: E731
                capture_step(model, forward, y[ids], ids, per_sample_ce, writer, step=step, epoch=epoch, lr=LR)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
            writer.flush()  # the passes in shards (and journal lines) of their own
            for split, ids in (("train", torch.tensor(PASS_TRAIN)), ("val", torch.tensor(VAL))):
                cp = f"epoch-{epoch}/{split}"
                _keep(run, model, x, y, ids, cp, step)
                batches = [(ids, lambda ids=ids: model(x[ids]), y[ids])]
                lr = LR * (len(TRAIN) // BATCH)  # the steps the pass stands for
                checkpoint_pass(model, batches, per_sample_ce, writer, capture_point=cp, step=step, epoch=epoch, lr=lr)
            writer.flush()
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return write_run(tmp_path_factory.mktemp("messages") / "store")


def metastore(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real entry point: ``(exit status, stdout, stderr)``."""
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_similar_names_where_the_sample_is_and_which_occurrences_it_compared(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 10: outside the passes, the error names ``--capture-point train``; there, the query is the sample's last
    occurrence, and each other sample appears once, at its occurrence nearest that step (the later on a tie)."""
    status, _, err = metastore(capsys, "similar", str(run.path), "--sample", "20")
    assert status == 2 and "pass --capture-point train" in err and err.count("\n") == 1
    status, out, err = metastore(
        capsys, "similar", str(run.path), "--sample", "20", "--capture-point", "train", "-k", "99"
    )
    assert status == 0, err
    steps = {(step, sid): grad for (cp, step, sid), grad in run.grads.items() if cp == "train"}
    query_step = max(step for step, sid in steps if sid == 20)
    assert f"query: sample 20 at step {query_step} in 'train' (the last of its {EPOCHS} occurrences)" in out
    expected = {}
    for sid in set(TRAIN) - {20}:
        at = min((s for s, i in steps if i == sid), key=lambda s: (abs(s - query_step), -s))
        expected[sid] = (at, _cosine(steps[(at, sid)], steps[(query_step, 20)]))
    status, out, _ = metastore(capsys, "similar", str(run.path), "--sample", "20", "--capture-point", "train", "--json")
    rows = json.loads(out)
    assert len(rows) == 10 and len({row["sample_id"] for row in rows}) == 10  # one row per sample
    assert all(row["step"] == expected[row["sample_id"]][0] for row in rows)
    ranking = [(sid, cosine) for sid, (_, cosine) in expected.items()]
    assert_top_ranking([(row["sample_id"], row["cosine"]) for row in rows], ranking, 1e-5)  # fp32 store


def test_influence_names_where_the_test_sample_is_and_sums_its_occurrences(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 10 for influence: the error names the capture point; with it, the output says the occurrences are summed,
    and the scores are ``lr_pass <g_i(w_last pass), sum_t g_20(w_t)>``."""
    status, _, err = metastore(capsys, "influence", str(run.path), "--test", "20")
    assert status == 2 and "pass --capture-point train" in err
    args = ("influence", str(run.path), "--test", "20", "--capture-point", "train", "-k", "3", "--method", "tracin")
    status, out, err = metastore(capsys, *args)
    assert status == 0 and f"occur up to {EPOCHS} times in 'train'" in out, err
    status, out, _ = metastore(capsys, *args, "--json")
    (row,) = json.loads(out)
    test = sum(grad for (cp, _, sid), grad in run.grads.items() if cp == "train" and sid == 20)
    last = f"epoch-{EPOCHS - 1}/train"
    lr = LR * (len(TRAIN) // BATCH)
    ranking = [(sid, lr * float(grad @ test)) for (cp, _, sid), grad in run.grads.items() if cp == last]
    tol = 1e-5 * max(abs(v) for _, v in ranking)
    assert_top_ranking([(p["sample_id"], p["score"]) for p in row["proponents"]], ranking, tol)


def test_outliers_on_a_damaged_journal_name_the_damage(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 12: the passes' journal lines damaged, ``outliers`` (and a command that needs a pass) names the damage,
    not only the missing passes."""
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(run.path, copy)
    journal = copy / "index-rank0.jsonl"
    lines = journal.read_bytes().split(b"\n")
    damaged = [k for k, line in enumerate(lines) if b'"epoch-' in line]
    assert damaged  # the passes have journal lines of their own (the writer is flushed around them)
    for k in damaged:
        lines[k] = lines[k][:10] + b"X" * 10 + lines[k][20:]
    journal.write_bytes(b"\n".join(lines))
    status, out, err = metastore(capsys, "outliers", str(copy))  # the training steps are intact: ranked by AUM
    assert status == 0, err
    assert "the store's index is damaged: index-rank0.jsonl line" in out and f"metastore verify {copy}" in out
    status, _, err = metastore(capsys, "similar", str(copy), "--sample", "3")  # needs a pass: an error
    assert status == 2 and err.count("\n") == 1
    assert "the store's index is damaged: index-rank0.jsonl line" in err and f"metastore verify {copy}" in err


def test_restore_of_a_projected_layer_names_the_store_method_that_recomputes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 9: the way out is ``store.recompute`` (it exists), with the snapshot of the sample's pass."""
    from metastore_plugins import CaptureSession, open_store
    from metastore_plugins.core.ops.represent import represent
    from metastore_plugins.core.store.snapshots.weights import write_snapshot

    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0])
    with CaptureSession(model) as session:
        F.cross_entropy(model(x), y).backward()
    kept = represent(session.factors(), {"0": "projected"}, k_in=2, k_out=2)
    with StoreWriter(tmp_path / "store") as writer:
        writer.write(kept, sample_ids=torch.arange(4), step=3, capture_point="epoch-1/val")
    write_snapshot(tmp_path / "store", model, name="epoch-1", step=3)
    out = str(tmp_path / "g.safetensors")
    args = ("restore", str(tmp_path / "store"), "--sample", "2", "--capture-point", "epoch-1/val", "--out", out)
    status, _, err = metastore(capsys, *args, "--layer", "0")
    assert status == 2 and err.count("\n") == 1
    assert "metastore_plugins.recompute" not in err
    assert "open_store(RUN).recompute(model, dataset, [2], snapshot='epoch-1')" in err
    assert callable(open_store(tmp_path / "store").recompute)  # the method the message names
    status, _, err = metastore(capsys, *args, "--layer", "2")  # an exact layer restores
    assert status == 0, err


def test_outlier_columns_each_hold_one_quantity_and_a_ranking_over_the_passes_says_so(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 11: ``pass_loss`` is the loss at the last pass (blank outside it), ``last_step_loss`` the loss at the last
    training step, whatever the ranking; a ranking that covers only the passes' samples says how many it left out."""
    last = f"epoch-{EPOCHS - 1}/train"
    at_pass = {sid: loss for (cp, _, sid), loss in run.losses.items() if cp == last}
    last_step: dict[int, tuple[int, float]] = {}
    for (cp, step, sid), loss in run.losses.items():
        if cp == "train" and step >= last_step.get(sid, (-1, 0.0))[0]:
            last_step[sid] = (step, loss)
    for by in ("auto", "loss", "self_influence"):
        status, out, err = metastore(capsys, "outliers", str(run.path), "-k", "24", "--by", by, "--json")
        assert status == 0, err
        rows = json.loads(out)
        assert rows and all(list(row) == ["rank", "sample_id", "label", *COLUMNS, "class_zscore"] for row in rows), (
            rows[0]
        )
        for row in rows:
            sid = row["sample_id"]
            assert (row["pass_loss"] is None) == (sid not in PASS_TRAIN) == (row["self_influence"] is None)
            if row["pass_loss"] is not None:
                assert abs(row["pass_loss"] - at_pass[sid]) <= 1e-5 * max(1.0, at_pass[sid]), (by, sid)
            assert abs(row["last_step_loss"] - last_step[sid][1]) <= 1e-5 * max(1.0, last_step[sid][1]), (by, sid)
        status, out, _ = metastore(capsys, "outliers", str(run.path), "--by", by)
        header = next(line for line in out.splitlines() if line.startswith("| rank"))
        assert all(f" {column} " in header for column in COLUMNS)
        subset = f"{len(PASS_TRAIN)} samples of the {len(TRAIN)} trained; the other {len(TRAIN) - len(PASS_TRAIN)}"
        if by == "auto":  # AUM: every trained sample
            assert f"ranked by lowest AUM (area under the margin over the training steps): {len(TRAIN)} samples" in out
            assert "not ranked" not in out
        else:
            assert (
                "ranked by the loss at 'epoch-2/train'" if by == "loss" else "ranked by TracIn self-influence"
            ) in out
            assert subset + " are not ranked" in out
        assert f"pass_prediction, pass_loss: at '{last}'" in out
