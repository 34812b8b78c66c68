"""Checkpoint passes' sources: when passes run, which samples they cover, and their exact ids.

- :class:`CheckpointSchedule` chooses when passes run and the bounded, seeded, fixed training
  subset they cover (the first items of a stream);
- :class:`PassSource` is one split of a pass; :func:`indexed_batches` iterates a map-style
  dataset subset with exact ids whatever the items look like, :func:`stream_batches` the first
  items of an ``IterableDataset`` whose items carry their id; :func:`rank_share` splits a pass
  between process ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from metastore_plugins.core.errors import SampleIdError
from metastore_plugins.core.model.sample_ids import SAMPLE_ID_KEYS, take_sample_ids, unwrap_dataset
from metastore_plugins.core.ops.cost import PASS_BATCH_BYTES, pass_batch_size

#: the split of a pass over the training set, and its capture point's suffix (``epoch-0/train``)
TRAIN_SPLIT = "train"
#: the name of the checkpoint pass before the first training step (:meth:`CheckpointSchedule.at_start`)
START_PASS = "start"


@dataclass(frozen=True)
class PassSource:
    """One split of a checkpoint pass: the dataset indices it covers (or, for a stream, how many of its first
    items) and how to batch them."""

    split: str  # "train" or "val": the capture point is "<pass name>/<split>"
    dataset: Any
    indices: list[int] | None  # None: an IterableDataset, of which the pass takes the first `limit` items
    batch_size: int
    collate_fn: Callable[[list[Any]], Any] | None = None
    limit: int = 0

    @property
    def samples(self) -> int:
        """The samples the split covers (over all ranks)."""
        return self.limit if self.indices is None else len(self.indices)

    def batches(self, rank: int, world_size: int) -> Iterator[tuple[Tensor, Any]]:
        """``(ids, batch)`` of this rank's share (:func:`rank_share`; a stream: the first items of this rank's own)."""
        if self.indices is None:
            return stream_batches(self.dataset, self.limit, self.batch_size, self.collate_fn)
        share = rank_share(self.indices, rank, world_size)
        return indexed_batches(self.dataset, share, self.batch_size, self.collate_fn)


@dataclass
class CheckpointSchedule:
    """When checkpoint passes run, and the fixed subsets they cover.

    Args:
        every_n_epochs: a pass at the end of every n-th epoch (or evaluation; 0: never).
        train_samples: the most training samples in each pass (drawn once, seeded, then fixed).
        seed: the seed of that draw.
        val_samples: the most validation samples in each pass (the first ones).
        start_pass: a pass over the validation samples before the first training step (:meth:`at_start`).
        periods: the epochs (or evaluations) of the schedule's that make a pass (None: each of them), set with the
            sizes by the attribution allowance (:meth:`allow`).
    """

    every_n_epochs: int = 1
    train_samples: int = 256
    seed: int = 0
    val_samples: int = 256
    start_pass: bool = True
    train_indices: list[int] | None = field(default=None)
    periods: tuple[int, ...] | None = None

    def due(self, epoch: int) -> bool:
        """Whether a pass runs at the end of epoch (or evaluation) ``epoch`` (0-based)."""
        if self.periods is not None:
            return epoch in self.periods
        return self.every_n_epochs > 0 and (epoch + 1) % self.every_n_epochs == 0

    def due_periods(self, periods: int) -> list[int]:
        """The periods of ``0 .. periods - 1`` the schedule makes a pass at, before any allowance."""
        return [p for p in range(periods) if self.every_n_epochs > 0 and (p + 1) % self.every_n_epochs == 0]

    def allow(self, periods: tuple[int, ...], val_samples: int, train_samples: int) -> None:
        """Keep passes at ``periods`` only, of these sizes (the attribution allowance's; before the first pass). A
        training subset already drawn (restored from a checkpoint) stays as it is: the same samples after
        resuming."""
        self.periods, self.val_samples = periods, val_samples
        self.train_samples = train_samples if self.train_indices is None else len(self.train_indices)

    def at_start(self, step: int) -> bool:
        """Whether a pass runs before training step ``step`` (:data:`START_PASS`): before the first step of a run
        whose schedule makes passes (not on a resumed run). It holds the validation samples only, the test side of
        the steps before the first epoch-end pass in in-run influence (the weights they started from: the pairing
        of :func:`~metastore_plugins.core.analysis.in_run.step_windows`)."""
        return self.start_pass and self.every_n_epochs > 0 and step == 0

    def train_subset(self, dataset_size: int) -> list[int]:
        """The sorted dataset indices of the training subset (the same in every pass, and after resuming)."""
        if self.train_indices is None:
            if dataset_size <= self.train_samples:
                self.train_indices = list(range(dataset_size))
            else:
                g = torch.Generator().manual_seed(self.seed)
                self.train_indices = sorted(torch.randperm(dataset_size, generator=g)[: self.train_samples].tolist())
        return self.train_indices

    def sources(self, train: Any, val: Any | None, *, train_batch_size: int, val_batch_size: int) -> list[PassSource]:
        """The splits of one pass over the loaders ``train`` and ``val`` (none for a ``val`` without a sized dataset).

        The training subset of ``train.dataset`` (:meth:`train_subset`) and the first
        ``val_samples`` of ``val.dataset``, batched as given, collated by each loader's ``collate_fn``.
        """
        dataset = train.dataset
        if _is_stream(dataset):
            found = [PassSource("train", dataset, None, train_batch_size, train.collate_fn, self.train_samples)]
        else:
            subset = self.train_subset(len(dataset))
            found = [PassSource("train", dataset, subset, train_batch_size, train.collate_fn)]
        val_set = getattr(val, "dataset", None)
        collate = getattr(val, "collate_fn", None)
        if val_set is not None and _is_stream(val_set):
            found.append(PassSource("val", val_set, None, val_batch_size, collate, self.val_samples))
        elif val_set is not None and hasattr(val_set, "__len__"):
            count = min(len(val_set), self.val_samples)
            found.append(PassSource("val", val_set, list(range(count)), val_batch_size, collate))
        return found


def _is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__")


def rank_share(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The indices a process rank takes in a checkpoint pass (every rank a disjoint share)."""
    return list(indices[rank::world_size])


class _Tagged(Dataset):
    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self.dataset, self.indices = dataset, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> tuple[Any, int]:
        return self.dataset[self.indices[k]], self.indices[k]


def indexed_batches(
    dataset: Any, indices: Sequence[int], batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None
) -> Iterator[tuple[Tensor, Any]]:
    """``(ids, batch)`` over ``dataset[indices]`` in order: exact ids for any map-style dataset."""
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise SampleIdError(
            f"checkpoint passes need a map-style dataset (__getitem__, __len__); got {type(dataset).__name__}"
        )
    collate = collate_fn or torch.utils.data.default_collate

    def both(items: list[tuple[Any, int]]) -> tuple[Tensor, Any]:
        return torch.tensor([i for _, i in items]), collate([item for item, _ in items])

    tagged = _Tagged(unwrap_dataset(dataset), indices)
    # a private generator: the loader's base seed is not drawn from torch's global one (training's)
    yield from DataLoader(tagged, batch_size=max(1, batch_size), collate_fn=both, generator=torch.Generator())


def stream_batches(
    dataset: Any, limit: int, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None
) -> Iterator[tuple[Tensor, Any]]:
    """``(ids, batch)`` over the first ``limit`` items of an iterable dataset (a stream), read in this process.

    The ids come from each item's ``"sample_id"`` or ``"idx"`` field (dict items), as in
    training; a stream whose items carry none raises :class:`SampleIdError` naming what to add.
    """
    collate = collate_fn or torch.utils.data.default_collate
    items = itertools.islice(iter(dataset), max(0, limit))
    while group := list(itertools.islice(items, max(1, batch_size))):
        batch = collate(group)
        ids = take_sample_ids(batch, strip=False)
        if ids is None:
            raise SampleIdError(
                f"checkpoint passes over the stream {type(dataset).__name__} need the id of each item: give its "
                f"items a {' or '.join(map(repr, SAMPLE_ID_KEYS))} field (dict items), or turn the passes off "
                "(checkpoint_every_n_epochs=0 / checkpoint_every_n_evals=0)"
            )
        yield ids, batch


def dataset_size(dataset: Any) -> int | None:
    """``len(dataset)``, or None for a stream or a dataset without a length."""
    if dataset is None or _is_stream(dataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


def within_memory(sources: Sequence[PassSource], sample_bytes: float, max_bytes: int | None = None) -> list[PassSource]:
    """``sources`` with batches of at most ``max_bytes / sample_bytes`` samples
    (:data:`~metastore_plugins.core.ops.cost.PASS_BATCH_BYTES` by default; as given while ``sample_bytes``, the
    exact factor bytes a captured sample holds, is not measured: 0)."""
    most = PASS_BATCH_BYTES if max_bytes is None else max_bytes
    return [replace(source, batch_size=pass_batch_size(source.batch_size, sample_bytes, most)) for source in sources]
