"""``metastore inspect`` on hostile stores (issue 29, issue 28 item 12): stored strings printed escaped,
unreadable plans, tags and snapshots listed under problems, no hang, no traceback, a reader that stops early."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter
from metastore_plugins.cli import main
from metastore_plugins.core.store.snapshots.weights import write_snapshot
from metastore_plugins.core.store.tags.book import TagBook
from metastore_plugins.core.training.passes import capture_step

#: What a terminal acts on: none of it may reach stdout or stderr raw.
RAW = ("\x1b", "\x07", "\r", "\u202e", "\x9b")
#: Seconds a refusal may take at most (a hang never returns).
PROMPT = 60


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


def make_store(store: Path) -> Path:
    """One captured training step of a small MLP."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    with StoreWriter(store) as writer:
        capture_step(model, lambda: model(x), y, torch.arange(4), per_sample_ce, writer, step=0, lr=0.1)
    return store


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def cli(*args: str, timeout: float = PROMPT) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "metastore_plugins.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def tag_line(name: str, seq: int) -> bytes:
    """A tag line written by hand: its JSON and CRC-32 (the journal's line format)."""
    entry = {"name": name, "first_step": seq, "last_step": seq, "keep": None, "capture_point": None}
    entry |= {"attributes": {"note": "x" * 40}, "rank": 0, "seq": seq, "automatic": False}
    text = json.dumps(entry, separators=(",", ":")).encode()
    return text + b" " + f"{zlib.crc32(text):08x}".encode() + b"\n"


def set_plan(store: Path, plan: object) -> None:
    path = store / "manifest-rank0.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["capture_plan"] = plan
    path.write_text(json.dumps(manifest))


def test_tag_names_and_attributes_print_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = make_store(tmp_path / "store")
    TagBook(store).add("rtl\u202eexe.txt", steps=0, note="\x1b]0;pwned\x07\rover\nproblems: none\x9b2J")
    status, out, err = run(capsys, "inspect", str(store))
    assert status == 0, err
    assert not any(c in out + err for c in RAW)
    assert [line for line in out.splitlines() if "problems:" in line][-1] == "problems: none"
    assert sum(line.startswith("problems:") for line in out.splitlines()) == 1  # the stored one stays in its line
    assert "rtl\\u202eexe.txt" in out and "\\x1b]0;pwned\\x07\\rover\\nproblems: none\\x9b2J" in out


@pytest.mark.parametrize(
    "plan",
    [[1, 2], "auto", {"policy": "auto"}, {"\x1b]0;pwned\x07": 1}],
    ids=["list", "text", "missing-fields", "escape-key"],
)
def test_a_capture_plan_that_is_not_a_plan_is_a_problem_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plan: object
) -> None:
    store = make_store(tmp_path / "store")
    set_plan(store, plan)
    status, out, err = run(capsys, "inspect", str(store))
    assert status == 1 and "Traceback" not in err
    problems = out.split("problems:", 1)[1]
    assert "capture_plan" in problems and not any(c in out for c in RAW)


def test_a_deleted_snapshots_folder_is_named_when_the_run_recorded_snapshots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store(tmp_path / "store")
    write_snapshot(store, nn.Linear(2, 2), name="epoch-0", step=0)
    status, out, _ = run(capsys, "inspect", str(store))
    assert status == 0 and "problems: none" in out
    shutil.rmtree(store / "snapshots")
    status, out, _ = run(capsys, "inspect", str(store))
    problems = out.split("problems:", 1)[1]
    assert status == 1 and "epoch-0" in problems and "snapshots" in problems


