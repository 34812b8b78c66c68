"""Weight snapshots: the files (``weights``), their checks and journal, and the row deltas between them.

``metastore_plugins.core.store.snapshots`` was a module (goes in 0.3): its names are looked up in
:mod:`metastore_plugins.core.store.snapshots.weights` with a ``DeprecationWarning``.
"""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(__name__, ["metastore_plugins.core.store.snapshots.weights"])
