"""The output directory of a training run (--output_dir): which checkpoint a run resumes from, one run per
directory (run_lock.py's lock, and a refusal to start over another run's files without --overwrite), write
access, the run's arguments (args.json), and removing a directory a run created but wrote nothing into."""
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import distributed
import metrics
import run_lock
from checkpoint_io import (
    TMP_PREFIX,
    in_directory,
    remove_stale_tmp,
    run_checkpoints,
    write_failure_reason,
)
from errors import UserError


@dataclass(frozen=True)
class RunDirSettings:
    """The flags of the output directory, each named as its argparse destination."""
    output_dir: str
    resume: str                   # --resume: this checkpoint (default: output_dir/checkpoint.pth, when it exists)
    auto_resume: bool
    overwrite: bool               # a new run where another one's files are: delete them
    lock: bool                    # one run per directory (--no-lock: none)
    eval: bool                    # evaluation only: nothing is written, nothing locked or cleaned


def find_resume_path(settings: RunDirSettings) -> str:
    """--resume, else (auto-resume, no --overwrite) output_dir/checkpoint.pth when it exists, else '' (this
    process's view of the filesystem: in a process group, `agree_on_resume_path` decides)."""
    if settings.resume:
        return settings.resume
    auto = os.path.join(settings.output_dir, 'checkpoint.pth') if settings.output_dir else ''
    if auto and settings.auto_resume and not settings.overwrite and os.path.isfile(auto):
        return auto
    return ''


def agree_on_resume_path(settings: RunDirSettings, device: Any) -> str:
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


def resume_elsewhere_note(settings: RunDirSettings, path: str) -> str:
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


def _check_previous_run(settings: RunDirSettings) -> str | None:
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
    cont = (' relaunch without --no-auto-resume to continue it,' if first == 'checkpoint.pth' else
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


def prepare_output_dir(settings: RunDirSettings, device: Any) -> None:
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
                    err = run_lock.lock_run_dir(out)
                else:  # no lock of our own, but never beside a run that holds one
                    holder = run_lock.live_holder(out)
                    err = run_lock.in_use(out, holder) if holder else None
            if err is None and not settings.eval:
                remove_stale_tmp(out)
                try:
                    err = _check_previous_run(settings)
                except OSError as e:
                    err = f'cannot clear --output_dir {out}: {e.strerror} ({e.filename})'
        if err:
            raise UserError(err)

    distributed.on_rank0(prepare, device, f'cannot prepare --output_dir {out}')


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
            run_lock.remove_lone_lock(folder)
            os.rmdir(folder)
        except OSError:  # not empty, or gone: keep it and the folders above it
            return


