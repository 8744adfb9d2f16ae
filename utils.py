"""The training process and its operating system: stop signals (the main process and its data-loader workers)
and the CPU memory allocator.

The rest of the engine's helpers: distributed.py (process group, collectives), metrics.py (progress lines,
log.txt), errors.py (one-line errors), checkpoint.py (checkpoint format, RNG state).
"""
import contextlib
import signal
from typing import Iterator

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
