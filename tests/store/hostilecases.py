"""Real stores to damage, and hand tools to write hostile journal lines, manifests and shards.

A journal line is rebuilt here with ``journal.encode_line`` from an edited JSON object (or by hand
with ``zlib.crc32``), so a test can make a line that is well formed and CRC-valid but hostile.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash
from storecases import FP32_ROUNDOFF, synthetic_batch

from metastore_plugins import StoreWriter
from metastore_plugins.core.store.shards.journal import encode_line

GOLDEN_V1 = Path(__file__).resolve().parent / "golden" / "store"
#: Seconds a refusal may take at most: generous, so that a loaded machine does not fail; a hang never returns.
PROMPT = 10.0
T = TypeVar("T")
Expected = dict[int, dict[str, torch.Tensor]]


def write_batches(writer: StoreWriter, seeds: range, size: int = 4) -> Expected:
    """One batch per seed (sample ids ``seed * size ...``, step ``seed``); the expected gradient of each sample."""
    expected = {}
    for seed in seeds:
        records, grads = synthetic_batch(seed, size)
        ids = torch.arange(size) + seed * size
        writer.write(records, sample_ids=ids, step=seed, labels=ids % 3)
        expected.update({int(i): {k: v[pos] for k, v in grads.items()} for pos, i in enumerate(ids.tolist())})
    return expected


def build_store(path: Path, shards: int = 4, encoding: str = "fp32") -> Expected:
    """``shards`` shards of one batch of 4 samples each (shard ``i`` holds sample ids ``4i..4i+3``)."""
    with StoreWriter(path, encoding=encoding, shard_bytes=1) as writer:  # type: ignore[arg-type]
        expected = write_batches(writer, range(shards))
    assert len(list(path.glob("*.safetensors"))) == shards
    return expected


def check(store: Any, expected: Expected) -> None:
    """Every sample of ``expected`` restores to its gradient (fp32 round-off)."""
    for sample, grads in expected.items():
        restored = store.restore(sample)
        for name, value in grads.items():
            torch.testing.assert_close(restored[name], value, rtol=FP32_ROUNDOFF["rtol"], atol=FP32_ROUNDOFF["atol"])


def of_shard(expected: Expected, shard: int) -> Expected:
    return {k: v for k, v in expected.items() if k // 4 == shard}


def shard(path: Path, i: int, rank: int = 0) -> Path:
    return path / f"rank{rank}-{i:06d}.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- journal lines -------------------------------------------------------------------------------


def journal(path: Path, rank: int = 0) -> Path:
    return path / f"index-rank{rank}.jsonl"


def journal_objects(path: Path, rank: int = 0) -> list[dict[str, Any]]:
    """The JSON objects of a rank's journal lines (columns still packed), CRC checked by hand."""
    objects = []
    for line in journal(path, rank).read_bytes().splitlines():
        text, crc = line.rsplit(b" ", 1)
        assert int(crc, 16) == zlib.crc32(text)
        objects.append(json.loads(text))
    return objects


def crc_line(text: bytes) -> bytes:
    """``text`` as a journal line with its CRC, built by hand (any bytes, even not JSON)."""
    return text + b" " + f"{zlib.crc32(text):08x}".encode() + b"\n"


def raw_line(entry: dict[str, Any]) -> bytes:
    """A CRC-valid line of any JSON object, NaN and huge numbers included (``encode_line`` refuses NaN)."""
    return crc_line(json.dumps(entry, separators=(",", ":")).encode("ascii"))


def write_journal(path: Path, objects: list[dict[str, Any]], rank: int = 0) -> None:
    journal(path, rank).write_bytes(b"".join(encode_line(entry) for entry in objects))


def edit_line(path: Path, i: int, edit: Callable[[dict[str, Any]], Any], rank: int = 0) -> None:
    """Apply ``edit`` to line ``i``'s object and write it back with a valid CRC (``raw_line``)."""
    objects = journal_objects(path, rank)
    edit(objects[i])
    journal(path, rank).write_bytes(b"".join(raw_line(entry) for entry in objects))


def edit_text(path: Path, i: int, old: str, new: str, rank: int = 0) -> None:
    """Replace ``old`` by ``new`` in line ``i``'s JSON text and recompute its CRC by hand (``zlib.crc32``)."""
    lines = journal(path, rank).read_bytes().splitlines(keepends=True)
    text = lines[i].rsplit(b" ", 1)[0]
    assert old.encode() in text, (old, text[:200])
    lines[i] = crc_line(text.replace(old.encode(), new.encode(), 1))
    journal(path, rank).write_bytes(b"".join(lines))


def column(values: Any, code: str) -> list[str]:
    """A packed column ``[code, base64]`` of ``values`` stored as numpy ``<code``."""
    return [code, base64.b64encode(np.asarray(values, dtype=f"<{code}").tobytes()).decode("ascii")]


def unpacked(packed: list[str]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(packed[1]), dtype=f"<{packed[0]}")


def resync(path: Path, i: int, rank: int = 0) -> None:
    """Make line ``i`` agree with its shard file's size and checksums again (a consistent, hostile store)."""
    file = path / journal_objects(path, rank)[i]["file"]
    data = file.read_bytes()

    def agree(entry: dict[str, Any]) -> None:
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        if "xxh3_128" in entry:
            entry["xxh3_128"] = xxhash.xxh3_128_hexdigest(data)

    edit_line(path, i, agree, rank)


# -- manifests and the version 1 golden store ----------------------------------------------------


def manifest(path: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((path / f"manifest-rank{rank}.json").read_text())


def save_manifest(path: Path, content: dict[str, Any], rank: int = 0) -> None:
    (path / f"manifest-rank{rank}.json").write_text(json.dumps(content))


def golden_v1(path: Path) -> Path:
    """A copy of the version 1 golden store (two ranks) at ``path``."""
    shutil.copytree(GOLDEN_V1, path)
    return path


# -- not hanging ---------------------------------------------------------------------------------


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` in a daemon thread: its result, or its exception raised here; fails if it does not return in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not return within {seconds} s (it hangs)"
    if "error" in box:
        raise box["error"]
    return box["value"]
