"""Issue 44 item 2 (the rest): a damaged capture-plan record, an embedding declared far larger than its stored rows,
and a permuted factor shape. Each ends in one line naming the file (``verify`` lists it; the ``metastore`` command
prints one line and exits 2), never a traceback or a multi-GB allocation, and the stored data is unchanged.

The manifest is rewritten by hand as a user with write access would (it has no checksum to recompute). A command
that could allocate many GB on the code before the fix runs in a subprocess under an address-space cap
(``RLIMIT_AS``: its size after imports plus :data:`HEADROOM`), so a regression fails there instead of filling the
machine.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass

#: Bytes of address space the capped command may add after its imports (the queries of this store need a few MB;
#: the forged embedding below asks for 4 GiB and 16 GiB on the code before the fix).
HEADROOM = 2 * 2**30
#: Seconds a capped command may take (it answers within a few on the busy 2-core machine).
SECONDS = 180

_CAPPED = """
import resource, sys
sys.path[:0] = {paths!r}
from metastore_plugins.cli import main
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, vm + {headroom}))
sys.exit(main({argv!r}))
"""


class Bag(nn.Module):
    """Token embedding, mean over tokens, linear head: an ``embedding`` and an ``outer`` record per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(11, 4), nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(self.emb(ids).mean(1))  # (B, 3)


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training steps and the passes ``epoch-0/train`` (16 samples) and ``epoch-0/val`` (8) of :class:`Bag`."""
    path = tmp_path_factory.mktemp("plan") / "store"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 11, (24, 5), generator=generator), torch.randint(0, 3, (24,), generator=generator)
        model = Bag()
        with StoreWriter(path) as writer:
            for step, lo in enumerate((0, 8)):
                ids = torch.arange(lo, lo + 8)
                capture_step(
                    model, lambda ids=ids: model(x[ids]), y[ids], ids, per_sample_ce, writer, step=step, lr=0.1
                )
            for split, ids in (("train", torch.arange(16)), ("val", torch.arange(16, 24))):
                batches = [(ids, lambda ids=ids: model(x[ids]), y[ids])]
                checkpoint_pass(model, batches, per_sample_ce, writer, capture_point=f"epoch-0/{split}", step=2, lr=0.1)
    return path


#: A plan as a planner records it (``CapturePlan.to_json``), written out by hand.
PLAN: dict[str, Any] = {
    "policy": "auto",
    "budget": 10**6,
    "budget_source": "given",
    "encoding": "fp32",
    "k": 8,
    "train": {"fc": "projected", "emb": "exact"},
    "passes": {"fc": "projected", "emb": "exact"},
    "snapshots": 0,
    "planned_passes": 1,
    "planned": {"total": 1000},
    "exact_layers": [],
    "degraded": [],
    "bases": [],
    "pass_k": 0,
}


def forged(store_dir: Path, tmp_path: Path, edit: Any) -> tuple[Path, dict[str, str]]:
    """A copy of the store with its manifest edited by ``edit``; the sha256 of every shard, to check afterwards."""
    path = tmp_path / "store"
    subprocess.run(["cp", "-r", str(store_dir), str(path)], check=True)
    manifest = json.loads((path / "manifest-rank0.json").read_text())
    edit(manifest)
    (path / "manifest-rank0.json").write_text(json.dumps(manifest))
    return path, shard_digests(path)


def shard_digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.safetensors"))}


def metastore(*argv: str) -> subprocess.CompletedProcess[str]:
    """The ``metastore`` command in a subprocess under the address-space cap."""
    script = _CAPPED.format(paths=sys.path, headroom=HEADROOM, argv=list(argv))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=SECONDS)


def one_error_line(done: subprocess.CompletedProcess[str], command: str, *named: str) -> str:
    """Exit status 2 and one error line on stderr, ``metastore COMMAND: error: ...``, naming each of ``named``;
    before it at most warnings of one line each (the nearest-gradient index the query scanned around)."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"metastore {command}: error: "), done.stderr[-3000:]
    assert all(line.startswith(f"metastore {command}: warning: ") for line in lines[:-1]), done.stderr[-3000:]
    assert all(name in lines[-1] for name in named), lines[-1]
    return lines[-1]


# -- a damaged capture-plan record --------------------------------------------------------------------------------


DAMAGED_PLANS = {
    "k-a-million": {"k": 10**6},
    "passes-a-list": {"passes": ["fc"]},
    "pass_k-2-40": {"pass_k": 2**40},
    "k-a-string": {"k": "8"},
    "train-unknown-keep": {"train": {"fc": "everything"}},
    "degraded-no-step": {"degraded": [{"part": "training steps", "from": "exact", "to": "norms"}]},
    "budget-negative": {"budget": -1},
}


