"""Built-in capture rules, one module per layer family; each registers itself on import."""

from metastore_plugins.core.capture.layers import attention, conv, embedding, embedding_bag, linear, norm, recurrent

__all__ = ["attention", "conv", "embedding", "embedding_bag", "linear", "norm", "recurrent"]
