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
    """Raise UserError(err) on every rank when any rank (in practice rank 0) found a problem."""
    failed = bool(err)
    if distributed.is_dist_avail_and_initialized():
        failed = distributed.all_reduce_max([1.0 if err else 0.0], device)[0] > 0
    if failed:
        raise UserError(err or 'rank 0 could not prepare --output_dir (see its error); stopped')


def find_resume_path(args: argparse.Namespace) -> str:
    """--resume, else (auto-resume, no --overwrite) output_dir/checkpoint.pth when it exists, else ''."""
    if args.resume:
        return args.resume
    auto = os.path.join(args.output_dir, 'checkpoint.pth') if args.output_dir else ''
    if auto and args.auto_resume and not args.overwrite and os.path.isfile(auto):
        return auto
    return ''


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
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'PID {os.getpid()} on host {socket.gethostname()}\n'.encode(), 0)
    _held_locks[key] = fd
    return None


def prepare_output_dir(args: argparse.Namespace, device: Any) -> None:
    """Create --output_dir, lock it (training, unless --no-lock: one run per directory) and remove temporaries
    of killed writes. A training run that would start over in a directory holding another run stops with one
    line, unless --overwrite (which deletes that run's checkpoints and log.txt, nothing is moved).
    Evaluation only neither locks nor cleans: it writes nothing there and may read a running job's files."""
    if not args.output_dir:
        return
    err = None
    if distributed.is_main_process():
        try:
            make_output_dir(args.output_dir)
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
    raise_on_any_rank(err, device)


# per --output_dir made by make_output_dir in this process, the folders on its path it created, deepest first:
# a run that fails before writing anything into them removes them again (remove_unused_output_dir)
_created_dirs: Dict[str, List[str]] = {}


def make_output_dir(directory: str) -> None:
    """os.makedirs(directory, exist_ok=True), remembering which of the folders on its path it created."""
    missing, d = [], os.path.abspath(directory)
    while not os.path.lexists(d):
        missing.append(d)
        d = os.path.dirname(d)
    os.makedirs(directory, exist_ok=True)
    if missing:
        _created_dirs[os.path.abspath(directory)] = missing


def remove_unused_output_dir(directory: str) -> None:
    """After a failed start, leave nothing behind: remove the folders make_output_dir created for `directory` that
    hold nothing but this process's lock file (given up first), deepest first. A folder that existed before, or
    that holds anything else, is left as it is (os.rmdir removes only empty folders)."""
    for folder in _created_dirs.pop(os.path.abspath(directory), []) if directory else []:
        try:
            fd = _held_locks.get(folder)
            if fd is not None and os.listdir(folder) == [LOCK_NAME]:
                os.remove(os.path.join(folder, LOCK_NAME))
                del _held_locks[folder]
                os.close(fd)
            os.rmdir(folder)
        except OSError:  # not empty, or gone: keep it and the folders above it
            return


def check_room(directory: str, nbytes: int, device: Any) -> None:
    """Before training: `directory` is writable and has room for two checkpoints of about `nbytes`
    (the new one is written next to the previous one, then renamed)."""
    err = None
    if directory and distributed.is_main_process():
        try:
            fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + 'probe.', dir=directory)
            os.close(fd)
            os.remove(tmp)
        except OSError as e:
            err = (f'cannot write to --output_dir {directory}: {write_failure_reason(e)}; '
                   f'make it writable or choose another --output_dir')
        else:
            free = shutil.disk_usage(directory).free
            if free < 2 * nbytes:
                err = (f'--output_dir {directory} has {free / 2**20:.0f} MiB free, but a checkpoint takes about '
                       f'{nbytes / 2**20:.0f} MiB and two must fit while one replaces the other; free some space '
                       f'or choose another --output_dir')
    raise_on_any_rank(err, device)
