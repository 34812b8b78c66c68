"""The storage engine: sharded safetensors written on a background thread, an append-only index, a reader.

- :class:`StoreWriter` queues records and per-sample metadata and writes whole shards;
- :class:`StoreReader` lists, selects, restores and verifies what a run directory holds;
- :mod:`~metastore_plugins.core.store.maintenance` compacts small shards and repairs what a
  killed run left. The format (manifest, journal, shards): docs/format.md.

The modules live in rooms by role (``shards``, ``snapshots``, ``tags``, ``vectors``, ``writing``, ``reading``,
``maintenance``), each importing only the rooms before it; the root keeps the file access every room goes
through (``files``, ``file_kinds``, ``writable``): docs/design.md.

It knows bytes, not questions: queries (norms, influence, dynamics, sketches) live in
:mod:`metastore_plugins.core.analysis`, whose ``open_store`` returns a ``GradientStore``
(a ``StoreReader`` with the query methods). Nothing here imports from above ``core.store``.
"""

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.reading.batches import BatchRef
from metastore_plugins.core.store.reading.locate import find_store_dir
from metastore_plugins.core.store.reading.reader import StoreReader
from metastore_plugins.core.store.reading.selection import Selection, StoredBatch
from metastore_plugins.core.store.shards.encoding import DEFAULT_ENCODING, ENCODINGS, Encoding
from metastore_plugins.core.store.writing.writer import StoreWriter, WriterStats

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "BatchRef",
    "Encoding",
    "Selection",
    "StoreError",
    "StoreReader",
    "StoreWriter",
    "StoredBatch",
    "WriterStats",
    "find_store_dir",
]
