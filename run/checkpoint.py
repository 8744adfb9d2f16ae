"""The checkpoints of a run, in one place, for every task: the files' names (LAST, BEST, the numbered backups), the
file layer (written atomically with a checksum, copied as reflinks where the filesystem has them, read back with
one-line errors for what is missing, damaged, foreign or unsafe; a release's safetensors reads as a checkpoint of
weights only), the command line a checkpoint records, log.txt's strict-JSON lines (each epoch's or evaluation's
record also travels in the checkpoint), and the run's checkpoints: what a checkpoint holds
(RunCheckpoints.state, IterationCheckpoints.state), the names a state is kept under, the best accuracy so far and
the room on disk the saves need.

A state is serialised once, to its first name; its other names are independent files: reflinks of it where the
filesystem has them (no data copied), else byte copies. Every name is replaced by a rename, never rewritten in
place, so a later write to one name, ours or a user's (``cp x best.pth`` writes in place), leaves the others as they
were. Rank 0 writes; whatever stops it stops every rank with one line. resume.py reads a run back from a checkpoint,
weights.py takes one set of weights from one, output_dir.py repairs the run directory after a resume.
"""
import argparse
import errno
import glob
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from models.compat import safe_globals
from models.weight_files import file_eval_config, is_safetensors
from run import distributed
from run.errors import (
    CheckpointError,
    CheckpointWriteError,
    FlagError,
    UserError,
    exception_chain,
    first_line,
    is_url,
    write_failure_reason,
)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


# --------------------------------------------------------------------------------------------------
# File names
# --------------------------------------------------------------------------------------------------
LAST = 'checkpoint.pth'  # the run's latest state: what the same command resumes from
BEST = 'best.pth'        # the state with the best accuracy (mIoU, AP) so far
#: the numbered backups every --save-freq epochs: checkpoint_NNNN.pth
NUMBERED = re.compile(r'checkpoint_(\d+)\.pth$')
#: the prefix of the temporary file a write goes to before it is renamed into place
TMP_PREFIX = '.tmp-'


def backup_name(epoch: int) -> str:
    """The name of the backup kept after `epoch` every --save-freq epochs."""
    return f'checkpoint_{epoch:04d}.pth'


# --------------------------------------------------------------------------------------------------
# The file layer: atomic writes, copies, checked reads
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# The command line a checkpoint records, and its task
# --------------------------------------------------------------------------------------------------
def saved_args(ckpt: Any) -> dict[str, Any]:
    """The command line stored in a checkpoint as a dict (ours store a dict, the reference's a Namespace)."""
    args = ckpt.get('args') if isinstance(ckpt, dict) else None
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args) if isinstance(args, dict) else {}


def recorded_args(path: str) -> dict[str, Any]:
    """The command line the checkpoint file `path` records (saved_args), read before the run builds anything:
    memory-mapped, so its tensors are not read (the full load, checksum verified, comes later)."""
    return saved_args(load_checkpoint_file(path, verify=False, mmap=True))


def describe_best(ckpt: Any) -> str:
    """Which weights a checkpoint records as its best, in words."""
    if not isinstance(ckpt, dict) or 'max_accuracy' not in ckpt:
        return ''
    which = ckpt.get('best_weights')
    if which not in ('model', 'model_ema'):
        return ('the checkpoint does not record which weights gave its best accuracy '
                f'({float(ckpt["max_accuracy"]):.2f}%)')
    epoch = f' at epoch {ckpt["best_epoch"]}' if ckpt.get('best_epoch') is not None else ''
    return (f'the checkpoint records its best accuracy, {float(ckpt["max_accuracy"]):.2f}%{epoch}, from the '
            f'{"EMA" if which == "model_ema" else "model"} weights')


def comparable(v: Any) -> Any:
    """A list as a tuple, so that a value read back from a checkpoint compares equal to the one it was."""
    return tuple(v) if isinstance(v, list) else v


