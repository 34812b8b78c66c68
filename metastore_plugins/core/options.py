"""The settings both callbacks take, checked where they are given: the shared half of their constructors."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from metastore_plugins.core.capture.session import UNSUPPORTED_POLICIES
from metastore_plugins.core.reports.tables import check_outlier_source
from metastore_plugins.core.run import LabelsFn, PerSampleLossFn, RunCapture
from metastore_plugins.core.store.encoding import ENCODINGS


@dataclass(frozen=True)
class CallbackOptions:
    """What :class:`MetaStoreCallback` and :class:`MetaStoreTrainerCallback` share (their docstrings
    say what each setting does). ``owner`` is the callback's name, for the error messages."""

    owner: str
    per_sample_loss: PerSampleLossFn | None = None
    labels: LabelsFn | None = None
    encoding: str = "fp16"
    modules: Sequence[str] | None = None
    unsupported: str = "warn"
    capture_train_steps: bool = True
    checkpoint_val_samples: int = 256
    reports: bool = True
    report_k: int = 20
    outliers_from: str = "checkpoints"

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            raise ValueError(f"{self.owner}(modules=...) takes a list of module paths; write [{self.modules!r}]")
        object.__setattr__(self, "modules", None if self.modules is None else tuple(self.modules))
        for setting, value, choices in (
            ("encoding", self.encoding, ENCODINGS),
            ("unsupported", self.unsupported, UNSUPPORTED_POLICIES),
        ):
            if value not in choices:
                raise ValueError(f"{self.owner}({setting}=...) must be one of {', '.join(choices)}; got {value!r}")
        check_outlier_source(self.outliers_from, self.capture_train_steps, self.owner)

    def check_model(self, model: nn.Module) -> None:
        """Raise naming ``modules=`` when it lists paths that ``model`` does not have."""
        unknown = sorted(set(self.modules or ()) - {name for name, _ in model.named_modules()})
        if unknown:
            raise ValueError(
                f"{self.owner}(modules=...) names modules that {type(model).__name__} does not have: "
                f"{unknown}; use paths from model.named_modules()"
            )

    def run_capture(
        self, path: str | os.PathLike[str], *, rank: int, loss_reduction: str, config: dict[str, Any]
    ) -> RunCapture:
        """The :class:`RunCapture` of one process rank, with these settings."""
        session = {"unsupported": self.unsupported, **({"modules": list(self.modules)} if self.modules else {})}
        return RunCapture(
            path,
            rank=rank,
            loss_reduction=loss_reduction,
            per_sample_loss=self.per_sample_loss,
            labels=self.labels,
            encoding=self.encoding,
            config=config,
            session_options=session,
        )
