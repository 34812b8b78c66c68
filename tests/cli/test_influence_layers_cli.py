"""``metastore influence --layers``: the scores of the named layers only (the advice of K-FAC's refusal of tied
layers, "leave one of them out with layers=", can be followed from the shell).

The store is written straight through ``StoreWriter`` (tests/methodcases.py: layers ``0`` and ``2``). Reference:
TracIn on layer ``2`` alone, ``sum_c <g_i, g_j>`` over the two paired passes of the gradients read back with
``store.restore(..., layer="2")``, up to ties (``assert_top_ranking``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from methodcases import TRAIN, VAL, write_passes
from reportcases import assert_top_ranking

from metastore_plugins import open_store
from metastore_plugins.cli import main


def test_tracin_on_the_named_layer_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_passes(tmp_path / "store")
    store = open_store(path)
    assert main(["influence", str(path), "--method", "tracin", "--layers", "2", "-k", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)

    def flat(sid: int, point: str) -> np.ndarray:
        grads = store.restore(sid, capture_point=point, layer="2")
        assert sorted(grads) == ["2.bias", "2.weight"]
        return np.concatenate([g.double().reshape(-1).numpy() for g in grads.values()])

    train_ids = sorted(store.sample_ids(TRAIN[0]).tolist())
    for row in rows:
        scores = [sum(flat(i, t) @ flat(row["test_id"], v) for t, v in zip(TRAIN, VAL)) for i in train_ids]
        got = [(p["sample_id"], p["score"]) for p in row["proponents"]]
        assert_top_ranking(got, list(zip(train_ids, scores)), 1e-6 * max(abs(s) for s in scores))
    assert len(rows) == len(store.sample_ids(VAL[0]))


def test_ekfac_on_the_named_layer_differs_from_every_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_passes(tmp_path / "store")
    tops = {}
    for layers in ([], ["--layers", "0"]):
        assert main(["influence", str(path), "--method", "ekfac", *layers, "-k", "16", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        tops[tuple(layers)] = {row["test_id"]: [p["score"] for p in row["proponents"]] for row in rows}
    assert tops[()].keys() == tops[("--layers", "0")].keys()
    assert any(not np.allclose(tops[()][t], tops[("--layers", "0")][t]) for t in tops[()])


def test_an_empty_layer_list_is_an_argument_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["influence", str(tmp_path), "--layers", ","])
    assert "comma-separated layer names" in capsys.readouterr().err
