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
import json
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
from models.weight_files import file_eval_config, is_safetensors

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


def _describe_format(head: bytes) -> str:
    """What the first bytes of a file that is no checkpoint look like, in words."""
    try:
        text = head.decode('utf-8')
    except UnicodeDecodeError:
        text = ''
    if text and all(c.isprintable() or c in '\t\r\n' for c in text):
        first = text.strip().splitlines()[0][:40] if text.strip() else ''
        return f'a text file beginning {first!r}' if first else 'a text file of blank lines'
    return f'unknown file format, starting with bytes {head[:8].hex(" ")}'


#: how torch's weights-only unpickler names a global it refuses (torch 2.4 and later; older: Unsupported class)
_GLOBAL = re.compile(r'(?:GLOBAL|Unsupported class) ([^\s]+?)(?: was not|\s|$)')


def _unsafe_global(msg: str) -> str:
    """The Python name of a refused global in an unpickling error `msg` ('' when the error is another one). A
    refused name that is no dotted Python name is the trace of damage, not of a pickled object ('')."""
    if 'Unsupported global' not in msg and 'Unsupported class' not in msg:
        return ''
    m = _GLOBAL.search(msg)
    name = m.group(1) if m else ''
    if m and not all(part.isidentifier() for part in name.split('.')):
        return ''
    return name or 'an object that is not a tensor'


def _has_pickle(path: str) -> bool:
    """Whether the zip archive `path` holds a pickle (torch.save writes ARCHIVE/data.pkl)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith('/data.pkl') or n == 'data.pkl' for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return True  # unreadable as a zip: the caller's damage message applies


def _unpickling_detail(e: BaseException) -> str:
    """The short cause of an unpickling failure (torch wraps its own in a page of advice)."""
    m = re.search(r'WeightsUnpickler error:\s*([^\n]+)', str(e)) or re.search(r'(Unsupported operand \d+)', str(e))
    return m.group(1).strip() if m else f'{type(e).__name__}: {first_line(e)}'


def is_url(path: str) -> bool:
    """Whether a checkpoint flag names a URL (nothing is downloaded: checkpoints are local files)."""
    return path.startswith(('http://', 'https://'))


#: the entry of a release read as a checkpoint (load_release) that holds its metadata
RELEASE_KEY = 'release'


def load_release(path: str) -> dict[str, Any]:
    """A release (tools/release.py's weights-only safetensors, or any safetensors file of weights) read as a
    checkpoint: its weights under ``model``; under ``args`` the --model, --input-size and --eval-crop-ratio its
    metadata records (the settings it is evaluated at, models.weight_files.file_eval_config); its class names
    under ``classes``; its metadata under ``release``. It holds no optimizer, schedule or epoch."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework='pt') as f:
            meta = dict(f.metadata() or {})
            weights = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f'checkpoint {path} is a damaged safetensors file ({first_line(e)}); '
                              f'{other_checkpoints_hint(path)}') from e
    cfg = file_eval_config(path)
    args: dict[str, Any] = {'model': meta['model']} if meta.get('model') else {}
    if cfg:
        args.update(input_size=cfg['input_size'][-1], eval_crop_ratio=cfg.get('crop_pct'))
    ckpt: dict[str, Any] = {'model': weights, 'args': args, RELEASE_KEY: meta}
    try:
        classes = json.loads(meta.get('classes') or '[]')
    except ValueError:
        classes = None
    if isinstance(classes, list) and classes:
        ckpt['classes'] = [str(c) for c in classes]
    return ckpt


def load_checkpoint_file(path: str, verify: bool = True, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) with one-line errors for missing, truncated, corrupt, foreign and
    unsafe files (those that can be told apart from a damaged checkpoint name the run's other checkpoints).
    argparse.Namespace is accepted (reference checkpoints store their args as one). A checkpoint with a
    checksum is verified unless verify=False. A safetensors release reads as load_release's checkpoint."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f'checkpoint {path} does not exist' + (
            ' (downloading is disabled: download it yourself and pass the local file)' if is_url(path) else ''))
    if os.path.isdir(path):
        raise CheckpointError(f'checkpoint {path} is a directory, expected a .pth file')
    if os.path.getsize(path) == 0:
        raise CheckpointError(f'checkpoint {path} is empty (0 bytes); {other_checkpoints_hint(path)}')
    with open(path, 'rb') as f:
        head = f.read(64)
    if is_safetensors(path):
        return load_release(path)
    is_zip, is_legacy = head[:2] == b'PK', head[:1] == b'\x80'  # torch.save zip format / legacy pickle format
    if not (is_zip or is_legacy):
        raise CheckpointError(f'checkpoint {path} is not a PyTorch checkpoint ({_describe_format(head)}); '
                              f'{other_checkpoints_hint(path)}')
    try:
        with safe_globals([argparse.Namespace]):
            ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=mmap and is_zip)
    except Exception as e:
        msg = str(e)
        if (is_zip and (not zipfile.is_zipfile(path) or 'central directory' in msg or 'zip archive' in msg
                        or 'failed reading' in msg)) or isinstance(e, EOFError) or 'EOF' in msg:
            raise CheckpointError(f'checkpoint {path} is truncated or corrupt ({os.path.getsize(path)} bytes); '
                                  f'{other_checkpoints_hint(path)}') from e
        unsafe = _unsafe_global(msg)
        if unsafe:
            raise CheckpointError(f'{path} contains Python objects other than tensors and plain containers '
                                  f'({unsafe}); refusing to unpickle it (weights_only=True); '
                                  f'{other_checkpoints_hint(path)}') from e
        if is_zip and not _has_pickle(path):  # a zip archive, but not one torch.save wrote
            raise CheckpointError(f'checkpoint {path} is not a PyTorch checkpoint ({first_line(e)}); '
                                  f'{other_checkpoints_hint(path)}') from e
        # the unpickler met bytes no pickle writes (an unknown opcode, a broken string, a missing memo entry):
        # the file was damaged after torch.save wrote it
        detail = _unpickling_detail(e)
        raise CheckpointError(f'checkpoint {path} is corrupt: its pickled contents are damaged ({detail}); '
                              f'{other_checkpoints_hint(path)}') from e
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