def _to_plain(obj: Any) -> Any:
    """Convert to types that torch.load(weights_only=True) accepts (dict/list/tuple/str/int/float/bool/None)."""
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def args_to_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The command line as a plain dict (the checkpoint's ``args``)."""
    return _to_plain(dict(vars(args)))


#: the checkpoints of the other tasks (the 'task' entry they carry) -> the script that writes and evaluates them
TASK_SCRIPTS = {'segmentation': 'segmentation/train.py', 'detection': 'detection/train.py'}


def task_of(ckpt: Any) -> str:
    """The task whose run wrote a loaded checkpoint: its 'task' entry, 'classification' without one (main.py's
    checkpoints, the reference's, releases)."""
    task = ckpt.get('task') if isinstance(ckpt, dict) else None
    return task if isinstance(task, str) else 'classification'


def check_task(ckpt: Any, path: str, task: str) -> None:
    """One line (CheckpointError) for a checkpoint `path` that a run of another task than `task` wrote (a
    classification checkpoint or release given to segmentation/train.py, say)."""
    if isinstance(ckpt, dict) and ckpt.get('task') == task:
        return
    other = task_of(ckpt)
    if other in TASK_SCRIPTS:
        raise CheckpointError(f'{path} is a {other} checkpoint (written by {TASK_SCRIPTS[other]}), not a {task} one: '
                              f'evaluate or continue it with {TASK_SCRIPTS[other]}; start {task} from a '
                              f'classification checkpoint with --pretrained')
    raise CheckpointError(f'{path} is not a {task} checkpoint (a classification checkpoint or '
                          f'release?): start from its backbone with --pretrained {path}')


def refuse_other_task(flag: str, path: str) -> None:
    """Refuse, in one line (FlagError), a checkpoint that another task wrote (its 'task' entry: segmentation,
    detection) given to main.py, saying what it is and the command that takes it; its recorded --data-path goes
    into that command. A file that cannot be read passes: loading it later says why."""
    try:
        ckpt = load_checkpoint_file(path, verify=False, mmap=True)
    except (CheckpointError, OSError):
        return
    task = task_of(ckpt)
    if task == 'classification':
        return
    script = TASK_SCRIPTS.get(task)
    if script is None:
        raise FlagError(f'{flag} {path} is a {task} checkpoint, not a classification one; main.py takes '
                        f'classification checkpoints')
    data = saved_args(ckpt).get('data_path')
    command = f'python {script} --eval --resume {shlex.quote(path)}' + (f' --data-path {shlex.quote(data)}'
                                                                           if data else '')
    raise FlagError(f'{flag} {path} is a {task} checkpoint (written by {script}), not a classification one: '
                    f'evaluate it with `{command}` (or continue its training with --resume instead of --eval); '
                    f'main.py takes classification checkpoints')


# --------------------------------------------------------------------------------------------------
# log.txt: one strict-JSON line per epoch or evaluation
# --------------------------------------------------------------------------------------------------
def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, inf) replaced by None, so that it serialises as strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def json_line(obj: Any) -> str:
    """`obj` as one strict-JSON line of log.txt, newline included (non-finite numbers written as null)."""
    return json.dumps(json_safe(obj), allow_nan=False) + '\n'


def write_json_line(path: Any, obj: Any) -> None:
    """Append `obj` as one strict-JSON line (json_line)."""
    with open(path, 'a') as f:
        f.write(json_line(obj))
        f.flush()


def write_log_line(directory: str, record: dict[str, Any]) -> None:
    """Append an epoch's record to `directory`/log.txt as one JSON line; a failure is one line that says the
    checkpoint of that epoch holds the record (it is added when the run resumes)."""
    path = os.path.join(directory, 'log.txt')
    try:
        write_json_line(path, record)
    except OSError as e:
        raise UserError(f'could not append to {path}: {write_failure_reason(e)}; the checkpoint of epoch '
                        f'{record.get("epoch")} holds the line, it is added when the run resumes') from e
def replace_log_line(directory: str, record: dict[str, Any], key: str = 'epoch') -> None:
    """Put `record` in log.txt in place of the line with the same `key` (the line of an epoch whose evaluation a
    stop cut short, written without its test_* entries), or append it when log.txt has none. log.txt is
    rewritten atomically: a crash leaves the old file or the new one."""
    path = os.path.join(directory, 'log.txt')
    lines: list[str] = []
    if os.path.isfile(path):
        with open(path) as f:
            lines = f.readlines()
    new, replaced = json_line(record), False
    for i, line in enumerate(lines):
        try:
            same = json.loads(line).get(key) == record[key]
        except (ValueError, AttributeError):
            same = False
        if same:
            lines[i], replaced = ('' if replaced else new), True
    if not replaced:
        lines.append(new)
    write_atomic(path, lambda f: f.write(''.join(lines).encode()))


