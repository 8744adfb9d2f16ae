"""The output directory of a run (--output_dir), shared by every task: which checkpoint a run resumes from, one run per
directory (an exclusive lock the OS releases however the holder ends, and a refusal to start over another run's
files without --overwrite), write access, the run's arguments (args.json), removing a directory a run created but
wrote nothing into, and its repair after a resume (names a crash between two writes left behind, log.txt lines of
later epochs or iterations, a log line the crash kept out).
"""
import errno
import fcntl
import json
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from run import distributed
from run.checkpoint import (
    LAST,
    TMP_PREFIX,
    copy_atomic,
    in_directory,
    json_safe,
    load_checkpoint_file,
    remove_stale_tmp,
    run_checkpoints,
    write_atomic,
    write_log_line,
)
from run.errors import CheckpointError, CheckpointWriteError, UserError, write_failure_reason


# --------------------------------------------------------------------------------------------------
# Which checkpoint a run resumes from
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputDirSettings:
    """The flags of the output directory, each named as its argparse destination."""
    output_dir: str
    resume: str                   # --resume: this checkpoint (default: output_dir/checkpoint.pth, when it exists)
    auto_resume: bool
    overwrite: bool               # a new run where another one's files are: delete them
    lock: bool                    # one run per directory (--no-lock: none)
    eval: bool                    # evaluation only: nothing is written, nothing locked or cleaned


def find_resume_path(settings: OutputDirSettings) -> str:
    """--resume, else (auto-resume, no --overwrite) output_dir/checkpoint.pth when it exists, else '' (this
    process's view of the filesystem: in a process group, `agree_on_resume_path` decides)."""
    if settings.resume:
        return settings.resume
    auto = os.path.join(settings.output_dir, LAST) if settings.output_dir else ''
    if auto and settings.auto_resume and not settings.overwrite and os.path.isfile(auto):
        return auto
    return ''


def agree_on_resume_path(settings: OutputDirSettings, device: Any) -> str:
    """The checkpoint the run resumes from, decided by rank 0 (`find_resume_path` on its filesystem) for every
    rank. A rank whose own view differs (a node-local --output_dir, a file not yet visible over NFS after a quick
    restart) stops every rank with one line: ranks that resumed from different states would train on together
    with different weights, epochs and learning rates. That every rank reads the same file is checked when they
    load it (resume.load_agreed)."""
    mine = find_resume_path(settings)
    decided = distributed.broadcast_object(mine)
    err = None
    fix = ('every node must see the same --output_dir (a shared filesystem), or pass --resume with a path every '
           'node sees')
    if mine != decided:
        err = (f'{distributed.where()} does not see {decided}, which rank 0 resumes from: {fix}' if decided else
               f'{distributed.where()} sees {mine}, but rank 0 does not and would start afresh: {fix}')
    distributed.agree_on_errors(err, device)
    return decided


def resume_elsewhere_note(settings: OutputDirSettings, path: str) -> str:
    """A note when a training run resumes checkpoint `path` of another directory into --output_dir (both
    named): the checkpoints and log.txt go to --output_dir from here on. '' otherwise."""
    out = settings.output_dir
    if settings.eval or not path or not out or in_directory(path, out):
        return ''
    return (f'Note: resuming {path} into another --output_dir: {out} gets the checkpoints and log.txt '
            f'from here on; {os.path.dirname(path) or "."} keeps those so far')


ARGS_NAME = 'args.json'  # in --output_dir: the arguments of the latest start of the run


def save_args(output_dir: str, arguments: dict[str, Any], device: Any) -> None:
    """Write `arguments` (the run's whole command line, checkpoint.args_to_dict) to --output_dir/args.json as
    one indented JSON object (rank 0; a failure stops every rank with one line). Each start replaces it."""
    if not output_dir:
        return
    path = os.path.join(output_dir, ARGS_NAME)

    def write() -> None:
        try:
            with open(path, 'w') as f:
                json.dump(json_safe(arguments), f, indent=1, default=str)
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


def _check_previous_run(settings: OutputDirSettings) -> str | None:
    out = settings.output_dir
    resume = find_resume_path(settings)
    old = previous_run_files(out)
    if not old or (resume and in_directory(resume, out)):
        return None  # an empty directory, or continuing the run it holds
    if settings.overwrite:
        for name in old:
            os.remove(os.path.join(out, name))
        print(f'--overwrite: removed the previous run from {out} ({", ".join(old)}); starting a new run')
        return None
    listed = ', '.join(old[:5]) + (', ...' if len(old) > 5 else '')
    if resume:
        return (f'--output_dir {out} already holds another run ({listed}); resuming {resume} there would mix the two '
                f'runs: choose another --output_dir, or pass --overwrite to delete those files first')
    first = next((n for n in old if n.endswith('.pth')), None)
    cont = (' relaunch without --no-auto-resume to continue it,' if first == LAST else
            f' pass --resume {os.path.join(out, first)} to continue it,' if first else '')
    return (f'--output_dir {out} already holds a run ({listed}):{cont} choose another --output_dir, '
            f'or pass --overwrite to delete those files and start a new run there')


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


