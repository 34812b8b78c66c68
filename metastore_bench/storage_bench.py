"""Storage: bytes per sample of the store against dense per-sample fp32 gradients, per encoding,
with and without dropping zero-suffix (padding) rows, on one padded text batch.

"With pruning" is what :class:`StoreWriter` wrote (shard files on disk, headers and metadata
included). "Without pruning" is computed from the record shapes: every factored row is the same
size, so a record of ``R`` kept rows would take ``bytes * B*T_layer / R`` with all ``B*T_layer``
rows kept (capped by its dense form, which the store keeps when smaller).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import ENCODINGS, StoreWriter
from metastore_plugins.core.store.shards.encoding import encode

from .models import Workload

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def _encoded_bytes(record: LayerRecord, encoding: str) -> int:
    return sum(
        v.numel() * v.element_size() for name, t in record.tensors.items() for v in encode(name, t, encoding).values()
    )


def _full_rows(record: LayerRecord, tokens: int) -> int:
    """Rows with no pruning: ``B*T`` for token-level layers (embeddings, encoder), ``B`` for the pooled head."""
    token_level = record.layer.startswith(("bert.embeddings", "bert.encoder"))
    return record.batch_size * (tokens if token_level else 1)


def run(workload: Workload) -> dict[str, Any]:
    """Bytes per sample for every encoding on one padded batch (half of the tokens are padding)."""
    model = workload.build()
    batch = workload.batch(workload.batch_size, seed=1)
    size = workload.batch_size
    with CaptureSession(model) as session:
        workload.loss(model, batch).backward()
    records = session.factors()
    dense = sum(r.dense_nbytes for r in records)
    word = sum(r.dense_nbytes for r in records if r.layer.endswith("word_embeddings"))
    kinds: dict[str, int] = {}
    rows_kept = rows_full = 0
    for r in records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
        if r.kind != "dense":
            rows_kept += int(r.tensors["sample"].shape[0])
            rows_full += _full_rows(r, workload.tokens)
    out: dict[str, Any] = {
        "workload": workload.name,
        "batch_size": size,
        "tokens": workload.tokens,
        "padding_fraction": float(1 - batch["attention_mask"].float().mean()) if "attention_mask" in batch else 0.0,
        "record_kinds": kinds,
        "uncaptured_parameters": session.uncaptured_parameters(),
        "factored_rows_kept": rows_kept,
        "factored_rows_unpruned": rows_full,
        "dense_fp32_per_sample": dense / size,
        "dense_fp32_per_sample_without_word_embeddings": (dense - word) / size,
        "encodings": {},
    }
    for encoding in ENCODINGS:
        with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
            with StoreWriter(tmp, encoding=encoding) as writer:
                writer.write(records, sample_ids=torch.arange(size), step=0, labels=batch["labels"])
            on_disk = writer.stats.bytes_written
        tensors = sum(_encoded_bytes(r, encoding) for r in records)
        unpruned = 0.0
        for r in records:
            b = _encoded_bytes(r, encoding)
            if r.kind == "dense":
                unpruned += b
            else:
                kept = max(1, int(r.tensors["sample"].shape[0]))
                dense_enc = r.dense_nbytes * _ELEMENT_BYTES[encoding] / 4
                unpruned += min(b * _full_rows(r, workload.tokens) / kept, dense_enc)
        overhead = on_disk - tensors  # safetensors header, sample ids, labels
        per_sample = on_disk / size
        per_sample_unpruned = (unpruned + overhead) / size
        out["encodings"][encoding] = {
            "store_per_sample": per_sample,
            "store_per_sample_unpruned": per_sample_unpruned,
            "ratio_dense_to_store": out["dense_fp32_per_sample"] / per_sample,
            "ratio_dense_without_word_embeddings_to_store": out["dense_fp32_per_sample_without_word_embeddings"]
            / per_sample,
            "pruning_saves": per_sample_unpruned / per_sample,
        }
    out["writer_throughput"] = writer_throughput(records, size)
    return out


def writer_throughput(records: list[LayerRecord], size: int, batches: int = 8) -> dict[str, float]:
    """MB/s of ``StoreWriter`` (fp32, one shard) against ``save_file`` of the same tensors, same run."""
    with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
        start = time.perf_counter()
        with StoreWriter(Path(tmp) / "store", encoding="fp32", shard_bytes=2**40) as writer:
            for step in range(batches):
                writer.write(records, sample_ids=torch.arange(size) + step * size, step=step)
        store_s = time.perf_counter() - start
        written = writer.stats.bytes_written
        tensors = {
            f"b{step}/r{k}/{name}": t.clone()
            for step in range(batches)
            for k, r in enumerate(records)
            for name, t in r.tensors.items()
        }
        start = time.perf_counter()
        save_file(tensors, str(Path(tmp) / "plain.safetensors"))
        plain_s = time.perf_counter() - start
    return {"bytes": written, "store_mb_s": written / store_s / 1e6, "save_file_mb_s": written / plain_s / 1e6}
