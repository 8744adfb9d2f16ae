"""One process's life: the stop signals (SIGTERM, SIGINT and SLURM's SIGUSR1 set a flag the training loop checks at
step boundaries; data-loader workers leave them to the main process), how the process ends (every exception as an
exit status and at most one line, without waiting for workers that ignore the stop signals or for a peer that
died), and the CPUs and memory it may count on (its default number of data-loader workers, its CPU allocator).
"""
import contextlib
import os
import re
import signal
import sys
import time
import traceback
from typing import Any, Callable, Iterator

from run import distributed
from run.errors import BadSampleError, UserError, eprint, exception_chain, first_line


# --------------------------------------------------------------------------------------------------
# Stop signals
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# How a run ends: exit status and one line
# --------------------------------------------------------------------------------------------------
def _is_peer_failure(e):
    import torch.distributed as dist
    if isinstance(e, (getattr(dist, 'DistBackendError', ()), getattr(dist, 'DistNetworkError', ()),
                      getattr(dist, 'DistStoreError', ()))):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and distributed.is_dist_avail_and_initialized() and any(
        s in msg for s in ('Connection closed by peer', 'Connection reset', 'Broken pipe', 'timed out',
                           'Timed out', 'ProcessGroupGloo', 'gloo', 'NCCL', 'Socket Timeout'))


def _dead_loader_worker(e: BaseException) -> str:
    """'a data-loader worker (pid N) was killed by signal Killed' (or '... exited unexpectedly') when a DataLoader
    worker died under `e` (torch reports it as a RuntimeError naming the pid), else ''."""
    for c in exception_chain(e):
        if not isinstance(c, RuntimeError):
            continue
        killed = re.search(r'DataLoader worker \(pid (\d+)\) is killed by signal: ([^.\n]+)', str(c))
        if killed:
            return f'a data-loader worker (pid {killed.group(1)}) was killed by signal {killed.group(2).strip()}'
        exited = re.search(r'DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly', str(c))
        if exited:
            return f'a data-loader worker (pid {exited.group(1).strip()}) exited unexpectedly'
    return ''


def _broken_connection(e: BaseException) -> bool:
    """Whether `e` is, or was raised from, a connection that broke (a reset, a broken pipe, an end of file) as
    one does when the process at its other end dies."""
    return any(isinstance(c, (ConnectionError, EOFError)) for c in exception_chain(e))


#: how long a report waits for the kernel to show a worker whose connection broke as dead
WORKER_DEATH_WAIT_S = 5.0


def _dead_loader_worker_after(e: BaseException) -> str:
    """_dead_loader_worker for the error `e` that ended a run, also when a worker's death showed first as
    another error (a connection reset while a batch was received from it). A DataLoader's SIGCHLD handler
    raises its RuntimeError at whatever line runs when a worker dies, even while this error is reported:
    it is switched off here, and torch's own check of the workers asked directly. A killed worker closes its
    connections before the kernel records its exit, so after a broken connection the check is repeated for
    up to WORKER_DEATH_WAIT_S seconds (on a loaded machine that gap is long enough to miss)."""
    try:
        if hasattr(signal, 'SIGCHLD'):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        found = _dead_loader_worker(e)
        if not found:
            from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails
            deadline = time.monotonic() + (WORKER_DEATH_WAIT_S if _broken_connection(e) else 0.0)
            while True:
                _error_if_any_worker_fails()
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
    except RuntimeError as late:  # the handler fired first, or the check found a dead worker
        return _dead_loader_worker(late)
    return found


def finish(body: Callable[[], int], loader_sizes: Callable[[], tuple[Any, Any]] = lambda: (None, None)) -> int:
    """Run `body` (a run of main.py) and turn every way it ends into an exit status with at most one line: a
    UserError is its line (exit 1, or 2 for flags); --strict-data's bad image, a killed data-loader worker and
    a lost peer are named; Ctrl-C is 130; anything else prints its traceback. Paths that must not wait for
    loader workers or a dead peer leave with os._exit. Under a process group, a clean end destroys the group and
    any other end leaves without waiting in its shutdown. `loader_sizes()` gives the run's --num_workers and
    --batch-size when it ends, for the advice after a killed loader worker."""
    code = 0
    try:
        code = body()
    except UserError as e:
        prefix = f'[rank {distributed.get_rank()}] ' if distributed.get_world_size() > 1 else ''
        eprint(f'{prefix}error: {e}')
        code = e.exit_code
    except BadSampleError as e:  # --strict-data: raised in a loader worker, re-raised here
        # from a worker, the message is the last line of the worker's traceback
        eprint(f"error: {str(e).strip().splitlines()[-1].split('BadSampleError: ', 1)[-1]}")
        # the failed epoch's loader workers ignore SIGTERM, so a normal exit would wait for them forever
        sys.stdout.flush()
        os._exit(1)
    except KeyboardInterrupt:
        eprint('interrupted')
        code = 130
    except Exception as e:
        worker = _dead_loader_worker_after(e)
        if worker:  # the out-of-memory killer's usual victim; its traceback says nothing useful
            num_workers, batch_size = loader_sizes()
            eprint(f'[rank {distributed.get_rank()}] error: {worker}, most likely for lack of memory (the '
                   f'out-of-memory killer): use fewer --num_workers (now {num_workers}) or a smaller '
                   f'--batch-size (now {batch_size}); the same command resumes from the last checkpoint')
            sys.stdout.flush()
            os._exit(1)  # the other workers of the loader ignore SIGTERM: do not wait for them
        if _is_peer_failure(e):
            eprint(f'[rank {distributed.get_rank()}] error: lost contact with the other processes '
                   f'({first_line(e)}); another rank probably died or stopped - see its log')
            sys.stdout.flush()
            os._exit(1)  # do not wait in process-group shutdown for a dead peer
        # An unexpected error: show it, then leave at once. Its traceback keeps the data loaders alive,
        # and their workers ignore SIGTERM (so a stop signal reaches only this process), so a normal
        # interpreter exit would wait for them forever. Checkpoints are written atomically: nothing is lost.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if distributed.is_dist_avail_and_initialized():
        if code == 0:
            distributed.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def stopped_status(launcher: str, stop_flag: Any, saved: bool = True) -> int:
    """Exit status of a training run that a stop signal ended after saving its checkpoint: 128 + the signal for
    a plain process (a scheduler sees it was stopped, not finished); 0 under a launcher (torchrun, srun), where
    every rank stopped together and saved: a non-zero status would make torchrun --max-restarts start the
    group again (inside an allocation that is ending, or against a user's SIGTERM) and srun
    --kill-on-bad-exit tear down the step. The `Stopped by ...` line says what happened. A stop that saved
    nothing (`saved` False: an evaluation cut short) is 128 + the signal everywhere."""
    if saved and launcher != 'none':
        return 0
    return 128 + int(stop_flag.signum or signal.SIGTERM)


