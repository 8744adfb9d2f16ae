"""How batches reach the model: the samplers and loaders of the flags (build_loaders), loader workers that
ignore the stop signals, stay from one epoch to the next and are still seeded per epoch as new workers would be
(PersistentDataLoader: a resumed epoch replays its augmentations), and uint8 batches normalised, and randomly
erased, on the device (DeviceLoader, batch_random_erasing), as the CPU transform would.
"""
import atexit
import random
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from timm.data.random_erasing import RandomErasing

import samplers
from cli import val_batch_size
from run import distributed
from run.process import stop_signals_blocked, worker_init_fn


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader whose worker processes ignore the stop signals from birth, whatever the start
    method: they are started with the signals blocked (a spawned worker takes seconds to import torch
    before `worker_init_fn` runs), and `worker_init_fn` ignores them."""

    def __iter__(self):
        with stop_signals_blocked():
            return super().__iter__()


@dataclass(frozen=True)
class LoaderSettings:
    """The loader flags, each named as its argparse destination."""
    batch_size: int               # per process; validation batches are 1.5 times as large
    num_workers: int
    pin_mem: bool                 # pinned memory, on GPUs
    repeated_aug: bool            # RASampler's repeated augmentation x3
    dist_eval: bool               # split the validation set over the processes, exactly
    seed: int
    device: str




def build_loaders(dataset_train: Any, dataset_val: Any, settings: LoaderSettings) -> tuple[Any, Any, Any]:
    """(train sampler, train loader, validation loader) of `settings`: repeated augmentation (RASampler) or a
    seeded DistributedSampler for training (also for one process: reshuffled per epoch, resumable), exact
    dist-eval or the whole set for validation. No training set (evaluation only): None, None, loader."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    sampler_train = loader_train = None  # evaluation only: no training set
    if dataset_train is None:
        pass
    elif settings.repeated_aug:
        sampler_train = samplers.RASampler(dataset_train, num_replicas=world, rank=rank, shuffle=True,
                                           seed=settings.seed)
    else:
        # DistributedSampler also for one process: reshuffled (set_epoch) and seeded, so resumable
        sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=world, rank=rank,
                                                            shuffle=True, seed=settings.seed)
    if settings.dist_eval and world > 1:
        sampler_val = samplers.DistributedEvalSampler(dataset_val, num_replicas=world, rank=rank)
    else:
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    pin = settings.pin_mem and str(settings.device).startswith('cuda')
    # Workers stay from one epoch to the next, and each epoch's workers are seeded from the RNG state at the
    # start of the epoch, which the checkpoint holds, so a resumed epoch replays the same augmentations
    # (PersistentDataLoader)
    common = dict(num_workers=settings.num_workers, pin_memory=pin, worker_init_fn=worker_init_fn)
    if dataset_train is not None:
        loader_train = PersistentDataLoader(dataset_train, sampler_train, batch_size=settings.batch_size,
                                                  drop_last=True, **common)
    loader_val = PersistentDataLoader(dataset_val, sampler_val, batch_size=val_batch_size(settings.batch_size),
                                            drop_last=False, **common)
    return sampler_train, loader_train, loader_val


def data_facts(dataset_train: Any, dataset_val: Any, loader_train: Any) -> dict:
    """What every rank must see alike of the data (distributed.check_same_everywhere): the classes, the number of
    training and validation images and of training batches per epoch."""
    import hashlib
    classes = getattr(dataset_train if dataset_train is not None else dataset_val, 'classes', None) or []
    digest = hashlib.sha256('\n'.join(map(str, classes)).encode()).hexdigest()[:8]
    facts = {'classes': f'{len(classes)} (sha256 {digest})', 'validation images': len(dataset_val)}
    if dataset_train is not None:
        facts.update({'training images': len(dataset_train), 'training batches per epoch': len(loader_train)})
    return facts


# --------------------------------------------------------------------------------------------------
# Workers that stay from one epoch to the next, seeded per epoch
# --------------------------------------------------------------------------------------------------
def seed_worker(base_seed: int, worker_id: int) -> None:
    """Seed this process's python, torch and numpy generators as torch seeds a worker it starts: python and
    torch with base_seed + worker_id, numpy with the SeedSequence of (worker_id, base_seed) torch uses."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed & 0xFFFFFFFF, base_seed >> 32, 0]).generate_state(4))


class _EpochSeeded(torch.utils.data.Dataset):
    """`dataset` indexed by (epoch seed, index): a loader worker reseeds itself (`seed_worker`) at its first
    item of each epoch, then returns dataset[index]. In the main process (no workers) nothing is reseeded."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset
        self._seed: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        seed, index = key
        worker = torch.utils.data.get_worker_info()
        if worker is not None and seed != self._seed:
            seed_worker(seed, worker.id)
            self._seed = seed
        return self.dataset[index]


class _WithEpochSeed(torch.utils.data.Sampler):
    """`sampler`'s indices, each paired with the seed of the epoch being iterated: (seed, index)."""

    def __init__(self, sampler: torch.utils.data.Sampler) -> None:
        self.sampler, self.seed = sampler, 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        seed = self.seed
        return ((seed, index) for index in self.sampler)