# --------------------------------------------------------------------------------------------------
# The run's checkpoints
# --------------------------------------------------------------------------------------------------
@dataclass
class TrainingParts:
    """What a training run trains and what its checkpoints hold besides the weights: the bare model (no DDP, not
    compiled), its EMA (or None), the optimizer, the LR scheduler and the fp16 GradScaler (or None)."""
    model: torch.nn.Module
    model_ema: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    loss_scaler: Any = None


def write_state(state: dict[str, Any], directory: str, names: Sequence[str], device: Any) -> None:
    """Write `state`, with its checksum added, to the first of `names` in `directory`, then copy that file to the
    others in order (rank 0; a failure stops every rank with one line naming the file)."""
    first = os.path.join(directory, names[0])

    def write() -> None:
        try:
            save_atomic({**state, 'checksum': {'sha256': checksums(state)}}, first)
            for name in names[1:]:
                copy_atomic(first, os.path.join(directory, name))
        except UserError:
            raise
        except Exception as e:  # save_atomic names OSErrors; anything else (a pickling error) by its type
            raise CheckpointWriteError(f'could not write checkpoint {first}: {type(e).__name__}: '
                                       f'{first_line(e)}; the previous {names[0]} (if any) is kept') from e

    distributed.on_rank0(write, device, f'could not write checkpoint {first}')


def append_log(directory: str, record: dict[str, Any], device: Any) -> None:
    """Append `record` to `directory`/log.txt as one JSON line (rank 0; a failure stops every rank with one line).
    The record is also in the checkpoint, so a line lost to a crash or a full disk is written at the next resume."""
    if directory:
        distributed.on_rank0(lambda: write_log_line(directory, record), device,
                             f'could not append to {os.path.join(directory, "log.txt")}')


