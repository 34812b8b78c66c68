"""The ``metastore`` command's exit on an error: every class of ``core/errors.py`` gives one line and status 2
(a partitioned query stopped by another rank too); an error that is not the package's is not swallowed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from metastore_plugins import cli
from metastore_plugins.cli import parser
from metastore_plugins.core import errors

#: Every error class the package raises; its warning class is an error too where warnings are made errors.
CLASSES = [getattr(errors, name) for name in errors.__all__]
#: A message that would print on two lines, with a control character, were it not escaped.
MESSAGE = "first line\nsecond line \x1b[31m"
ESCAPED = "first line\\nsecond line \\x1b[31m"


def raising(exc: BaseException) -> object:
    def _open(args: argparse.Namespace) -> object:
        raise exc

    return _open


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_every_error_class_is_listed() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)
    assert len(CLASSES) >= 20


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_package_error_of_each_class_exits_2_with_one_line(
    cls: type[errors.MetastoreError],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cli, "_open", raising(cls(MESSAGE)))
    status, out, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert status == 2
    assert out == ""
    assert err == f"metastore inspect: error: {ESCAPED}\n"


def test_a_partitioned_query_stopped_by_another_rank_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Raised by the query (the command's own function), not by opening the store: as a rank that stopped does."""

    def stopped(args: argparse.Namespace, target: object) -> int:
        raise errors.DistributedQueryError(MESSAGE)

    monkeypatch.setattr(cli, "_open", lambda args: tmp_path)
    monkeypatch.setattr(parser, "cmd_influence", stopped)
    status, out, err = run_cli(["influence", str(tmp_path)], capsys)
    assert status == 2
    assert out == ""
    assert err == f"metastore influence: error: {ESCAPED}\n"


def test_a_missing_file_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nothing-here"
    monkeypatch.setattr(cli, "_open", raising(FileNotFoundError(2, "No such file or directory", str(missing))))
    status, _, err = run_cli(["inspect", str(missing)], capsys)
    assert status == 2
    assert err.startswith("metastore inspect: error: ") and str(missing) in err and err.count("\n") == 1


def test_a_store_path_that_is_not_there_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nothing-here"
    for command in (["inspect"], ["outliers"], ["compact"], ["verify"]):
        status, out, err = run_cli([*command, str(missing)], capsys)
        assert status == 2, command
        assert err.startswith(f"metastore {command[0]}: error: ") and err.count("\n") == 1, err
        assert "nothing-here" in err


@pytest.mark.parametrize("exc", [ValueError("a bug"), TypeError("a bug"), KeyError("a bug")], ids=repr)
def test_an_error_that_is_not_the_packages_is_not_swallowed(
    exc: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_open", raising(exc))
    with pytest.raises(type(exc), match="a bug"):
        cli.main(["inspect", str(tmp_path)])