def test_a_garbage_tag_line_is_listed_under_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = make_store(tmp_path / "store")
    TagBook(store).add("kept", steps=0)
    with open(store / "tags-rank0.jsonl", "ab") as handle:
        handle.write(b"garbage\n")
    status, out, _ = run(capsys, "inspect", str(store))
    problems = out.split("problems:", 1)[1]
    assert status == 1 and "tags-rank0.jsonl: line 2 is damaged" in problems
    assert "kept" in out.split("problems:", 1)[0]


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_snapshot_or_tags_file_that_is_a_fifo_or_link_is_a_problem_not_a_hang(tmp_path: Path, kind: str) -> None:
    store = make_store(tmp_path / "store")
    (store / "snapshots").mkdir()
    for path in (store / "snapshots" / "s-rank0.safetensors", store / "tags-rank0.jsonl"):
        os.mkfifo(path) if kind == "fifo" else path.symlink_to("/etc/passwd")
    done = cli("inspect", str(store))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    problems = done.stdout.split("problems:", 1)[1]
    assert "s-rank0.safetensors" in problems and "tags-rank0.jsonl" in problems


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_inspect_read_by_head_exits_cleanly(tmp_path: Path, as_json: bool) -> None:
    store = make_store(tmp_path / "store")
    (store / "tags-rank0.jsonl").write_bytes(b"".join(tag_line(f"t{i}", i) for i in range(5000)))
    command = [sys.executable, "-m", "metastore_plugins.cli", "inspect", str(store), *(["--json"] * as_json)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        head = [process.stdout.readline() for _ in range(5)]
        process.stdout.close()  # as `head -5` does
        err = process.stderr.read().decode()
        status = process.wait(timeout=PROMPT)
    assert len(head) == 5 and status == 0 and "BrokenPipeError" not in err and "Traceback" not in err, err


def test_many_tags_are_counted_and_a_few_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = make_store(tmp_path / "store")
    (store / "tags-rank0.jsonl").write_bytes(b"".join(tag_line(f"t{i}", i) for i in range(3000)))
    status, out, _ = run(capsys, "inspect", str(store))
    assert status == 0 and "tags       3000" in out and "2,950 more" in out
    assert sum(re.match(r"  t\d+ ", line) is not None for line in out.splitlines()) == 50
    status, out, _ = run(capsys, "inspect", str(store), "--json")
    assert [tag["name"] for tag in json.loads(out)["tags"]] == [f"t{i}" for i in range(3000)]


def test_restore_of_a_sample_beyond_int64_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = make_store(tmp_path / "store")
    status, _, err = run(capsys, "restore", str(store), "--sample", str(2**70), "--out", str(tmp_path / "g"))
    assert status == 2 and "--sample" in err and "2^63-1" in err and "Traceback" not in err


def model_layer(store: Path) -> str:
    from metastore_plugins import open_store

    return open_store(store).layers()[0]


#: Characters that change what a reader sees without showing themselves (zero-width, joiners, the byte order mark).
INVISIBLE = ("\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad")


def test_invisible_characters_in_layer_names_print_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: a layer named with a zero-width joiner printed raw, so two different names looked the same."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator)
    model = nn.Sequential()
    model.add_module("fc" + "".join(INVISIBLE), nn.Linear(5, 3))
    store = tmp_path / "store"
    with StoreWriter(store) as writer:
        capture_step(model, lambda: model(x), y, torch.arange(4), per_sample_ce, writer, step=0, lr=0.1)
    for command in (["inspect", str(store)], ["query", str(store), "contributors", "--layer", model_layer(store)]):
        status, out, err = run(capsys, *command)
        assert status == 0, err
        assert not any(c in out + err for c in INVISIBLE), (command, out)
    status, out, err = run(capsys, "inspect", str(store))
    assert "fc\\u200b\\u200c\\u200d\\u2060\\ufeff\\xad" in out, out


def test_a_stored_plan_string_never_makes_a_line_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: a plan's string holding a newline printed a forged line under `metastore outliers`' table."""
    store = make_store(tmp_path / "store")
    plan = {
        "policy": "auto",
        "budget": 10**6,
        "budget_source": "given",
        "encoding": "fp32",
        "k": 8,
        "train": {"0": "exact", "2": "exact"},
        "passes": {"0": "exact", "2": "exact"},
        "snapshots": 0,
        "planned_passes": 1,
        "planned": {"total": 1000},
        "exact_layers": [],
        "degraded": [{"step": 0, "part": "training steps\nproblems: none\u2028forged", "from": "exact", "to": "norms"}],
        "bases": [],
        "pass_k": 0,
    }
    set_plan(store, plan)
    status, out, err = run(capsys, "outliers", str(store))
    assert status == 0, err
    assert not any(line.startswith(("problems:", "forged")) for line in out.splitlines()), out
    status, out, err = run(capsys, "verify", str(store))
    assert status == 1 and "manifest-rank0.json" in out + err, out + err  # the plan is refused, and said to be


def test_a_caption_line_holding_line_breaks_stays_one_line() -> None:
    """The markdown tables' closing lines: a stored string with line breaks is escaped in its line (reports files
    and the CLI alike), so it cannot add a line of its own."""
    from metastore_plugins.core.reports.tables import outlier_markdown

    caption = ["Budget: training steps\nproblems: none\r\u2028forged."]
    text = outlier_markdown([{"rank": 1}], ["rank"], caption)
    assert text.splitlines() == [
        "| rank |",
        "|---|",
        "| 1 |",
        "",
        "Budget: training steps\\nproblems: none\\r\\u2028forged.  ",
    ]
