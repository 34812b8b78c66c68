"""Exact sample ids of collated batches: what the dataset carries, or what the sampler drew.

- :class:`IndexedDataset` makes every item carry its dataset index, and
  :func:`take_sample_ids` reads it back (removing what the wrapper added);
- :class:`RecordingBatchSampler` remembers the index lists a ``DataLoader`` draws, so that
  the ids of plain map-style datasets are known without changing them.

Ids are never guessed: where neither works, :func:`missing_ids_error` says what to change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from metastore_plugins.core.errors import ConfigTypeError, SampleIdError, UnknownNameError

SAMPLE_ID_KEYS = ("sample_id", "idx")
INDEX_KEY = "sample_id"


class IndexedDataset(Dataset):
    """Wraps a map-style dataset so that every item carries its dataset index.

    Dict items get a ``"sample_id"`` entry; any other item ``item`` becomes
    ``(*item, index)`` (``(item, index)`` if it is not a tuple or list). The trainer
    callbacks remove what this wrapper added before your step sees the batch, so
    ``x, y = batch`` keeps working.
    """

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigTypeError(
                f"IndexedDataset needs a map-style dataset (__getitem__ and __len__); got {type(dataset).__name__}"
            )
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        if isinstance(item, Mapping):
            return {**item, INDEX_KEY: index}
        if isinstance(item, (tuple, list)):
            return (*item, index)
        return (item, index)


def unwrap_dataset(dataset: Any) -> Any:
    """The dataset inside an :class:`IndexedDataset` (the dataset itself otherwise)."""
    return dataset.dataset if isinstance(dataset, IndexedDataset) else dataset


def take_sample_ids(batch: Any, *, strip: bool) -> Tensor | None:
    """``(B,)`` dataset indices of a collated batch, or ``None`` if it carries none.

    Args:
        batch: a collated batch.
        strip: the batch comes from an :class:`IndexedDataset`: remove what it added
            (the ``"sample_id"`` entry of a dict, the last element of a list) in place.

    Raises:
        SampleIdError: ``strip`` is set but the batch cannot be modified in place.
    """
    if strip:
        if isinstance(batch, dict) and INDEX_KEY in batch:
            return torch.as_tensor(batch.pop(INDEX_KEY)).reshape(-1)
        if isinstance(batch, list) and batch:
            return torch.as_tensor(batch.pop()).reshape(-1)
        raise SampleIdError(
            f"the dataset is an IndexedDataset but its collated batch is a {type(batch).__name__}, which cannot carry "
            "the index out of your step: use the default collate_fn (lists and dicts), or put the index in a "
            f"dict batch under one of {SAMPLE_ID_KEYS} yourself"
        )
    if isinstance(batch, Mapping):
        for key in SAMPLE_ID_KEYS:
            if key in batch:
                return torch.as_tensor(batch[key]).reshape(-1)
    return None


class RecordingBatchSampler:
    """Wraps a loader's batch sampler and remembers the index lists it yields, oldest first.

    A ``DataLoader`` draws index lists in its own process and, with ``in_order=True`` (the
    default), delivers batches in the same order, however many workers and prefetched
    batches: so the ``k``-th batch consumed holds the ``k``-th list drawn. Each new pass
    over the loader starts a fresh list.

    The wrapper draws nothing itself: the wrapped sampler's ``iter()`` runs when the loader's
    iterator calls ``iter()`` and its lists are drawn when the loader draws them, so a loader
    shuffles exactly as it would unwrapped and leaves every random number generator the same.
    It must be installed before the loader's iterator is made (an iterator made earlier holds
    the unwrapped sampler, and one made again would draw a new shuffle).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pending: deque[list[int]] = deque()

    def __iter__(self) -> Iterator[Any]:
        return self._record(iter(self.inner))  # now, as unwrapped: a sampler may draw its order in iter()

    def _record(self, lists: Iterator[Any]) -> Iterator[Any]:
        self.pending.clear()  # runs at the first draw of a new pass
        for indices in lists:
            self.pending.append([int(i) for i in indices])
            yield indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, drop_last, ... of the wrapped sampler
        if name == "inner":
            raise UnknownNameError(name)
        return getattr(self.inner, name)

    def next_ids(self, batch_size: int | None) -> Tensor:
        """The ids of the next batch consumed."""
        if not self.pending:
            raise SampleIdError("a batch arrived that the sampler did not draw (was the loader iterated elsewhere?)")
        ids = self.pending.popleft()
        if batch_size is not None and batch_size != len(ids):
            raise SampleIdError(f"the sampler drew {len(ids)} indices but the batch holds {batch_size} samples")
        return torch.tensor(ids)


def record_sampler_ids(loader: Any) -> RecordingBatchSampler | None:
    """Install a :class:`RecordingBatchSampler` on a ``DataLoader`` where ids can be derived that way."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    if loader.batch_sampler is None or getattr(loader, "in_order", True) is False:
        return None
    if isinstance(loader.batch_sampler, RecordingBatchSampler):
        return loader.batch_sampler
    recorder = RecordingBatchSampler(loader.batch_sampler)
    object.__setattr__(loader, "batch_sampler", recorder)  # DataLoader forbids setting it after construction
    return recorder


def batch_size_of(batch: Any) -> int | None:
    """The length of the first tensor found in a batch (``None`` if it holds none)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        size = batch_size_of(value)
        if size is not None:
            return size
    return None


def loader_batch_size(loader: Any) -> int | None:
    """The samples per batch a loader yields: its ``batch_size``, else its batch sampler's (``DataLoader(
    batch_sampler=...)`` leaves ``loader.batch_size`` None), else the mean of a sized batch sampler over a sized
    dataset (rounded up); ``None`` when none of them tells."""
    size = getattr(loader, "batch_size", None)
    sampler = getattr(loader, "batch_sampler", None)
    size = size or getattr(sampler, "batch_size", None)
    if isinstance(size, int) and size > 0:
        return size
    try:
        batches, samples = len(sampler), len(loader.dataset)  # type: ignore[arg-type]
    except (TypeError, AttributeError):
        return None
    return -(-samples // batches) if batches > 0 and samples > 0 else None


def missing_ids_error(where: str) -> SampleIdError:
    return SampleIdError(
        f"the {where} batches carry no sample ids and the loader's sampler cannot tell them (an IterableDataset, "
        "in_order=False, or no batch sampler); guessing them could silently mislabel every stored "
        "gradient. Wrap the dataset: `from metastore_plugins import IndexedDataset; "
        f"DataLoader(IndexedDataset(dataset), ...)`, or return dict items with a {SAMPLE_ID_KEYS[0]!r} entry."
    )