def prepare_output_dir(settings: OutputDirSettings, device: Any) -> None:
    """Create --output_dir, check that files can be written there, lock it (training: one run per directory;
    --no-lock takes no lock but still stops beside a live holder) and remove temporaries of killed writes. A
    training run that would start over in a directory holding another run stops with one line, unless
    --overwrite (which deletes that run's checkpoints and log.txt, nothing is moved).
    Evaluation only neither locks nor cleans: it writes nothing there and may read a running job's files."""
    out = settings.output_dir
    if not out:
        return

    def prepare() -> None:  # rank 0; anything it raises stops every rank (distributed.on_rank0)
        err = None
        try:
            make_output_dir(out)
        except OSError as e:
            err = f'cannot create --output_dir {out}: {e.strerror}'
        else:
            if not settings.eval:
                err = check_writable(out)
            if err is None and not settings.eval:
                if settings.lock:
                    err = lock_run_dir(out)
                else:  # no lock of our own, but never beside a run that holds one
                    holder = live_holder(out)
                    err = in_use(out, holder) if holder else None
            if err is None and not settings.eval:
                remove_stale_tmp(out)
                try:
                    err = _check_previous_run(settings)
                except OSError as e:
                    err = f'cannot clear --output_dir {out}: {e.strerror} ({e.filename})'
        if err:
            raise UserError(err)

    distributed.on_rank0(prepare, device, f'cannot prepare --output_dir {out}')


# --------------------------------------------------------------------------------------------------
# One run per directory: its lock
# --------------------------------------------------------------------------------------------------
LOCK_NAME = '.run.lock'  # in --output_dir: held by the run writing there


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
        return in_use(directory, holder)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f'PID {os.getpid()} on host {socket.gethostname()}\n'.encode(), 0)
    except OSError as e:
        os.close(fd)
        return (f'cannot write the lock file {path}: {write_failure_reason(e)}; make --output_dir writable or '
                f'choose another')
    _held_locks[key] = fd
    return None


def in_use(directory: str, holder: str) -> str:
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


def remove_lone_lock(directory: str) -> None:
    """Give up this process's lock on `directory` and remove the lock file when it is all the directory holds
    (a run that failed before writing anything leaves nothing behind); else change nothing."""
    folder = os.path.abspath(directory)
    fd = _held_locks.get(folder)
    if fd is not None and os.listdir(folder) == [LOCK_NAME]:
        os.remove(os.path.join(folder, LOCK_NAME))
        del _held_locks[folder]
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# Leaving nothing behind
# --------------------------------------------------------------------------------------------------
# per --output_dir made by make_output_dir in this process, the folders on its path it created, deepest first:
# a run that wrote nothing into them removes them again when it ends (remove_unused_output_dir)
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


