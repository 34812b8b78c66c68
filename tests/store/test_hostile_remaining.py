"""Issue 29's remaining medium cases: journal columns that contradict their shard, layer specs that disagree
between ranks or with the stored tensors, JSON that would parse into far more memory than its bytes, and a
manifest shape whose dense gradient no machine holds.

A case that could fill the machine's memory on the code before the fix runs in a subprocess under a
memory cap (``RLIMIT_AS``: its address space after imports plus :data:`HEADROOM`), so a regression fails
with a ``MemoryError`` there instead of taking the machine down.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from hostilecases import manifest

from metastore_plugins import StoreWriter
from metastore_plugins.core.capture.records import LayerRecord

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
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=SUBPROCESS_SECONDS, check=False
    )
    assert done.returncode == 0, f"rc {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


# -- case 4: a manifest shape whose dense gradient no machine holds -----------------------------------


def test_restore_of_a_layer_declared_huge_is_refused_before_allocating(tmp_path: Path) -> None:
    """An embedding declared ``[2**31 - 1, 8]`` (64 GiB per sample) whose stored rows are small: restore names the
    layer and the cap instead of allocating (on the code before: a MemoryError under the cap, 64 GiB without)."""
    path = tmp_path / "store"
    record = LayerRecord(
        layer="emb",
        kind="embedding",
        batch_size=1,
        params={"weight": "emb.weight"},
        param_shapes={"weight": (2**31 - 1, 8)},
        tensors={
            "ids": torch.tensor([3, 2**31 - 2], dtype=torch.int32),
            "suffix": torch.ones(2, 8),
            "sample": torch.zeros(2, dtype=torch.int32),
            "position": torch.arange(2, dtype=torch.int32),
        },
    )
    with StoreWriter(path) as writer:
        writer.write([record], sample_ids=torch.tensor([7]), step=0)
    assert manifest(path)["layers"]["emb"]["param_shapes"]["weight"] == [2**31 - 1, 8]
    out = run_capped(f"""
    print(sorted(open_store({str(path)!r}).restore(7)))
    """)
    assert out.startswith("StoreError:"), out
    assert "'emb'" in out and "bytes" in out and "METASTORE_MAX_RESTORE_BYTES" in out and out.count("\n") == 1, out
