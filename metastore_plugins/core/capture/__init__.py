"""Capture: hooks per layer family that turn back-propagation into per-sample gradient factors.

Pure maths and hooks, no I/O. See ``docs/capture.md`` for the formulas and conventions.
"""

from metastore_plugins.core.capture import layers  # noqa: F401  (imported for its effect: the built-in rules register)
from metastore_plugins.core.capture.layers.norm import capture_with_vmap
from metastore_plugins.core.capture.registry import (
    CaptureRule,
    LayerContext,
    find_rule,
    register_capture,
    registered_types,
    unregister_capture,
)
from metastore_plugins.core.capture.session import CaptureSession
from metastore_plugins.core.errors import UnsupportedLayerError
from metastore_plugins.core.records import LayerRecord, restore_all

__all__ = [
    "CaptureRule",
    "CaptureSession",
    "LayerContext",
    "LayerRecord",
    "UnsupportedLayerError",
    "capture_with_vmap",
    "find_rule",
    "register_capture",
    "registered_types",
    "restore_all",
    "unregister_capture",
]