class PersistentDataLoader(DataLoader):
    """DataLoader (workers ignore the stop signals) over `sampler`'s indices whose worker processes stay from
    one epoch to the next (persistent workers, when there are workers) and are still seeded per epoch as
    torch seeds the workers it starts for an epoch: from a seed drawn from the main process's torch
    generator when the epoch's iterator is made. So each epoch's random augmentations follow from the
    random state at its start, which a checkpoint holds (a resumed epoch replays them), and equal those of
    workers started anew every epoch, without starting processes every epoch. The draw is the one torch
    makes for every new iterator, so the main process's random stream advances as with a plain DataLoader.
    `dataset` is the wrapped data set (len() as the original; `.dataset` is the original)."""

    def __init__(self, dataset: torch.utils.data.Dataset, sampler: torch.utils.data.Sampler, num_workers: int = 0,
                 **kwargs: Any) -> None:
        self.epoch_sampler = _WithEpochSeed(sampler)
        # torch draws a new iterator's worker seed from this generator (unused here), not from the main stream
        super().__init__(_EpochSeeded(dataset), sampler=self.epoch_sampler, num_workers=num_workers,
                         persistent_workers=num_workers > 0, generator=torch.Generator(), **kwargs)
        if num_workers > 0:
            if not _LIVE_LOADERS:
                atexit.register(_close_live_loaders)
            _LIVE_LOADERS.add(self)

    def __iter__(self):
        # the draw torch makes for a new iterator's worker seed, from the same (main) generator
        self.epoch_sampler.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return super().__iter__()

    def close(self) -> None:
        """Stop the worker processes now. They ignore SIGTERM, which is how the interpreter's exit stops the
        child processes it finds still running: a loader left alive to the end (say, by an exception's
        traceback) would make the exit wait for them forever, so every loader still alive is closed first."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator._shutdown_workers()


_LIVE_LOADERS: 'weakref.WeakSet[PersistentDataLoader]' = weakref.WeakSet()


def _close_live_loaders() -> None:
    for loader in list(_LIVE_LOADERS):
        loader.close()


# --------------------------------------------------------------------------------------------------
# Batches on the device: normalisation and random erasing of uint8 batches
# --------------------------------------------------------------------------------------------------
def batch_random_erasing(augment: Any, device: Any) -> Callable | None:
    """The train transform's random erasing (``augment``, a datasets.Augmentation: --reprob, --remode,
    --recount) for a normalised batch on ``device``: timm's RandomErasing, each image erased or not on its own,
    as in the CPU transform; None when --reprob is 0."""
    if not augment.reprob:
        return None
    return RandomErasing(augment.reprob, mode=augment.remode, max_count=augment.recount, device=device)


class DeviceLoader:
    """The batches of ``loader`` (uint8 images first, then targets and anything else, such as datasets.WithIndex's
    indices) on ``device``, the images as float32 normalised with ``mean``/``std`` (of the 0..1 scale, as
    a data config gives them): the same operations, in the same order, as ToTensor and Normalize in a CPU
    transform, so the values are those of the CPU transform bit for bit.

    On a GPU with loader workers, each batch is copied (from pinned memory: ``pin_memory=True``) and
    normalised on a side stream while the previous batch is in use. Elsewhere each batch is prepared when
    it is asked for: with no workers the main process loads the images, and loading ahead would draw its
    random augmentations out of turn (a resumed epoch replays them from the random state of the stop).
    ``len``, ``batch_size``, ``dataset`` and ``sampler`` are the loader's."""

    def __init__(self, loader: Any, device: Any, mean: Sequence[float], std: Sequence[float]) -> None:
        self.loader, self.device = loader, torch.device(device)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1).to(self.device)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1).to(self.device)
        self._stream = None

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def _prepare(self, batch: Sequence[Any]) -> tuple:
        images, *rest = batch
        if images.dtype != torch.uint8:
            raise TypeError(f'DeviceLoader takes batches of uint8 images, got {images.dtype} (build the data '
                            f'set with uint8=True)')
        images = images.to(self.device, non_blocking=True).float().div_(255).sub_(self.mean).div_(self.std)
        return (images, *(t.to(self.device, non_blocking=True) if torch.is_tensor(t) else t for t in rest))

    def __iter__(self) -> Iterator[tuple]:
        if self.device.type != 'cuda' or not getattr(self.loader, 'num_workers', 0):
            for batch in self.loader:
                yield self._prepare(batch)
            return
        # timm's PrefetchLoader scheme: the side stream waits for the work queued so far before it writes
        # (blocks freed by that work may be handed to its allocations), the consumer for the side stream
        # before it uses a batch
        if self._stream is None:  # one stream for good: the allocator pools blocks per stream
            self._stream = torch.cuda.Stream(device=self.device)
        ready = None
        for batch in self.loader:
            consumer = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(consumer)
            with torch.cuda.stream(self._stream):
                upcoming = self._prepare(batch)
            if ready is not None:
                yield ready
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            ready = upcoming
        if ready is not None:
            yield ready


def device_loader(loader: Any, cfg: dict[str, Any], device: Any) -> DeviceLoader:
    """``loader`` (of a data set built with ``uint8=True``) as a ``DeviceLoader`` normalising with the mean and
    std of the data config ``cfg``, those the CPU transform would use."""
    return DeviceLoader(loader, device, cfg['mean'], cfg['std'])
