"""The ``metastore`` command: inspect a store, build reports, answer queries.

Example::

    metastore inspect runs/text-classifier
    metastore outliers runs/text-classifier -k 10
    metastore influence runs/text-classifier --test 0,1,2 -k 5
    metastore restore runs/text-classifier --sample 17 --capture-point epoch-1/val --out g.safetensors
    metastore compact runs/text-classifier          # merge small shards (crash-safe)
    metastore verify runs/text-classifier --repair  # mend what a killed run left behind
    torchrun --nproc-per-node 4 -m metastore_plugins.cli influence runs/text-classifier  # partitioned

Every error of the package (a :class:`~metastore_plugins.core.errors.MetastoreError`: user mistakes such as an unknown
run, sample, layer or step, a damaged store, a store that cannot be written by a command that writes into it, a
partitioned query stopped by another rank) and a path that is not there print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from metastore_plugins.cli.output import printable
from metastore_plugins.cli.parser import PARTITIONED, build_parser
from metastore_plugins.core.analysis import open_store
from metastore_plugins.core.distributed import init_from_env, launched, open_distributed_store, rank_of, shutdown
from metastore_plugins.core.errors import IncompleteStoreWarning, MetastoreError
from metastore_plugins.core.store import find_store_dir

__all__ = ["PARTITIONED", "build_parser", "main"]


def _open(args: argparse.Namespace) -> Any:
    """The store (a partitioned one under ``torchrun`` or with ``--device``), or the directory for maintenance."""
    if getattr(args, "on_directory", False):
        return find_store_dir(args.run)
    if launched() or getattr(args, "device", None):
        init_from_env(timeout_s=args.timeout)
        return open_distributed_store(args.run, device=args.device)
    return open_store(args.run)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Output cut short by its reader (``| head``) is not an error."""
    try:
        status = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # what is left to flush at exit goes nowhere, quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return status


#: Where this package's modules live: their warnings are said on one line (others' as Python shows them).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line(command: str, show: Any, message: Warning | str, category: type[Warning], *where: Any) -> None:
    """A warning of this package (an incomplete store's, a damaged file the query works around) on one line of
    stderr, escaped (``metastore CMD: warning: ...``); others' as Python shows them."""
    filename = str(where[0]) if where else ""
    if issubclass(category, IncompleteStoreWarning) or os.path.abspath(filename).startswith(_PACKAGE + os.sep):
        print(f"metastore {command}: warning: {printable(message)}", file=sys.stderr)
    else:
        show(message, category, *where)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if launched() and args.command not in PARTITIONED:
        print(
            f"metastore {args.command}: error: it does not run partitioned; run it without torchrun "
            f"(partitioned: {', '.join(PARTITIONED)})",
            file=sys.stderr,
        )
        return 2
    try:
        target = _open(args)
        quiet = rank_of() != 0  # every rank computes, rank 0 prints
        with open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stdout) as out:
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.showwarning = functools.partial(_one_line, args.command, warnings.showwarning)
                status = args.func(args, target) or 0
    except (MetastoreError, FileNotFoundError) as exc:  # any error of the package; a store path that is not there
        print(f"metastore {args.command}: error: {printable(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metastore: interrupted", file=sys.stderr)
        return 130
    finally:
        if launched():  # under torchrun the command owns its process group
            shutdown()
    return status
