"""The training process and its operating system: stop signals (the main process and its data-loader workers)
and the CPU memory allocator.

The rest of the engine's helpers: distributed.py (process group, collectives), metrics.py (progress lines,
log.txt), errors.py (one-line errors), checkpoint.py (checkpoint format, RNG state).
"""
import signal


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


def worker_init_fn(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: workers leave SIGINT/SIGTERM to the main process, which stops them cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


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
