"""Issue 29's remaining medium cases: journal columns that contradict their shard, layer specs that disagree
between ranks or with the stored tensors, JSON that would parse into far more memory than its bytes, and a
manifest shape whose dense gradient no machine holds.

A case that could fill the machine's memory on the code before the fix runs in a subprocess under a
memory cap (``RLIMIT_AS``: its address space after imports plus :data:`HEADROOM`), so a regression fails
with a ``MemoryError`` there instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostilecases import (
    Expected,
    build_store,
    check,
    column,
    crc_line,
    edit_line,
    journal,
    manifest,
    save_manifest,
    shard,
    unpacked,
    write_batches,
)
from safetensors.torch import load_file
from storecases import synthetic_batch

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import LayerRecord

#: Bytes of address space the capped subprocess may add after its imports (its own parsing of a valid
#: store needs a few MB; the hostile inputs below need 3.6 GB and 64 GiB on the code before the fix).
HEADROOM = 2 * 2**30
#: Seconds the capped subprocess may take (a refusal takes well under one on the busy 2-core machine).
SUBPROCESS_SECONDS = 120

_CAPPED = """
import resource, sys
sys.path[:0] = {paths!r}
from metastore_plugins import open_store
from metastore_plugins.core.store import StoreError
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, vm + {headroom}))
try:
{body}
except StoreError as exc:
    print("StoreError:", exc)
except MemoryError:
    print("MemoryError")
    raise
"""


def run_capped(body: str) -> str:
    """Run ``body`` (Python, ``path`` bound to the store) under the memory cap; its stdout (a StoreError's line)."""
    script = _CAPPED.format(paths=sys.path, headroom=HEADROOM, body=textwrap.indent(textwrap.dedent(body), "    "))
    env = {key: value for key, value in os.environ.items() if key != "METASTORE_MAX_RESTORE_BYTES"}  # the default
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=SUBPROCESS_SECONDS, check=False, env=env
    )
    assert done.returncode == 0, f"rc {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


# -- case 4: a manifest shape whose dense gradient no machine holds -----------------------------------


def test_restore_of_a_layer_declared_huge_is_refused_before_allocating(tmp_path: Path) -> None:
    """An embedding declared ``[2**22, 1024]`` (16 GiB per sample: its rows within ``MAX_EMBEDDING_ROWS``) whose
    stored rows are small: restore names the layer and the cap instead of allocating (on the code before: a
    MemoryError under the cap, 16 GiB without)."""
    path = tmp_path / "store"
    record = LayerRecord(
        layer="emb",
        kind="embedding",
        batch_size=1,
        params={"weight": "emb.weight"},
        param_shapes={"weight": (2**22, 1024)},
        tensors={
            "ids": torch.tensor([3, 2**22 - 1], dtype=torch.int32),
            "suffix": torch.ones(2, 1024),
            "sample": torch.zeros(2, dtype=torch.int32),
            "position": torch.arange(2, dtype=torch.int32),
        },
    )
    with StoreWriter(path) as writer:
        writer.write([record], sample_ids=torch.tensor([7]), step=0)
    assert manifest(path)["layers"]["emb"]["param_shapes"]["weight"] == [2**22, 1024]
    out = run_capped(f"""
    print(sorted(open_store({str(path)!r}).restore(7)))
    """)
    assert out.startswith("StoreError:"), out
    assert "'emb'" in out and "bytes" in out and "METASTORE_MAX_RESTORE_BYTES" in out and out.count("\n") == 1, out


