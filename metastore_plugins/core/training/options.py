"""The settings both callbacks take, checked where they are given: the shared half of their constructors.

:class:`CaptureSettings` declares them once (names, types, meaning); the callbacks take them
as ``**settings: Unpack[CaptureSettings]`` and :class:`CallbackOptions` holds their defaults,
checks them, and builds what both callbacks need from them: the :class:`RunCapture`, the
:class:`CheckpointSchedule` and the end-of-training reports.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
from torch import nn

from metastore_plugins.core.capture.session import UNSUPPORTED_POLICIES, CaptureSession, UnsupportedPolicy
from metastore_plugins.core.model.rng import preserved_rng
from metastore_plugins.core.policy.plan import POLICIES, Policy, RunShape
from metastore_plugins.core.policy.runtime import CapturePolicy, parse_budget
from metastore_plugins.core.reports.samples import SampleRenderer, renderers
from metastore_plugins.core.reports.tables import (
    OUTLIER_RANKINGS,
    OutlierRanking,
    OutlierSource,
    check_outlier_source,
)
from metastore_plugins.core.store.encoding import DEFAULT_ENCODING, ENCODINGS, Encoding
from metastore_plugins.core.store.readcache import SHARDS
from metastore_plugins.core.training.run import CheckpointSchedule, LabelsFn, LossReduction, PerSampleLossFn, RunCapture


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
    seed: int
    reports: bool
    report_k: int
    outliers_from: OutlierSource
    rank_outliers_by: OutlierRanking
    sample_renderer: SampleRenderer | None
    per_layer_scalars: bool
    overwrite: bool


#: The ``Args:`` text of :class:`CaptureSettings`, which each callback's docstring includes at ``{settings}``.
SETTINGS_DOC = """\
per_sample_loss: ``(forward output, batch) -> (B,)`` per-sample losses (recorded with the
    factors). Default: cross-entropy of the model's ``(B, C)`` logits on the labels.
labels: ``batch -> (B,)``; default: ``y`` of ``(x, y)`` batches, ``batch["labels"]`` of dicts.
encoding: ``"fp16"`` (default), ``"fp32"``, ``"bf16"`` or ``"int8"``.
policy: ``"auto"`` (default): a plan made at the first step keeps each layer exact, projected
    (``k x k`` numbers with its exact squared norm) or as exact norms only, whatever fits the
    budget, and snapshots the weights at checkpoint passes for exact recomputation;
    ``"exact"``: every layer's exact factors at every step (the budget, if given, still holds).
    See docs/policies.md.
budget: bytes the store may take (an int, or ``"250MB"``, ``"4GiB"``); default: one weight
    snapshot per planned checkpoint pass plus 20 KiB per planned sample (``policy="auto"``), no
    limit (``policy="exact"``). Split evenly between processes.
flush_seconds: a crash loses at most about the last ``flush_seconds`` of captured steps: what
    the store writer holds is written as a shard once its oldest step waited half of that
    (default 10.0; ``None``: only full 64 MiB shards, epoch ends and checkpoint saves write).
modules: capture only these module paths of the model (all by default).
unsupported: ``"warn"`` (default), ``"error"`` or ``"skip"`` for parameters no capture rule covers.
capture_train_steps: capture every training step (capture point ``"train"``; default True).
checkpoint_train_samples: the most training samples in each checkpoint pass (a seeded,
    fixed subset; default 256).
checkpoint_val_samples: the most validation samples in each checkpoint pass (default 256).
seed: the seed of the training subset (default 0).
reports: build reports at the end of training: files, and TensorBoard where the trainer
    logs to it (default True).
report_k: rows of the outlier table (default 20).
outliers_from: where the outlier table's self-influence comes from: ``"checkpoints"``
    (default): the training samples of the checkpoint passes, at the passes' weights;
    ``"training"``: every trained sample, in-run ``sum_t lr_t ||g_i(w_t)||^2`` over the captured
    training steps (no pass over the whole training set needed).
rank_outliers_by: ``"auto"`` (default): every trained sample by its area under the margin
    (AUM, the labelled logit minus the largest other, averaged over its training steps; lowest
    first) where the training steps hold margins (class logits), else by self-influence;
    ``"aum"``, ``"loss"`` (the loss at the last pass: best on short fine-tunes of pretrained
    models) or ``"self_influence"`` to choose. docs/quality.md measures why.
