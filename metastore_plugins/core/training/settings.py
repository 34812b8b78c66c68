"""The settings both callbacks take, checked where they are given: the shared half of their constructors.

:class:`CaptureSettings` declares them once (names, types; :mod:`.settings_doc` says what each does); the
callbacks take them as ``**settings: Unpack[CaptureSettings]`` and :class:`CallbackOptions` holds their
defaults, checks them, and makes what they configure: the :class:`CheckpointSchedule` and the
:class:`RunCapture` of a process rank (with the tags set before training).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

import numpy as np
from torch import nn

from metastore_plugins.core.analysis.methods import METHOD_CHOICES, MethodChoice
from metastore_plugins.core.capture.session import (
    UNSUPPORTED_POLICIES,
    CaptureSession,
    LossReduction,
    UnsupportedPolicy,
)
from metastore_plugins.core.errors import ConfigError, ConfigTypeError, StateError
from metastore_plugins.core.model.losses import LabelsFn, PerSampleLossFn
from metastore_plugins.core.model.pass_sources import CheckpointSchedule
from metastore_plugins.core.policy.budget import POLICIES, Budget, Policy, parse_budget
from metastore_plugins.core.reports.samples import SampleRenderer
from metastore_plugins.core.reports.tables import (
    OUTLIER_RANKINGS,
    OutlierRanking,
    OutlierSource,
    check_outlier_source,
)
from metastore_plugins.core.store.encoding import DEFAULT_ENCODING, ENCODINGS, Encoding
from metastore_plugins.core.training.basis_fit import BASIS_SAMPLES, BASIS_SOURCES, BasisSource
from metastore_plugins.core.training.run import RunCapture


class CaptureSettings(TypedDict, total=False):
    """The keyword settings both callbacks take (defaults in :class:`CallbackOptions`)."""

    per_sample_loss: PerSampleLossFn | None
    labels: LabelsFn | None
    encoding: Encoding
    policy: Policy
    budget: int | float | str | None
    flush_seconds: float | None
    modules: Sequence[str] | None
    unsupported: UnsupportedPolicy
    capture_train_steps: bool
    checkpoint_train_samples: int
    checkpoint_val_samples: int
    basis_samples: int
    basis_from: BasisSource
    seed: int
    reports: bool
    report_k: int
    outliers_from: OutlierSource
    rank_outliers_by: OutlierRanking
    influence_method: MethodChoice
    sample_renderer: SampleRenderer | None
    per_layer_scalars: bool
    index: bool
    overwrite: bool


@dataclass(frozen=True)
class CallbackOptions:
    """What :class:`MetaStoreCallback` and :class:`MetaStoreTrainerCallback` share (their docstrings
    say what each setting does). ``owner`` is the callback's name, for the error messages."""

    owner: str
    per_sample_loss: PerSampleLossFn | None = None
    labels: LabelsFn | None = None
    encoding: Encoding = DEFAULT_ENCODING
    policy: Policy = "auto"
    budget: int | float | str | None = None
    flush_seconds: float | None = 10.0
    modules: Sequence[str] | None = None
    unsupported: UnsupportedPolicy = "warn"
    capture_train_steps: bool = True
    checkpoint_train_samples: int = 256
    checkpoint_val_samples: int = 256
    basis_samples: int = BASIS_SAMPLES
    basis_from: BasisSource = "checkpoint"
    seed: int = 0
    reports: bool = True
    report_k: int = 20
    outliers_from: OutlierSource = "checkpoints"
    rank_outliers_by: OutlierRanking = "auto"
    influence_method: MethodChoice = "auto"
    sample_renderer: SampleRenderer | None = None
    per_layer_scalars: bool = False
    index: bool = False
    overwrite: bool = False

    @classmethod
    def of(cls, owner: str, settings: CaptureSettings) -> CallbackOptions:
        """The options of ``owner``'s ``**settings``; an unknown name raises ``TypeError`` naming it."""
        known = {f.name for f in fields(cls)} - {"owner"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigTypeError(
                f"{owner}() got unexpected setting(s) {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(sorted(known))}"
            )
        return cls(owner, **settings)

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            raise ConfigError(f"{self.owner}(modules=...) takes a list of module paths; write [{self.modules!r}]")
        object.__setattr__(self, "modules", None if self.modules is None else tuple(self.modules))
        object.__setattr__(self, "budget", parse_budget(self.budget, self.owner))
        for setting, value, choices in (
            ("policy", self.policy, POLICIES),
            ("encoding", self.encoding, ENCODINGS),
            ("unsupported", self.unsupported, UNSUPPORTED_POLICIES),
            ("rank_outliers_by", self.rank_outliers_by, OUTLIER_RANKINGS),
            ("influence_method", self.influence_method, METHOD_CHOICES),
            ("basis_from", self.basis_from, BASIS_SOURCES),
        ):
            if value not in choices:
                raise ConfigError(f"{self.owner}({setting}=...) must be one of {', '.join(choices)}; got {value!r}")
        check_outlier_source(self.outliers_from, self.capture_train_steps, self.owner)
        if self.rank_outliers_by == "aum" and not self.capture_train_steps:
            raise ConfigError(
                f"{self.owner}(rank_outliers_by='aum') ranks by the training steps' margins; keep "
                "capture_train_steps=True"
            )
        for setting, least in (("report_k", 1), ("checkpoint_train_samples", 1), ("checkpoint_val_samples", 1)):
            self.whole_number(setting, getattr(self, setting), least)
        self.whole_number("seed", self.seed, None)
        self.whole_number("basis_samples", self.basis_samples, 0)
        if self.sample_renderer is not None and not callable(self.sample_renderer):
            raise ConfigError(
                f"{self.owner}(sample_renderer=...) must be a function (split, sample id) -> text or image; "
                f"got {self.sample_renderer!r}"
            )
        if not isinstance(self.per_layer_scalars, bool):
            raise ConfigError(
                f"{self.owner}(per_layer_scalars=...) must be True or False; got {self.per_layer_scalars!r}"
            )
        if not isinstance(self.index, bool):
            raise ConfigError(f"{self.owner}(index=...) must be True or False; got {self.index!r}")
        if not isinstance(self.overwrite, bool):
            raise ConfigError(f"{self.owner}(overwrite=...) must be True or False; got {self.overwrite!r}")
        seconds = self.flush_seconds
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf")
        ):
            raise ConfigError(
                f"{self.owner}(flush_seconds=...) must be a positive number of seconds, or None to write only full "
                f"shards; got {seconds!r}"
            )

    def whole_number(self, setting: str, value: Any, least: int | None) -> int:
        """``value`` as an int, or a ``ValueError`` naming ``owner(setting=...)`` when it is no integer ``>= least``."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (least is not None and value < least):
            bound = f" >= {least}" if least is not None else ""
            raise ConfigError(f"{self.owner}({setting}=...) must be an integer{bound}; got {value!r}")
        return int(value)

    def check_model(self, model: nn.Module, capturable: bool = False) -> None:
        """Raise naming ``modules=`` when it lists paths that ``model`` does not have; with ``capturable``,
        also when no trainable parameter of the model (under ``modules``) can be captured: modules without
        a rule go through the generic rule, so only parameters a rule leaves out (MHA ``bias_k``) count."""
        unknown = sorted(set(self.modules or ()) - {name for name, _ in model.named_modules()})
        if unknown:
            raise ConfigError(
                f"{self.owner}(modules=...) names modules that {type(model).__name__} does not have: "
                f"{unknown}; use paths from model.named_modules()"
            )
        if not capturable:
            return
        modules = self.modules
        probe = CaptureSession(model, unsupported="skip", modules=list(modules) if modules else None)
        probe.attach()
        probe.close()
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        if trainable and set(trainable) <= set(probe.uncaptured_parameters()):
            raise ConfigError(
                f"no trainable parameter of {type(model).__name__}{' under ' + str(modules) if modules else ''} is "
                "covered by a capture rule, so nothing would be stored: register one with "
                "metastore_plugins.register_capture, or pass modules=[...] naming layers of the model"
            )

    def schedule(self, every_n: int, setting: str) -> CheckpointSchedule:
        """The checkpoint schedule: a pass at every ``every_n``-th epoch (or evaluation; 0: none), with these sizes.

        ``setting`` names ``every_n`` in the callback's signature, for the error message.
        """
        every_n = self.whole_number(setting, every_n, 0)
        return CheckpointSchedule(every_n, self.checkpoint_train_samples, self.seed, self.checkpoint_val_samples)

    def run_capture(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int,
        loss_reduction: LossReduction,
        config: dict[str, Any],
        world_size: int = 1,
        announce: Callable[[str], None] | None = None,
        early_tags: list[tuple[str, dict[str, Any]]] | None = None,
        start_step: int | None = None,
    ) -> RunCapture:
        """The :class:`RunCapture` of one process rank, with these settings (the budget split between ranks).

        ``early_tags``: the tags :meth:`tag` kept before training; written now (and the list emptied).
        ``start_step``: the trainer's step the run starts at, for the store's run log.
        """
        session = {"unsupported": self.unsupported, **({"modules": list(self.modules)} if self.modules else {})}
        run = RunCapture(
            path,
            rank=rank,
            loss_reduction=loss_reduction,
            per_sample_loss=self.per_sample_loss,
            labels=self.labels,
            encoding=self.encoding,
            flush_seconds=self.flush_seconds,
            config=config,
            session_options=session,
            owner=self.owner,
            budget=Budget(self.policy, None if self.budget is None else int(self.budget)).per_rank(world_size),
            announce=announce,
            index=self.index,
            start_step=start_step,
        )
        run.basis_samples = self.basis_samples
        run.basis_from(self.basis_from)
        try:
            while early_tags:
                name, options = early_tags.pop(0)
                run.tag(name, step=0, **options)
        except BaseException:
            run.close()  # a bad tag: its lock and writer thread go with it
            raise
        return run

    def tag(
        self, run: RunCapture | None, name: str, step: int, early: list[tuple[str, dict[str, Any]]], **options: Any
    ) -> Any:
        """``run.tag(...)`` at ``step`` (see :meth:`RunCapture.tag`); before training (``run`` None) a tag with
        ``steps=`` is kept in ``early`` and written when the run starts (:meth:`run_capture`), and returns None."""
        if run is not None:
            return run.tag(name, step=step, **options)
        if options.get("steps") is None or options.get("keep") == "snapshot":
            raise StateError(
                f"{self.owner}.tag() before training starts needs steps=(first, last) (or steps=one step), and is "
                "written when training starts; a tag of the current step, or keep='snapshot' (the weights now), "
                "must be set while training runs: call it from a hook of your model or of a callback"
            )
        early.append((name, dict(options)))
        return None
