"""How a training or evaluation process ends: every exception as an exit status and at most one line (no
traceback for what a user can act on), without waiting for data-loader workers that ignore the stop signals
or for a peer that died. main.run() runs main() through ``finish``.
"""
import os
import re
import signal
import sys
import time
import traceback
from typing import Any, Callable

import distributed
from errors import UserError, eprint, exception_chain, first_line
from image_folder import BadSampleError


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

