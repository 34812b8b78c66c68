"""metastore_plugins: exact, compact per-sample gradients of a training run, and the answers they give."""

from metastore_plugins.core.capture import CaptureSession, register_capture

__version__ = "0.1.0"
__all__ = ["CaptureSession", "register_capture", "__version__"]