sample_renderer: ``(split, sample id) -> text or image`` (``split`` ``"train"`` or ``"val"``): what the
    reports show of a sample; a string goes into the outlier and influence tables, an image
    (array, tensor or PIL image) into the figures. Default: decoded ``input_ids`` (HF, with a
    tokenizer), the dataset's small images (Lightning). See docs/reports.md.
per_layer_scalars: a TensorBoard scalar chart of the gradient norm of every layer, besides the
    heatmap and the three summary charts (default False).
overwrite: a fresh run (not resumed from a checkpoint) into a directory that already holds a
    store moves that store aside (``<dirpath>.replaced-<UTC time>``, never deleted) and starts a
    new one; default False: such a run stops at its start with an error naming both ways out.
    A resumed run always continues its store."""


def with_settings_doc(cls: type) -> type:
    """Put :data:`SETTINGS_DOC` into ``cls.__doc__`` where it says ``{settings}`` (indented to match)."""
    doc = cls.__doc__ or ""
    line = next(line for line in doc.splitlines() if "{settings}" in line)
    indent = line[: len(line) - len(line.lstrip())]
    cls.__doc__ = doc.replace(line, "\n".join(indent + row if row else row for row in SETTINGS_DOC.splitlines()))
    return cls


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
    seed: int = 0
    reports: bool = True
    report_k: int = 20
    outliers_from: OutlierSource = "checkpoints"
    rank_outliers_by: OutlierRanking = "auto"
    sample_renderer: SampleRenderer | None = None
    per_layer_scalars: bool = False
    overwrite: bool = False

    @classmethod
    def of(cls, owner: str, settings: CaptureSettings) -> CallbackOptions:
        """The options of ``owner``'s ``**settings``; an unknown name raises ``TypeError`` naming it."""
        known = {f.name for f in fields(cls)} - {"owner"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(
                f"{owner}() got unexpected setting(s) {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(sorted(known))}"
            )
        return cls(owner, **settings)

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            raise ValueError(f"{self.owner}(modules=...) takes a list of module paths; write [{self.modules!r}]")
        object.__setattr__(self, "modules", None if self.modules is None else tuple(self.modules))
        object.__setattr__(self, "budget", parse_budget(self.budget, self.owner))
        for setting, value, choices in (
            ("policy", self.policy, POLICIES),
            ("encoding", self.encoding, ENCODINGS),
            ("unsupported", self.unsupported, UNSUPPORTED_POLICIES),
            ("rank_outliers_by", self.rank_outliers_by, OUTLIER_RANKINGS),
        ):
            if value not in choices:
                raise ValueError(f"{self.owner}({setting}=...) must be one of {', '.join(choices)}; got {value!r}")
        check_outlier_source(self.outliers_from, self.capture_train_steps, self.owner)
        if self.rank_outliers_by == "aum" and not self.capture_train_steps:
            raise ValueError(
                f"{self.owner}(rank_outliers_by='aum') ranks by the training steps' margins; keep "
                "capture_train_steps=True"
            )
        for setting, least in (("report_k", 1), ("checkpoint_train_samples", 1), ("checkpoint_val_samples", 1)):
            self.whole_number(setting, getattr(self, setting), least)
        self.whole_number("seed", self.seed, None)
        if self.sample_renderer is not None and not callable(self.sample_renderer):
            raise ValueError(
                f"{self.owner}(sample_renderer=...) must be a function (split, sample id) -> text or image; "
                f"got {self.sample_renderer!r}"
            )
        if not isinstance(self.per_layer_scalars, bool):
            raise ValueError(
                f"{self.owner}(per_layer_scalars=...) must be True or False; got {self.per_layer_scalars!r}"
            )
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"{self.owner}(overwrite=...) must be True or False; got {self.overwrite!r}")
        seconds = self.flush_seconds
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf")
        ):
            raise ValueError(
                f"{self.owner}(flush_seconds=...) must be a positive number of seconds, or None to write only full "
                f"shards; got {seconds!r}"
            )

    def whole_number(self, setting: str, value: Any, least: int | None) -> int:
        """``value`` as an int, or a ``ValueError`` naming ``owner(setting=...)`` when it is no integer ``>= least``."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (least is not None and value < least):
            bound = f" >= {least}" if least is not None else ""
            raise ValueError(f"{self.owner}({setting}=...) must be an integer{bound}; got {value!r}")
        return int(value)

    def check_model(self, model: nn.Module, capturable: bool = False) -> None:
        """Raise naming ``modules=`` when it lists paths that ``model`` does not have; with ``capturable``,
        also when no trainable parameter of the model (under ``modules``) can be captured: modules without
        a rule go through the generic rule, so only parameters a rule leaves out (MHA ``bias_k``) count."""
        unknown = sorted(set(self.modules or ()) - {name for name, _ in model.named_modules()})
        if unknown:
            raise ValueError(
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
            raise ValueError(
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
    ) -> RunCapture:
        """The :class:`RunCapture` of one process rank, with these settings (the budget split between ranks).

        ``early_tags``: the tags :meth:`tag` kept before training; written now (and the list emptied).
        """
        budget = None if self.budget is None else int(self.budget) // max(1, world_size)
        policy = CapturePolicy(self.policy, budget, encoding=self.encoding, owner=self.owner)
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
            policy=policy,
            announce=announce,
        )
        try:
            while early_tags:
                name, options = early_tags.pop(0)
                run.tag(name, step=0, **options)
        except BaseException:
            run.close()  # a bad tag: its lock and writer thread go with it
            raise
        return run

    def expect(
        self,
        run: RunCapture,
        model: nn.Module,
        schedule: CheckpointSchedule,
        *,
        train_batches: int,
        train_batch_size: int,
        periods: int,
        sizes: tuple[int | None, int | None],
        rank: int,
        world_size: int,
    ) -> None:
        """Tell the run's capture policy what the run will be, for its plan.

        ``train_batches``: training micro-batches this rank will capture (0: unknown); ``periods``: epochs (or
        evaluations) the schedule counts; ``sizes``: the training and validation set sizes (None: unknown).
        """
        passes = periods // schedule.every_n_epochs if schedule.every_n_epochs else 0
        train_size, val_size = sizes
        share = lambda most, size: -(-min(most, most if size is None else size) // max(1, world_size))  # noqa: E731
        pass_samples = share(schedule.train_samples, train_size) + (
            share(schedule.val_samples, val_size) if val_size else 0
        )
        run.policy.expect(
            RunShape.of(
                model,
                train_batches=(train_batches if train_batches > 0 else -1) if self.capture_train_steps else 0,
                train_batch_size=train_batch_size,
                passes=passes,
                pass_samples=pass_samples,
                rank=rank,
                reports=self.reports,
            )
        )

    def tag(
        self, run: RunCapture | None, name: str, step: int, early: list[tuple[str, dict[str, Any]]], **options: Any
    ) -> Any:
        """``run.tag(...)`` at ``step`` (see :meth:`RunCapture.tag`); before training (``run`` None) a tag with
        ``steps=`` is kept in ``early`` and written when the run starts (:meth:`run_capture`), and returns None."""
        if run is not None:
            return run.tag(name, step=step, **options)
        if options.get("steps") is None or options.get("keep") == "snapshot":
            raise RuntimeError(
                f"{self.owner}.tag() before training starts needs steps=(first, last) (or steps=one step), and is "
                "written when training starts; a tag of the current step, or keep='snapshot' (the weights now), "
                "must be set while training runs: call it from a hook of your model or of a callback"
            )
        early.append((name, dict(options)))
        return None

    def start_line(self, store_dir: Path, schedule: CheckpointSchedule, period: str) -> str:
        """The one line a callback logs when training starts: where the store goes, and what it keeps."""
        steps = "every training step" if self.capture_train_steps else "no training steps"
        passes = (
            f"checkpoint passes every {schedule.every_n_epochs} {period} over at most {schedule.train_samples} "
            f"training and {schedule.val_samples} validation samples"
            if schedule.every_n_epochs
            else "no checkpoint passes"
        )
        return f"{self.owner}: per-sample gradients of {steps} and {passes} go to {store_dir} ({self.encoding})"

    def end_line(
        self,
        store_dir: Path,
        result: dict[str, Any] | None,
        logdirs: Sequence[Path],
        seconds: Mapping[str, float] | None = None,
    ) -> str:
        """The one line a callback logs when training ends: what was written, how long the passes and the reports
        took (``seconds``: :attr:`RunCapture.seconds`), and how to open it."""
        how = [f"metastore inspect {store_dir}"] + [f"tensorboard --logdir {logdir}" for logdir in logdirs]
        seconds = seconds or {}
        refined = seconds.get("refinement", 0.0)
        if result is None:
            made = "no reports" if self.reports else "reports off"
        else:
            of = f", of which {refined:.1f} s recomputing samples exactly" if refined else ""
            made = f"reports in {store_dir / 'reports'} (built in {result.get('seconds', 0.0):.1f} s{of})"
        passes = f"; checkpoint passes took {seconds['passes']:.1f} s" if seconds.get("passes") else ""
        return f"{self.owner}: store {store_dir} written, {made}{passes}; open with: {' | '.join(how)}"

    def build_reports(
        self, store_dir: Path, writers: Sequence[Any], *, step: int, rank: int = 0, **sources: Any
    ) -> dict[str, Any] | None:
        """The end-of-training reports into ``<store_dir>/reports`` and ``writers`` (see ``report_run``).

        Call it on every rank. Under a process group of several ranks, each opens the store
        partitioned and scores its share; rank 0 writes (docs/distributed.md): ``writers`` and
        ``sources`` (``report_run``'s ``render=``, ``samples=``, ``recompute=``) count on rank 0
        only, and the other ranks return ``{"partition": ...}``. ``sample_renderer`` replaces ``render=`` and
        ``samples=``. Without one, ranks other than 0
        return ``None`` at once. A store the reports cannot be built from (no class predictions
        of a regression model, say), or a rank that failed mid-pass, gives a warning, not an
        error: the store is complete, and training ended well. Whatever building them draws from
        the global random number generators (a dataset's augmentation, read for thumbnails) is undone.
        """
        from metastore_plugins.core.distributed import DistributedQueryError
        from metastore_plugins.core.reports.partitioned import distributed, report_store
        from metastore_plugins.core.reports.tensorboard import report_run  # matplotlib and tensorboard: only now

        if rank != 0 and not distributed():
            return None
        if rank == 0 and self.sample_renderer is not None:  # the user's rendering replaces the callback's
            text, lookup = renderers(self.sample_renderer)
            sources = {**sources, "render": text, "samples": lookup}
        started = time.perf_counter()
        try:
            with preserved_rng():
                result = report_run(
                    report_store(store_dir),
                    store_dir / "reports",
                    writers if rank == 0 else (),
                    step=step,
                    k=self.report_k,
                    outliers_from=self.outliers_from,
                    rank_outliers_by=self.rank_outliers_by,
                    per_layer_scalars=self.per_layer_scalars,
                    **(sources if rank == 0 else {}),
                )
            if result is not None:
                result["seconds"] = time.perf_counter() - started
            return result
        except (KeyError, ValueError, DistributedQueryError) as exc:
            where = f" on rank {rank}" if distributed() else ""
            warnings.warn(
                f"{self.owner} could not build the reports{where} ({exc!r}); the store {store_dir} is complete. "
                "Pass reports=False to skip them",
                stacklevel=3,
            )
            return None
        finally:
            SHARDS.clear()  # the trainer's process keeps no shard bytes after its reports (up to 4 GiB otherwise)


def phase_seconds(seconds: Mapping[str, float], result: Mapping[str, Any] | None) -> dict[str, float]:
    """Where a callback's time went after its training steps: ``pass_seconds`` (checkpoint passes),
    ``report_seconds`` (the reports, recomputation included) and ``refine_seconds`` (the reports' exact
    recomputation); ``seconds`` is the callback's ``seconds``, ``result`` its ``report_result``."""
    return {
        "pass_seconds": round(seconds.get("passes", 0.0), 2),
        "report_seconds": round((result or {}).get("seconds", 0.0), 2),
        "refine_seconds": round(seconds.get("refinement", 0.0), 2),
    }


def check_writable(path: str | os.PathLike[str], setting: str) -> Path:
    """Create ``path`` and check it is writable, or raise naming ``setting``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"cannot create the store directory {path} ({exc}); set {setting} to a writable directory"
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"the store directory {path} is not writable; set {setting} to a writable directory")
    return path
