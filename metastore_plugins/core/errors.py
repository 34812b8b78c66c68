"""Every error this package raises on purpose derives from :class:`MetastoreError`.

Each class also derives from the built-in error it always was (``ValueError`` for a mistake in what
was given, ``TypeError`` for an argument of the wrong kind, ``RuntimeError`` for a state the run cannot go on
from, ``ImportError`` for a missing optional package), so ``except ValueError`` keeps working. No module
raises a built-in exception class or defines an exception class elsewhere (``tests/layout/test_raises.py``).
Catch ``MetastoreError`` to handle any of them::

    try:
        store = open_store("runs/demo/store")
    except MetastoreError as exc:
        print(f"cannot use the store: {exc}")
"""

from __future__ import annotations

__all__ = [
    "CompiledModelError",
    "ConfigError",
    "ConfigTypeError",
    "DistributedQueryError",
    "ExistingStoreError",
    "IncompleteStoreWarning",
    "JournalError",
    "LossScaleError",
    "MetastoreError",
    "MissingDependencyError",
    "NotPerSampleError",
    "OutOfRangeError",
    "QueryError",
    "ReferenceMismatchError",
    "RepresentationError",
    "SampleIdError",
    "StateError",
    "StoreError",
    "StoreNotWritableError",
    "UnknownNameError",
    "UnsupportedLayerError",
    "UnsupportedPlatformError",
    "WriterError",
]


class MetastoreError(Exception):
    """Base of every error the package raises on purpose; the message names what to fix."""


class ConfigError(MetastoreError, ValueError):
    """A setting or argument given a value it cannot take (a callback's setting, a query's or operator's keyword,
    a budget, a method name); the message names it and what it takes."""


class ConfigTypeError(MetastoreError, TypeError):
    """A setting or argument of the wrong kind (a dataset that is not map-style, a module type that is not an
    ``nn.Module`` subclass), or one the call does not take."""


class StateError(MetastoreError, RuntimeError):
    """A call the object's state does not allow now (a closed writer, a second session on one model, a tag before
    training), or a state the run cannot go on from (layers that saw different batch sizes)."""


class WriterError(StateError):
    """The store writer's thread failed (a disk error with ``on_error="raise"``); the cause is chained."""


class MissingDependencyError(MetastoreError, ImportError):
    """An optional package a feature needs (matplotlib, tensorboard, pyarrow) is not installed; names the extra."""


class UnsupportedPlatformError(MetastoreError, NotImplementedError):
    """A host the store format cannot be read or written on (big-endian)."""


class UnknownNameError(MetastoreError, AttributeError):
    """A module or object has no attribute of that name (``getattr`` and ``hasattr`` see an ``AttributeError``)."""


class OutOfRangeError(MetastoreError, IndexError):
    """A row index outside an array the store keeps on disk."""


class ReferenceMismatchError(MetastoreError, AssertionError):
    """:mod:`metastore_plugins.testing`: computed gradients that cannot be compared with the reference's."""


class StoreError(MetastoreError, ValueError):
    """A user mistake about a store (not a store, unknown capture point, sample, step or layer),
    or a damaged or malformed store (a checksum mismatch, a hostile manifest or shard, a link)."""


class StoreNotWritableError(StoreError):
    """A command that writes into a store (compaction, repair, capture, reports into ``<store>/reports``) met a
    directory this process cannot write (a read-only filesystem, no permission); names it and what to do."""


class JournalError(MetastoreError, ValueError):
    """A journal line that cannot be trusted (torn, damaged or malformed), with what is wrong."""


class RepresentationError(MetastoreError, ValueError):
    """A query asked of a layer kept in a representation that cannot answer it (norms only, projections)."""


class NotPerSampleError(MetastoreError, ValueError):
    """A module's output for a batch of one does not have the shape of one sample's output."""


class UnsupportedLayerError(MetastoreError, RuntimeError):
    """A trainable parameter that no capture rule covers, with ``unsupported="error"``."""


class CompiledModelError(MetastoreError, ValueError):
    """A model compiled with ``torch.compile``, whose per-sample gradients the capture hooks cannot read."""


class SampleIdError(MetastoreError, ValueError):
    """A batch whose samples' dataset indices cannot be known exactly."""


class LossScaleError(MetastoreError, ValueError):
    """The loss a trainer back-propagated cannot be related to the per-sample losses exactly."""


class ExistingStoreError(MetastoreError, ValueError):
    """A fresh run was given a store directory that already holds the store of an earlier run."""


class QueryError(MetastoreError, ValueError):
    """A query asked with arguments the store cannot answer (no test points, passes it does not hold, a batch of
    the wrong shape); the message names the argument and what the store has."""


class DistributedQueryError(MetastoreError, RuntimeError):
    """A partitioned query stopped because another rank died, hung or disagreed; the message names it."""


class IncompleteStoreWarning(MetastoreError, UserWarning):
    """A query covers steps the store does not hold: capture stopped after an error writing it (a full disk).

    A warning (``warnings.warn``), raised only where warnings are made errors; a ``MetastoreError`` like the rest."""
