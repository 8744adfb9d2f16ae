"""The output directory of a training run (--output_dir): which checkpoint a run resumes from, one run per
directory (a lock, and a refusal to start over another run's files without --overwrite), write access, room
for the checkpoints before training starts, log.txt's lines, and the repairs after a resume (what a crash
between two writes, an older version's hard links or a resume from an older state left behind)."""
import argparse
import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any

import distributed
import metrics
from checkpoint_io import (
    TMP_PREFIX,
    copy_atomic,
    in_directory,
    load_checkpoint_file,
    remove_stale_tmp,
    run_checkpoints,
    write_atomic,
    write_failure_reason,
)
from errors import CheckpointError, CheckpointWriteError, UserError

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


def resume_elsewhere_note(args: argparse.Namespace, path: str) -> str:
    """A note when a training run resumes checkpoint `path` of another directory into --output_dir (both
    named): the checkpoints and log.txt go to --output_dir from here on. '' otherwise."""
    if args.eval or not path or not args.output_dir or in_directory(path, args.output_dir):
        return ''
    return (f'Note: resuming {path} into another --output_dir: {args.output_dir} gets the checkpoints and log.txt '
            f'from here on; {os.path.dirname(path) or "."} keeps those so far')


ARGS_NAME = 'args.json'  # in --output_dir: the arguments of the latest start of the run


def save_args(args: argparse.Namespace, arguments: dict[str, Any], device: Any) -> None:
    """Write `arguments` (the run's whole command line, checkpoint.args_to_dict) to --output_dir/args.json as
    one indented JSON object (rank 0; a failure stops every rank with one line). Each start replaces it."""
    if not args.output_dir:
        return
    path = os.path.join(args.output_dir, ARGS_NAME)

    def write() -> None:
        try:
            with open(path, 'w') as f:
                json.dump(metrics.json_safe(arguments), f, indent=1, default=str)
                f.write('\n')
        except OSError as e:
            raise UserError(f'could not write {path}: {write_failure_reason(e)}') from e

    distributed.on_rank0(write, device, f'could not write {path}')


def previous_run_files(directory: str) -> list[str]:
    """Names of the files of an earlier run in `directory` (checkpoints, a non-empty log.txt)."""
    names = [os.path.basename(p) for p in run_checkpoints(directory)]
    log = os.path.join(directory, 'log.txt')
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        names.append('log.txt')
    return names


def _check_previous_run(args: argparse.Namespace) -> str | None:
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
_held_locks: dict[str, int] = {}


def lock_run_dir(directory: str) -> str | None:
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


def _process_start_time(pid: int) -> float | None:
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


def live_holder(directory: str) -> str | None:
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


def check_writable(directory: str) -> str | None:
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
_created_dirs: dict[str, list[str]] = {}


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


def write_log_line(directory: str, record: dict[str, Any]) -> None:
    """Append an epoch's record to `directory`/log.txt as one JSON line; a failure is one line that says the
    checkpoint of that epoch holds the record (it is added when the run resumes)."""
    path = os.path.join(directory, 'log.txt')
    try:
        metrics.write_json_line(path, record)
    except OSError as e:
        raise UserError(f'could not append to {path}: {write_failure_reason(e)}; the checkpoint of epoch '
                        f'{record.get("epoch")} holds the line, it is added when the run resumes') from e


def repair(directory: str, path: str, ckpt: dict[str, Any]) -> None:
    """After a resume from `path` (rank 0): when it is in the run directory `directory`, bring the directory in
    line with the resumed state (_repair_files) and add its log line when log.txt lacks it (_repair_log)."""
    if in_directory(path, directory):
        _repair_files(directory, path, ckpt)
        _repair_log(directory, ckpt.get('log'))

def _repair_files(directory: str, path: str, ckpt: dict[str, Any]) -> None:
    """Bring the run directory in line with the resumed state: names that an older version hard-linked to
    one file become independent files, log.txt's lines of later epochs are moved aside (a resume from an
    older checkpoint), and the other names this state was saved under (best.pth, checkpoint_NNNN.pth) get a
    copy of it when they are missing, unreadable, or hold an older state that a stop between the writes
    left there. An older file written after the resumed one was put there by hand: it is left alone."""
    separate_hard_links(directory)
    _trim_log(directory, path, ckpt)
    epoch = ckpt.get('epoch')
    for name in ckpt.get('files') or []:
        target = os.path.join(directory, name)
        if os.path.exists(target) and os.path.samefile(target, path):
            continue
        reason = None
        if not os.path.exists(target):
            reason = 'missing (deleted, or the run stopped before writing it)'
        else:
            try:
                other = load_checkpoint_file(target, verify=False, mmap=True)
            except CheckpointError:
                reason = 'unreadable (truncated or damaged after it was written)'
            else:
                was = other.get('epoch', '?') if isinstance(other, dict) else '?'
                if not isinstance(other, dict) or (other.get('checksum') != ckpt.get('checksum')
                                                   and _order(other) < _order(ckpt)):
                    if os.path.getmtime(target) <= os.path.getmtime(path):
                        reason = f'older (epoch {was}: the run stopped between writing {path} and it)'
                    else:
                        print(f'Note: {target} holds an older state (epoch {was}) than {path} (epoch {epoch}), '
                              f'which was also saved under that name, but was written after it (put there by '
                              f'hand?): left as it is')
        if reason:
            copy_atomic(path, target)
            print(f'Repaired {target}: it was {reason}; copied the state of epoch {epoch} there from {path}, '
                  f'which was saved under both names')

