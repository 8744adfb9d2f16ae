"""Repairs of a run directory after a resume from one of its checkpoints: what a crash between two writes, names
that are hard links of one file, or a resume from an older state left behind (checkpoint names that lack the
resumed state, log.txt lines of later epochs, a log line the crash kept out)."""
import json
import os
import time
from typing import Any

from checkpoint_io import copy_atomic, in_directory, load_checkpoint_file, run_checkpoints, write_atomic
from errors import CheckpointError, CheckpointWriteError
from metrics import json_line, write_log_line

#: the words of a checkpoint's position key in the lines below
_WORDS = {'epoch': ('epoch', 'epochs'), 'iter': ('iteration', 'iterations')}


def repair(directory: str, path: str, ckpt: dict[str, Any], key: str = 'epoch') -> None:
    """After a resume from `path` (rank 0): when it is in the run directory `directory`, bring the directory in
    line with the resumed state (_repair_files) and add its log line when log.txt lacks it (add_missing_log_line).
    `key` is the checkpoint's position and log.txt's key: 'epoch' for classification, 'iter' for segmentation."""
    if in_directory(path, directory):
        _repair_files(directory, path, ckpt, key)
        add_missing_log_line(directory, ckpt.get('log'), key)

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
