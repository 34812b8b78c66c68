"""Every error this package raises on purpose derives from :class:`MetastoreError`.

Each class also derives from the built-in error it always was (``ValueError`` for a mistake in what
was given, ``RuntimeError`` for a state the run cannot go on from), so ``except ValueError`` keeps working.
Catch ``MetastoreError`` to handle any of them::

    try:
        store = open_store("runs/demo/store")
    except MetastoreError as exc:
        print(f"cannot use the store: {exc}")
"""

from __future__ import annotations

__all__ = [
    "DistributedQueryError",
    "ExistingStoreError",
    "IncompleteStoreWarning",
    "JournalError",
    "LossScaleError",
    "MetastoreError",
    "NotPerSampleError",
    "RepresentationError",
    "SampleIdError",
    "StoreError",
    "StoreNotWritableError",
    "UnsupportedLayerError",
]


class MetastoreError(Exception):
    """Base of every error the package raises on purpose; the message names what to fix."""


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
