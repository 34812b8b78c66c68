"""Tags: named moments of a run (steps, step ranges, snapshots) with attributes and what to keep of them.

DataStates-style: user code (or the callbacks themselves) tags the current step or a range,
``tag("lr-drop", steps=(a, b), keep="exact", reason="plateau")``. ``keep`` raises or lowers the
representation of those steps within the budget (``"exact"``, ``"projected"``, ``"norms"``,
``"nothing"``) or asks for a weight snapshot (``"snapshot"``). Checkpoint passes are tagged
automatically (``automatic=True``) with their epoch, step, learning rate and logged metrics.

Each rank appends its tags to ``tags-rank{r}.jsonl``, one checksummed journal line each
(:func:`~metastore_plugins.core.store.shards.journal.encode_line`), appended and fsynced by the store's
:class:`~metastore_plugins.core.store.shards.journal.JournalAppender`: a crash tears at most the
last line, which readers skip (:func:`check_tags` reports it) and the rank's next :class:`TagBook`
cuts; a damaged earlier line is an error. The file is read and appended through
:class:`~metastore_plugins.core.store.files.StoreDir`: never through a link, never a FIFO, device or
directory, and at most :data:`MAX_TAGS_BYTES` of it.

Example::

    book = TagBook(store_dir, rank=0)
    book.add("lr-drop", steps=(100, 120), keep="exact", reason="plateau")
    book.keep_for(110, "train")                       # 'exact'
    find_tags(read_tags(store_dir), "lr-drop", reason="plateau")
"""

from __future__ import annotations

import json
import operator
import os
import re
import warnings
from collections.abc import Mapping
from contextlib import closing
from dataclasses import asdict
from pathlib import Path
from typing import Any

from metastore_plugins.core.errors import ConfigError, JournalError, StoreError
from metastore_plugins.core.records import KEEP_CHOICES
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.journal import (
    MAX_LINE_BYTES,
    JournalAppender,
    ParsedPrefixes,
    decode_line,
    encode_line,
)
from metastore_plugins.core.store.shards.journal_batch import decode_lines, gc_paused
from metastore_plugins.core.store.tags.tag_line import FIELDS, Tag, tag_attributes, tag_of

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TAGS_FILE = re.compile(r"tags-rank(\d+)\.jsonl")
#: The largest tags file read (a tag line is about 200 bytes: over a million tags).
MAX_TAGS_BYTES = 256 * 2**20


class TagBook:
    """The tags of one rank of a store: added while training runs, appended to ``tags-rank{r}.jsonl``."""

    def __init__(self, store_dir: str | os.PathLike[str], rank: int = 0) -> None:
        """Read what the rank's earlier tags say a training run needs, and cut a line torn (or damaged) by a crash,
        so the next one starts clean.

        A training start reads the file whole but parses only its last line and the lines that keep something
        (``"keep":"..."`` in their text): a million tags cost a fraction of a second. Each line used is checked
        (CRC, fields) as before; :attr:`tags`, :func:`read_tags` and :func:`check_tags` check every line.

        Raises:
            StoreError: naming the file and line, when a line before the last that keeps something is damaged.
        """
        self.path = Path(store_dir) / f"tags-rank{rank}.jsonl"
        self.rank = rank
        self._count = 0
        self._keeps: list[Tag] = []  # the tags keep_for looks at, in the order written
        try:
            root = StoreDir(self.path.parent)
        except StoreError:  # no store directory yet: no tags
            return
        with root:
            if not root.exists(self.path.name):
                return
            data = root.read(self.path.name, MAX_TAGS_BYTES, "a tags file")
            good, damage = _trusted_end(data)
            self._count = data.count(b"\n", 0, good)
            self._keeps = _keeping_tags(self.path, data, good)
            found = root.lstat(self.path.name)
            if found is not None and found.st_size != good:
                if damage is not None:
                    warnings.warn(f"{self.path}: {damage}; cut, so the next tag starts clean", stacklevel=2)
                JournalAppender(root, self.path.name, good).close()

    @property
    def tags(self) -> list[Tag]:
        """This rank's tags in the order written (the file read and every line checked)."""
        try:
            root = StoreDir(self.path.parent)
        except StoreError:
            return []
        with root:
            return read_file(root, self.path.name)[0] if root.exists(self.path.name) else []

    def add(
        self,
        name: str,
        *,
        steps: int | tuple[int, int] | None = None,
        keep: str | None = None,
        capture_point: str | None = None,
        current_step: int | None = None,
        automatic: bool = False,
        attributes: Mapping[str, Any] | None = None,
        **more: Any,
    ) -> Tag:
        """Tag ``steps`` (a step, an inclusive ``(first, last)`` range; default ``current_step``) and write it.

        Attributes come as keywords (``reason="plateau"``) or as an ``attributes`` mapping. The tag's
        line is written and fsynced before this returns.

        Raises:
            ValueError: naming the argument, for a bad name, range, ``keep``, capture point or attribute.
        """
        if not isinstance(name, str) or not name.strip() or _CONTROL.search(name):
            raise ConfigError(f"tag(name=...) must be a non-empty string without control characters; got {name!r}")
        first, last = _steps(steps if steps is not None else current_step)
        if keep is not None and keep not in KEEP_CHOICES:
            raise ConfigError(f"tag(keep=...) must be one of {', '.join(KEEP_CHOICES)} or None; got {keep!r}")
        if capture_point is not None and (not isinstance(capture_point, str) or not capture_point):
            raise ConfigError(
                f"tag(capture_point=...) must be a capture point name, or None for all; got {capture_point!r}"
            )
        attributes = {**(attributes or {}), **more}
        clash = sorted(set(attributes) & set(FIELDS))
        if clash:
            raise ConfigError(f"tag attributes {clash} clash with the tag's own fields; rename them")
        bad = sorted(str(key) for key, value in attributes.items() if str(key) not in tag_attributes({key: value}))
        if bad:
            raise ConfigError(f"tag attributes {bad} must be JSON scalars (str, int, finite float, bool, None)")
        values = tag_attributes(attributes)
        tag = Tag(name, first, last, keep, capture_point, values, self.rank, self._count, bool(automatic))
        self._append(encode_line(asdict(tag)))
        self._count += 1
        if keep is not None and keep != "snapshot":
            self._keeps.append(tag)
        return tag

    def keep_for(self, step: int, capture_point: str) -> str | None:
        """The ``keep`` of the latest tag (highest ``seq``) that covers ``step`` at ``capture_point``, else None.

        Tags without a ``keep`` and ``keep="snapshot"`` tags say nothing about representation and are passed over.
        """
        for tag in reversed(self._keeps):
            if tag.covers(step, capture_point):
                return tag.keep
        return None

    def _append(self, line: bytes) -> None:
        """Write ``line`` at the end and fsync; on failure cut the file back, so no torn line precedes the next."""
        with StoreDir(self.path.parent, create=True) as root:
            found = root.lstat(self.path.name)
            with closing(JournalAppender(root, self.path.name, found.st_size if found is not None else 0)) as journal:
                journal.append(line)


