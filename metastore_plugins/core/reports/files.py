"""Write report tables as plain files (JSON, CSV, markdown) into a run directory."""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from metastore_plugins.core.reports.influence_method import influence_caption
from metastore_plugins.core.store.files import StoreDir, open_under

#: Line breaks (``str.splitlines`` splits at each): a stored string holding one would start a line of its own.
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")


def one_line(text: object) -> str:
    """``str(text)`` with its line breaks escaped (``\\n``): a stored string stays on the line it is put in."""
    return _LINE_BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub-style markdown table of ``columns`` (floats to 4 significant digits)."""

    def cell(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.4g}"
        return " ".join(str(value).split()).replace("|", "\\|")  # one line, no column breaks

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


#: What to do when the report folder cannot be written (``<store>/reports`` of a read-only store).
REPORTS_ELSEWHERE = "write the reports to another folder: `metastore report --out DIR` (Python: report_run(store, DIR))"


def open_reports(store_dir: Path, directory: str | os.PathLike[str]) -> StoreDir:
    """The report folder, created: ``<store>/reports`` (or any folder inside the store) is never reached
    through a link (:class:`~metastore_plugins.core.store.files.StoreError` naming it and the fix); a folder
    elsewhere is the user's own choice and opened as given."""
    return open_under(store_dir, Path(directory), create=True)


def write_text(out: StoreDir, name: str, text: str) -> Path:
    """Replace ``name`` in ``out`` by ``text`` (UTF-8), atomically and never through a link; its path."""
    out.atomic_write(name, text.encode("utf-8"))
    return out.path / name


def write_table(out: StoreDir, name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[Path]:
    """Write ``name.json`` (all fields), ``name.csv`` and ``name.md`` (the given columns) into ``out``."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return [
        write_text(out, f"{name}.json", json.dumps(list(rows), indent=1)),
        write_text(out, f"{name}.csv", table.getvalue()),
        write_text(out, f"{name}.md", markdown_table(rows, columns)),
    ]


#: characters of a sample's text in a markdown table (the JSON files keep it whole)
TEXT_CHARS = 80


def shorten(text: Any, limit: int = TEXT_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis (``None``: empty)."""
    line = " ".join(str(text if text is not None else "").split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def influence_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The influence report in markdown: with sample texts, one small table per test sample (its text and
    whether its scores are exact, then each proponent and opponent with its label, score and text); without,
    one line per test sample (ids and labels of its proponents and opponents).

    Closing lines say which method and damping produced the scores and whether they are exact or estimates
    (:func:`~metastore_plugins.core.reports.influence_method.influence_caption`)."""
    texts = any(
        row.get("test_text") or any(e.get("text") for e in row["proponents"] + row["opponents"]) for row in rows
    )
    lines = (
        []
        if texts
        else [
            "| test id | label | prediction | proponents (id:label) | opponents (id:label) |",
            "|---|---|---|---|---|",
        ]
    )
    for row in rows:
        if texts:
            lines += _sample_table(row)
            continue
        pro = ", ".join(f"{p['sample_id']}:{p['label']}" for p in row["proponents"])
        opp = ", ".join(f"{p['sample_id']}:{p['label']}" for p in row["opponents"])
        lines.append(f"| {row['test_id']} | {row['test_label']} | {row['test_prediction']} | {pro} | {opp} |")
    if rows:
        lines.append("\n" + "  \n".join(map(one_line, influence_caption(rows))))
    return "\n".join(lines) + "\n"


def _sample_table(row: dict[str, Any]) -> list[str]:
    """One test sample's block: a heading with its text and whether its scores are exact, then a table of its
    proponents and opponents."""
    kind = "exact scores" if row.get("exact", True) else "estimated scores"
    lines = [
        f"**test {row['test_id']}** (label {row['test_label']}, prediction {row['test_prediction']}; {kind}): "
        + shorten(row.get("test_text"), 2 * TEXT_CHARS).replace("|", "\\|"),
        "",
        "| | train id | label | score | text |",
        "|---|---|---|---|---|",
    ]
    for sign, key in (("+", "proponents"), ("-", "opponents")):
        for entry in row[key]:
            text = shorten(entry.get("text")).replace("|", "\\|")
            lines.append(
                f"| {sign} | {entry['sample_id']} | {entry['label']} | {float(entry['score']):+.3g} | {text} |"
            )
    return [*lines, ""]


#: ``(split, sample id) -> text`` of a sample (``None`` if it has none), e.g. decoded input ids.
RenderFn = Callable[[str, int], "str | None"]
#: ``token ids -> text``, e.g. a tokenizer's ``decode`` without special tokens.
DecodeFn = Callable[[Sequence[int]], str]


def text_renderer(decode: DecodeFn | None, datasets: Mapping[str, Any]) -> RenderFn | None:
    """``(split, sample id) -> text``: the ``input_ids`` of item ``sample id`` of ``datasets[split]``, decoded.

    ``None`` without ``decode``; a sample whose item has no ``input_ids`` (or cannot be read) renders as ``None``.
    """
    if decode is None:
        return None

    def render(split: str, sample_id: int) -> str | None:
        dataset = datasets.get(split)
        try:
            item = dataset[int(sample_id)]  # type: ignore[index]
            ids = item["input_ids"] if isinstance(item, Mapping) else None
            return None if ids is None else str(decode(ids))
        except (TypeError, KeyError, IndexError):
            return None

    return render
