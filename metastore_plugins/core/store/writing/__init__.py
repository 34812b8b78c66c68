"""The write side: :class:`~metastore_plugins.core.store.writing.writer.StoreWriter`, what it queues,
its life in the run log, and the run log itself.
"""
