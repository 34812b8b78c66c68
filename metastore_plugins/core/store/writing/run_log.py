"""The run log of one rank: ``run-rank{r}.jsonl``, how the runs that wrote the store started, stopped and ended.

A store's shards say what was captured; this file says whether that is all there is. A
:class:`~metastore_plugins.core.store.writing.writer.StoreWriter` appends one checksummed journal line per event
(:func:`~metastore_plugins.core.store.shards.journal.encode_line`, appended and fsynced through
:class:`~metastore_plugins.core.store.shards.journal.JournalAppender`; a torn last line is skipped)::

    {"event": "start", "step": 0, "time": 1.7e9, "pid": 4242, "host": "node-1"}
    {"event": "stopped", "step": 12, "error": "OSError: [Errno 28] No space left on device", "time": ...}
    {"event": "end", "how": "exception", "step": 10, "error": "ValueError: boom", "lost": 0, "time": ...}

``start``: a run (a callback's, a resumed one again) began writing at ``step``. ``stopped``: capture stopped
after an error writing the store; nothing from ``step`` on was stored (the store is *incomplete* from there,
until a later run resumed at a later step). ``end``: the writer closed; ``how`` is one of :data:`HOW`,
``step`` the last step it stored (null: none), ``lost`` the samples it could not store. A start with no end
after it: the run is still going, or its process was killed. Every field: docs/format.md.

Example::

    log = read_run_log(store_dir)
    missing_steps(log.sessions)          # [(0, 12, None)]: rank 0 holds nothing from step 12 on
"""

from __future__ import annotations

import contextvars
import functools
import io
import os
import re
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from metastore_plugins.core.errors import IncompleteStoreWarning, JournalError, StoreError
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.journal import JournalAppender, decode_line, encode_line, read_lines

#: How a run ended: the trainer's end of training; an exception (``KeyboardInterrupt``: interrupted) came
#: through training; the process exited, or a new run began, while training had not ended and no exception
#: was seen (one the caller caught, ``sys.exit``).
HOW = ("finished", "exception", "interrupted", "unfinished")
_RUN_FILE = re.compile(r"run-rank(0|[1-9][0-9]{0,8})\.jsonl", re.ASCII)
#: The largest run log read (a line is about 150 bytes).
MAX_RUN_LOG_BYTES = 16 * 2**20
#: The longest error text a line keeps.
MAX_ERROR_CHARS = 300

F = TypeVar("F", bound=Callable[..., Any])


def run_log_name(rank: int) -> str:
    return f"run-rank{rank}.jsonl"


@dataclass
class Session:
    """One run's writing on one rank: from its ``start`` line (or the file's first line) to its ``end`` line."""

    rank: int
    start: int | None = None  # the step it started at (None: not recorded, a writer outside a run)
    pid: int | None = None
    host: str | None = None
    stopped: int | None = None  # the first step not stored after an error writing the store
    error: str | None = None  # that error
    how: str | None = None  # one of HOW; None: no end recorded (still running, or killed)
    last_step: int | None = None  # the last step stored
    end_error: str | None = None
    lost: int = 0  # samples not stored after the error

    def alive(self) -> bool:
        """Whether the process that began this session, without ending it, runs still (this host only)."""
        if self.how is not None or self.pid is None or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process: it exists
            return True
        return True

    def state(self) -> str:
        """This session's state in words (``metastore inspect``)."""
        last = f"last step stored: {self.last_step}" if self.last_step is not None else "no step stored"
        if self.how == "finished":
            return f"finished; {last}"
        if self.how == "exception":
            return f"ended by an exception ({self.end_error}); {last}"
        if self.how == "interrupted":
            return f"interrupted ({self.end_error or 'KeyboardInterrupt'}); {last}"
        if self.how == "unfinished":
            return f"stopped without ending training (an exception the caller caught, or the process exited); {last}"
        who = f"process {self.pid} on {self.host}" if self.pid is not None else "its process"
        if self.alive():
            return f"still running ({who})"
        return f"not closed: {who} is gone (killed, or its machine stopped); the store holds what it wrote until then"


@dataclass
class RunLog:
    """What the run logs of a store say: every rank's sessions in order, and the lines that could not be read."""

    sessions: list[Session] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def event(kind: str, **fields: Any) -> bytes:
    """One run-log line: ``{"event": kind, **fields, "time": now}``."""
    return encode_line({"event": kind, **fields, "time": time.time()})


def start_event(step: int) -> bytes:
    return event("start", step=int(step), pid=os.getpid(), host=socket.gethostname())


def error_text(error: BaseException | None) -> str | None:
    """``Type: message`` of ``error`` on one line, at most :data:`MAX_ERROR_CHARS` characters."""
    if error is None:
        return None
    text = " ".join(f"{type(error).__name__}: {error}".split()).removesuffix(":")  # KeyboardInterrupt: no message
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def how_of(error: BaseException | None) -> str:
    """How a run that ended with ``error`` (None: at the end of training) ended: one of :data:`HOW`."""
    if error is None:
        return "finished"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "exception"


def append_event(directory: Path, rank: int, line: bytes) -> None:
    """Append ``line`` to rank ``rank``'s run log (created) and fsync; a torn last line is cut first."""
    name = run_log_name(rank)
    with StoreDir(directory) as root:
        good = _read(root, name)[1] if root.exists(name) else 0
        with closing(JournalAppender(root, name, good)) as journal:
            journal.append(line)


