"""Deprecated path (goes in 0.3): see metastore_plugins.core.store.reading.reader (and reading.locate)."""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(
    __name__, ["metastore_plugins.core.store.reading.reader", "metastore_plugins.core.store.reading.locate"]
)
