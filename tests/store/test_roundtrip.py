"""Write captured batches of a tiny model from two ranks, read them back, compare with torch.func.

The run: 24 training samples, 2 epochs x 2 steps, each step 2 ranks x 2 micro-batches of 3
(ranks written in reverse order to exercise the merge), an SGD update per step, and after
each epoch a checkpoint pass over some train samples (rank 0) and 5 test samples (rank 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from storecases import PooledTagger, flat, per_sample_losses, rel_err, tagger_batch, tagger_loss

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.errors import StoreError
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients

TOL = 1e-5
TRAIN, TEST_IDS = 24, torch.arange(100, 105)
SHARD_BYTES = 6000
CHECKPOINT_TRAIN_IDS = {0: list(range(0, 8)), 1: list(range(4, 12))}
POINTS = ["ckpt0/test", "ckpt0/train", "ckpt1/test", "ckpt1/train", "train"]


@dataclass
class Run:
    path: Path
    grads: dict[tuple[str, int, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # (cp, step, id) -> grads
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # cp -> metadata rows, in write order
    kinds: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def expected(self, cp: str) -> list[dict[str, Any]]:
        """Rows in the documented selection order: (step, micro-batch, rank), then batch order."""
        return sorted(self.rows[cp], key=lambda r: (r["step"], r["micro_batch"], r["rank"], r["_pos"]))

    def column(self, cp: str, name: str, rows: list[dict[str, Any]] | None = None) -> np.ndarray:
        return np.array([r[name] for r in (self.expected(cp) if rows is None else rows)])

    def grad(self, cp: str, row: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.grads[(cp, row["step"], row["sample_id"])]


def _subset(data: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in data.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    gen = torch.Generator().manual_seed(1)
    with torch.random.fork_rng(devices=[]):  # module-scoped: seed its own weights, leave the global RNG alone
        torch.manual_seed(0)
        model = PooledTagger()
    train_data, test_data = tagger_batch(torch.arange(TRAIN), gen), tagger_batch(TEST_IDS, gen)
    out = Run(tmp_path_factory.mktemp("roundtrip") / "store")
    out.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    writers = {
        r: StoreWriter(out.path, rank=r, encoding="fp32", shard_bytes=SHARD_BYTES, config={"seed": 0}) for r in (1, 0)
    }

    def capture(cp: str, ids: torch.Tensor, batch: dict[str, torch.Tensor], rank: int, **where: Any) -> None:
        expected = reference_per_sample_gradients(model, tagger_loss, batch)
        losses = per_sample_losses(model, tagger_loss, batch)
        with torch.no_grad():
            predictions = model(batch["ids"], batch["mask"]).argmax(1)
        with CaptureSession(model) as session:
            tagger_loss(model, batch).backward()
        records = session.factors()
        out.kinds |= {r.kind for r in records}
        train_like = cp == "train"
        writers[rank].write(
            records,
            sample_ids=ids,
            capture_point=cp,
            labels=batch["y"],
            losses=losses,
            predictions=predictions if train_like else None,
            **where,
        )
        for pos, sample in enumerate(ids.tolist()):
            out.grads[(cp, where["step"], sample)] = {k: v[pos] for k, v in expected.items()}
            out.rows.setdefault(cp, []).append(
                {
                    "sample_id": sample,
                    "label": int(batch["y"][pos]),
                    "loss": float(losses[pos]),
                    "prediction": int(predictions[pos]) if train_like else -1,
                    "lr": math.nan if where.get("lr") is None else where["lr"],
                    "capture_point": cp,
                    "_pos": pos,
                    **{k: where.get(k, 0) for k in ("step", "epoch", "micro_batch")},
                    "rank": rank,
                }
            )

    step = 0
    for epoch in (0, 1):
        order = torch.randperm(TRAIN, generator=gen)
        for s in range(2):
            lr = 0.5 / (step + 1)
            model.zero_grad()
            for rank in (1, 0):
                for mb in (0, 1):
                    ids = order[s * 12 + rank * 6 + mb * 3 :][:3]
                    capture("train", ids, _subset(train_data, ids), rank, step=step, epoch=epoch, micro_batch=mb, lr=lr)
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
            step += 1
        train_ids = torch.tensor(CHECKPOINT_TRAIN_IDS[epoch])
        capture(
            f"ckpt{epoch}/train",
            train_ids,
            _subset(train_data, train_ids),
            0,
            step=step - 1,
            epoch=epoch,
            lr=0.5 / step,
        )
        capture(f"ckpt{epoch}/test", TEST_IDS, _subset(test_data, TEST_IDS - 100), 1, step=step - 1, epoch=epoch)
        model.zero_grad()
    for writer in writers.values():
        writer.close()
    return out


@pytest.fixture(scope="module")
def store(run: Run) -> GradientStore:
    return open_store(run.path)


def test_the_model_yields_every_record_kind(run: Run) -> None:
    assert run.kinds == {"outer", "dense", "embedding"}


def test_listing(run: Run, store: GradientStore) -> None:
    assert store.capture_points() == POINTS
    assert store.steps() == [0, 1, 2, 3]
    assert store.steps("train") == [0, 1, 2, 3]
    assert store.steps("ckpt0/train") == [1] and store.steps("ckpt1/test") == [3]
    assert store.epochs() == [0, 1] and store.epochs("ckpt1/train") == [1]
    assert sorted(store.layers()) == ["emb", "enc", "head", "norm"]
    assert store.parameters() == run.shapes
    assert store.ranks() == [0, 1]
    assert store.config == {"seed": 0}
    assert store.learning_rate("ckpt1/train") == 0.5 / 4 and store.learning_rate("ckpt1/test") is None


def test_sample_ids_follow_step_micro_batch_rank_order(run: Run, store: GradientStore) -> None:
    for cp in POINTS:
        ids = store.sample_ids(cp)
        assert ids.dtype == np.int64
        np.testing.assert_array_equal(ids, run.column(cp, "sample_id"))
    # each train sample seen once per epoch
    assert sorted(store.sample_ids("train").tolist()) == sorted(list(range(TRAIN)) * 2)


def test_metadata_columns_equal_what_was_written(run: Run, store: GradientStore) -> None:
    for cp in POINTS:
        meta = store.metadata(cp)
        for name in ("sample_id", "label", "prediction", "step", "epoch", "micro_batch", "rank", "capture_point"):
            np.testing.assert_array_equal(meta[name], run.column(cp, name), err_msg=f"{cp}: {name}")
        np.testing.assert_array_equal(meta["loss"], run.column(cp, "loss").astype(np.float32), err_msg=cp)
        np.testing.assert_array_equal(meta["lr"], run.column(cp, "lr"), err_msg=cp)  # NaN where none was given
    assert len(store.select("train")) == 2 * TRAIN


def test_restore_equals_torch_func_reference(run: Run, store: GradientStore) -> None:
    for (cp, step, sample), expected in run.grads.items():
        restored = store.restore(sample, capture_point=cp, step=step)
        assert max_relative_error(restored, expected) <= TOL, (cp, step, sample)
    # one layer only
    expected = run.grads[("ckpt0/test", 1, 102)]
    head = store.restore(102, capture_point="ckpt0/test", layer="head")
    assert max_relative_error(head, {k: v for k, v in expected.items() if k.startswith("head.")}) <= TOL
    step = store.metadata("train", sample_ids=[5])["step"][0]  # a numpy integer
    assert (
        max_relative_error(store.restore(5, capture_point="train", step=step), run.grads[("train", int(step), 5)])
        <= TOL
    )
    # unique in a checkpoint pass: no step needed
    assert max_relative_error(store.restore(102, capture_point="ckpt0/test"), expected) <= TOL


def test_restore_of_a_sample_seen_twice_needs_the_step(store: GradientStore) -> None:
    with pytest.raises(StoreError, match="more than once"):
        store.restore(3, capture_point="train")
    with pytest.raises(StoreError, match="more than once"):
        store.restore(3)  # in "train" twice and in ckpt0/train


def test_select_by_steps_epochs_samples(run: Run, store: GradientStore) -> None:
    rows = run.expected("train")
    cases = [
        ({"steps": (1, 2)}, [r for r in rows if 1 <= r["step"] <= 2]),
        ({"steps": 3}, [r for r in rows if r["step"] == 3]),
        ({"epochs": 1}, [r for r in rows if r["epoch"] == 1]),
        ({"epochs": [0]}, [r for r in rows if r["epoch"] == 0]),
        ({"sample_ids": [17, 3, 5]}, [r for r in rows if r["sample_id"] in (3, 5, 17)]),
        ({"sample_ids": np.array([5]), "epochs": 1}, [r for r in rows if r["sample_id"] == 5 and r["epoch"] == 1]),
        ({"steps": (7, 9)}, []),
        (
            {"steps": np.int64(2), "epochs": np.int64(1)},
            [r for r in rows if r["step"] == 2],
        ),  # as metadata() gives them
    ]
    for where, expected in cases:
        np.testing.assert_array_equal(
            store.sample_ids("train", **where), [r["sample_id"] for r in expected], err_msg=str(where)
        )
        meta = store.metadata("train", **where)
        if expected:
            np.testing.assert_array_equal(meta["step"], [r["step"] for r in expected])
            np.testing.assert_array_equal(meta["label"], [r["label"] for r in expected])
        assert len(store.select("train", **where)) == len(expected)


def test_select_layers(run: Run, store: GradientStore) -> None:
    selection = store.select("ckpt1/train", layers=["enc", "head"])
    batches = list(selection.batches())
    assert batches and all({r.layer for r in b.records} == {"enc", "head"} for b in batches)
    rows = run.expected("ckpt1/train")
    names = ["enc.bias", "enc.weight", "head.bias", "head.weight"]
    expected = [float(flat(run.grad("ckpt1/train", r), names).norm()) for r in rows]
    np.testing.assert_allclose(store.norms("ckpt1/train", layers=["enc", "head"]), expected, rtol=TOL)
    with pytest.raises(StoreError, match="nope"):
        store.select("train", layers=["enc", "nope"])


def test_chunks_respect_the_byte_budget(store: GradientStore) -> None:
    selection = store.select("train")
    sizes = [sum(r.nbytes for r in b.records) for b in selection.batches()]
    budget = int(2.5 * np.median(sizes))
    chunks = list(selection.chunks(budget))
    assert len(chunks) > 1 and any(len(c) > 1 for c in chunks)
    for chunk in chunks:
        used = sum(r.nbytes for b in chunk for r in b.records)
        assert used <= budget or len(chunk) == 1
    # consecutive, nothing lost or repeated
    ids = np.concatenate([b.meta["sample_id"].numpy() for chunk in chunks for b in chunk])
    np.testing.assert_array_equal(ids, store.sample_ids("train"))
    assert [len(c) for c in selection.chunks(1)] == [1] * len(sizes)


def test_two_ranks_merge_transparently(run: Run, store: GradientStore) -> None:
    files = sorted(p.name for p in run.path.iterdir())
    assert "manifest-rank0.json" in files and "manifest-rank1.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert any(f.startswith("rank0-") for f in shards) and any(f.startswith("rank1-") for f in shards)
    assert len(shards) > 4  # small shard_bytes: several shards per rank
    np.testing.assert_array_equal(store.metadata("train")["rank"], run.column("train", "rank"))
    summary = store.summary()
    assert summary["ranks"] == [0, 1] and summary["shards"] == len(shards)
    assert summary["samples"] == sum(len(rows) for rows in run.rows.values())
    assert summary["encodings"] == ["fp32"]
    assert summary["capture_points"]["train"] == 16  # 4 steps x 2 ranks x 2 micro-batches
    assert store.verify() == []
    # one rank on its own holds exactly its samples
    meta = store.metadata("train")
    from_rank1 = [r["sample_id"] for r in run.expected("train") if r["rank"] == 1]
    np.testing.assert_array_equal(meta["sample_id"][meta["rank"] == 1], from_rank1)


def test_norms_equal_reference(run: Run, store: GradientStore) -> None:
    for cp in ("train", "ckpt0/test"):
        rows = run.expected(cp)
        expected = [float(flat(run.grad(cp, r)).norm()) for r in rows]
        np.testing.assert_allclose(store.norms(cp), expected, rtol=TOL)
        by_layer = store.norms(cp, by_layer=True)
        assert sorted(by_layer) == ["emb", "enc", "head", "norm"]
        names = ["norm.bias", "norm.weight"]
        np.testing.assert_allclose(
            by_layer["norm"], [float(flat(run.grad(cp, r), names).norm()) for r in rows], rtol=TOL
        )


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(flat(a) @ flat(b))


def test_influence_equals_lr_weighted_reference_dots(run: Run, store: GradientStore) -> None:
    with pytest.warns(UserWarning, match="different samples"):  # ckpt0/train and ckpt1/train differ
        scores = store.influence(train=["ckpt0/train", "ckpt1/train"], test=["ckpt0/test", "ckpt1/test"])
    np.testing.assert_array_equal(scores.row_ids, np.arange(12))  # first seen order over the passes
    np.testing.assert_array_equal(scores.col_ids, TEST_IDS.numpy())
    expected = np.zeros((12, 5))
    for epoch, step, lr in ((0, 1, 0.5 / 2), (1, 3, 0.5 / 4)):
        for i in CHECKPOINT_TRAIN_IDS[epoch]:
            for j, test in enumerate(TEST_IDS.tolist()):
                train_grad = run.grads[(f"ckpt{epoch}/train", step, i)]
                expected[i, j] += lr * _dot(train_grad, run.grads[(f"ckpt{epoch}/test", step, test)])
    assert rel_err(scores.scores, expected) <= TOL
    # restricted to some samples, one pass; the test pass recorded no lr, the train pass's is used
    part = store.influence(train="ckpt1/train", test="ckpt1/test", train_ids=[9, 4], test_ids=[103], max_bytes=1)
    np.testing.assert_array_equal(part.row_ids, [4, 9])
    np.testing.assert_array_equal(part.col_ids, [103])
    one_pass = [0.125 * _dot(run.grads[("ckpt1/train", 3, i)], run.grads[("ckpt1/test", 3, 103)]) for i in (4, 9)]
    assert rel_err(part.scores[:, 0], one_pass) <= TOL
    top = part.top(1)[0]
    assert abs(one_pass[0] - one_pass[1]) > 100 * TOL * max(map(abs, one_pass))  # no near-tie in the reference
    assert top["sample_id"] == 103 and top["proponents"][0][0] == [4, 9][int(np.argmax(one_pass))]


def test_self_influence_sums_per_sample_id(run: Run, store: GradientStore) -> None:
    points = ["ckpt0/train", "ckpt1/train"]
    with pytest.warns(UserWarning, match="different samples"):
        values = store.self_influence(points)
    with pytest.warns(UserWarning):
        ids = store.self_influence_ids(points)
    np.testing.assert_array_equal(ids, np.arange(12))
    expected = np.zeros(12)
    for epoch, step, lr in ((0, 1, 0.5 / 2), (1, 3, 0.5 / 4)):
        for i in CHECKPOINT_TRAIN_IDS[epoch]:
            expected[i] += lr * float(flat(run.grads[(f"ckpt{epoch}/train", step, i)]).square().sum())
    assert rel_err(values, expected) <= TOL
    single = store.self_influence("ckpt0/train")
    rows = run.expected("ckpt0/train")
    assert rel_err(single, [0.25 * float(flat(run.grad("ckpt0/train", r)).square().sum()) for r in rows]) <= TOL


def test_in_run_influence_sums_train_occurrences(run: Run, store: GradientStore) -> None:
    scores = store.in_run_influence("ckpt1/test", train="train", steps=(0, 1))
    rows = [r for r in run.expected("train") if r["step"] <= 1]
    np.testing.assert_array_equal(scores.row_ids, list(dict.fromkeys(r["sample_id"] for r in rows)))
    position = {int(v): k for k, v in enumerate(scores.row_ids)}
    expected = np.zeros((len(position), 5))
    for r in rows:
        for j, test in enumerate(TEST_IDS.tolist()):
            expected[position[r["sample_id"]], j] += r["lr"] * _dot(
                run.grad("train", r), run.grads[("ckpt1/test", 3, test)]
            )
    assert rel_err(scores.scores, expected) <= TOL


def test_similar_is_gradient_cosine(run: Run, store: GradientStore) -> None:
    sim = store.similar("ckpt0/test", "ckpt0/train", query_ids=[101, 104])
    np.testing.assert_array_equal(sim.row_ids, CHECKPOINT_TRAIN_IDS[0])
    np.testing.assert_array_equal(sim.col_ids, [101, 104])
    train = torch.stack([flat(run.grads[("ckpt0/train", 1, i)]) for i in CHECKPOINT_TRAIN_IDS[0]])  # (8, P)
    test = torch.stack([flat(run.grads[("ckpt0/test", 1, j)]) for j in (101, 104)])  # (2, P)
    expected = (train / train.norm(dim=1, keepdim=True)) @ (test / test.norm(dim=1, keepdim=True)).T  # (8, 2)
    np.testing.assert_allclose(sim.scores, expected, atol=TOL)


def test_unknown_names_raise_store_error(store: GradientStore) -> None:
    with pytest.raises(StoreError, match="unknown capture point 'nope'.*train"):
        store.sample_ids("nope")
    with pytest.raises(StoreError, match="unknown layer"):
        store.norms("train", layers=["fc9"])
    with pytest.raises(StoreError, match="unknown layer"):
        store.layer_info("fc9")
    with pytest.raises(StoreError, match="sample 999 is not stored"):
        store.restore(999)
    with pytest.raises(StoreError, match="not stored at capture point 'ckpt0/test' at step 3"):
        store.restore(101, capture_point="ckpt0/test", step=3)