def read_run_log(store_dir: str | os.PathLike[str]) -> RunLog:
    """Every rank's sessions (by rank, then as written) and one problem line per file or line not read."""
    log = RunLog()
    try:
        root = StoreDir(Path(store_dir))
    except StoreError:
        return log
    with root:
        names = sorted((int(m.group(1)), m.group(0)) for n in root.listdir() if (m := _RUN_FILE.fullmatch(n)))
        for rank, name in names:
            try:
                lines, _, damage = _read(root, name)
            except StoreError as exc:
                log.problems.append(str(exc))
                continue
            if damage is not None:
                log.problems.append(f"{root.path / name}: {damage}; skipped")
            log.sessions += _sessions(rank, lines)
    return log


def _read(root: StoreDir, name: str) -> tuple[list[dict[str, Any]], int, str | None]:
    """The readable lines of a run log, the size of its trusted part, and what is wrong with the rest."""
    data = root.read(name, MAX_RUN_LOG_BYTES, "a run log")
    lines: list[dict[str, Any]] = []
    good = 0
    for number, line, offset in read_lines(io.BytesIO(data)):
        try:
            if line is None:
                raise JournalError("longer than any run-log line")
            lines.append(decode_line(line))
            good = offset
        except JournalError as exc:
            return lines, good, f"line {number} is damaged or torn ({exc})"
    return lines, good, None


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _str(value: Any) -> str | None:
    return value[:MAX_ERROR_CHARS] if type(value) is str else None


def _sessions(rank: int, lines: list[dict[str, Any]]) -> list[Session]:
    sessions: list[Session] = []
    for line in lines:
        kind = line.get("event")
        if kind == "start" or not sessions or sessions[-1].how is not None:
            sessions.append(Session(rank))
        current = sessions[-1]
        if kind == "start":
            current.start, current.pid, current.host = (
                _int(line.get("step")),
                _int(line.get("pid")),
                _str(line.get("host")),
            )
        elif kind == "stopped" and current.stopped is None:
            current.stopped, current.error = _int(line.get("step")), _str(line.get("error"))
        elif kind == "end":
            how = line.get("how")
            current.how = how if how in HOW else "unfinished"
            current.last_step, current.end_error = _int(line.get("step")), _str(line.get("error"))
            current.lost = _int(line.get("lost")) or 0
    return sessions


#: A span of steps a rank does not hold: ``(rank, first step, first step held again)``; None: to the end.
Gap = tuple[int, int, "int | None"]


def missing_steps(sessions: list[Session]) -> list[Gap]:
    """The spans of steps the store lacks: from each stop to the start of the rank's next run, when that is later."""
    gaps: list[Gap] = []
    for i, session in enumerate(sessions):
        if session.stopped is None:
            continue
        later = [s.start for s in sessions[i + 1 :] if s.rank == session.rank and s.start is not None]
        resumed = later[0] if later else None
        if resumed is None or resumed > session.stopped:
            gaps.append((session.rank, session.stopped, resumed))
    return gaps


def covers(gaps: list[Gap], capture_point: str | None, steps: list[int], window: tuple[int, int] | None) -> bool:
    """Whether a selection could have held steps in ``gaps``: its step ``window``, else the span of its capture point
    stored at ``steps`` (the training steps, or any point stored at several steps, run on; a pass is at its one step).
    """
    end = 2**62
    if window is None and capture_point is not None and steps:
        series = "/" not in capture_point or len(steps) > 1
        window = (steps[0], end) if series else (steps[0], steps[-1])
    low, high = window or (-end, end)
    return any(low < (resumed if resumed is not None else end) and first <= high for _, first, resumed in gaps)


def incomplete_note(gaps: list[Gap], sessions: list[Session]) -> str | None:
    """One line saying from which step the store is incomplete and why (None: complete), ranks named when several."""
    if not gaps:
        return None
    rank, first, resumed = min(gaps, key=lambda gap: gap[1])
    cause = next((s for s in sessions if s.rank == rank and s.stopped == first), None)
    lost = sum(s.lost for s in sessions if s.stopped is not None)
    ranks = {s.rank for s in sessions}
    where = f" on rank {rank}" if len(ranks) > 1 else ""
    span = (
        f"steps {first}..{resumed - 1} were not stored"
        if resumed is not None
        else f"nothing from step {first} on was stored"
    )
    more = f"; {len(gaps) - 1} more gap(s) on other ranks" if len(gaps) > 1 else ""
    return (
        f"INCOMPLETE store: capture stopped at step {first}{where} after an error writing the store "
        f"({cause.error if cause is not None and cause.error else 'not recorded'}): {span}"
        + (f", {lost:,} sample(s) lost" if lost else "")
        + more
    )


def store_incomplete(store_dir: str | os.PathLike[str]) -> str | None:
    """The line saying from which step the store in ``store_dir`` is incomplete (:func:`incomplete_note`), or None."""
    sessions = read_run_log(store_dir).sessions
    return incomplete_note(missing_steps(sessions), sessions)


# -- queries: one warning per query ---------------------------------------------------------

_NOTED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("metastore_incomplete_noted", default=None)


@contextmanager
def one_note(*already: str) -> Iterator[None]:
    """Within the block, each store's incompleteness is warned about once (``already``: paths said elsewhere)."""
    noted = _NOTED.get()
    token = _NOTED.set(set(already)) if noted is None else None
    if noted is not None:
        noted.update(already)
    try:
        yield
    finally:
        if token is not None:
            _NOTED.reset(token)


def noted_once(query: F) -> F:
    """``query`` (a store method) warns at most once about the store's incompleteness, however often it selects."""

    @functools.wraps(query)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_note():
            return query(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def warn_incomplete(path: Path, note: str, stacklevel: int) -> None:
    """Warn ``note`` (an :class:`IncompleteStoreWarning`) unless it was said already in this query."""
    noted = _NOTED.get()
    key = str(path)
    if noted is not None:
        if key in noted:
            return
        noted.add(key)
    warnings.warn(f"{path}: {note}; this answer covers only what was stored", IncompleteStoreWarning, stacklevel)
