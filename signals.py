"""Stop signals: the flag SIGTERM, SIGINT and SLURM's SIGUSR1 set in the training process (checked at step
boundaries), and how processes it starts (data-loader workers) leave those signals to it."""
import contextlib
import signal
from typing import Iterator


class StopFlag:
    """Set by SIGTERM/SIGINT; the training loop checks it (agreed over all ranks) at each step boundary.
    A second SIGINT aborts at once."""

    def __init__(self):
        self.signum = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:  # SIGUSR1: some schedulers warn with it before SIGTERM
            signal.signal(sig, self._handler)

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