def prepare_show_dir(directory: str) -> None:
    """Create an evaluation's --show-dir (on every process: each writes the pictures of the images it scores; a
    folder created here and left empty is removed at the end, as --output_dir) and check that files can be written
    there; either failing is one line (UserError), before the evaluation starts."""
    try:
        make_output_dir(directory)
        fd, probe = tempfile.mkstemp(prefix='.probe.', dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UserError(f'--show-dir {directory}: cannot write there ({e.strerror or e}); choose a writable '
                        f'folder') from e


def leave_nothing_unused(body: Callable[[], int], directory: str) -> int:
    """`body()` (a run's main); however it ends (an error, a non-zero exit status, or a success that wrote nothing
    there: a resume with nothing left to train, an evaluation), an output `directory` it created and wrote nothing
    into is removed again: a run leaves behind only what it wrote."""
    try:
        code = body()
    finally:
        remove_unused_output_dir(directory)
    return code


def remove_unused_output_dir(directory: str) -> None:
    """At the end of a run, leave nothing it did not write: remove the folders make_output_dir created for
    `directory` that hold nothing but this process's lock file (given up first), deepest first. A folder that
    existed before, or that holds anything else, is left as it is (os.rmdir removes only empty folders)."""
    for folder in _created_dirs.pop(os.path.abspath(directory), []) if directory else []:
        try:
            remove_lone_lock(folder)
            os.rmdir(folder)
        except OSError:  # not empty, or gone: keep it and the folders above it
            return


# --------------------------------------------------------------------------------------------------
# Repairs after a resume
# --------------------------------------------------------------------------------------------------
#: the words of a checkpoint's position key in the lines below
_WORDS = {'epoch': ('epoch', 'epochs'), 'iter': ('iteration', 'iterations')}


def repair(directory: str, path: str, ckpt: dict[str, Any], key: str = 'epoch') -> None:
    """After a resume from `path` (rank 0): when it is in the run directory `directory`, bring the directory in
    line with the resumed state (_repair_files) and add its log line when log.txt lacks it (add_missing_log_line).
    `key` is the checkpoint's position and log.txt's key: 'epoch' for classification, 'iter' for segmentation."""
    if in_directory(path, directory):
        _repair_files(directory, path, ckpt, key)
        add_missing_log_line(directory, ckpt.get('log'), key)


def repair_after_resume(directory: str, path: str, ckpt: dict[str, Any], device: Any, key: str = 'epoch') -> None:
    """After a training resume from `path` (its loaded checkpoint `ckpt`), on every rank: bring --output_dir
    `directory` in line with the resumed state when `path` is one of its files (`repair`; rank 0, a failure stops
    every rank with one line). Nothing without an --output_dir."""
    if directory:
        distributed.on_rank0(lambda: repair(directory, path, ckpt, key), device,
                             f'could not repair the files of {directory} from {path}')


def _repair_files(directory: str, path: str, ckpt: dict[str, Any], key: str = 'epoch') -> None:
    """Bring the run directory in line with the resumed state: names that are hard links of one file become
    independent files, log.txt's lines of later epochs (iterations) are moved aside (a resume from an
    older checkpoint), and the other names this state was saved under (best.pth, checkpoint_NNNN.pth) get a
    copy of it when they are missing, unreadable, or hold an older state that a stop between the writes
    left there. An older file written after the resumed one was put there by hand: it is left alone."""
    separate_hard_links(directory)
    _trim_log(directory, path, ckpt, key)
    epoch, word = ckpt.get(key), _WORDS[key][0]
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
                was = other.get(key, '?') if isinstance(other, dict) else '?'
                if not isinstance(other, dict) or (other.get('checksum') != ckpt.get('checksum')
                                                   and _order(other, key) < _order(ckpt, key)):
                    if os.path.getmtime(target) <= os.path.getmtime(path):
                        reason = f'older ({word} {was}: the run stopped between writing {path} and it)'
                    else:
                        print(f'Note: {target} holds an older state ({word} {was}) than {path} ({word} {epoch}), '
                              f'which was also saved under that name, but was written after it (put there by '
                              f'hand?): left as it is')
        if reason:
            copy_atomic(path, target)
            print(f'Repaired {target}: it was {reason}; copied the state of {word} {epoch} there from {path}, '
                  f'which was saved under both names')


def _trim_log(directory: str, path: str, ckpt: dict[str, Any], key: str = 'epoch') -> None:
    """Move log.txt's lines of the epochs (iterations) after the resumed state (a resume from an older
    checkpoint, e.g. --resume best.pth) to a side file next to it, so that log.txt ends where the run continues
    and the rerun epochs are not listed twice. Nothing is deleted."""
    log = os.path.join(directory, 'log.txt')
    if not isinstance(ckpt.get(key), int) or not os.path.isfile(log):
        return
    inside = key == 'epoch' and ckpt.get('step')  # stopped inside an epoch
    done = ckpt[key] - (1 if inside else 0)  # the last finished epoch (iteration)
    with open(log) as f:
        lines = f.readlines()
    keep: list[str] = []
    later: list[str] = []
    epochs = []
    for line in lines:
        try:
            e = json.loads(line).get(key)
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
    word, words = _WORDS[key]
    what = f'{path} stopped inside epoch {ckpt["epoch"]}' if inside else f'resumed from {word} {done} ({path})'
    span = f'{word} {done + 1}' if max(epochs) == done + 1 else f'{words} {done + 1}..{max(epochs)}'
    print(f"Note: {what}, older than log.txt's last {word} {max(epochs)}: moved the lines of {span} to "
          f'{side}, so that log.txt ends where the run continues')


def add_missing_log_line(directory: str, record: Any, key: str = 'epoch') -> None:
    """Add the checkpoint's log.txt `record` when log.txt has no line with its `key` (a crash or a full disk kept
    it out): the epoch for classification, the iteration for segmentation. A half-written last line is dropped
    first."""
    if not isinstance(record, dict) or key not in record:
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
    seen = set()
    for line in text.splitlines():
        try:
            seen.add(json.loads(line).get(key))
        except (ValueError, AttributeError):
            continue
    if record[key] not in seen:
        write_log_line(directory, record)
        print(f'Repaired {path}: added the line of {_WORDS[key][0]} {record[key]} from the '
              f'checkpoint, which log.txt lacked (the run stopped, or could not write, before logging it)')




def separate_hard_links(directory: str) -> None:
    """Give every checkpoint name of a run directory that is a hard link of another one
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


def _order(ckpt: dict[str, Any], key: str = 'epoch') -> tuple[int, float]:
    """(epoch, step) of a checkpoint, a finished epoch after every step inside it; (iteration, inf) with `key`
    'iter'."""
    step = ckpt.get('step') if key == 'epoch' else None
    return int(ckpt.get(key, -1)), float(step) if step else float('inf')
