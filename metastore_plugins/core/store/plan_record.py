"""Deprecated path (goes in 0.3): see core.store.reading.plan_check and core.policy.plan_record."""

from metastore_plugins.core._moved import moved_module

__getattr__ = moved_module(
    __name__, ["metastore_plugins.core.store.reading.plan_check", "metastore_plugins.core.policy.plan_record"]
)