def _steps(steps: Any) -> tuple[int, int]:
    pair = steps if isinstance(steps, tuple) and len(steps) == 2 else (steps, steps)
    if any(isinstance(s, bool) or not hasattr(type(s), "__index__") for s in pair):  # ints, numpy integers pass
        raise ConfigError(f"tag(steps=...) must be a step or a (first, last) pair of steps; got {steps!r}")
    first, last = (operator.index(s) for s in pair)
    if first < 0 or last < first:
        raise ConfigError(f"tag(steps=...) must satisfy 0 <= first <= last; got {steps!r}")
    return first, last


#: How a line that keeps something reads in the text ``encode_line`` writes: a training start parses only these.
_KEEP_TEXT = b'"keep":"'


def _trusted_end(data: bytes) -> tuple[int, str | None]:
    """The size of a tags file's trusted part, judged by its last line alone, and what is wrong with that line."""
    if not data:
        return 0, None
    start = data.rfind(b"\n", 0, len(data) - 1) + 1
    number = data.count(b"\n", 0, start) + 1
    try:
        if len(data) - start > MAX_LINE_BYTES:
            raise JournalError("longer than any tag line")
        tag_of(decode_line(data[start:]))
    except JournalError as exc:
        return start, f"line {number} is damaged ({exc})"
    return len(data), None


def _keeping_tags(path: Path, data: bytes, good: int) -> list[Tag]:
    """The tags of ``data[:good]`` that keep a representation, each line checked; StoreError for a damaged one."""
    tags = []
    at = data.find(_KEEP_TEXT, 0, good)
    while at >= 0:
        start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at, good) + 1 or good
        try:
            tag = tag_of(decode_line(data[start:end]))
        except JournalError as exc:
            number = data.count(b"\n", 0, start) + 1
            raise StoreError(f"{path}: line {number} is damaged ({exc}); remove it to read the rest") from None
        if tag.keep is not None and tag.keep != "snapshot":
            tags.append(tag)
        at = data.find(_KEEP_TEXT, end, good)
    return tags


#: The tags files this process parsed (their tags and line count): a later read parses only the lines appended
#: since, while the bytes parsed before are unchanged (a file changed anywhere else is parsed again whole).
_PARSED: ParsedPrefixes[tuple[list[Tag], int]] = ParsedPrefixes()


