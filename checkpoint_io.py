"""Checkpoint files: written atomically, copied, read back with their checksum.

The file layer under the run's checkpoints (checkpoint.py) and the run directory (run_dir.py): a write goes
to a temporary file beside its target, is flushed to disk and renamed into place, so a crash at any moment
leaves the previous file or the new one; copies (best.pth, checkpoint_NNNN.pth) are reflinks where the
filesystem has them, else byte copies, each its own file; a read refuses, in one line, what is missing,
truncated, corrupt (the sha256 every checkpoint carries), foreign or unsafe to unpickle.
"""
import argparse
import errno
import glob
import hashlib
import os
import re
import shutil
import stat
import tempfile
import zipfile
from typing import Any

import torch

from errors import CheckpointError, CheckpointWriteError, exception_chain, first_line
from models.compat import safe_globals

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

TMP_PREFIX = '.tmp-'


NUMBERED = re.compile(r'checkpoint_(\d+)\.pth$')


def write_failure_reason(e: BaseException) -> str:
    """The cause of a failed write: the OSError anywhere in the chain (torch.save reports a failed
    write as 'unexpected pos'), else the first line of the error."""
    for c in exception_chain(e):
        if isinstance(c, OSError) and c.errno:
            return 'no space left on device' if c.errno == errno.ENOSPC else os.strerror(c.errno)
    return first_line(e)


def _hash_into(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f'T{t.dtype}{tuple(t.shape)}'.encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(b'{')
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _hash_into(h, obj[k])
        h.update(b'}')
    elif isinstance(obj, (list, tuple)):
        h.update(b'[' if isinstance(obj, list) else b'(')
        for v in obj:
            _hash_into(h, v)
        h.update(b']')
    else:
        h.update(repr(obj).encode())


def checksums(state: dict[str, Any]) -> dict[str, str]:
    """sha256 of every top-level part of a checkpoint (tensor bytes, shapes, dtypes and plain values)."""
    out = {}
    for key in sorted(state):
        if key != 'checksum':
            h = hashlib.sha256()
            _hash_into(h, state[key])
            out[key] = h.hexdigest()
    return out


def verify_checksum(ckpt: Any, path: str) -> None:
    """Raise CheckpointError when a checkpoint that carries a checksum no longer matches it.
    Files without one (older or foreign checkpoints) pass."""
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get('checksum'), dict):
        return
    want = ckpt['checksum'].get('sha256') or {}
    got = checksums({k: v for k, v in ckpt.items() if k in want})
    bad = sorted(k for k in want if got.get(k) != want[k])
    if bad:
        raise CheckpointError(f'checkpoint {path} is corrupt: the checksum of {", ".join(bad)} does not match '
                              f'(the file changed after it was written); {other_checkpoints_hint(path)}')


