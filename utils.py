"""The training process and its operating system: stop signals (the main process and its data-loader workers),
data-loader workers that stay from one epoch to the next, and the CPU memory allocator.

The rest of the engine's helpers: distributed.py (process group, collectives), metrics.py (progress lines,
log.txt), errors.py (one-line errors), checkpoint.py (checkpoint format, RNG state).
"""
import atexit
import contextlib
import random
import signal
import weakref
from typing import Any, Iterator, Optional, Tuple

import numpy as np
import torch.utils.data


# --------------------------------------------------------------------------------------------------
# Graceful stop on SIGTERM / SIGINT
# --------------------------------------------------------------------------------------------------
class StopFlag:
    """Set by SIGTERM/SIGINT; the training loop checks it (agreed over all ranks) at each step boundary.
    A second SIGINT aborts at once."""

    def __init__(self):
        self.signum = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)
        if hasattr(signal, 'SIGUSR1'):  # some schedulers warn with SIGUSR1 before SIGTERM
            signal.signal(signal.SIGUSR1, self._handler)

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ''


# the signals that ask a run to stop; SLURM (scancel --signal) and torchrun send them to every process of
# the job, data-loader workers included
STOP_SIGNALS = tuple(getattr(signal, name) for name in ('SIGTERM', 'SIGINT', 'SIGUSR1') if hasattr(signal, name))


def worker_init_fn(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: workers leave the stop signals to the main process, which stops them
    cleanly. Workers started by spawn or forkserver (Python 3.14's default) inherit no handler, and a stop
    signal's default action would kill them and with them the run."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold the stop signals back from this thread for the block; one that arrives meanwhile is delivered
    when it ends, nothing is lost. Processes started inside the block inherit the blocked mask (through
    fork and exec), so they ignore the stop signals from their first instruction on."""
    if not hasattr(signal, 'pthread_sigmask'):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader whose worker processes ignore the stop signals from birth, whatever the start
    method: they are started with the signals blocked (a spawned worker takes seconds to import torch
    before `worker_init_fn` runs), and `worker_init_fn` ignores them."""

    def __iter__(self):
        with stop_signals_blocked():
            return super().__iter__()


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
        self._seed: Optional[int] = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Tuple[int, int]) -> Any:
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

    def __iter__(self) -> Iterator[Tuple[int, int]]:
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
# CPU memory allocator
# --------------------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)


def retain_freed_cpu_memory() -> bool:
    """Keep freed CPU memory in the process for reuse instead of handing it back to the OS.

    glibc serves blocks above its mmap threshold (adaptive, at most 32 MiB) with a fresh ``mmap`` and
    unmaps them on free, so every large activation of every step page-faults and is zeroed again by
    the kernel. With mmap and heap trimming off, freed blocks are reused as they are. The cost: the
    process keeps its peak heap, and glibc's aligned allocations leave gaps that grow it for the first
    steps (figures in docs/performance.md). Returns False, changing nothing, where glibc's ``mallopt``
    is not available.
    """
    import ctypes
    import ctypes.util
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))