# --------------------------------------------------------------------------------------------------
# CPUs and memory
# --------------------------------------------------------------------------------------------------
#: data-loader workers per process when --num_workers is not given: enough for a GPU's input pipeline
#: (docs/performance.md), capped by this process's share of the node's CPUs
DEFAULT_NUM_WORKERS = 10


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: what taskset, cgroups cpusets and SLURM allow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS (macOS)
        return os.cpu_count() or 1


def _leading_int(text: str) -> int:
    m = re.match(r'\d+', text or '')
    return int(m.group()) if m else 0


def cpus_per_process() -> tuple[int, str]:
    """(CPUs this process may count on, how that share was found). The training processes of a node share its
    CPUs: torchrun starts LOCAL_WORLD_SIZE processes that all inherit its CPU set; SLURM gives each srun task
    SLURM_CPUS_PER_TASK CPUs (binding them or not), else the tasks on the node share the step's CPUs."""
    cpus = available_cpus()
    _, _, _, launcher = distributed.launch_env()
    env = os.environ
    if launcher == 'torchrun':
        n = max(1, _leading_int(env.get('LOCAL_WORLD_SIZE', '')) or 1)
        if n > 1:
            return cpus // n, f'the {cpus} CPUs of this process shared by the {n} processes on this node'
    elif launcher == 'slurm':
        per_task = _leading_int(env.get('SLURM_CPUS_PER_TASK', ''))
        if per_task:
            return min(cpus, per_task), f'SLURM_CPUS_PER_TASK={per_task}, {cpus} CPUs available to this process'
        n = max(1, _leading_int(env.get('SLURM_NTASKS_PER_NODE') or env.get('SLURM_STEP_TASKS_PER_NODE')
                                or env.get('SLURM_TASKS_PER_NODE', '')))
        if n > 1:
            return cpus // n, f'the {cpus} CPUs of this process shared by the {n} SLURM tasks on this node'
    return cpus, f'the {cpus} CPUs available to this process'


def default_num_workers() -> tuple[int, str]:
    """(--num_workers when not given, why): this process's share of the node's CPUs less one for the training
    process itself, at most DEFAULT_NUM_WORKERS and at least 1 (loading then overlaps the step even with a
    single CPU per process; --num_workers 0 loads in the training process). More workers than CPUs only
    compete for them (and PyTorch warns about it)."""
    share, how = cpus_per_process()
    n = max(1, min(DEFAULT_NUM_WORKERS, share - 1))
    return n, (f'{share} CPU(s) per process ({how}), one of them left to the training process; at most '
               f'{DEFAULT_NUM_WORKERS}, at least 1')


def _meminfo_bytes(*fields: str) -> int | None:
    """The sum of /proc/meminfo's `fields` (kB) in bytes; None where the file or a field is missing (not Linux)."""
    try:
        with open('/proc/meminfo') as f:
            values = dict(line.split(':', 1) for line in f if ':' in line)
        return sum(_leading_int(values[k].strip()) for k in fields) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes (a container's, a SLURM job's), v2 or v1; None where none is
    set or none can be read."""
    paths = {}
    try:
        with open('/proc/self/cgroup') as f:
            for line in f:  # 'ID:CONTROLLERS:PATH'; v2 has the single line '0::PATH'
                _, controllers, path = line.rstrip('\n').split(':', 2)
                paths[controllers] = path.lstrip('/')
    except (OSError, ValueError):
        pass
    candidates = [os.path.join('/sys/fs/cgroup', paths.get('', ''), 'memory.max'), '/sys/fs/cgroup/memory.max']
    v1 = next((p for c, p in paths.items() if 'memory' in c.split(',')), '')
    candidates += [os.path.join('/sys/fs/cgroup/memory', v1, 'memory.limit_in_bytes'),
                   '/sys/fs/cgroup/memory/memory.limit_in_bytes']
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 2 ** 60 else None  # 'max' or v1's huge value: none
    return None


def available_memory() -> tuple[int | None, str]:
    """(bytes of memory a new allocation of this process may still get, what they are): the kernel's estimate of
    available RAM plus free swap, within the cgroup's memory limit when one is set; (None, '') where neither can
    be read. Generous on purpose: what a size check refuses against it cannot fit."""
    free = _meminfo_bytes('MemAvailable', 'SwapFree')
    if free is None:
        try:
            free = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
            what = 'physical memory'
        except (AttributeError, ValueError, OSError):
            return None, ''
    else:
        what = 'available RAM and free swap'
    limit = _cgroup_limit()
    if limit is not None and limit < free:
        return limit, "the cgroup's memory limit"
    return free, what


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