def _new_file_mode(path: str) -> int:
    """The mode a plain open(path, 'wb') would give: the existing file's, else 0666 minus the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _fsync_dir(directory: str) -> None:
    """Make a rename in `directory` durable (where the filesystem allows)."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_atomic(path: str, write) -> None:
    """Call write(file) on a temporary file in path's directory, fsync, then rename it to path: a crash
    at any moment leaves either the previous file or the new one. A KeyboardInterrupt passes through
    (the previous file is kept); other failures become one-line CheckpointWriteErrors."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(path) + '.', dir=directory)
        os.fchmod(fd, _new_file_mode(path))  # mkstemp creates 0600
        with os.fdopen(fd, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(directory)
    except (OSError, RuntimeError) as e:  # torch.save wraps write failures and interrupts in RuntimeError
        if any(isinstance(c, KeyboardInterrupt) for c in exception_chain(e)):
            raise KeyboardInterrupt from e
        if not os.path.isdir(directory):
            raise CheckpointWriteError(f'could not write checkpoint {path}: the output directory {directory} is '
                                       f'gone (deleted or renamed while the run was going), so nothing could be '
                                       f'saved; if it was renamed, its checkpoints went with it and the same '
                                       f'command with --output_dir set to its new name resumes') from e
        raise CheckpointWriteError(f'could not write checkpoint {path}: {write_failure_reason(e)}; '
                                   f'the previous {os.path.basename(path)} (if any) is kept') from e
    finally:
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass


def save_atomic(obj: Any, path: str) -> None:
    """torch.save(obj) to path atomically (see write_atomic)."""
    write_atomic(path, lambda f: torch.save(obj, f))


#: ioctl FICLONE (linux/fs.h, _IOW(0x94, 9, int)): let a file share another's blocks copy-on-write (a reflink)
FICLONE = 0x40049409


def _copy_into(src: str, f) -> None:
    """Write the contents of the file `src` to the open, empty file `f`: a reflink where the filesystem has them
    (btrfs, XFS, bcachefs, ZFS 2.2: no data is written, and a later write to either file stays its own), else
    an in-kernel copy (copy_file_range: about 3x faster than a copy through Python, docs/performance.md; a
    server-side copy on NFS 4.2), else a copy through Python."""
    with open(src, 'rb') as s:
        if fcntl is not None:
            try:
                fcntl.ioctl(f.fileno(), FICLONE, s.fileno())
                return
            except OSError:  # EOPNOTSUPP (ext4, tmpfs), EXDEV, ENOTTY (not Linux), EINVAL: copy the bytes
                pass
        size, copied = os.fstat(s.fileno()).st_size, 0
        if hasattr(os, 'copy_file_range'):
            try:
                while copied < size:
                    n = os.copy_file_range(s.fileno(), f.fileno(), size - copied)
                    if not n:
                        break
                    copied += n
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                    raise  # a full disk, an I/O error
            if copied == size:
                return
            s.seek(0)  # not supported here, or a short copy: start again through Python
            f.seek(0)
            f.truncate()
        shutil.copyfileobj(s, f, 1 << 24)


def copy_atomic(src: str, dst: str) -> None:
    """Make `dst` an independent copy of the file `src` (a reflink where the filesystem has them), written
    atomically (see write_atomic): `dst` is at every moment the previous file or a complete copy."""
    write_atomic(dst, lambda f: _copy_into(src, f))


def remove_stale_tmp(directory: str) -> None:
    """Temporary files left by a process killed mid-write (kill -9)."""
    for p in glob.glob(os.path.join(glob.escape(directory), TMP_PREFIX + '*')):
        try:
            os.remove(p)
        except OSError:
            pass


def run_checkpoints(directory: str) -> list[str]:
    """The checkpoint files of a run directory: checkpoint.pth, best.pth, then numbered ones, newest first."""
    numbered = sorted((p for p in glob.glob(os.path.join(glob.escape(directory), 'checkpoint_*.pth'))
                       if NUMBERED.search(p)), key=lambda p: -int(NUMBERED.search(p).group(1)))
    return [p for p in (os.path.join(directory, n) for n in ('checkpoint.pth', 'best.pth')) if os.path.isfile(p)] \
        + numbered


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def other_checkpoints_hint(path: str) -> str:
    """What to do instead of loading a damaged `path`: the other checkpoints next to it (not names that are hard
    links of the same file, which share its damage)."""
    directory = os.path.dirname(os.path.abspath(path)) if path else '.'
    shown = os.path.dirname(path) or '.'
    others = [os.path.join(shown, os.path.basename(p)) for p in run_checkpoints(directory)
              if os.path.basename(p) != os.path.basename(path) and not _same_file(p, path)]
    alt = (f'resume from another checkpoint of the run ({", ".join("--resume " + p for p in others[:4])})'
           if others else f'there is no other checkpoint in {shown}')
    return f'{alt}, or start a new run with --no-auto-resume --overwrite'


def is_url(path: str) -> bool:
    """Whether a checkpoint flag names a URL (nothing is downloaded: checkpoints are local files)."""
    return path.startswith(('http://', 'https://'))


def load_checkpoint_file(path: str, verify: bool = True, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) with one-line errors for missing, truncated, corrupt, foreign and
    unsafe files. argparse.Namespace is accepted (reference checkpoints store their args as one).
    A checkpoint with a checksum is verified unless verify=False."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f'checkpoint {path} does not exist' + (
            ' (downloading is disabled: download it yourself and pass the local file)' if is_url(path) else ''))
    if os.path.isdir(path):
        raise CheckpointError(f'checkpoint {path} is a directory, expected a .pth file')
    if os.path.getsize(path) == 0:
        raise CheckpointError(f'checkpoint {path} is empty (0 bytes); {other_checkpoints_hint(path)}')
    with open(path, 'rb') as f:
        magic = f.read(4)
    is_zip, is_legacy = magic[:2] == b'PK', magic[:1] == b'\x80'  # torch.save zip format / legacy pickle format
    if not (is_zip or is_legacy):
        raise CheckpointError(f'{path} is not a PyTorch checkpoint (unknown file format)')
    try:
        with safe_globals([argparse.Namespace]):
            ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=mmap and is_zip)
    except Exception as e:
        msg = str(e)
        if 'Unsupported global' in msg or 'Unsupported class' in msg or 'Unsupported operand' in msg:
            raise CheckpointError(f'{path} contains Python objects other than tensors and plain containers; '
                                  f'refusing to unpickle it (weights_only=True)') from e
        if (is_zip and (not zipfile.is_zipfile(path) or 'central directory' in msg or 'zip archive' in msg
                        or 'failed reading' in msg)) or isinstance(e, EOFError) or 'EOF' in msg:
            raise CheckpointError(f'checkpoint {path} is truncated or corrupt ({os.path.getsize(path)} bytes); '
                                  f'{other_checkpoints_hint(path)}') from e
        raise CheckpointError(f'{path} is not a PyTorch checkpoint ({first_line(e)})') from e
    if verify:
        verify_checksum(ckpt, path)
    return ckpt


def checkpoint_identity(ckpt: Any, path: str) -> tuple[Any, Any, str]:
    """(epoch, step, digest) of a loaded checkpoint: what ranks compare to know they read the same state. The
    digest covers the checksum the file carries (verified when it was loaded), else the file's bytes."""
    h = hashlib.sha256()
    if isinstance(ckpt, dict) and isinstance(ckpt.get('checksum'), dict):
        _hash_into(h, ckpt['checksum'])
    else:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                h.update(block)
    epoch, step = (ckpt.get('epoch'), ckpt.get('step')) if isinstance(ckpt, dict) else (None, None)
    return epoch, step, h.hexdigest()[:16]


def describe_identity(identity: tuple[Any, Any, str]) -> str:
    """'epoch 1 step 3, sha256 0123abcd...' for a checkpoint_identity."""
    epoch, step, digest = identity
    where = f'epoch {epoch}' + (f' step {step}' if step else '') + ', ' if epoch is not None else ''
    return f'{where}sha256 {digest}'


def in_directory(path: str, directory: str) -> bool:
    """Whether the file `path` is in `directory` (the same directory, however each is spelt)."""
    try:
        return os.path.samefile(os.path.dirname(os.path.abspath(path)), directory)
    except OSError:
        return False

