"""Where a run's store may go: a fresh run never writes into a store an earlier run left.

A store directory holds one run. A run resumed from a checkpoint (Lightning
``trainer.fit(ckpt_path=...)``, Hugging Face ``trainer.train(resume_from_checkpoint=...)``)
continues the store it left; a fresh run (step 0) into a directory whose store holds samples
is refused with both ways out, or, with ``overwrite=True``, the earlier store is moved aside
(``<dir>.replaced-<UTC time>``), never deleted. Rank 0 decides and every rank follows, so
under DDP all ranks do the same.

Example::

    moved = claim_store_dir(path, continuing=trainer_step > 0, overwrite=False, owner="MyCallback",
                            resume="trainer.fit(..., ckpt_path=...)")
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from metastore_plugins.core.errors import ExistingStoreError, StoreError, StoreNotWritableError
from metastore_plugins.core.store.reading.reader import StoreReader
from metastore_plugins.core.store.shards.journal import RankLock, journal_name
from metastore_plugins.core.store.shards.manifest import find_manifests
from metastore_plugins.core.store.writable import check_writable

#: Rank 0's decision: (what, the place an overwritten store moved to, or why it could not move).
Decision = tuple[str, str]


def claim_store_dir(
    path: str | os.PathLike[str],
    *,
    continuing: bool,
    overwrite: bool,
    owner: str,
    resume: str,
    step: int = 0,
    rank: int = 0,
    agree: Callable[[Decision], Decision] = lambda decision: decision,
) -> Path | None:
    """Decide whether this run writes into ``path``; return where an overwritten store was moved (else None).

    Rank 0 looks, moves an overwritten store aside, then ``agree`` hands its decision to every rank.

    Args:
        path: the store directory the run is about to write.
        continuing: the run resumes an earlier one (it starts past step 0): it continues the store.
        overwrite: a fresh run may replace a store found there: the old one is moved aside, never deleted.
        owner: the callback's name, for the message (``owner(overwrite=True)``).
        resume: how this trainer resumes from a checkpoint, for the message.
        step: the optimizer step the run starts at: a resumed run into a store that holds training steps
            from there on (the earlier run went past its checkpoint) is warned that they will be stored twice.
        rank: this process's rank.
        agree: sends rank 0's decision to every rank (a broadcast; the identity in one process).

    Raises:
        ExistingStoreError: on every rank, when a fresh run without ``overwrite`` finds a store in
            ``path``, or when the store to overwrite could not be moved.
    """
    path = Path(path)
    decision: Decision = ("", "")
    if rank == 0:
        try:
            decision = _decide(path, continuing, overwrite, owner, step)
        except (OSError, ValueError) as exc:  # an unreadable directory: every rank must hear it, not wait for it
            decision = ("error", f"{owner}: cannot read the store directory {path} ({exc}); check its permissions")
    what, detail = agree(decision)
    if what == "refuse":
        raise ExistingStoreError(
            f"{owner}: {path} already holds the store of an earlier run, and this run starts afresh (at step 0): "
            "writing into it would mix both runs' samples, and every query would count them together. To continue "
            f"that run, resume it from its checkpoint ({resume}); to start a new store, pass another dirpath, or "
            f"{owner}(overwrite=True) to move the earlier store aside (to {path}.replaced-<time>; nothing is deleted)"
        )
    if what == "error":
        raise ExistingStoreError(detail)
    if what == "replaced":
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(detail)
    if detail and rank == 0:
        warnings.warn(f"{owner}: {detail}", stacklevel=3)
    return None


def create_store_dir(path: str | os.PathLike[str], setting: str) -> Path:
    """Create ``path`` and check this process can write it, or raise naming ``setting``.

    Called on every rank after :func:`claim_store_dir`: before rank 0's decision, another rank must not touch
    the directory, which rank 0 may be moving aside.
    """
    path = Path(path)
    fix = f"set {setting} to a writable directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreNotWritableError(f"cannot create the store directory {path} ({exc}); {fix}") from exc
    check_writable(path, fix)
    return path


def holds_store(path: Path) -> bool:
    """Whether ``path`` holds a store with samples: a rank whose index journal lists a shard.

    A store an earlier run left without any sample (it failed at its first step) holds nothing to mix.
    """
    journals = [path / journal_name(rank) for rank, _ in find_manifests(path)]
    return any(journal.is_file() and journal.stat().st_size > 0 for journal in journals)


def _decide(path: Path, continuing: bool, overwrite: bool, owner: str, step: int) -> Decision:
    """Rank 0's decision, with an overwritten store already moved: ``(what, the new place, the error or a note)``."""
    if not holds_store(path):
        return "write", ""
    if continuing:
        return "write", _steps_again(path, step)
    if not overwrite:
        return "refuse", ""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = path.with_name(f"{path.name}.replaced-{stamp}"), 1
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    locks: list[RankLock] = []
    try:
        for rank, _ in find_manifests(path):
            locks.append(RankLock(path, rank))  # no writer, compaction or repair of it may be running
        os.rename(path, aside)
    except (OSError, ValueError) as exc:  # StoreError: a rank in use
        return "error", (
            f"{owner}(overwrite=True) could not move the earlier store {path} aside to {aside} ({exc}); "
            "move or delete it yourself, or pass another dirpath"
        )
    finally:
        for lock in locks:
            lock.release()
    return "replaced", str(aside)


def _steps_again(path: Path, step: int) -> str:
    """What a run resumed at ``step`` will store a second time (the training steps the store holds from there on)."""
    try:
        steps = StoreReader(path, checksums=False).steps("train")
    except (StoreError, KeyError, ValueError):  # no training steps, or a store the run's writer will judge
        return ""
    later = [s for s in steps if s >= step]
    if not later:
        return ""
    return (
        f"the store {path} already holds training steps {later[0]}..{later[-1]}, stored after the checkpoint this "
        f"run resumes from (step {step}); this run stores them again, and queries over those steps count both "
        "copies (steps=(first, last) below it read one)"
    )
