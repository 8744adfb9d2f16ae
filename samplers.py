"""Samplers: repeated augmentation (DeiT ``RASampler``), an exact distributed eval sampler, and the endless
sampler of a run counted in iterations (segmentation's ``IterationSampler``).

``RASampler(dataset, num_replicas=None, rank=None, shuffle=True, num_repeats=3, seed=0)``
    DeiT semantics (timm's ``RepeatAugSampler`` is the same algorithm but has no seed, hence this
    class): each epoch the indices are permuted with a generator seeded by ``seed + epoch`` (the
    same order on every rank), every index is repeated ``num_repeats`` times consecutively, the
    list is padded by wrapping to a multiple of ``num_replicas``, rank ``r`` takes every
    ``num_replicas``-th element from ``r`` and keeps the first ``num_selected_samples``:
    ``floor(len(dataset) // 256 * 256 / num_replicas)``. With seed 0 this is exactly DeiT's order.
    Tiny data sets (< 256 images), where DeiT's rule gives an empty epoch, use
    ``ceil(len(dataset) / num_replicas)`` instead (as timm does). Call ``set_epoch(epoch)`` every
    epoch, also in single-process runs (num_replicas=1, rank=0): that is what reshuffles.
``DistributedEvalSampler(dataset, num_replicas=None, rank=None)``
    Rank ``r`` gets indices ``r, r + R, r + 2R, ...`` in increasing order: no padding, every index
    exactly once over all ranks (ranks beyond ``len(dataset)`` get none). ``set_epoch`` is a no-op.
``IterationSampler(n, world, rank, batch_size, seed, start=0)``
    This rank's (epoch, index) keys from iteration ``start`` on, without end; see the class.
"""
import math
from typing import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ['RASampler', 'DistributedEvalSampler', 'IterationSampler']


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f'invalid rank {rank} for num_replicas {num_replicas}')
    return num_replicas, rank


class RASampler(Sampler[int]):
    """Repeated-augmentation sampler with DeiT semantics (see the module docstring)."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, num_repeats: int = 3, seed: int = 0) -> None:
        self.num_replicas, self.rank = _world(num_replicas, rank)
        if int(num_repeats) != num_repeats or num_repeats < 1:
            raise ValueError(f'num_repeats must be a positive integer, got {num_repeats}')
        self.dataset, self.shuffle, self.num_repeats, self.seed = dataset, shuffle, int(num_repeats), seed
        self.epoch = 0
        n = len(dataset)
        self.num_samples = int(math.ceil(n * self.num_repeats / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        if n >= 256:
            self.num_selected_samples = int(math.floor(n // 256 * 256 / self.num_replicas))
        else:  # DeiT's rule would give 0 samples: an empty epoch
            self.num_selected_samples = int(math.ceil(n / self.num_replicas))
        self.num_selected_samples = min(self.num_selected_samples, self.num_samples)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if n == 0:
            return iter([])
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g)
        else:
            indices = torch.arange(n)
        indices = torch.repeat_interleave(indices, self.num_repeats).tolist()
        m = len(indices)
        picked = range(self.rank, self.total_size, self.num_replicas)[: self.num_selected_samples]
        return iter([indices[i % m] for i in picked])

    def __len__(self) -> int:
        return self.num_selected_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (call before every epoch)."""
        self.epoch = epoch


class DistributedEvalSampler(Sampler[int]):
    """Exact evaluation split: every index on exactly one rank, no padding, fixed order."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.dataset = dataset
        self.indices = list(range(self.rank, len(dataset), self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        """No-op (the evaluation order does not depend on the epoch)."""


class IterationSampler(torch.utils.data.Sampler):
    """This rank's (epoch, index) keys from iteration `start` on, without end. Epoch e is torch's
    DistributedSampler order of epoch e (shuffled with seed + e, padded to a multiple of the processes) cut to
    whole batches, so iteration `it` is step it % steps of epoch it // steps, whatever was run before."""

    def __init__(self, n: int, world: int, rank: int, batch_size: int, seed: int, start: int = 0):
        self.n, self.world, self.rank, self.batch_size, self.seed, self.start = n, world, rank, batch_size, seed, start
        self.steps = -(-n // world) // batch_size  # whole batches per epoch

    def __iter__(self):
        epoch, skip = divmod(self.start, self.steps)
        while True:
            order = torch.utils.data.DistributedSampler(range(self.n), self.world, self.rank, shuffle=True,
                                                        seed=self.seed)
            order.set_epoch(epoch)
            for index in list(order)[skip * self.batch_size:self.steps * self.batch_size]:
                yield epoch, index
            epoch, skip = epoch + 1, 0
