"""metastore_plugins: exact, compact per-sample gradients of a training run, and the answers they give."""

from metastore_plugins.core.capture import CaptureSession, register_capture
from metastore_plugins.core.store import GradientStore, StoreWriter, open_store

__version__ = "0.1.0"
__all__ = ["CaptureSession", "GradientStore", "StoreWriter", "__version__", "open_store", "register_capture"]
