"""One run per output directory: an exclusive lock that the OS releases however the holding process ends, and who
holds it, seen without taking it (--no-lock)."""
import errno
import fcntl
import os
import re
import socket

from checkpoint_io import write_failure_reason

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
