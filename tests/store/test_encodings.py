"""Error of each encoding on a tiny BERT, against torch.func per-sample gradients.

Errors are relative to the largest reference value: ``max |store - ref| / max |ref|``, for
the per-sample gradient norms and for the train x test gradient dot matrix. Run with ``-s``
to see the measured numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from storecases import flat, reference_loop, rel_err
from torch import Tensor, nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.records import LayerRecord, dense_record
from metastore_plugins.core.store import DEFAULT_ENCODING, ENCODINGS
from metastore_plugins.core.store.shards.encoding import encoded_nbytes

pytest.importorskip("transformers")

#: Upper bounds asserted per encoding: (norms, dots). Measured on this model (see docs/store.md):
#: fp32 1e-7 / 2e-7, fp16 5e-5 / 7e-5, bf16 1.9e-3 / 3.6e-3, int8 8e-4 / 1e-3.
BOUNDS = {"fp32": (1e-5, 1e-5), "fp16": (1e-2, 1e-2), "bf16": (1e-2, 2e-2), "int8": (5e-3, 5e-3)}


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config).train()


def bert_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(input_ids=batch["ids"], attention_mask=batch["mask"]).logits, batch["y"])


def padded_batch(lengths: list[int], tokens: int, generator: torch.Generator) -> dict[str, Tensor]:
    mask = (torch.arange(tokens) < torch.tensor(lengths)[:, None]).long()  # (B, T)
    ids = torch.randint(1, 60, (len(lengths), tokens), generator=generator) * mask  # (B, T), pad id 0
    return {"ids": ids, "mask": mask, "y": torch.randint(0, 2, (len(lengths),), generator=generator)}


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list], dict[str, Tensor]]:
    """Records and reference gradients of a train batch (8) and a test batch (4) at the same weights."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # module-scoped: seed its own weights, leave the global RNG alone
        torch.manual_seed(0)
        model = tiny_bert()
    batches = {"train": padded_batch([9, 3, 6, 1, 9, 7, 2, 5], 9, gen), "test": padded_batch([4, 9, 2, 6], 9, gen)}
    records, reference = {}, {}
    for cp, batch in batches.items():
        reference[cp] = reference_loop(model, bert_loss, batch)
        with CaptureSession(model) as session:
            bert_loss(model, batch).backward()
        assert session.uncaptured_parameters() == []
        records[cp] = session.factors()
        model.zero_grad()
    return records, reference


def _per_sample_vectors(grads: dict[str, Tensor]) -> Tensor:
    size = next(iter(grads.values())).shape[0]
    return torch.stack([flat({name: g[i] for name, g in grads.items()}) for i in range(size)])


def _write(path: Path, records: dict[str, list], encoding: str | None) -> None:
    kwargs = {} if encoding is None else {"encoding": encoding}
    with StoreWriter(path, shard_bytes=50_000, **kwargs) as writer:
        writer.write(records["train"], sample_ids=torch.arange(8), step=0, capture_point="train")
        writer.write(records["test"], sample_ids=torch.arange(100, 104), step=0, capture_point="test")


@pytest.mark.parametrize("encoding", [*ENCODINGS, None])
def test_encoding_error_on_tiny_bert(bert_run: tuple, tmp_path: Path, encoding: str | None) -> None:
    records, reference = bert_run
    _write(tmp_path, records, encoding)
    store = open_store(tmp_path)
    used = encoding or DEFAULT_ENCODING
    assert store.summary()["encodings"] == [used]
    flat_ref = {cp: _per_sample_vectors(grads) for cp, grads in reference.items()}  # (B, P) each
    ref_norms = np.concatenate([flat_ref["train"].norm(dim=1).numpy(), flat_ref["test"].norm(dim=1).numpy()])
    norms = np.concatenate([store.norms("train"), store.norms("test")])
    ref_dots = (flat_ref["train"] @ flat_ref["test"].T).numpy()  # (8, 4)
    scores = store.influence(train="train", test="test")  # no lr recorded: plain dots
    np.testing.assert_array_equal(scores.row_ids, np.arange(8))
    norm_err, dot_err = rel_err(norms, ref_norms), rel_err(scores.scores, ref_dots)
    label = used + (" (default)" if encoding is None else "")
    print(
        f"\n[{label}] norms rel err {norm_err:.2e}, dots rel err {dot_err:.2e}, "
        f"bytes {store.summary()['bytes_on_disk']}"
    )
    norm_bound, dot_bound = BOUNDS[used]
    assert norm_err <= norm_bound and dot_err <= dot_bound
    if used != "fp32":  # lossy encodings are not secretly exact
        assert norm_err > 0 or dot_err > 0


