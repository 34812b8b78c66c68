"""A compiled LightningModule (``trainer.fit(torch.compile(module))``) or one holding a compiled submodule: the
callback refuses it at setup, before the first step, with an error naming torch.compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_cases import Classifier, fit, loaders

from metastore_plugins import MetaStoreCallback
from metastore_plugins.core.errors import CompiledModelError


@pytest.mark.parametrize("where", ["module", "submodule"])
def test_a_compiled_module_is_refused_at_setup(tmp_path: Path, where: str) -> None:
    module = Classifier()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    if where == "submodule":
        module.net = torch.compile(module.net)
    fitted = torch.compile(module) if where == "module" else module
    with pytest.raises(CompiledModelError, match=r"torch\.compile"):
        fit(tmp_path, fitted, *loaders(), [MetaStoreCallback(tmp_path / "store")])
    after = dict(module.named_parameters())
    assert all(after[name.replace("net.", "net._orig_mod.") if where == "submodule" else name].detach().equal(value)
               for name, value in before.items())  # fmt: skip
    assert not (tmp_path / "store").exists()
