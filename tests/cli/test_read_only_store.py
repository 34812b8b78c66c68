"""Every ``metastore`` subcommand on a store mounted read-only: it reads, or exits 2 with one line that names the
directory and what to do (issue 43, item 4).

The store is made read-only by the kernel, not by a mock: a read-only bind mount inside a new user and mount
namespace (``unshare -rm``, no privilege needed where user namespaces are on), so every write meets the real
``EROFS``. Being root does not get past it (``chmod`` would not stop root). One Python process inside the
namespace runs the commands through the CLI's ``main`` and records each one's exit status, stdout, stderr and any
exception that escaped it (what the interpreter would print as a traceback).
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from metastore_plugins.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

#: Runs ``python DRIVER RESULTS STORE`` with STORE bind-mounted read-only over itself in a private mount namespace.
_READ_ONLY = 'd="$1"; shift; mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" && exec "$@"'

_DRIVER = """
import contextlib, errno, io, json, sys, traceback
from metastore_plugins.cli import main

results, store, commands = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:  # the mount is what the test says it is: a write fails with the kernel's EROFS
    open(store + "/probe", "w")
    probe = "written"
except OSError as exc:
    probe = errno.errorcode.get(exc.errno, str(exc.errno))
out = {"probe": probe, "runs": []}
for argv in commands:
    stdout, stderr = io.StringIO(), io.StringIO()
    escaped = None
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
        except BaseException:
            status, escaped = 1, traceback.format_exc()
    out["runs"].append({"argv": argv, "status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                        "traceback": escaped})
with open(results, "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("read_only") / "run"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_text_classifier.py"), "--out", str(out), "--epochs", "2"]
        + ["--train-size", "64"],  # fp16: in fp32 this small run outgrows its plan and its last pass is projected
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out / "metastore"


def _commands(store: Path, elsewhere: Path) -> dict[str, list[list[str]]]:
    """Per subcommand, the invocations run on the read-only store (each with ``--json`` where it reads)."""
    s = str(store)
    return {
        "inspect": [["inspect", s, "--json"]],
        "verify": [["verify", s, "--json"], ["verify", s, "--repair"]],
        "compact": [["compact", s]],
        "report": [["report", s], ["report", s, "--out", str(elsewhere / "reports")]],
        "outliers": [["outliers", s, "-k", "3", "--json"]],
        "influence": [
            ["influence", s, "--test", "1", "-k", "2", "--json"],
            ["influence", s, "--test", "1", "-k", "2", "--index", "build", "--json"],  # the index: kept in memory
        ],
        "similar": [["similar", s, "--sample", "3", "-k", "2", "--index", "build", "--json"]],
        "query": [
            ["query", s, "changed", "-k", "2", "--json"],
            ["query", s, "contributors", "--layer", "classifier", "-k", "2", "--json"],
            ["query", s, "spikes", "--threshold", "1", "--json"],
            ["query", s, "compare", "--other", s, "-k", "2", "--json"],
        ],
        "restore": [
            ["restore", s, "--sample", "3", "--capture-point", "epoch-1/val", "--out", str(elsewhere / "g.st")],
            ["restore", s, "--sample", "3", "--capture-point", "epoch-1/val", "--out", str(store / "g.st")],
        ],
    }


_COPY = "copy the store to a writable directory"


def _refusal(argv: list[str], store: Path) -> tuple[str, str] | None:
    """For an invocation that must write into the read-only directory: (the directory its one line names, below
    the store; the fix it names). None for one that reads."""
    if argv[0] == "verify" and "--repair" in argv or argv[0] == "compact":
        return "", _COPY
    if argv[0] == "report" and "--out" not in argv:
        return "/reports", "--out DIR"
    if argv[0] == "restore" and argv[-1].startswith(str(store)):
        return "", "pass --out"
    return None


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory``: (size, mtime in ns), from ``os.stat``."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def _run_read_only(store: Path, commands: list[list[str]], results: Path) -> dict[str, object]:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) for a read-only bind mount")
    argv = ["unshare", "-rm", "sh", "-c", _READ_ONLY, "sh", str(store)]
    done = subprocess.run(
        [*argv, sys.executable, "-c", _DRIVER, str(results), str(store), json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if not results.exists() and "mount" in done.stderr:
        pytest.skip(f"no read-only bind mount in a user namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return json.loads(results.read_text())


def test_every_subcommand_reads_a_read_only_store_or_says_why_not_in_one_line(store_dir: Path, tmp_path: Path) -> None:
    commands = _commands(store_dir, tmp_path)
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands) == set(subparsers.choices)  # every subcommand of the parser is run
    before = _files(store_dir)
    out = _run_read_only(store_dir, [argv for runs in commands.values() for argv in runs], tmp_path / "results.json")
    assert out["probe"] == errno.errorcode[errno.EROFS]  # the kernel refused a write: the store is read-only
    assert _files(store_dir) == before  # nothing written, nothing removed
    runs = out["runs"]
    assert isinstance(runs, list)
    for run in runs:
        argv, refusal = run["argv"], _refusal(run["argv"], store_dir)
        assert run["traceback"] is None, f"{argv}: {run['traceback']}"
        if refusal is None:
            assert run["status"] == 0, f"{argv}: {run['stderr']}"
            if "--json" in argv:
                json.loads(run["stdout"])
            continue
        named, fix = refusal
        lines = run["stderr"].splitlines()
        assert run["status"] == 2 and len(lines) == 1, f"{argv}: {run['stderr']}"
        assert lines[0].startswith(f"metastore {argv[0]}: error: {store_dir}{named} cannot be written"), lines[0]
        assert "Read-only file system" in lines[0] and fix in lines[0], lines[0]
    written = tmp_path / "reports"  # report --out elsewhere: written there, the store's own reports untouched
    assert {p.name for p in written.iterdir()} >= {"outliers.json", "influence.json", "summary.json"}
    assert (tmp_path / "g.st").stat().st_size > 0
