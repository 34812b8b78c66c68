"""Projected and norms-only records written by the store writer and read back by the reader, every encoding.

Squared norms are kept in float32 whatever the encoding: read back, they equal the torch.func
gradients' squared norms to float rounding. Projections are encoded like other gradient tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from storecases import PooledTagger, reference_loop, tagger_batch, tagger_loss

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.ops import total_dots
from metastore_plugins.core.ops.represent import represent
from metastore_plugins.core.store.shards.encoding import ENCODINGS

CHOICE = {"emb": "norms", "enc": "projected", "norm": "projected"}  # head stays exact
ROUNDING = {"fp32": 1e-6, "fp16": 2e-3, "bf16": 1e-2, "int8": 2e-2}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_kept_records_round_trip(tmp_path: Path, encoding: str) -> None:
    torch.manual_seed(0)
    model = PooledTagger()
    batch = tagger_batch(torch.arange(6), torch.Generator().manual_seed(1))
    with CaptureSession(model) as session:
        tagger_loss(model, batch).backward()
    kept = represent(session.factors(), CHOICE, k_in=4, k_out=3)  # type: ignore[arg-type]
    reference = reference_loop(model, lambda m, b: tagger_loss(m, b), batch)
    with StoreWriter(tmp_path, encoding=encoding) as writer:  # type: ignore[arg-type]
        writer.write(kept, sample_ids=torch.arange(6), step=0)
    store = open_store(tmp_path)
    assert store.verify() == []
    (stored,) = list(store.select().batches())
    by_layer = {record.layer: record for record in stored.records}
    assert {layer: record.kind for layer, record in by_layer.items()} == {
        "emb": "norms",
        "enc": "projected",
        "norm": "projected",
        "head": "outer",
    }
    for layer, record in by_layer.items():
        if record.kind == "outer":
            continue
        expected = sum(reference[name].double().flatten(1).pow(2).sum(1) for name in record.params.values())
        error = (record.tensors["sq_norm"].double() - expected).abs().max() / expected.abs().max()
        assert float(error) <= 1e-5, layer  # float32, not the encoding
        written = next(r for r in kept if r.layer == layer)
        assert torch.equal(record.tensors["sq_norm"], written.tensors["sq_norm"])
        if record.kind == "projected":
            projected = written.tensors["projected"]
            error = (record.tensors["projected"] - projected).abs().max() / projected.abs().max()
            assert float(error) <= ROUNDING[encoding], layer
    enc = [by_layer["enc"]]
    assert torch.allclose(total_dots(enc, enc).diagonal(), (enc[0].tensors["projected"].flatten(1) ** 2).sum(1))
    with pytest.raises(RepresentationError, match="layer 'emb'.*norms only"):
        total_dots([by_layer["emb"]], [by_layer["emb"]])
    with pytest.raises(RepresentationError, match="layer 'enc'"):
        store.restore(2, layer="enc")


@pytest.mark.parametrize("where", ["eigenvalues", "mean_eigenvalue"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-3])
def test_a_projected_record_with_eigenvalues_not_finite_or_negative_is_refused(where: str, bad: float) -> None:
    """The reader's check of a projected record's eigenbasis, against numpy's ``isfinite`` and ``>= 0``."""
    from metastore_plugins.core.errors import StoreError
    from metastore_plugins.core.store.shards.record_check import check_record

    entry = {"layer": "enc", "kind": "projected"}
    layer = {"param_shapes": {"weight": [8, 6]}, "params": {"weight": "enc.weight"}, "layout": "out_in"}

    def tensors(value: float) -> dict[str, torch.Tensor]:
        found = {
            "projected": torch.randn(3, 4, 2),
            "sq_norm": torch.rand(3),
            "basis": torch.tensor([5]),
            "eigenvalues": torch.rand(4, 2) + 0.5,
            "mean_eigenvalue": torch.tensor([0.7]),
        }
        found[where].reshape(-1)[-1] = value
        return found

    for value, float64 in ((bad, False), (bad, True), (0.0, False), (3.0, True)):
        given = tensors(value)
        if float64:
            given[where] = given[where].double()
        array = given[where].numpy()
        sound = bool(np.isfinite(array).all() and (array >= 0).all())  # the reference
        if sound:
            check_record(Path("s.safetensors"), "b0/r0/", entry, layer, 3, given, given)
        else:
            with pytest.raises(StoreError, match=rf"s.safetensors: tensor b0/r0/{where} must be finite, non-negative"):
                check_record(Path("s.safetensors"), "b0/r0/", entry, layer, 3, given, given)
