"""Maintenance that rewrites a store: compaction (``compaction``) and repair.

``metastore_plugins.core.store.maintenance`` was a module (goes in 0.3): its names are looked up in
:mod:`metastore_plugins.core.store.maintenance.compaction` with a ``DeprecationWarning``.
"""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(__name__, ["metastore_plugins.core.store.maintenance.compaction"])
