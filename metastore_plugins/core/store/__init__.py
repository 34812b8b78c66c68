"""The gradient store: sharded safetensors written on a background thread, a manifest, a reader.

- :class:`StoreWriter` queues records and per-sample metadata and writes whole shards;
- :func:`open_store` returns a :class:`GradientStore` that lists, selects, restores,
  verifies and answers queries (norms, influence, similarity, ...).
"""

from metastore_plugins.core.store.encoding import DEFAULT_ENCODING, ENCODINGS, Encoding
from metastore_plugins.core.store.queries import Scores
from metastore_plugins.core.store.reader import GradientStore, StoreError, open_store
from metastore_plugins.core.store.selection import Selection, StoredBatch
from metastore_plugins.core.store.writer import StoreWriter, WriterStats

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "Encoding",
    "GradientStore",
    "Scores",
    "Selection",
    "StoreError",
    "StoreWriter",
    "StoredBatch",
    "WriterStats",
    "open_store",
]
