"""The output directory of a training run (--output_dir): which checkpoint a run resumes from, one run per
directory (a lock, and a refusal to start over another run's files without --overwrite), write access, and room
for the checkpoints before training starts. main.py calls these once, before and after building the model."""
import argparse
import errno
import fcntl
import math
import os
import re
import shutil
import socket
import tempfile
from typing import Any, Dict, List, Optional

import distributed
from checkpoint import TMP_PREFIX, in_directory, remove_stale_tmp, run_checkpoints, write_failure_reason
from errors import UserError

LOCK_NAME = '.run.lock'  # in --output_dir: held by the run writing there


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
        return _in_use(directory, holder)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f'PID {os.getpid()} on host {socket.gethostname()}\n'.encode(), 0)
    except OSError as e:
        os.close(fd)
        return (f'cannot write the lock file {path}: {write_failure_reason(e)}; make --output_dir writable or '
                f'choose another')
    _held_locks[key] = fd
    return None


def _in_use(directory: str, holder: str) -> str:
    return (f'--output_dir {directory} is in use by another run ({holder or "a process that holds its lock"}); '
            f'wait for that run to end or stop it, or choose another --output_dir')


def _process_start_time(pid: int) -> Optional[float]:
    """When process `pid` started (seconds since the epoch; Linux /proc), None where that cannot be read."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        with open('/proc/stat') as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith('btime '))
        return boot + ticks / os.sysconf('SC_CLK_TCK')
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _recorded_holder_alive(text: str, lock_path: str) -> bool:
    """Whether the lock file's line ('PID N on host H') names a live process on this host that is still the
    one that wrote it: a process that started after the line was written only reuses the number."""
    m = re.fullmatch(r'PID (\d+) on host (\S+)', text)
    if not m or m.group(2) != socket.gethostname() or int(m.group(1)) == os.getpid():
        return False
    pid = int(m.group(1))
    try:
        os.kill(pid, 0)
    except PermissionError:  # alive, another user's
        pass
    except OSError:
        return False
    started = _process_start_time(pid)
    try:
        return started is None or started <= os.path.getmtime(lock_path) + 1  # btime has whole seconds
    except OSError:
        return False


def live_holder(directory: str) -> Optional[str]:
    """Who holds the lock of `directory`, seen without taking it (--no-lock): the holder's line when another
    process holds the lock file's lock, or when the process that line names still runs on this host (for
    filesystems whose locks do not work); None when no live holder is visible."""
    if os.path.abspath(directory) in _held_locks:
        return None  # this process: closing a descriptor of the file below would drop its lock
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no run has locked this directory
    try:
        try:
            text = os.read(fd, 256).decode(errors='replace').strip()
        except OSError:
            text = ''
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released when fd is closed
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                return text or 'a process that holds its lock'
        return text if _recorded_holder_alive(text, path) else None
    finally:
        os.close(fd)


def check_writable(directory: str) -> Optional[str]:
    """An error line when no file can be created in `directory` (a read-only filesystem or directory)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + 'probe.', dir=directory)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return (f'cannot write to --output_dir {directory}: {write_failure_reason(e)}; '
                f'make it writable or choose another --output_dir')
    return None


def prepare_output_dir(args: argparse.Namespace, device: Any) -> None:
    """Create --output_dir, check that files can be written there, lock it (training: one run per directory;
    --no-lock takes no lock but still stops beside a live holder) and remove temporaries of killed writes. A
    training run that would start over in a directory holding another run stops with one line, unless
    --overwrite (which deletes that run's checkpoints and log.txt, nothing is moved).
    Evaluation only neither locks nor cleans: it writes nothing there and may read a running job's files."""
    if not args.output_dir:
        return

    def prepare() -> None:  # rank 0; anything it raises stops every rank (distributed.on_rank0)
        err = None
        try:
            make_output_dir(args.output_dir)
        except OSError as e:
            err = f'cannot create --output_dir {args.output_dir}: {e.strerror}'
        else:
            if not args.eval:
                err = check_writable(args.output_dir)
            if err is None and not args.eval:
                if args.lock:
                    err = lock_run_dir(args.output_dir)
                else:  # no lock of our own, but never beside a run that holds one
                    holder = live_holder(args.output_dir)
                    err = _in_use(args.output_dir, holder) if holder else None
            if err is None and not args.eval:
                remove_stale_tmp(args.output_dir)
                try:
                    err = _check_previous_run(args)
                except OSError as e:
                    err = f'cannot clear --output_dir {args.output_dir}: {e.strerror} ({e.filename})'
        if err:
            raise UserError(err)

    distributed.on_rank0(prepare, device, f'cannot prepare --output_dir {args.output_dir}')


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


def checkpoints_at_peak(args: argparse.Namespace, start_epoch: int) -> int:
    """How many checkpoints --output_dir holds at the peak of the saves from `start_epoch` on: checkpoint.pth
    and its replacement while that is written, best.pth holding an older state, and a numbered backup once a
    --save-freq epoch is behind and another save follows (each further backup adds one more, for good)."""
    freq = args.save_freq
    backup = bool(freq) and any((e + 1) % freq == 0 for e in range(start_epoch, args.epochs - 1))
    return 3 + int(backup)


def _held_bytes(directory: str) -> int:
    """Bytes of the checkpoints in `directory` that the saves to come replace (checkpoint.pth, best.pth),
    each file once (names an older version hard-linked are one file)."""
    seen = {}
    for name in ('checkpoint.pth', 'best.pth'):
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def check_room(directory: str, nbytes: int, device: Any, copies: int = 3) -> None:
    """Before training: room in `directory` for the peak of the saves to come, `copies` checkpoints of about
    `nbytes` (checkpoints_at_peak), less what checkpoint.pth and best.pth hold already. Copies are counted in
    full, also where the filesystem shares blocks between them (reflinks). Rank 0 checks, every rank stops."""
    if not directory:
        return

    def check() -> None:
        held = _held_bytes(directory)
        need = max(copies * nbytes - held, 0)
        free = shutil.disk_usage(directory).free
        if free < need:
            mib = 2 ** 20
            there = f', {held / mib:.0f} MiB of them are there already' if held else ''
            raise UserError(f'--output_dir {directory} has {free / mib:.0f} MiB free, but the saves to come need '
                            f'{need / mib:.0f} MiB more (at their peak the directory holds {copies} checkpoints of '
                            f'about {nbytes / mib:.0f} MiB: checkpoint.pth, its replacement while it is written, '
                            f'best.pth{", a numbered backup" if copies > 3 else ""}{there}): '
                            f'{math.ceil((need - free) / mib)} MiB are missing; free that much space or choose '
                            f'another --output_dir')

    distributed.on_rank0(check, device, f'cannot check the room in --output_dir {directory}')