def _trim_log(directory: str, path: str, ckpt: dict[str, Any]) -> None:
    """Move log.txt's lines of the epochs after the resumed state (a resume from an older checkpoint, e.g.
    --resume best.pth) to a side file next to it, so that log.txt ends where the run continues and the
    rerun epochs are not listed twice. Nothing is deleted."""
    log = os.path.join(directory, 'log.txt')
    if not isinstance(ckpt.get('epoch'), int) or not os.path.isfile(log):
        return
    done = ckpt['epoch'] - (1 if ckpt.get('step') else 0)  # the last finished epoch
    with open(log) as f:
        lines = f.readlines()
    keep: list[str] = []
    later: list[str] = []
    epochs = []
    for line in lines:
        try:
            e = json.loads(line).get('epoch')
        except (ValueError, AttributeError):
            e = None
        if isinstance(e, int) and e > done:
            epochs.append(e)
            later.append(line)
        else:  # an unreadable line after a later epoch's belongs to it
            (later if e is None and later else keep).append(line)
    if not epochs:
        return
    side = f'{log}.{time.strftime("%Y%m%d-%H%M%S")}.bak'
    n = 1
    while os.path.exists(side):
        side, n = f'{log}.{time.strftime("%Y%m%d-%H%M%S")}-{n}.bak', n + 1
    with open(side, 'w') as f:
        f.writelines(later)
    write_atomic(log, lambda f: f.write(''.join(keep).encode()))
    what = (f'{path} stopped inside epoch {ckpt["epoch"]}' if ckpt.get('step')
            else f'resumed from epoch {done} ({path})')
    span = f'epoch {done + 1}' if max(epochs) == done + 1 else f'epochs {done + 1}..{max(epochs)}'
    print(f"Note: {what}, older than log.txt's last epoch {max(epochs)}: moved the lines of {span} to "
          f'{side}, so that log.txt ends where the run continues')

def _repair_log(directory: str, record: Any) -> None:
    """Add the resumed epoch's log line when log.txt lacks it (a crash or a full disk kept it out); a
    half-written last line is dropped first."""
    if not isinstance(record, dict) or 'epoch' not in record:
        return
    path = os.path.join(directory, 'log.txt')
    text = ''
    if os.path.isfile(path):
        with open(path) as f:
            text = f.read()
    if text and not text.endswith('\n'):
        keep = text[:text.rfind('\n') + 1]
        with open(path, 'r+') as f:
            f.truncate(len(keep.encode()))
        print(f'Repaired {path}: dropped a half-written last line')
        text = keep
    epochs = set()
    for line in text.splitlines():
        try:
            epochs.add(json.loads(line).get('epoch'))
        except (ValueError, AttributeError):
            continue
    if record['epoch'] not in epochs:
        write_log_line(directory, record)
        print(f'Repaired {path}: added the line of epoch {record["epoch"]} from the checkpoint, which '
              f'log.txt lacked (the run stopped, or could not write, before logging it)')


def separate_hard_links(directory: str) -> None:
    """Give every checkpoint name of a run directory that an older version hard-linked to another one
    (checkpoint.pth, best.pth, checkpoint_NNNN.pth sharing one file) a file of its own, so that a write to one
    name (``cp x best.pth`` writes in place) leaves the others as they were. Where that fails (a full disk)
    the names stay linked, with a note: the run's own saves replace names, they never write through them."""
    first: dict[tuple[int, int], str] = {}
    for p in run_checkpoints(directory):
        try:
            st = os.stat(p)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if st.st_nlink < 2 or key not in first:
            first.setdefault(key, p)
            continue
        try:
            copy_atomic(first[key], p)
        except CheckpointWriteError as e:
            print(f'Note: {p} and {first[key]} are one file (hard links of an older version); {e}: left linked, '
                  f'so a write into one of them changes both')
        else:
            print(f'Note: {p} and {first[key]} were one file (hard links of an older version); {p} is now a '
                  f'file of its own, so that writing to one name leaves the other as it was')


def _order(ckpt: dict[str, Any]) -> tuple[int, float]:
    """(epoch, step) of a checkpoint, a finished epoch after every step inside it."""
    return int(ckpt.get('epoch', -1)), float(ckpt['step']) if ckpt.get('step') else float('inf')

