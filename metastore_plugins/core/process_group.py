"""Whether a ``torch.distributed`` process group is up, and its size: the one place the package asks."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def group_up() -> bool:
    """Whether ``torch.distributed`` is available and its default process group initialised."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any = None) -> int:
    """The number of ranks of ``group`` (the default group), 1 without a process group."""
    return dist.get_world_size(group) if group_up() else 1


def rank_of(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group): the one that prints or writes results."""
    return dist.get_rank(group) if group_up() else 0