def _tiny_outer(seed: int, magnitude: float) -> tuple[LayerRecord, dict[str, Tensor]]:
    """An outer record with tiny suffix values, one all-zero prefix row, and its gradients by einsum."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(6, 1, 5, generator=g)  # (R, 1, d_in): rows 2 per sample, 3 samples
    prefix[3] = 0.0  # e.g. a ReLU output that is all zero
    suffix = torch.randn(6, 1, 4, generator=g) * magnitude  # (R, 1, d_out)
    suffix[4, 0, 1:] = 0.0  # a row with a single non-zero entry
    record = LayerRecord(
        layer="fc",
        kind="outer",
        batch_size=3,
        params={"weight": "fc.weight", "bias": "fc.bias"},
        param_shapes={"weight": (4, 5), "bias": (4,)},
        tensors={
            "prefix": prefix,
            "suffix": suffix,
            "sample": torch.arange(3).repeat_interleave(2).int(),
            "position": torch.arange(6).int() % 2,
        },
    )
    a, d = prefix[:, 0].reshape(3, 2, 5), suffix[:, 0].reshape(3, 2, 4)
    return record, {"fc.weight": torch.einsum("bto,bti->boi", d, a), "fc.bias": d.sum(1)}


@pytest.mark.parametrize(("encoding", "bound"), [("fp32", 1e-7), ("fp16", 2e-3), ("bf16", 1e-2), ("int8", 2e-2)])
def test_tiny_values_and_zero_rows_round_trip(tmp_path: Path, encoding: str, bound: float) -> None:
    """Suffix values ~1e-9 underflow in plain fp16 (smallest subnormal 6e-8); per-row scales keep them."""
    assert torch.tensor(3e-9).half().item() == 0.0  # the premise
    record, expected = _tiny_outer(0, 1e-9)
    zero_dense = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)) * 1e-9  # (B, 4)
    zero_dense[1] = 0.0  # a sample whose gradient is exactly zero
    dense = dense_record("ln", {"weight": zero_dense}, {"weight": "ln.weight"})
    empty = LayerRecord(  # a layer every row of which was dropped (suffix all zero)
        layer="unused",
        kind="outer",
        batch_size=3,
        params={"weight": "unused.weight"},
        param_shapes={"weight": (2, 3)},
        tensors={
            "prefix": torch.zeros(0, 1, 3),
            "suffix": torch.zeros(0, 1, 2),
            "sample": torch.zeros(0, dtype=torch.int32),
            "position": torch.zeros(0, dtype=torch.int32),
        },
    )
    with StoreWriter(tmp_path, encoding=encoding) as writer:
        writer.write([record, dense, empty], sample_ids=[7, 8, 9], step=0)
    store = open_store(tmp_path)
    for pos, sample in enumerate((7, 8, 9)):
        got = store.restore(sample)
        for name in ("fc.weight", "fc.bias"):
            exp = expected[name][pos]
            assert got[name].abs().max() > 0, f"{name} of sample {sample} underflowed to zero"
            assert rel_err(got[name], exp) <= bound, (name, sample)
        assert torch.isfinite(got["ln.weight"]).all()
        if pos == 1:
            assert torch.equal(got["ln.weight"], torch.zeros(4))
        else:
            assert rel_err(got["ln.weight"], zero_dense[pos]) <= bound
        assert torch.equal(got["unused.weight"], torch.zeros(2, 3))
    # the all-zero prefix row decodes to exact zeros, not NaN
    stored = next(r for r in next(store.select().batches()).records if r.layer == "fc")
    assert torch.equal(stored.tensors["prefix"][3], torch.zeros(1, 5))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_dense_parameter_named_scale_round_trips(tmp_path: Path, encoding: str) -> None:
    """Row scales are stored as ``<key>.scale``; a parameter called ``scale`` must not be mistaken for one."""
    grads = torch.randn(2, 3, generator=torch.Generator().manual_seed(0)) + 2.0  # (B, 3)
    record = dense_record("rms", {"scale": grads}, {"scale": "rms.scale"})
    with StoreWriter(tmp_path, encoding=encoding) as writer:
        writer.write([record], sample_ids=[0, 1], step=0)
    restored = open_store(tmp_path).restore(1)
    assert list(restored) == ["rms.scale"]
    assert rel_err(restored["rms.scale"], grads[1]) <= 2e-2


def _reference_encoding(tensor: Tensor, encoding: str) -> dict[str, Tensor]:
    """The documented encodings, written out here independently of the store's code."""
    if not tensor.is_floating_point():
        return {"": tensor.to(torch.int32)}
    x = tensor.double()
    if encoding == "fp32":
        return {"": tensor.float()}
    if encoding == "bf16":
        return {"": tensor.float().bfloat16()}
    peak = x.abs().reshape(len(x), -1).amax(1) if x.numel() else x.new_zeros(len(x))  # (R,)
    top = 127.0 if encoding == "int8" else 1.0
    scale = torch.where(peak > 0, peak / top, torch.ones_like(peak)).float()  # (R,)
    scaled = tensor.float() / scale.view(-1, *([1] * (tensor.dim() - 1)))
    data = scaled.round().clamp(-127, 127).to(torch.int8) if encoding == "int8" else scaled.half()
    return {"": data, ".scale": scale}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_shard_file_holds_each_encoded_tensor_and_its_checksum(tmp_path: Path, encoding: str) -> None:
    """The writer encodes a shard into one buffer: safetensors reads back every tensor as encoded
    one by one, metadata columns as given, and the returned size and sha256 are the file's."""
    import hashlib

    import xxhash
    from safetensors import safe_open

    from metastore_plugins.core.store.shards import manifest as mf
    from metastore_plugins.core.store.shards.shardfile import write_shard

    torch.manual_seed(0)
    first = LayerRecord(
        "fc",
        "outer",
        3,
        {"weight": "fc.weight"},
        {"weight": (4, 3)},
        {
            "prefix": torch.randn(5, 1, 3),
            "suffix": torch.randn(5, 1, 4) * 1e-8,
            "sample": torch.tensor([0, 0, 1, 2, 2]),
            "position": torch.arange(5),
        },
    )
    empty = LayerRecord(
        "fc",
        "outer",
        2,
        {"weight": "fc.weight"},
        {"weight": (4, 3)},
        {
            "prefix": torch.randn(0, 1, 3),
            "suffix": torch.randn(0, 1, 4),
            "sample": torch.zeros(0, dtype=torch.long),
            "position": torch.zeros(0, dtype=torch.long),
        },
    )
    dense = LayerRecord(
        "ln",
        "dense",
        2,
        {"weight": "ln.weight"},
        {"weight": (4,)},
        {"grad.weight": torch.cat([torch.zeros(1, 4), torch.randn(1, 4).half().float()])},
    )
    batches = [
        ([first], {"sample_id": torch.tensor([7, 8, 9]), "loss": torch.rand(3, dtype=torch.float64)}),
        ([empty, dense], {"sample_id": torch.tensor([1, 2]), "label": torch.tensor([True, False])}),
    ]
    before = [{k: t.clone() for k, t in r.tensors.items()} for records, _ in batches for r in records]
    size, sha256, xxh3 = write_shard(tmp_path / "s.safetensors", batches, encoding, {"format": "x"})

    raw = (tmp_path / "s.safetensors").read_bytes()
    assert (size, sha256, xxh3) == (len(raw), hashlib.sha256(raw).hexdigest(), xxhash.xxh3_128_hexdigest(raw))
    expected: dict[str, Tensor] = {}
    for index, (records, meta) in enumerate(batches):
        for k, record in enumerate(records):
            for name, tensor in record.tensors.items():
                for suffix, value in _reference_encoding(tensor, encoding).items():
                    expected[mf.record_key(index, k, name) + suffix] = value
        for column, values in meta.items():
            expected[mf.meta_key(index, column)] = values
    with safe_open(tmp_path / "s.safetensors", framework="pt") as stored:
        assert stored.metadata() == {"format": "x"}
        assert sorted(stored.keys()) == sorted(expected)
        for key, value in expected.items():
            got = stored.get_tensor(key)
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
    after = [dict(r.tensors) for records, _ in batches for r in records]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(after, before) for k in a)  # the records are only read
    for tensors in before:
        for tensor in tensors.values():
            assert encoded_nbytes(tensor, encoding) == sum(
                v.numel() * v.element_size() for v in _reference_encoding(tensor, encoding).values()
            )
