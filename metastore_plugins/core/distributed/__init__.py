"""Analytics over ``torch.distributed``: queries partitioned by shard across ranks, results identical to one process.

- :mod:`.partition` -- which rank scores which shards (balanced by rows);
- :mod:`.collectives` -- gathers and broadcasts with timeouts, whose errors name the rank that died;
- :mod:`.scan` -- ``PartitionedScan``: the analysis queries' scan, split by shard, combined by collectives;
- :mod:`.queries` -- ``partitioned_self_influence``, ``partitioned_influence`` (and its top-k),
  ``partitioned_similar``, ``partitioned_norms``, ``partitioned_sketches``: queries over such a scan;
- :mod:`.store` -- ``DistributedStore``: a ``GradientStore`` whose every query reads through one;
- :mod:`.launch` -- the process group from ``torchrun``'s environment.

See ``docs/distributed.md``.
"""

from metastore_plugins.core.distributed.launch import init_from_env, launched, shutdown
from metastore_plugins.core.distributed.partition import assign_shards, split
from metastore_plugins.core.distributed.queries import (
    partitioned_influence,
    partitioned_influence_top,
    partitioned_norms,
    partitioned_self_influence,
    partitioned_similar,
    partitioned_sketches,
)
from metastore_plugins.core.distributed.scan import PartitionedScan
from metastore_plugins.core.distributed.store import DistributedStore, open_distributed_store, rank_of
from metastore_plugins.core.errors import DistributedQueryError

__all__ = [
    "DistributedQueryError",
    "DistributedStore",
    "PartitionedScan",
    "assign_shards",
    "init_from_env",
    "launched",
    "open_distributed_store",
    "partitioned_influence",
    "partitioned_influence_top",
    "partitioned_norms",
    "partitioned_self_influence",
    "partitioned_similar",
    "partitioned_sketches",
    "rank_of",
    "shutdown",
    "split",
]
