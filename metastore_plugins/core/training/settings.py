"""The settings both callbacks take, each declared once: its name, type, default, the text that says what it does,
and its check.

:class:`CallbackOptions` declares them (each field a :func:`setting`); everything else is derived from it: the
:data:`SETTINGS` table, the callbacks' docstrings (:mod:`.settings_doc`), the checks run when a callback is made
(:meth:`CallbackOptions.__post_init__`), and the defaults the docs tables are checked against
(``tests/lightning/test_defaults_table.py``). :class:`CaptureSettings` is the same names and types as a
``TypedDict``, for ``**settings: Unpack[CaptureSettings]`` (mypy cannot derive a TypedDict at runtime; a test
checks that it equals :data:`SETTINGS`). The options also make what they configure: the
:class:`CheckpointSchedule`, the run's :class:`~metastore_plugins.core.policy.budget.Budget` (built once, here)
and the :class:`RunCapture` of a process rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, TypedDict, TypeVar, get_type_hints

from torch import nn

from metastore_plugins.core.analysis.methods import MethodChoice, method_choices
from metastore_plugins.core.capture.session import (
    UNSUPPORTED_POLICIES,
    CaptureSession,
    LossReduction,
    UnsupportedPolicy,
)
from metastore_plugins.core.errors import ConfigError, ConfigTypeError
from metastore_plugins.core.model.losses import LabelsFn, PerSampleLossFn
from metastore_plugins.core.model.pass_sources import CheckpointSchedule
from metastore_plugins.core.policy.allowance import ATTRIBUTION_TIME
from metastore_plugins.core.policy.budget import POLICIES, Budget, Policy
from metastore_plugins.core.reports.samples import SampleRenderer
from metastore_plugins.core.reports.tables import (
    OUTLIER_RANKINGS,
    OutlierRanking,
    OutlierSource,
    check_outlier_source,
)
from metastore_plugins.core.store.shards.encoding import DEFAULT_ENCODING, ENCODINGS, Encoding
from metastore_plugins.core.training.basis_fit import BASIS_SAMPLES, BASIS_SOURCES, BasisSource
from metastore_plugins.core.training.run import RunCapture
from metastore_plugins.core.training.setting_checks import (
    Check,
    byte_size,
    flag,
    module_paths,
    one_of,
    sample_function,
    seconds,
    share,
    whole,
    whole_number,
)

T = TypeVar("T")


def setting(default: T, doc: str, check: Check | None = None) -> T:
    """One setting of :class:`CallbackOptions`: its default, what it does (``doc``, one paragraph of the callbacks'
    docstrings) and its check (``check(owner, name, value) -> value kept``; None: any value)."""
    return field(default=default, metadata={"doc": doc, "check": check})


class Setting(NamedTuple):
    """One row of :data:`SETTINGS`."""

    name: str
    type: Any
    default: Any
    doc: str
    check: Check | None


class CaptureSettings(TypedDict, total=False):
    """The keyword settings both callbacks take: :data:`SETTINGS`' names and types (a test checks they agree)."""

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
    attribution_time: float | None
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
    """What :class:`MetaStoreCallback`, :class:`MetaStoreTrainerCallback` and :func:`~metastore_plugins.track`
    share, each setting declared once. ``owner`` is the adapter's name, for the error messages."""

    owner: str
    per_sample_loss: PerSampleLossFn | None = setting(
        None,
        "``(forward output, batch) -> (B,)`` per-sample losses (recorded with the factors). Default: "
        "cross-entropy of the model's ``(B, C)`` logits on the labels.",
    )
    labels: LabelsFn | None = setting(
        None,
        '``batch -> (B,)``; default: ``y`` of ``(x, y)`` batches, ``batch["labels"]`` of dicts.',
    )
    encoding: Encoding = setting(
        DEFAULT_ENCODING,
        '``"fp16"`` (default), ``"fp32"``, ``"bf16"`` or ``"int8"``.',
        one_of(ENCODINGS),
    )
    policy: Policy = setting(
        "auto",
        '``"auto"`` (default): a plan made at the first step keeps each layer exact, projected (``k x k`` '
        "numbers with its exact squared norm) or as exact norms only, whatever fits the budget, and "
        'snapshots the weights at checkpoint passes for exact recomputation; ``"exact"``: every layer\'s '
        "exact factors at every step (the budget, if given, still holds). See docs/policies.md.",
        one_of(POLICIES),
    )
    budget: int | float | str | None = setting(
        None,
        'bytes the store may take (an int, or ``"250MB"``, ``"4GiB"``); default: one weight snapshot per '
        'planned checkpoint pass plus 20 KiB per planned sample (``policy="auto"``), no limit '
        '(``policy="exact"``). Split evenly between processes.',
        byte_size,
    )
    flush_seconds: float | None = setting(
        10.0,
        "a crash loses at most about the last ``flush_seconds`` of captured steps: what the store writer "
        "holds is written as a shard once its oldest step waited half of that (default 10.0; ``None``: "
        "only full 64 MiB shards, epoch ends and checkpoint saves write).",
        seconds,
    )
    modules: Sequence[str] | None = setting(
        None,
        "capture only these module paths of the model (all by default).",
        module_paths,
    )
    unsupported: UnsupportedPolicy = setting(
        "warn",
        '``"warn"`` (default), ``"error"`` or ``"skip"`` for parameters no capture rule covers.',
        one_of(UNSUPPORTED_POLICIES),
    )
    capture_train_steps: bool = setting(
        True,
        'capture every training step (capture point ``"train"``; default True).',
    )
    checkpoint_train_samples: int = setting(
        256,
        "the most training samples in each checkpoint pass (a seeded, fixed subset; default 256).",
        whole(1),
    )
    checkpoint_val_samples: int = setting(
        256,
        "the most validation samples in each checkpoint pass (default 256).",
        whole(1),
    )
    attribution_time: float | None = setting(
        ATTRIBUTION_TIME,
        "the most the checkpoint passes and their basis fits may cost, as a share of the training, counted in "
        "samples (default 0.25): at most four passes, evenly spaced, each of as many validation and training "
        "samples as that share affords, 32 of each at least; sizes you set are kept. ``None``: a pass at each "
        "scheduled epoch (or evaluation) of the sizes set. The start line says the passes and their cost "
        "(docs/policies.md).",
        share,
    )
    basis_samples: int = setting(
        BASIS_SAMPLES,
        "where the budget keeps checkpoint passes projected, they are projected on each layer's K-FAC "
        "eigenbasis, fitted at each checkpoint on this many of its training samples (default 256; ``0``: "
        "seeded random projections, which K-FAC / EK-FAC cannot use). The training steps the budget keeps "
        "projected go on the top of the latest basis too (at their own size), so that in-run K-FAC / "
        "EK-FAC applies to them (steps before the first checkpoint stay seeded).",
        whole(0),
    )
    basis_from: BasisSource = setting(
        "checkpoint",
        'where each checkpoint\'s eigenbasis comes from: ``"checkpoint"`` (default): a forward and '
        'backward of ``basis_samples`` training samples at the checkpoint\'s weights; ``"steps"``: the '
        "K-FAC sums of the training steps since the previous checkpoint (a few rows of each step's own "
        "factors: no forward or backward of its own). docs/policies.md measures both.",
        one_of(BASIS_SOURCES),
    )
    seed: int = setting(
        0,
        "the seed of the training subset (default 0).",
        whole(None),
    )
    reports: bool = setting(
        True,
        "build reports at the end of training: files, and TensorBoard where the trainer logs to it (default True).",
    )
    report_k: int = setting(
        20,
        "rows of the outlier table (default 20).",
        whole(1),
    )
    outliers_from: OutlierSource = setting(
        "auto",
        'where the outlier table\'s self-influence comes from: ``"auto"`` (default): the training steps where '
        'they are captured, else the passes; ``"checkpoints"``: the training samples of the checkpoint passes, '
        'at the passes\' weights; ``"training"``: every trained sample, in-run ``sum_t lr_t ||g_i(w_t)||^2`` '
        "over the captured training steps (no pass over the whole training set needed).",
    )
    rank_outliers_by: OutlierRanking = setting(
        "auto",
        '``"auto"`` (default): every trained sample by its area under the margin (AUM, the labelled logit '
        "minus the largest other, averaged over its training steps; lowest first) where the training "
        'steps hold margins (class logits), else by self-influence; ``"aum"``, ``"loss"`` (the loss at '
        'the last pass: best on short fine-tunes of pretrained models) or ``"self_influence"`` to choose. '
        "docs/quality.md measures why.",
        one_of(OUTLIER_RANKINGS),
    )
    influence_method: MethodChoice = setting(
        "auto",
        'what scores the influence table: ``"auto"`` (default): EK-FAC (curvature-preconditioned, the '
        "best agreement with retraining measured in docs/quality.md) where every layer of the checkpoint "
        "passes can be preconditioned (exact factors, or passes projected on the curvature eigenbasis: "
        '``basis_samples``), else TracIn (seeded projections: the table then says why); or ``"tracin"``, '
        '``"kfac"``, ``"ekfac"``, ``"trak"``. The table\'s caption and ``influence.json`` say which method '
        "and damping produced it.",
        lambda owner, name, value: one_of(method_choices())(owner, name, value),  # a registered method too
    )
    sample_renderer: SampleRenderer | None = setting(
        None,
        '``(split, sample id) -> text or image`` (``split`` ``"train"`` or ``"val"``): what the reports '
        "show of a sample; a string goes into the outlier and influence tables, an image (array, tensor "
        "or PIL image) into the figures. Default: decoded ``input_ids`` (HF, with a tokenizer), the "
        "dataset's small images (Lightning). See docs/reports.md.",
        sample_function,
    )
    per_layer_scalars: bool = setting(
        False,
        "a TensorBoard scalar chart of the gradient norm of every layer, besides the heatmap and the "
        "three summary charts (default False).",
        flag,
    )
    index: bool = setting(
        False,
        "build the nearest-gradient index of the store when training ends (after the last training step "
        "and compaction, before the reports: no cost during the steps), so that ``k=`` queries and the "
        "reports' TracIn proponents/opponents score only its candidates (default False: the first ``k=`` "
        "query builds it; docs/queries.md).",
        flag,
    )
    overwrite: bool = setting(
        False,
        "a fresh run (not resumed from a checkpoint) into a directory that already holds a store moves "
        "that store aside (``<dirpath>.replaced-<UTC time>``, never deleted) and starts a new one; "
        "default False: such a run stops at its start with an error naming both ways out. A resumed run "
        "always continues its store.",
        flag,
    )
    given: frozenset[str] = field(default=frozenset(), repr=False, compare=False)  # the settings passed
    capture_budget: Budget = field(init=False, repr=False, compare=False)

    @classmethod
    def of(cls, owner: str, settings: CaptureSettings) -> CallbackOptions:
        """The options of ``owner``'s ``**settings``; an unknown name raises ``ConfigTypeError`` naming it."""
        known = [row.name for row in SETTINGS]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigTypeError(
                f"{owner}() got unexpected setting(s) {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(sorted(known))}"
            )
        return cls(owner, **settings, given=frozenset(settings))

    def __post_init__(self) -> None:
        for row in SETTINGS:  # each setting's own check, in the order they are declared
            if row.check is not None:
                object.__setattr__(self, row.name, row.check(self.owner, row.name, getattr(self, row.name)))
        check_outlier_source(self.outliers_from, self.capture_train_steps, self.owner)
        if self.rank_outliers_by == "aum" and not self.capture_train_steps:
            raise ConfigError(
                f"{self.owner}(rank_outliers_by='aum') ranks by the training steps' margins; keep "
                "capture_train_steps=True"
            )
        given = None if self.budget is None else int(self.budget)
        object.__setattr__(self, "capture_budget", Budget(self.policy, given))  # the one Budget of the run

    def whole_number(self, setting: str, value: Any, least: int | None) -> int:
        """``value`` as an int, or a ``ConfigError`` naming ``owner(setting=...)`` unless an integer ``>= least``."""
        return whole_number(self.owner, setting, value, least)

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
        return CheckpointSchedule(  # the start pass serves the training steps' influence: only when they are captured
            every_n, self.checkpoint_train_samples, self.seed, self.checkpoint_val_samples, self.capture_train_steps
        )

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
            budget=self.capture_budget.per_rank(world_size),
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


def _table() -> tuple[Setting, ...]:
    """The settings as :class:`CallbackOptions` declares them."""
    hints = get_type_hints(CallbackOptions)
    return tuple(
        Setting(f.name, hints[f.name], f.default, f.metadata["doc"], f.metadata["check"])
        for f in fields(CallbackOptions)
        if "doc" in f.metadata
    )


#: Every setting, in the order :class:`CallbackOptions` declares them: name, type, default, doc, check.
SETTINGS: tuple[Setting, ...] = _table()
