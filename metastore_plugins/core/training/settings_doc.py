"""The text of the settings both callbacks take, put into each callback's docstring.

:data:`SETTINGS_DOC` says what each setting of :class:`~metastore_plugins.core.training.settings.CaptureSettings`
does; :func:`with_settings_doc` puts it where a callback's docstring says ``{settings}``.
"""

from __future__ import annotations

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
basis_samples: where the budget keeps checkpoint passes projected, they are projected on each
    layer's K-FAC eigenbasis, fitted at each checkpoint on this many of its training samples
    (default 256; ``0``: seeded random projections, which K-FAC / EK-FAC cannot use). The training
    steps the budget keeps projected go on the top of the latest basis too (at their own size), so
    that in-run K-FAC / EK-FAC applies to them (steps before the first checkpoint stay seeded).
basis_from: where each checkpoint's eigenbasis comes from: ``"checkpoint"`` (default): a forward
    and backward of ``basis_samples`` training samples at the checkpoint's weights; ``"steps"``:
    the K-FAC sums of the training steps since the previous checkpoint (a few rows of each step's
    own factors: no forward or backward of its own). docs/policies.md measures both.
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
influence_method: what scores the influence table: ``"auto"`` (default): EK-FAC (curvature-
    preconditioned, the best agreement with retraining measured in docs/quality.md) where every
    layer of the checkpoint passes can be preconditioned (exact factors, or passes projected on
    the curvature eigenbasis: ``basis_samples``), else TracIn (seeded projections: the table then
    says why); or ``"tracin"``, ``"kfac"``, ``"ekfac"``, ``"trak"``.
    The table's caption and ``influence.json`` say which method and damping produced it.
sample_renderer: ``(split, sample id) -> text or image`` (``split`` ``"train"`` or ``"val"``): what the
    reports show of a sample; a string goes into the outlier and influence tables, an image
    (array, tensor or PIL image) into the figures. Default: decoded ``input_ids`` (HF, with a
    tokenizer), the dataset's small images (Lightning). See docs/reports.md.
per_layer_scalars: a TensorBoard scalar chart of the gradient norm of every layer, besides the
    heatmap and the three summary charts (default False).
index: build the nearest-gradient index of the store when training ends (after the last
    training step and compaction, before the reports: no cost during the steps), so that
    ``k=`` queries and the reports' TracIn proponents/opponents score only its candidates
    (default False: the first ``k=`` query builds it; docs/queries.md).
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
