"""What a second run into a store directory left there (tests/lightning/test_rerun.py, tests/hf/test_hf_rerun.py).

:func:`file_hashes` fingerprints every file under a directory (an untouched or moved store is the same
bytes); :func:`stored_counts` counts how many times each sample id is stored at capture point ``train``
(a merged or continued store holds a sample once per epoch it trained in).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from metastore_plugins import open_store


def file_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every regular file under ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def stored_counts(store_dir: Path) -> dict[int, int]:
    """How many times each sample id is stored at capture point ``train``."""
    ids, counts = torch.unique(torch.as_tensor(open_store(store_dir).sample_ids("train")), return_counts=True)
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))