@pytest.mark.parametrize("damage", DAMAGED_PLANS.values(), ids=DAMAGED_PLANS.keys())
def test_verify_names_the_manifest_of_a_damaged_plan(store_dir: Path, tmp_path: Path, damage: dict[str, Any]) -> None:
    """One problem line naming ``manifest-rank0.json`` and the plan's field (before: verify said nothing)."""
    path, digests = forged(store_dir, tmp_path, lambda m: m["config"].update(capture_plan={**PLAN, **damage}))
    problems = open_store(path).verify()
    field = next(iter(damage))
    assert len(problems) == 1 and problems[0].startswith("manifest-rank0.json: "), problems
    assert "capture_plan" in problems[0] and repr(field) in problems[0], problems
    assert shard_digests(path) == digests


def test_verify_accepts_the_plan_a_planner_writes(store_dir: Path, tmp_path: Path) -> None:
    path, _ = forged(store_dir, tmp_path, lambda m: m["config"].update(capture_plan=PLAN))
    assert open_store(path).verify() == []


@pytest.mark.parametrize("damage", [{"k": 10**6}, {"passes": ["fc"]}], ids=["k-a-million", "passes-a-list"])
def test_report_refuses_a_damaged_plan_in_one_line(store_dir: Path, tmp_path: Path, damage: dict[str, Any]) -> None:
    """``metastore report --logdir`` (the projector's size comes from the plan's ``k``): one line naming the
    manifest, exit 2 (before: a traceback, a 64 TB allocation for ``k`` = 10^6, an AttributeError for a list)."""
    path, digests = forged(store_dir, tmp_path, lambda m: m["config"].update(capture_plan={**PLAN, **damage}))
    done = metastore("report", str(path), "--logdir", str(tmp_path / "logs"))
    one_error_line(done, "report", str(path / "manifest-rank0.json"), "capture_plan", repr(next(iter(damage))))
    assert shard_digests(path) == digests


# -- an embedding declared far larger than its stored rows ------------------------------------------------------------


def huge_embedding(manifest: dict[str, Any]) -> None:
    manifest["layers"]["emb"]["param_shapes"]["weight"] = [2**27, 4]  # stored ids stay below 11


def test_influence_refuses_an_embedding_of_2_27_rows_in_one_line(store_dir: Path, tmp_path: Path) -> None:
    """EK-FAC's ``(V, d)`` eigenvalues and TRAK's ``(k, V)`` projection of a 2^27-row table: 2 and 16 GiB on the
    code before (a MemoryError traceback under the cap, the OOM killer without); now one line naming the shard
    and the layer, and ``verify`` lists the shard."""
    path, digests = forged(store_dir, tmp_path, huge_embedding)
    for method in ("ekfac", "trak"):
        done = metastore("influence", str(path), "--method", method, "--test", "16", "-k", "2")
        line = one_error_line(done, "influence", "rank0-000000.safetensors", "'emb'", str(2**27))
        assert "Traceback" not in line
    problems = open_store(path).verify()
    assert len(problems) == 1 and problems[0].startswith("rank0-000000.safetensors: records b"), problems
    assert "'emb'" in problems[0], problems
    assert shard_digests(path) == digests


# -- a permuted factor shape ----------------------------------------------------------------------------------------


def permuted_shape(manifest: dict[str, Any]) -> None:
    assert manifest["layers"]["fc"]["param_shapes"]["weight"] == [3, 4]
    manifest["layers"]["fc"]["param_shapes"]["weight"] = [4, 3]  # the same elements, the factors' sides swapped


def test_verify_reports_the_permuted_shape_queries_refuse(store_dir: Path, tmp_path: Path) -> None:
    """``fc``'s weight declared ``[4, 3]`` for factors of ``d_out`` 3, ``d_in`` 4: queries refuse it, and now
    ``verify`` lists the shard and the layer (before: no problem at all), and repair leaves every shard as it is."""
    path, digests = forged(store_dir, tmp_path, permuted_shape)
    done = metastore("influence", str(path), "--method", "tracin", "--test", "16", "-k", "2")
    one_error_line(done, "influence", "rank0-000000.safetensors", "'fc'", "(4, 3)")
    problems = open_store(path).verify()
    assert len(problems) == 1 and problems[0].startswith("rank0-000000.safetensors: records b"), problems
    assert "'fc'" in problems[0] and "(4, 3)" in problems[0], problems
    done = metastore("verify", str(path), "--repair")
    assert "Traceback" not in done.stderr and "rank0-000000.safetensors" in done.stdout, done.stderr[-2000:]
    assert shard_digests(path) == digests