def read_file(
    root: StoreDir, name: str, named: str | None = None, data: bytes | None = None
) -> tuple[list[Tag], int, str | None]:
    """The tags of one file (only those named ``named`` when given), the size of its trusted part, and what is
    wrong with its last line (None: nothing); ``data``: the file's bytes when already read.

    With ``named``, a line whose text can hold neither the name's JSON string nor an escape is checked (its form
    and CRC) but not parsed (the tags of other names are not kept for the next read).

    Raises:
        StoreError: naming the file, when it is not a regular file, too large, or a line before the last is damaged.
    """
    data = root.read(name, MAX_TAGS_BYTES, "a tags file") if data is None else data
    key = str(root.path / name)
    good, (before, lines) = _PARSED.get(key, data) or (0, ([], 0))
    needles = None if named is None or good else _needles(named)
    found, good, damage = parse_from(root.path / name, data, good, lines, needles)
    tags = [*before, *found]
    if needles is None:
        _PARSED.put(key, data, good, (tags, len(tags)))
    return tags if named is None else [tag for tag in tags if tag.name == named], good, damage


def parse_from(
    path: Path, data: bytes, start: int, lines: int, needles: tuple[bytes, ...] | None = None
) -> tuple[list[Tag], int, str | None]:
    """The tags of the lines of ``data[start:]`` (``lines`` lines before them; with ``needles`` only the lines that
    hold one are parsed), the end of the trusted part, and what is wrong with the last line (None: nothing).

    Raises:
        StoreError: naming ``path`` and the line, when a line before the last is damaged.
    """
    tags: list[Tag] = []
    good = start
    failure: tuple[int, str] | None = None
    with gc_paused():  # a million tags: the collector would walk them again and again
        for number, (entry, end) in enumerate(decode_lines(data[start:], needles), start=lines + 1):
            if failure is not None:  # the bad line was not the last one
                raise StoreError(f"{path}: line {failure[0]} is damaged ({failure[1]}); remove it to read the rest")
            try:
                if isinstance(entry, JournalError):
                    raise entry
                if entry is not None:
                    tags.append(tag_of(entry))
                good = start + end
            except JournalError as exc:
                failure = (number, str(exc))
    return tags, good, None if failure is None else f"line {failure[0]} is damaged ({failure[1]})"


def _needles(name: str) -> tuple[bytes, ...]:
    """What the text of a line naming ``name`` holds: the name's JSON string (escaped as the writer does, or in
    UTF-8) or, written some other way, a backslash."""
    return json.dumps(name).encode("ascii"), json.dumps(name, ensure_ascii=False).encode("utf-8", "replace"), b"\\"


def tag_files(store_dir: str | os.PathLike[str]) -> tuple[StoreDir | None, list[str]]:
    """The store directory (None when missing) and its tags files, by rank."""
    try:
        root = StoreDir(Path(store_dir))
    except StoreError:
        return None, []
    ranks = sorted((int(m.group(1)), m.group(0)) for n in root.listdir() if (m := _TAGS_FILE.fullmatch(n)))
    return root, [name for _, name in ranks]


def read_tags(store_dir: str | os.PathLike[str], name: str | None = None) -> list[Tag]:
    """Every rank's tags (those named ``name`` when given), by rank then order written.

    With ``name``, every line's form and CRC are checked as before but only the lines whose text can name it
    are parsed (a million tags: under a second where every line costs 10 s).

    A torn or damaged last line of a file (a crash while appending) is skipped without error
    (:func:`check_tags` reports it).

    Raises:
        StoreError: naming the file and line, when a line before a file's last is damaged, or naming
            the file when it is a link, FIFO, device or directory, or larger than :data:`MAX_TAGS_BYTES`.
    """
    root, names = tag_files(store_dir)
    if root is None:
        return []
    with root:
        return [tag for file in names for tag in read_file(root, file, name)[0]]


def check_tags(store_dir: str | os.PathLike[str]) -> tuple[list[Tag], list[str]]:
    """The readable tags of every rank and one line per problem: a damaged or torn last line, a file
    that cannot be read (its tags are left out) (``metastore inspect``)."""
    root, names = tag_files(store_dir)
    if root is None:
        return [], []
    tags: list[Tag] = []
    problems: list[str] = []
    with root:
        for name in names:
            try:
                found, _, damage = read_file(root, name)
            except StoreError as exc:
                problems.append(str(exc))
                continue
            tags += found
            if damage is not None:
                problems.append(f"{root.path / name}: {damage}; skipped (the rank's next tag book cuts it)")
    return tags, problems


def find_tags(tags: list[Tag], tag: str | None = None, **attributes: Any) -> list[Tag]:
    """The tags named ``tag`` (any name when None) whose attributes include ``attributes`` (equal values)."""
    return [
        t
        for t in tags
        if (tag is None or t.name == tag)
        and all(key in t.attributes and t.attributes[key] == value for key, value in attributes.items())
    ]
