"""The output directory of a training run (--output_dir): which checkpoint a run resumes from, one run per
directory (a lock, and a refusal to start over another run's files without --overwrite), and room for the
checkpoints before training starts. main.py calls these once, before and after building the model."""
import argparse
import errno
import fcntl
import os
import shutil
import socket
import tempfile
from typing import Any, Dict, List, Optional

import distributed
from checkpoint import TMP_PREFIX, in_directory, remove_stale_tmp, run_checkpoints, write_failure_reason
from errors import UserError

LOCK_NAME = '.run.lock'  # in --output_dir: held by the run writing there


def raise_on_any_rank(err: Optional[str], device: Any) -> None:
    """Raise a UserError on every rank when any rank (in practice rank 0) found a problem (`err`)."""
    distributed.agree_on_errors(err or None, device)


def find_resume_path(args: argparse.Namespace) -> str:
    """--resume, else (auto-resume, no --overwrite) output_dir/checkpoint.pth when it exists, else '' (this
    process's view of the filesystem: in a process group, `agree_on_resume_path` decides)."""
    if args.resume:
        return args.resume
    auto = os.path.join(args.output_dir, 'checkpoint.pth') if args.output_dir else ''
    if auto and args.auto_resume and not args.overwrite and os.path.isfile(auto):
        return auto
    return ''


def agree_on_resume_path(args: argparse.Namespace, device: Any) -> str:
    """The checkpoint the run resumes from, decided by rank 0 (`find_resume_path` on its filesystem) for every
    rank. A rank whose own view differs (a node-local --output_dir, a file not yet visible over NFS after a quick
    restart) stops every rank with one line: ranks that resumed from different states would train on together
    with different weights, epochs and learning rates. That every rank reads the same file is checked when they
    load it (TrainingCheckpoints.resume)."""
    mine = find_resume_path(args)
    decided = distributed.broadcast_object(mine)
    err = None
    fix = ('every node must see the same --output_dir (a shared filesystem), or pass --resume with a path every '
           'node sees')
    if mine != decided:
        err = (f'{distributed.where()} does not see {decided}, which rank 0 resumes from: {fix}' if decided else
               f'{distributed.where()} sees {mine}, but rank 0 does not and would start afresh: {fix}')
    distributed.agree_on_errors(err, device)
    return decided


def previous_run_files(directory: str) -> List[str]:
    """Names of the files of an earlier run in `directory` (checkpoints, a non-empty log.txt)."""
    names = [os.path.basename(p) for p in run_checkpoints(directory)]
    log = os.path.join(directory, 'log.txt')
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        names.append('log.txt')
    return names


def _check_previous_run(args: argparse.Namespace) -> Optional[str]:
    out = args.output_dir
    resume = find_resume_path(args)
    old = previous_run_files(out)
    if not old or (resume and in_directory(resume, out)):
        return None  # an empty directory, or continuing the run it holds
    if args.overwrite:
        for name in old:
            os.remove(os.path.join(out, name))
        print(f'--overwrite: removed the previous run from {out} ({", ".join(old)}); starting a new run')
        return None
    listed = ', '.join(old[:5]) + (', ...' if len(old) > 5 else '')
    if resume:
        return (f'--output_dir {out} already holds another run ({listed}); resuming {resume} there would mix the two '
                f'runs: choose another --output_dir, or pass --overwrite to delete those files first')
    first = next((n for n in old if n.endswith('.pth')), None)
    cont = (' relaunch without --no-auto-resume to continue it,' if first == 'checkpoint.pth' else
            f' pass --resume {os.path.join(out, first)} to continue it,' if first else '')
    return (f'--output_dir {out} already holds a run ({listed}):{cont} choose another --output_dir, '
            f'or pass --overwrite to delete those files and start a new run there')


# open lock files of the run directories this process holds (kept open: closing one releases its lock)
_held_locks: Dict[str, int] = {}


def lock_run_dir(directory: str) -> Optional[str]:
    """Hold an exclusive lock on `directory` for the rest of this process; returns an error line when another
    process holds it. The lock is a POSIX record lock (fcntl) on ``directory/.run.lock``: the OS releases it when
    the process ends, however it ends, so a killed run never leaves a stale lock; unlike flock() it is not
    inherited by forked data-loader workers, which may outlive a killed process by a few seconds. Where the
    filesystem has no locks, says so and goes on without one."""
    key = os.path.abspath(directory)
    if key in _held_locks:
        return None
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        print(f'Note: cannot create the lock file {path} ({e.strerror}); running without a lock, so a second job '
              f'in this --output_dir would not be noticed')
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # ENOLCK, EOPNOTSUPP...: a filesystem without locks
            os.close(fd)
            print(f'Note: the filesystem of --output_dir {directory} does not support file locks '
                  f'({os.strerror(e.errno)}); running without a lock, so a second job in this directory would '
                  f'not be noticed (--no-lock silences this)')
            return None
        try:
            holder = os.read(fd, 256).decode(errors='replace').strip()
        except OSError:
            holder = ''
        os.close(fd)
        return (f'--output_dir {directory} is in use by another run ({holder or "a process that holds its lock"}); '
                f'wait for that run to end or stop it, or choose another --output_dir')
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f'PID {os.getpid()} on host {socket.gethostname()}\n'.encode(), 0)
    except OSError as e:
        os.close(fd)
        return (f'cannot write the lock file {path}: {write_failure_reason(e)}; make --output_dir writable or '
                f'choose another')
    _held_locks[key] = fd
    return None


def prepare_output_dir(args: argparse.Namespace, device: Any) -> None:
    """Create --output_dir, lock it (training, unless --no-lock: one run per directory) and remove temporaries
    of killed writes. A training run that would start over in a directory holding another run stops with one
    line, unless --overwrite (which deletes that run's checkpoints and log.txt, nothing is moved).
    Evaluation only neither locks nor cleans: it writes nothing there and may read a running job's files."""
    if not args.output_dir:
        return

    def prepare() -> None:  # rank 0; anything it raises stops every rank (distributed.on_rank0)
        err = None
        try:
            os.makedirs(args.output_dir, exist_ok=True)
        except OSError as e:
            err = f'cannot create --output_dir {args.output_dir}: {e.strerror}'
        else:
            if not args.eval and args.lock:
                err = lock_run_dir(args.output_dir)
            if err is None and not args.eval:
                remove_stale_tmp(args.output_dir)
                try:
                    err = _check_previous_run(args)
                except OSError as e:
                    err = f'cannot clear --output_dir {args.output_dir}: {e.strerror} ({e.filename})'
        if err:
            raise UserError(err)

    distributed.on_rank0(prepare, device, f'cannot prepare --output_dir {args.output_dir}')


def check_room(directory: str, nbytes: int, device: Any) -> None:
    """Before training: `directory` is writable and has room for two checkpoints of about `nbytes`
    (the new one is written next to the previous one, then renamed)."""
    if not directory:
        return

    def check() -> None:
        try:
            fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + 'probe.', dir=directory)
            os.close(fd)
            os.remove(tmp)
        except OSError as e:
            raise UserError(f'cannot write to --output_dir {directory}: {write_failure_reason(e)}; '
                            f'make it writable or choose another --output_dir') from e
        free = shutil.disk_usage(directory).free
        if free < 2 * nbytes:
            raise UserError(f'--output_dir {directory} has {free / 2**20:.0f} MiB free, but a checkpoint takes about '
                            f'{nbytes / 2**20:.0f} MiB and two must fit while one replaces the other; free some '
                            f'space or choose another --output_dir')

    distributed.on_rank0(check, device, f'cannot check the room in --output_dir {directory}')