class RunCheckpoints:
    """The checkpoints of one training run in --output_dir: what they hold (``state``), the names each state is kept
    under, the best accuracy so far and the room the saves need; log.txt's lines go with them. Nothing is written
    without an --output_dir. Counted in epochs (classification); IterationCheckpoints counts in iterations.

    ``record_accuracy`` notes an epoch's accuracies and says whether they beat the best so far; ``save_epoch``
    writes the state after an epoch to checkpoint.pth, best.pth and the --save-freq backup as they apply;
    ``save_stop`` writes a stop inside an epoch to checkpoint.pth; ``check_room`` refuses a start without room
    for the saves to come. resume.restore loads a state back into the parts."""

    #: the checkpoint's (and log.txt's) key of how far training got: 'epoch' or 'iter'
    progress_key = 'epoch'

    def __init__(self, *, output_dir: str, parts: TrainingParts, run_args: dict[str, Any], n_parameters: int,
                 device: Any, save_freq: int = 0, classes: Sequence[str] | None = None,
                 n_train_images: int | None = None):
        self.output_dir, self.save_freq, self.parts = output_dir, save_freq, parts
        self.run_args, self.n_parameters, self.device = run_args, n_parameters, device
        # the training data this run learns from, saved with every checkpoint and checked on resume
        self.classes = None if classes is None else [str(c) for c in classes]
        self.n_train_images = n_train_images
        self.max_accuracy = 0.0
        self.best: dict[str, Any] = {'best_weights': None, 'best_epoch': None, 'best_acc1': None}
        self._acc1: tuple[int | None, dict[str, Any] | None] = (None, None)

    # ---- best accuracy
    def record_accuracy(self, epoch: int, acc1: float, ema_acc1: float | None = None) -> bool:
        """Note epoch's accuracies (model, EMA); True when they beat the best so far."""
        acc = {'model': float(acc1), 'model_ema': None if ema_acc1 is None else float(ema_acc1)}
        self._acc1 = (epoch, acc)
        use_ema = ema_acc1 is not None and ema_acc1 >= acc1  # on a tie, the EMA: what checkpoint_path= loads
        best_now = float(ema_acc1 if use_ema else acc1)
        if best_now <= self.max_accuracy:
            return False
        self.max_accuracy = best_now
        self.best = {'best_weights': 'model_ema' if use_ema else 'model', 'best_epoch': epoch, 'best_acc1': acc}
        return True

    def restore_best(self, ckpt: dict[str, Any]) -> None:
        """The best accuracy so far and which weights gave it, as the checkpoint `ckpt` records them (the inverse
        of the best-accuracy entries of `state`)."""
        self.max_accuracy = float(ckpt.get('max_accuracy', 0.0))
        self.best = {k: ckpt.get(k) for k in self.best}

    # ---- names
    def names(self, epoch: int, improved: bool) -> list[str]:
        """The names the state after `epoch` is kept under: checkpoint.pth, best.pth when it `improved` on the
        best accuracy, the backup every --save-freq epochs."""
        names = [LAST] + ([BEST] if improved else [])
        if self.save_freq and (epoch + 1) % self.save_freq == 0:
            names.append(backup_name(epoch))
        return names

    # ---- writing
    def state(self, epoch: int, names: Sequence[str], extra: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint after `epoch` (docs/checkpoints.md#the-checkpoint-format), with the entries `extra` (where
        training stands: resume.epoch_state_entries; the epoch's log record). A dict with the reference checkpoints'
        entries (the weights in this model's key layout; loaders also take the reference layout), loadable with
        ``torch.load(weights_only=True)``:

            model, model_ema         state dicts without a ``module.`` prefix (model_ema only with an EMA)
            optimizer, lr_scheduler  their state dicts
            scaler                   the fp16 GradScaler's state dict, or None
            epoch                    the last finished epoch (or, with ``step``, the epoch stopped in the middle)
            args                     the command line as a plain dict
            max_accuracy             best top-1 so far, max over the model and the EMA
            n_parameters             trainable parameters

        and ours: ``best_weights`` ('model' or 'model_ema': which weights gave max_accuracy), ``best_epoch``,
        ``best_acc1`` (the two accuracies of that epoch), ``acc1`` (this epoch's two accuracies; None when a stop cut
        the epoch's evaluation short, which the resumed run then does first), ``log`` (the epoch's log.txt record),
        ``files`` (the names this state was written to), ``classes`` and ``n_train_images`` (the training data),
        ``rng_state`` (one entry per process), ``train_carry`` (the skipped-step counts); mid-epoch stops add
        ``step``, ``epoch_rng_state`` and ``loss_meter`` (one entry per process; these and ``rng_state``,
        ``train_carry`` hold a ``resume.EpochState``), and ``checksum`` (a sha256 of every part, verified on load:
        added by ``write_state``)."""
        parts = self.parts
        state = {
            'model': parts.model.state_dict(),
            'optimizer': parts.optimizer.state_dict(),
            'lr_scheduler': parts.lr_scheduler.state_dict(),
            'epoch': epoch,
            'scaler': parts.loss_scaler.state_dict() if parts.loss_scaler is not None else None,
            'args': dict(self.run_args),
            'max_accuracy': self.max_accuracy,
            'n_parameters': self.n_parameters,
            **self.best,
            'acc1': self._acc1[1] if self._acc1[0] == epoch and not extra.get('step') else None,
            'files': list(names),
        }
        if self.classes is not None:
            state['classes'] = self.classes
        if self.n_train_images is not None:
            state['n_train_images'] = self.n_train_images
        if parts.model_ema is not None:
            state['model_ema'] = parts.model_ema.module.state_dict()
        state.update(extra)
        return state

    def save(self, done: int, extra: dict[str, Any], names: Sequence[str]) -> None:
        """Write the run's state after `done` epochs (iterations) to the first of `names` in --output_dir (nothing
        without one), then copy that file (a reflink where the filesystem has them) to the others, in order."""
        if self.output_dir:
            write_state(self.state(done, names, extra), self.output_dir, names, self.device)

    def save_epoch(self, epoch: int, extra: dict[str, Any], improved: bool) -> None:
        """The state after a finished `epoch`, under the names of `names(epoch, improved)`."""
        self.save(epoch, extra, self.names(epoch, improved))

    def save_stop(self, epoch: int, extra: dict[str, Any]) -> str:
        """The state of a stop inside `epoch` to checkpoint.pth; returns where it went, in words."""
        self.save(epoch, extra, [LAST])
        return os.path.join(self.output_dir, LAST) if self.output_dir else '(no --output_dir: nothing saved)'

    def append_log(self, record: dict[str, Any]) -> None:
        """Append a record (an epoch's, an evaluation's) to log.txt (rank 0; a failure stops every rank with one
        line)."""
        append_log(self.output_dir, record, self.device)

    def replace_log(self, record: dict[str, Any]) -> None:
        """Put the epoch's record in log.txt in place of that epoch's line (replace_log_line; rank 0, a failure
        stops every rank with one line)."""
        if self.output_dir:
            distributed.on_rank0(lambda: replace_log_line(self.output_dir, record, self.progress_key), self.device,
                                 f'could not rewrite {os.path.join(self.output_dir, "log.txt")}')

    # ---- room
    def estimate_bytes(self, resume_path: str = '') -> int:
        """Size of one of this run's checkpoints (``checkpoint_bytes``)."""
        return checkpoint_bytes(self.parts.model, self.parts.model_ema is not None, resume_path)

    def check_room(self, start_epoch: int, epochs: int, resume_path: str = '') -> None:
        """Before training: room in --output_dir for the peak of the saves to come (checkpoints_at_peak copies of
        about one checkpoint's size), less what checkpoint.pth and best.pth hold already. Copies are counted in
        full, also where the filesystem shares blocks between them (reflinks). Rank 0 checks, every rank stops."""
        check_room(self.output_dir, self.estimate_bytes(resume_path), self.device,
                   checkpoints_at_peak(self.save_freq, start_epoch, epochs))


class IterationCheckpoints(RunCheckpoints):
    """The checkpoints of a run counted in iterations (segmentation, detection): the same writes, names, log.txt
    and room check as RunCheckpoints, a state of its own (``state``) that names its `task`. The best score so far
    (mIoU, AP) is the task's to keep: it goes into the state's ``extra`` entries."""

    progress_key = 'iter'

    def __init__(self, *, task: str, output_dir: str, parts: TrainingParts, run_args: dict[str, Any],
                 n_parameters: int, device: Any):
        super().__init__(output_dir=output_dir, parts=parts, run_args=run_args, n_parameters=n_parameters,
                         device=device)
        self.task = task

    def state(self, done: int, names: Sequence[str], extra: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint after `done` iterations: ``task`` (the run's), ``model`` (the bare model's state dict),
        ``optimizer``, ``scaler`` (fp16's GradScaler or None), ``iter`` (iterations done), ``args`` (the command
        line as a plain dict), ``n_parameters``, ``files`` (the names it was written to), then the task's entries
        `extra`: ``rng_state`` (one per process: resume.rng_state_entries), the best score, the log record, ... as
        the task's loop keeps them, and ``checksum`` (added by ``write_state``). The learning rate is a function of
        ``iter``, so no scheduler state is needed."""
        parts = self.parts
        return {'task': self.task, 'model': parts.model.state_dict(), 'optimizer': parts.optimizer.state_dict(),
                'scaler': parts.loss_scaler.state_dict() if parts.loss_scaler is not None else None, 'iter': done,
                'args': dict(self.run_args), 'n_parameters': self.n_parameters, 'files': list(names), **extra}


def checkpoint_bytes(model: torch.nn.Module, with_ema: bool = False, resume_path: str = '') -> int:
    """Size of one checkpoint: the resumed file's, else weights (twice with an EMA) + two optimizer buffers per
    trainable parameter (AdamW's moments; an upper bound for SGD)."""
    if resume_path and os.path.isfile(resume_path):
        return os.path.getsize(resume_path)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return weights * (2 if with_ema else 1) + 2 * trainable


def checkpoints_at_peak(save_freq: int, start_epoch: int, epochs: int) -> int:
    """How many checkpoints --output_dir holds at the peak of the saves from `start_epoch` on: checkpoint.pth
    and its replacement while that is written, best.pth holding an older state, and a numbered backup once a
    --save-freq epoch is behind and another save follows (each further backup adds one more, for good)."""
    backup = bool(save_freq) and any((e + 1) % save_freq == 0 for e in range(start_epoch, epochs - 1))
    return 3 + int(backup)


def _held_bytes(directory: str) -> int:
    """Bytes of the checkpoints in `directory` that the saves to come replace (checkpoint.pth, best.pth),
    each file once (names that are hard links of one file count once)."""
    seen = {}
    for name in (LAST, BEST):
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def check_room(directory: str, nbytes: int, device: Any, copies: int = 3) -> None:
    """Room in `directory` for `copies` checkpoints of about `nbytes`, less what checkpoint.pth and best.pth hold
    already; one line naming the MiB missing when there is not. Rank 0 checks, every rank stops. Nothing to
    check without a directory (a run without --output_dir saves nothing)."""
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
