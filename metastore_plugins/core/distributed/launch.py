"""Start and stop the process group of a partitioned query: from ``torchrun``'s environment, or not at all.

``torchrun --nproc-per-node N ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``; :func:`init_from_env` reads them. Without them (or with ``WORLD_SIZE=1``)
queries run in this one process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.process_group import group_up

#: Default bound on one collective: a rank that died or hangs is reported after this long at most.
DEFAULT_TIMEOUT_S = 600.0


def launched() -> bool:
    """Whether this process is one of several started by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the default process group from ``torchrun``'s environment; ``False`` when not launched by it.

    ``backend``: ``"nccl"`` when CUDA is available, else ``"gloo"``. Under NCCL each rank uses the
    GPU ``LOCAL_RANK``. ``timeout_s`` bounds every collective (a dead or stuck rank is reported,
    never waited for forever).

    Raises:
        ValueError: naming the variable when ``torchrun``'s environment is incomplete.
    """
    if not launched():
        return False
    if group_up():
        return True
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE is set but {', '.join(missing)} are not: start the processes with torchrun")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    """Destroy the default process group if one is initialised."""
    if group_up():
        dist.destroy_process_group()