def test_the_restore_cap_counts_every_layer_of_the_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fc`` (30 + 5 floats) and ``ln`` (5, dense: already in memory) of one sample: 140 bytes are built, so a cap
    of 139 bytes refuses the restore naming ``fc`` and one of 140 restores it to its einsum reference."""
    path = tmp_path / "store"
    expected = build_store(path, shards=1)
    monkeypatch.setenv("METASTORE_MAX_RESTORE_BYTES", "139")
    with pytest.raises(StoreError, match=r"would build 140 bytes .* over the 139-byte cap .* layer 'fc' takes 140"):
        open_store(path).restore(0)
    monkeypatch.setenv("METASTORE_MAX_RESTORE_BYTES", "140")
    check(open_store(path), expected)


# -- case 2: layer specs that disagree between ranks, or with the stored tensors ----------------------


def two_ranks(path: Path) -> Expected:
    """Ranks 0 and 1 of one store, two shards each (rank 1's sample ids follow rank 0's)."""
    expected = {}
    for rank in (0, 1):
        with StoreWriter(path, rank=rank, encoding="fp32", shard_bytes=1) as writer:
            expected.update(write_batches(writer, range(2 * rank, 2 * rank + 2)))
    return expected


@pytest.mark.parametrize(
    ("field", "value"),
    [("param_shapes", {"weight": [6, 5], "bias": [5]}), ("layout", "in_out"), ("params", {"weight": "w", "bias": "b"})],
)
def test_ranks_that_describe_a_layer_differently_are_refused_at_open(tmp_path: Path, field: str, value: Any) -> None:
    """Rank 1 says layer ``fc`` is a permuted ``[6, 5]`` (same element count), ``in_out`` or other parameters:
    the store is refused at open, naming both manifests, the layer and the field (before: opened, and rank 1's
    samples restored with the shape, layout or names rank 0 gives)."""
    path = tmp_path / "store"
    expected = two_ranks(path)
    check(open_store(path), expected)  # both ranks agree: every sample restores to its einsum reference
    content = manifest(path, rank=1)
    content["layers"]["fc"][field] = value
    save_manifest(path, content, rank=1)
    with pytest.raises(StoreError) as raised:
        open_store(path)
    text = str(raised.value)
    assert "manifest-rank1.json" in text and "manifest-rank0.json" in text, text
    assert f"layers['fc'].{field}" in text and "\n" not in text, text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda fc: fc.update(param_shapes={"weight": [6, 5], "bias": [5]}), r"weight of shape \(6, 5\) \(out_in"),
        (lambda fc: fc.update(layout="in_out"), r"weight of shape \(5, 6\) \(in_out"),
        (lambda fc: fc.update(param_shapes={"weight": [30], "bias": [5]}), r"weight of shape \(30,\) \(out_in"),
    ],
)
def test_a_manifest_shape_or_layout_that_is_not_the_stored_layers_is_refused_when_read(
    tmp_path: Path, edit: Any, message: str
) -> None:
    """One rank whose manifest permutes ``fc``'s ``(5, 6)`` weight to ``(6, 5)`` (or flattens it), or flips its
    layout: the factors are ``d_out 5, d_in 6``, so reading its records names the shard and layer (before:
    restore returned ``(6, 5)`` or transposed-and-reshaped gradients)."""
    path = tmp_path / "store"
    expected = build_store(path, shards=2)
    content = manifest(path)
    edit(content["layers"]["fc"])
    save_manifest(path, content)
    store = open_store(path)
    with pytest.raises(StoreError, match=message) as raised:
        store.restore(0)
    assert "rank0-000000.safetensors" in str(raised.value) and "'fc'" in str(raised.value)
    # the other layer of the batch still restores, to its reference
    torch.testing.assert_close(store.restore(0, layer="ln")["ln.weight"], expected[0]["ln.weight"], rtol=0, atol=0)


# -- case 1: journal columns that contradict their shard -------------------------------------------


def labelled_store(path: Path) -> None:
    """Three fp32 shards of one batch of 4 each: int labels, float32 losses, float predictions, lr; the middle
    shard without losses and with float labels (so -1/NaN fills and both label kinds are covered)."""
    with StoreWriter(path, encoding="fp32", shard_bytes=1) as writer:
        for seed in range(3):
            records, _ = synthetic_batch(seed, 4)
            ids = torch.arange(4) + 4 * seed
            labels = ids.double() / 2 if seed == 1 else ids % 3
            losses = None if seed == 1 else torch.linspace(0.1, 0.7, 4) + seed
            writer.write(
                records, sample_ids=ids, step=10 + seed, epoch=seed, labels=labels, losses=losses,
                predictions=ids.double() / 4, lr=0.5 / (seed + 1),
            )  # fmt: skip


@pytest.mark.parametrize(
    ("section", "key", "values"),
    [
        ("samples", "label", column([1, 0, 2, 2], "i8")),  # the shard's b0/meta/label is [0, 1, 2, 0]
        ("samples", "loss", column([0.1, 0.3, 0.5, 0.9], "f4")),  # one value off: b0/meta/loss ends at 0.7
        ("samples", "prediction", column([0.0, 0.25, 0.5, 0.5], "f8")),
        ("batches", "step", column([99], "i8")),
        ("batches", "epoch", column([7], "i8")),
        ("batches", "lr", column([0.125], "f8")),
    ],
)
def test_verify_reports_journal_columns_that_contradict_the_shard(
    tmp_path: Path, section: str, key: str, values: list[str]
) -> None:
    """Line 0's column rewritten (CRC valid, the shard untouched): verify names the shard, the batch and the column
    and says which side queries serve (before: verify said nothing and the journal's values were served)."""
    path = tmp_path / "store"
    labelled_store(path)
    assert open_store(path).verify() == []  # an honest store: no line, with -1 / NaN fills and float labels
    shard0 = load_file(str(shard(path, 0)))  # the reference: the shard's own tensors, read by safetensors
    wanted = {"label": [0, 1, 2, 0], "loss": [0.1, 0.3, 0.5, 0.7], "prediction": [0.0, 0.25, 0.5, 0.75]}
    if key in wanted:  # the edit really contradicts the shard's tensor
        stored = shard0[f"b0/meta/{key}"].double().numpy()
        assert not np.allclose(unpacked(values).astype(np.float64), stored)
        assert np.allclose(stored, wanted[key], rtol=1e-6, atol=0)  # float32 losses: rtol of fp32 round-off
    edit_line(path, 0, lambda entry: entry[section].update({key: values}))
    store = open_store(path)
    problems = store.verify()
    assert len(problems) == 1, problems
    line = problems[0]
    assert line.startswith("rank0-000000.safetensors: ") and f"{key} " in line and "b0" in line, line
    assert "queries serve the index's values" in line and "trust the shard" in line, line
    served = store.metadata()[key].astype(np.float64)  # queries serve the journal's values
    if section == "samples":
        assert np.allclose(served[:4], unpacked(values).astype(np.float64), rtol=1e-6, atol=0)
    else:  # batch 0's four samples carry the edited value (the batches are ordered by step)
        assert np.isclose(served, unpacked(values)[0], rtol=1e-6, atol=0).sum() == 4


# -- case 3: JSON that parses into far more memory than its bytes ---------------------------------------

#: ``{},`` repeated: a line or manifest of ``3 * BOMB`` bytes (120 MB) that ``json.loads`` turns into ``BOMB``
#: empty dicts, about 2.9 GB: past :data:`HEADROOM`, so the code before the fix fails with a MemoryError.
BOMB = 40_000_000


def test_a_journal_line_of_millions_of_empty_objects_is_ignored_not_a_memory_error(tmp_path: Path) -> None:
    """A CRC-valid line of 120 MB of ``{},`` after four good lines: ignored with a one-line problem naming it, the
    four shards' 16 samples still listed (before: a MemoryError at open under the cap)."""
    path = tmp_path / "store"
    build_store(path)
    with open(journal(path), "ab") as handle:
        handle.write(crc_line(b'{"x":[' + b"{}," * BOMB + b"{}]}"))
    out = run_capped(f"""
    store = open_store({str(path)!r})
    print(len(store.sample_ids()), store.summary()["index_problems"])
    print(store.open_problems)
    """)
    first, second = out.splitlines()
    assert first == "16 1", out
    assert "index-rank0.jsonl line 5: holds" in second and "more than the 1048576 a reader parses" in second, out


def test_a_manifest_of_millions_of_empty_objects_is_a_store_error_not_a_memory_error(tmp_path: Path) -> None:
    """A manifest of 120 MB (under the 256 MiB cap) whose config holds 40 M empty objects: a one-line StoreError
    naming it (before: a MemoryError under the cap)."""
    path = tmp_path / "store"
    build_store(path, shards=1)
    text = json.dumps(manifest(path)).encode()
    assert text.startswith(b"{") and b'"config": {' in text
    bomb = text.replace(b'"config": {', b'"config": {"x": [' + b"{}," * BOMB + b"{}], ", 1)
    (path / "manifest-rank0.json").write_bytes(bomb)
    out = run_capped(f"""
    open_store({str(path)!r})
    """)
    assert out.startswith("StoreError: cannot read manifest ") and "manifest-rank0.json: it holds" in out, out
    assert "more than the 8388608 a reader parses" in out and out.count("\n") == 1, out
