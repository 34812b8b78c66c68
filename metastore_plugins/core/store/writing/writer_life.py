"""A :class:`~metastore_plugins.core.store.writing.writer.StoreWriter`'s life in the run log, and the writers left
open at exit.

A writer holds one :class:`WriterLife`: it appends the run's ``start``, the ``stopped`` of the first
batch an error kept off the disk, and the ``end`` at close to the rank's run log
(:mod:`~metastore_plugins.core.store.writing.run_log`). The writer thread is a daemon (it must never keep a
process alive), so a process that exits with a writer open (an exception out of ``trainer.train()``, a
``KeyboardInterrupt``) would lose what the thread holds: :func:`close_open_writers` runs at interpreter
exit, before daemon threads stop, and closes each one this process opened: every queued batch is
written, and the run log says how the run ended (the exception that ended the program, else
``"unfinished"``). A process killed by a signal it does not handle (SIGKILL) runs no exit code: the
timer (``flush_seconds``) bounds what it loses.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Protocol

from metastore_plugins.core.store.writing.run_log import append_event, error_text, event, how_of, start_event


class WriterLife:
    """The run log of a writer of rank ``rank`` in ``path``: the ``start`` line when ``run_start`` (a run's first
    step) is given; the writer calls :meth:`lose` for every batch it cannot store and :meth:`end` when closing."""

    def __init__(self, path: Path, rank: int, run_start: int | None) -> None:
        self.path, self.rank, self.run_start = path, rank, run_start
        self.dropped_samples = 0
        self.lost_from: int | None = None  # the first step not stored after an error (recorded in the run log)
        self.stored_step: int | None = None  # the last step a listed shard holds
        self._unrecorded: list[bytes] = []  # run-log lines the disk refused; tried again at close
        self._record_error: Exception | None = None
        self._lock = threading.Lock()
        if run_start is not None:
            append_event(path, rank, start_event(run_start))

    def lose(self, step: int, samples: int, error: BaseException | None) -> None:
        """Count ``samples`` of a batch at ``step`` that are not stored; the first one is recorded as the stop, with
        ``error`` (what stopped the writer)."""
        with self._lock:
            self.dropped_samples += samples
            if self.lost_from is not None:
                return
            self.lost_from = step
        self._record(event("stopped", step=int(step), error=error_text(error)))

    def _record(self, line: bytes) -> None:
        """Append ``line`` to the run log; a disk that refuses it keeps it for :meth:`end` to try again."""
        try:
            append_event(self.path, self.rank, line)
        except (OSError, ValueError) as exc:  # a full disk; StoreError: the directory was changed under it
            self._record_error = exc
            self._unrecorded.append(line)

    def note(self) -> str:
        """What the stop warning says of the run log."""
        if self.lost_from is None:
            return ""
        if self._unrecorded:
            return (
                f"; the store could not record that it is incomplete yet ({self._record_error}), tried again at close"
            )
        return f"; the store records that it is incomplete from step {self.lost_from} (metastore inspect shows it)"

    def end(self, how: str | None, error: BaseException | None) -> None:
        """Append the ``end`` line (a run's writer, or one that lost samples)."""
        if self.run_start is None and self.lost_from is None:
            return
        lines, self._unrecorded = self._unrecorded, []
        end = event(
            "end",
            how=how or how_of(error),
            step=self.stored_step,
            error=error_text(error),
            lost=self.dropped_samples,
        )
        for line in [*lines, end]:
            self._record(line)
        if self._unrecorded:
            unknown = [f"that the store lacks every step from {self.lost_from} on"] if lines else []
            unknown += ["how this run ended"] if self.run_start is not None else []
            warnings.warn(
                f"{self.path}: the run log could not be written ({self._record_error}); metastore inspect will not "
                f"know {' nor '.join(unknown)}",
                RuntimeWarning,
                stacklevel=3,
            )


class OpenWriter(Protocol):
    """What :func:`close_open_writers` needs of a writer."""

    path: Path

    @property
    def failed(self) -> bool: ...

    def close(self, error: BaseException | None = None, *, how: str | None = None) -> None: ...


#: The writers this process opened and has not closed (the writer thread holds each one while it runs), each with
#: the process id that opened it.
_OPEN: weakref.WeakKeyDictionary[OpenWriter, int] = weakref.WeakKeyDictionary()


def opened(writer: OpenWriter) -> None:
    """Count ``writer`` among those :func:`close_open_writers` closes at exit."""
    _OPEN[writer] = os.getpid()


def closed(writer: OpenWriter) -> None:
    """``writer`` is closed: leave it at exit."""
    _OPEN.pop(writer, None)


def close_open_writers() -> None:
    """Close every writer this process left open (at interpreter exit): write what each holds, record how the run
    ended (the uncaught exception that ends the program, else ``"unfinished"``). A forked child's copies are left."""
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    for writer, pid in list(_OPEN.items()):
        if pid != os.getpid():
            continue
        try:
            writer.close(error, how=None if error is not None else "unfinished")
        except Exception as exc:  # one writer's failure leaves the others to close; its own error was raised before
            if not writer.failed:
                warnings.warn(f"{writer.path}: closing the store writer at exit failed ({exc!r})", RuntimeWarning, 2)


atexit.register(close_open_writers)
