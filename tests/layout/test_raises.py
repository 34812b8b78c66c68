"""Every error the package raises is a class of ``core/errors.py``, read from the source.

Two rules over every module's syntax tree: no ``raise`` of a built-in exception class (``raise ValueError(...)``,
``raise builtins.KeyError``), and no exception class defined anywhere but ``core/errors.py`` (a class whose base
is a built-in exception, one of that module's classes, or a name ending in ``Error``, ``Exception`` or
``Warning``). A bare ``raise`` and ``raise exc`` of a caught object pass: they re-raise what was raised.
A third keeps one home: an error class is imported from ``core/errors.py``, never from a module that re-exports it.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import metastore_plugins
from metastore_plugins.core import errors

ROOT = Path(metastore_plugins.__file__).parent
HOME = ROOT / "core" / "errors.py"

#: The built-in exception classes by name (``ValueError``, ``KeyError``, ``StopIteration``, the warnings ...).
BUILTIN_ERRORS = frozenset(
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
)
#: Names that make a class an exception class when they appear among its bases.
ERROR_NAMES = BUILTIN_ERRORS | frozenset(errors.__all__)
ERROR_SUFFIXES = ("Error", "Exception", "Warning")


def _name(node: ast.expr) -> str | None:
    """``X`` of ``X``, ``X(...)``, ``builtins.X`` or ``mod.X``; ``None`` for anything else."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_builtin_raise(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id in BUILTIN_ERRORS
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "builtins":
        return node.attr in BUILTIN_ERRORS
    return False


def _is_error_base(node: ast.expr) -> bool:
    name = _name(node)
    return name is not None and (name in ERROR_NAMES or name.endswith(ERROR_SUFFIXES))


def offences(source: str, where: str, *, is_home: bool = False) -> list[str]:
    """Each built-in raise and each exception class defined outside ``core/errors.py``, as ``where:line: what``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Raise) and node.exc is not None and _is_builtin_raise(node.exc):
            found.append((node.lineno, f"raise {_name(node.exc)}"))
        elif isinstance(node, ast.ClassDef) and not is_home and any(map(_is_error_base, node.bases)):
            found.append((node.lineno, f"class {node.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("metastore_plugins")):
            names = sorted(alias.name for alias in node.names if alias.name in errors.__all__)
            if names and (node.level or node.module != errors.__name__):
                found.append((node.lineno, f"import {', '.join(names)} from {'.' * node.level}{node.module or ''}"))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def package_offences() -> list[str]:
    return [
        offence
        for path in sorted(ROOT.rglob("*.py"))
        for offence in offences(path.read_text(), str(path.relative_to(ROOT.parent)), is_home=path == HOME)
    ]


PLANTED = """
import builtins
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store import Selection, StoreError as Again


class Half(ValueError):
    pass


class Own(StoreError):
    pass


class Plain:
    pass


def f(x):
    if x:
        raise ValueError("built-in")
    if x > 1:
        raise builtins.KeyError
    try:
        g()
    except OSError as exc:
        raise RuntimeError("wrapped") from exc
    try:
        g()
    except OSError:
        raise
    try:
        g()
    except OSError as exc:
        raise exc
    raise StoreError("fine")
"""


def test_the_checker_finds_each_planted_offence() -> None:
    assert offences(PLANTED, "planted.py") == [
        "planted.py:4: import StoreError from metastore_plugins.core.store",
        "planted.py:7: class Half",
        "planted.py:11: class Own",
        "planted.py:21: raise ValueError",
        "planted.py:23: raise KeyError",
        "planted.py:27: raise RuntimeError",
    ]
    assert offences("from .store import StoreError\n", "relative.py") == [
        "relative.py:1: import StoreError from .store"
    ]


def test_the_checker_lets_the_home_of_the_errors_define_classes() -> None:
    assert offences("class A(ValueError):\n    pass\n", "errors.py", is_home=True) == []
    assert offences(HOME.read_text(), "errors.py", is_home=True) == []
    assert offences(HOME.read_text(), "elsewhere.py") != []


def test_the_package_raises_only_its_own_errors() -> None:
    assert package_offences() == []
