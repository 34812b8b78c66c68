"""Deprecated path (goes in 0.3): see metastore_plugins.core.store.reading.batches."""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(__name__, ["metastore_plugins.core.store.reading.batches"])
