"""Deprecated path (goes in 0.3): see metastore_plugins.core.training (settings, settings_doc, expectations, lines,
report_pass, run_start)."""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(
    __name__,
    [
        "metastore_plugins.core.training.settings",
        "metastore_plugins.core.training.settings_doc",
        "metastore_plugins.core.training.expectations",
        "metastore_plugins.core.training.lines",
        "metastore_plugins.core.training.report_pass",
        "metastore_plugins.core.training.run_start",
        "metastore_plugins.core.policy.runtime",
    ],
)
