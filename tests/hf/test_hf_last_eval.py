"""A Trainer run whose last step is off the evaluation grid (issue 43, item 1): the Trainer evaluates at the last
step too, the capture plan counts that pass, every pass is stored whole, and the reports and the CLI answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from hf_cases import make_dataset, make_model, train  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback  # noqa: E402

N_TRAIN, N_VAL = 48, 16
#: a budget under which the second pass no longer fits when the plan counts one pass (the issue's case:
#: "could not build the reports", the last pass cut after its first batches), measured on this tiny BERT
BUDGET = 950_000


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MetaStoreTrainerCallback, list[int]]:
    tmp_path = tmp_path_factory.mktemp("last_eval")
    callback = MetaStoreTrainerCallback(budget=BUDGET, attribution_time=None)  # whole passes, as the budget was set
    trainer = train(
        tmp_path,
        make_model(),
        make_dataset(N_TRAIN, 1),
        make_dataset(N_VAL, 2),
        [callback],
        eval_strategy="steps",
        eval_steps=10,
        max_steps=17,
        learning_rate=1e-3,
    )
    evaluated = [int(entry["step"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    return Path(callback.dirpath), callback, evaluated


def _lines(path: Path) -> list[dict]:
    """A journal's entries: each line is JSON, a space and its checksum (docs/format.md)."""
    return [json.loads(line.rsplit(" ", 1)[0]) for line in path.read_text().splitlines() if line.strip()]


def test_plan_counts_the_evaluation_at_the_last_step(run) -> None:
    store, _, evaluated = run
    assert evaluated == [10, 17]  # the Trainer's own record: the last step is evaluated too
    manifest = json.loads((store / "manifest-rank0.json").read_text())  # the file on disk
    assert manifest["config"]["capture_plan"]["planned_passes"] == len(evaluated)
    tags = {tag["name"] for tag in _lines(store / "tags-rank0.jsonl") if tag.get("attributes", {}).get("checkpoint")}
    assert tags == {f"step-{step}" for step in evaluated}


def test_every_pass_is_stored_whole(run) -> None:
    store, _, evaluated = run
    code = (
        "import json, sys\n"
        "from metastore_plugins import open_store\n"
        "s = open_store(sys.argv[1])\n"
        "print(json.dumps({cp: sorted(s.sample_ids(cp).tolist()) for cp in s.capture_points() if cp != 'train'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, check=True)
    held = json.loads(out.stdout)  # read by a second process
    for step in evaluated:  # the dataset is the reference: every training and validation sample, once
        assert held[f"step-{step}/train"] == list(range(N_TRAIN))
        assert held[f"step-{step}/val"] == list(range(N_VAL))


def test_reports_built_and_the_cli_answers(run) -> None:
    store, callback, _ = run
    assert callback.report_result is not None
    assert (store / "reports" / "outliers.json").is_file() and (store / "reports" / "influence.json").is_file()
    cli = Path(sys.executable).with_name("metastore")
    for command in ("outliers", "report", "influence"):
        done = subprocess.run([str(cli), command, str(store)], capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr)
