"""Tags: the tag book (``book``) and the tags kept as columns (``tag_cache``).

``metastore_plugins.core.store.tags`` was a module (goes in 0.3): its names are looked up in
:mod:`metastore_plugins.core.store.tags.book` with a ``DeprecationWarning``.
"""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(__name__, ["metastore_plugins.core.store.tags.book"])
