"""The read side: :class:`~metastore_plugins.core.store.reading.reader.StoreReader`, selections and the
stored batches they load, the shard cache, ``verify`` (health), the bytes by part, repeated batches.
"""
