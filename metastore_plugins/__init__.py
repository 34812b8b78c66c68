"""metastore_plugins: exact, compact per-sample gradients of a training run, and the answers they give."""

from typing import Any

from metastore_plugins.core.analysis import GradientStore, open_store
from metastore_plugins.core.capture import CaptureSession, register_capture
from metastore_plugins.core.errors import MetastoreError, UnknownNameError
from metastore_plugins.core.model.sample_ids import IndexedDataset
from metastore_plugins.core.store import StoreWriter
from metastore_plugins.core.training.lines import phase_seconds
from metastore_plugins.loop import TrackedRun, track

__version__ = "0.1.0"
__all__ = [
    "CaptureSession",
    "GradientStore",
    "IndexedDataset",
    "MetastoreError",
    "MetaStoreCallback",
    "MetaStoreTrainerCallback",
    "StoreWriter",
    "TrackedRun",
    "__version__",
    "open_store",
    "phase_seconds",
    "register_capture",
    "track",
]


def __getattr__(name: str) -> Any:
    """The callbacks are imported on first use, so that importing the package never needs lightning or transformers."""
    if name == "MetaStoreCallback":
        from metastore_plugins.lightning_callback import MetaStoreCallback

        return MetaStoreCallback
    if name == "MetaStoreTrainerCallback":
        from metastore_plugins.hf_callback import MetaStoreTrainerCallback

        return MetaStoreTrainerCallback
    raise UnknownNameError(f"module 'metastore_plugins' has no attribute {name!r}")
