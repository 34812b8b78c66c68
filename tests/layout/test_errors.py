"""Every exception class of the package derives from one public base, and keeps the built-in base it had."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import metastore_plugins
from metastore_plugins.core import errors
from metastore_plugins.core.errors import MetastoreError

OPTIONAL = ("metastore_plugins.lightning_callback", "metastore_plugins.hf_callback")


def package_exception_classes() -> dict[str, type[BaseException]]:
    """Every class deriving from BaseException that a module of the package defines, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(metastore_plugins.__path__, "metastore_plugins."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("metastore_plugins"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_the_walk_imports_every_module_and_finds_the_errors() -> None:
    found = package_exception_classes()
    # the callbacks' modules are walked too (their frameworks are installed in the test environment)
    assert all(
        name in {info.name for info in pkgutil.walk_packages(metastore_plugins.__path__, "metastore_plugins.")}
        for name in OPTIONAL
    )
    assert "metastore_plugins.core.errors.StoreError" in found
    assert len(found) >= 10


def test_every_exception_class_derives_from_the_public_base() -> None:
    strays = sorted(name for name, cls in package_exception_classes().items() if not issubclass(cls, MetastoreError))
    assert strays == []
    assert metastore_plugins.MetastoreError is errors.MetastoreError
    assert "MetastoreError" in metastore_plugins.__all__


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("StoreError", ValueError),
        ("JournalError", ValueError),
        ("RepresentationError", ValueError),
        ("SampleIdError", ValueError),
        ("LossScaleError", ValueError),
        ("ExistingStoreError", ValueError),
        ("NotPerSampleError", ValueError),
        ("UnsupportedLayerError", RuntimeError),
        ("DistributedQueryError", RuntimeError),
        ("QueryError", ValueError),
        ("CompiledModelError", ValueError),
        ("ConfigError", ValueError),
        ("ConfigTypeError", TypeError),
        ("StateError", RuntimeError),
        ("WriterError", RuntimeError),
        ("MissingDependencyError", ImportError),
        ("UnsupportedPlatformError", NotImplementedError),
        ("UnknownNameError", AttributeError),
        ("OutOfRangeError", IndexError),
        ("ReferenceMismatchError", AssertionError),
    ],
)
def test_each_error_keeps_the_builtin_base_callers_catch(name: str, builtin: type[Exception]) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, builtin)
    with pytest.raises(MetastoreError):
        raise cls("a message")


def test_a_store_error_from_the_read_path_is_caught_by_the_base(tmp_path) -> None:
    from metastore_plugins import open_store

    with pytest.raises(MetastoreError, match="store"):
        open_store(tmp_path / "nothing-here")
