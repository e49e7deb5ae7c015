"""Deterministic, resumable data-parallel sampling and loading.

Lightning calls ``state_dict()`` on every stateful train dataloader when it saves a checkpoint
(``FitLoop.on_save_checkpoint`` -> ``CombinedLoader._state_dicts``) and, on resume, calls
``load_state_dict()`` in ``FitLoop.setup_data`` *before* it creates the iterator and before it
calls ``sampler.set_epoch(epoch)`` in ``FitLoop.on_advance_start``. Because our loader has a
length, Lightning does not prefetch ahead (``_PrefetchDataFetcher`` skips prefetching for sized
loaders), so at a checkpoint the number of batches the loader has yielded equals the number of
batches Lightning has consumed. Lightning keeps ``len(loader)`` as the full-epoch length and only
expects the resumed iterator to yield the remaining batches.

Positions are recorded in *global* samples (positions in the epoch's permutation), so the
record does not depend on which replica wrote it.

Why not torchdata's ``StatefulDataLoader`` (torchdata 0.11 installs from pip beside torch 2.13, and Lightning
treats it, like this loader, as any loader with ``state_dict``/``load_state_dict``): its state is per rank, the
batches this rank's loader yielded plus its sampler iterator's own state, which ``DistributedSampler`` does not
have, so on restore it fast-forwards by re-drawing that many batches from the *new* run's split. A checkpoint
resumed with another number of data-parallel replicas (a resharding resume, ``tests/scenarios/reshard.py``: saved
at dp = 2, resumed at dp = 1) would then start at the wrong sample, and with another batch size per replica
at the wrong step. Our record is the global position in the epoch's permutation, identical on every rank, so
any layout continues with exactly the next samples. Its other features (worker state snapshots, stateful
datasets) we do not need: the datasets are map-style and the position is all the state there is.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose position in the epoch can be saved and restored.

    Subclassing ``DistributedSampler`` matters: Lightning's ``_requires_distributed_sampler``
    leaves a loader alone when its sampler already is one, so our data-parallel split (which may
    differ from Lightning's world size in 3D parallelism) is never replaced.

    The epoch order is ``randperm(len(dataset))`` seeded with ``seed + epoch`` (or the identity when
    ``shuffle=False``); replica ``rank`` takes positions ``rank, rank + R, ...`` of it. With
    ``drop_last=True`` the tail that does not divide evenly is dropped; otherwise the order is padded
    by repeating its head, as ``torch``'s sampler does.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        n = len(dataset)  # type: ignore[arg-type]
        self.total_size = (n // num_replicas) * num_replicas if drop_last else -(-n // num_replicas) * num_replicas
        self.num_samples = self.total_size // num_replicas
        self._pending_offset = 0  # global positions to skip in `self.epoch`, set by load_state_dict
        self._iter_offset = 0  # offset the current iterator started from
        self._iter_yielded = 0  # local indices yielded by the current iterator

    @property
    def pending_offset(self) -> int:
        """Global positions the next iterator will skip (non-zero only right after a restore)."""
        return self._pending_offset

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a restored offset only applies to the epoch it was recorded in."""
        if epoch != self.epoch:
            self._pending_offset = 0
        super().set_epoch(epoch)

    def _epoch_order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        if self.total_size <= n:
            return order[: self.total_size]
        repeats = -(-self.total_size // max(n, 1))
        return (order * repeats)[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        offset, self._pending_offset = self._pending_offset, 0
        remaining = self._epoch_order()[offset:]
        remaining = remaining[: (len(remaining) // self.num_replicas) * self.num_replicas]
        self._iter_offset, self._iter_yielded = offset, 0
        return self._generate(remaining[self.rank :: self.num_replicas])

    def _generate(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._iter_yielded += 1
            yield index

    def __len__(self) -> int:
        """Full-epoch length, also right after a restore (Lightning counts the restored part)."""
        return self.num_samples

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Epoch and global samples consumed; ``consumed`` overrides the sampler's own count
        (the loader passes what it really yielded, since workers draw indices ahead)."""
        if consumed is None:
            consumed = self._iter_offset + self._iter_yielded * self.num_replicas
        return {
            "epoch": self.epoch,
            "consumed": min(consumed, self.total_size),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iterator continue right after the recorded position."""
        n = len(self.dataset)  # type: ignore[arg-type]
        for key, mine in (("dataset_len", n), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(
                    f"Cannot resume the sampler exactly: checkpoint has {key}={state[key]!r} but this run has "
                    f"{key}={mine!r}. Use the same data, seed and shuffle setting as the run that saved it."
                )
        self.epoch = int(state["epoch"])
        self._pending_offset = int(state["consumed"])
        self._iter_offset, self._iter_yielded = self._pending_offset, 0


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that Lightning treats as stateful, so mid-epoch resume is exact.

    It counts batches as they are handed to the training loop in the main process (worker
    processes draw indices ahead of that), and records ``offset + batches * batch_size * R``.
    """

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableDistributedSampler, **kwargs: Any) -> None:
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableDistributedSampler, got {type(sampler).__name__}")
        kwargs.setdefault("drop_last", True)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._epoch = sampler.epoch
        self._start = 0
        self._yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self._note_start()
        return self._generate()

    def _note_start(self) -> None:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        self._epoch, self._start, self._yielded = sampler.epoch, sampler.pending_offset, 0

    def _generate(self) -> Iterator[Any]:
        # Lightning calls `set_epoch` after `iter()`: re-read the sampler once iteration really starts.
        self._note_start()
        for batch in self._batches():
            self._yielded += 1
            yield batch

    def _batches(self) -> Iterator[Any]:
        """The DataLoader's batches; a subclass may fetch them ahead in the background (the count above stays the
        training loop's)."""
        return super().__iter__()

    def _consumed(self) -> int:
        return self._start + self._yielded * self.batch_size * self.sampler.num_replicas  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """Position of the training loop in the data, in global samples of the current epoch."""
        state = self.sampler.state_dict(consumed=self._consumed())  # type: ignore[attr-defined]
        state["epoch"] = self._epoch
        state["batch_size"] = self.batch_size
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; the next ``iter()`` yields exactly the batch after it."""
        self.sampler.load_state_dict(state)  # type: ignore[attr-defined]
        self._epoch, self._start, self._yielded = int(state["epoch"]), int(state["consumed"]), 0


def data_parallel_rank(trainer: Any) -> tuple[int, int]:
    """``(num_replicas, rank)`` of the data-parallel split from ``trainer.strategy``.

    In the 3D strategy all pipeline/tensor ranks of one replica report the same ``rank``, so they
    get identical batches. Without a trainer or a parallel strategy there is one replica.
    """
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
    if not kwargs:
        return 1, 0
    num_replicas, rank = int(kwargs.get("num_replicas") or 1), int(kwargs.get("rank") or 0)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"distributed_sampler_kwargs has rank={rank} outside 0..{num_replicas - 1}")
    return num_replicas, rank


def worker_options(num_workers: int) -> dict[str, Any]:
    """``DataLoader`` keyword arguments for ``num_workers`` worker processes.

    Workers start from a fork server, not by forking the training process. A training process has other threads
    (process groups, loader feeder threads of the previous epoch or run, loggers), and a fork copies the process at an
    instant when one of them may hold an interpreter lock: the child then waits on it forever, and the rank waits for
    its first batch with it (seen as a rare hang at the start of a fit; CPython 3.12 warns about forking a threaded
    process, and 3.14 makes the fork server the default). Our data sets pickle without their data, which each worker
    opens lazily, so starting workers this way costs an import, not a copy of the data.
    """
    if num_workers == 0 or "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    return {"multiprocessing_context": "forkserver"}


def build_train_loader(
    dataset: Dataset, batch_size: int, *, trainer: Any, seed: int, shuffle: bool, num_workers: int
) -> ResumableDataLoader:
    """The training loader shared by all our data modules."""
    num_replicas, rank = data_parallel_rank(trainer)
    sampler = ResumableDistributedSampler(dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=True)
    loader = ResumableDataLoader(dataset, batch_size, sampler, num_workers=num_workers, **worker_options(num_workers))
    if len(loader) == 0:
        size = len(dataset) if isinstance(dataset, Sized) else "?"
        raise ValueError(
            f"The training set has {size} samples, fewer than batch_size={batch_size} x {num_replicas} data-parallel "
            "replicas, so no full batch can be formed. Add data, or lower batch_size or seq_length."
        )
    return loader


def train_loader_of(module: Any, dataset: Dataset) -> ResumableDataLoader:
    """``build_train_loader`` with a data module's own ``batch_size``, ``seed``, ``shuffle`` and ``num_workers``
    hyper-parameters (every data module of ours has them)."""
    hp = module.hparams
    return build_train_loader(dataset, hp.batch_size, trainer=module.trainer, seed=hp.seed, shuffle=hp.shuffle,
                              num_workers=hp.num_workers)


def build_eval_loader(dataset: Dataset, batch_size: int, *, trainer: Any, num_workers: int) -> DataLoader:
    """An in-order validation loader split over data-parallel replicas (padded, nothing dropped)."""
    num_replicas, rank = data_parallel_rank(trainer)
    sampler = ResumableDistributedSampler(dataset, num_replicas, rank, shuffle=False, drop_last=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      **worker_options(num_workers))
