"""The checkpoint files of a training run in --output_dir, in one place: what a checkpoint holds, under which
names it is kept (checkpoint.pth after every epoch and at a stop, best.pth when the epoch gave the best accuracy
so far, checkpoint_NNNN.pth every --save-freq epochs), the best accuracy and which weights gave it, the room the
saves need, and log.txt's line of each epoch.

A state is serialised once, to its first name; its other names are independent files: reflinks of it where the
filesystem has them (no data copied), else byte copies (checkpoint_io.copy_atomic). Every name is replaced by a
rename, never rewritten in place, so a later write to one name, ours or a user's (``cp x best.pth`` writes in
place), leaves the others as they were. Rank 0 writes; whatever stops it stops every rank with one line.
"""
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any, Sequence

import torch

import distributed
import metrics
import run_repair
from checkpoint_io import checksums, copy_atomic, save_atomic
from errors import CheckpointWriteError, UserError, first_line
from optimizer import load_optimizer_state
from train_state import TrainingParts, set_rng_state
from weights import check_weights, select_weights

LAST = 'checkpoint.pth'  # the run's latest state: what the same command resumes from
BEST = 'best.pth'        # the state of the epoch with the best accuracy so far


def backup_name(epoch: int) -> str:
    """The name of the backup kept after `epoch` every --save-freq epochs."""
    return f'checkpoint_{epoch:04d}.pth'


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
        distributed.on_rank0(lambda: metrics.write_log_line(directory, record), device,
                             f'could not append to {os.path.join(directory, "log.txt")}')


@dataclass(frozen=True)
class TrainingRestore:
    """What a training resume restores besides the weights, as resume.py decided it."""
    opt: str                  # this run's --opt: the optimizer state must be of its kind
    saved_opt: Any            # the --opt the checkpoint records (None where it records none)
    schedule: bool            # the checkpoint's LR schedule state (False: the command line changed the schedule)
    rng_state: dict | None    # this process's random-number state to set now (None: not restored here)


class CheckpointSaver:
    """Saves the checkpoints of one training run (classification) and keeps its best accuracy.

    ``record_accuracy`` notes an epoch's accuracies and says whether they beat the best so far; ``save_epoch``
    writes the state after an epoch to checkpoint.pth, best.pth and the --save-freq backup as they apply;
    ``save_stop`` writes a stop inside an epoch to checkpoint.pth; ``check_room`` refuses a start without room
    for the saves to come. Nothing is written without an --output_dir. ``restore`` is the inverse of ``state``:
    it loads a checkpoint into the parts; ``repair`` brings the run directory in line after a resume."""

    def __init__(self, output_dir: str, save_freq: int, parts: TrainingParts, run_args: dict[str, Any],
                 n_parameters: int, device: Any, classes: Sequence[str] | None = None,
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

    # ---- reading back
    def restore(self, ckpt: dict[str, Any], path: str, model_name: str, training: TrainingRestore | None) -> None:
        """Load the checkpoint `ckpt` (read from `path`) into the parts, the inverse of `state`: with `training`
        the optimizer state (refused when of another kind than --opt; then the command line's settings), the LR
        schedule, the fp16 loss scale, the best accuracy and the random-number state as `training` says, and
        the EMA weights (from the model's when the checkpoint has none, with a warning); always the model
        weights of `model_name`. The weights and the optimizer's kind are checked before anything is loaded:
        a refusal (one line) leaves every part as it was."""
        parts = self.parts
        ema = parts.model_ema if training is not None else None
        ema_saved = ema is not None and isinstance(ckpt.get('model_ema'), dict)
        weights = [(parts.model, select_weights(ckpt, path, 'model')[1])]
        if ema_saved:
            weights.append((ema.module, select_weights(ckpt, path, 'model_ema')[1]))
        for module, sd in weights:  # checked before anything loads: a refusal leaves every part as it was
            check_weights(module, sd, model_name, path)
        if training is not None:
            load_optimizer_state(parts.optimizer, ckpt['optimizer'], path, training.saved_opt, training.opt)
            if training.schedule:
                parts.lr_scheduler.load_state_dict(ckpt['lr_scheduler'])
            if parts.loss_scaler is not None and ckpt.get('scaler'):
                parts.loss_scaler.load_state_dict(ckpt['scaler'])
            self.max_accuracy = float(ckpt.get('max_accuracy', 0.0))
            self.best = {k: ckpt.get(k) for k in self.best}
            if training.rng_state is not None:
                set_rng_state(training.rng_state)
        for module, sd in weights:
            module.load_state_dict(sd, strict=True)
        if ema is not None and not ema_saved:
            print('Warning: the checkpoint has no EMA weights; the EMA restarts from the model weights')
            ema.module.load_state_dict(parts.model.state_dict())

    def repair(self, path: str, ckpt: dict[str, Any]) -> None:
        """After a training resume from `path` (its loaded checkpoint `ckpt`): bring --output_dir in line with the
        resumed state when `path` is one of its files (run_repair.repair; rank 0, a failure stops every rank)."""
        if self.output_dir:
            distributed.on_rank0(lambda: run_repair.repair(self.output_dir, path, ckpt), self.device,
                                 f'could not repair the files of {self.output_dir} from {path}')

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
        """The checkpoint after `epoch` (docs/checkpoints.md#the-checkpoint-format), with the entries `extra`
        (where training stands, the epoch's log line)."""
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

    def save(self, epoch: int, extra: dict[str, Any], names: Sequence[str]) -> None:
        """Write the run's state after `epoch` to the first of `names` in --output_dir (nothing without one), then
        copy that file (a reflink where the filesystem has them) to the others, in order."""
        if self.output_dir:
            write_state(self.state(epoch, names, extra), self.output_dir, names, self.device)

    def save_epoch(self, epoch: int, extra: dict[str, Any], improved: bool) -> None:
        """The state after a finished `epoch`, under the names of `names(epoch, improved)`."""
        self.save(epoch, extra, self.names(epoch, improved))

    def save_stop(self, epoch: int, extra: dict[str, Any]) -> str:
        """The state of a stop inside `epoch` to checkpoint.pth; returns where it went, in words."""
        self.save(epoch, extra, [LAST])
        return os.path.join(self.output_dir, LAST) if self.output_dir else '(no --output_dir: nothing saved)'

    def append_log(self, record: dict[str, Any]) -> None:
        """Append the epoch's record to log.txt (rank 0; a failure stops every rank with one line)."""
        append_log(self.output_dir, record, self.device)

    def replace_log(self, record: dict[str, Any]) -> None:
        """Put the epoch's record in log.txt in place of that epoch's line (run_repair.replace_log_line; rank 0, a
        failure stops every rank with one line)."""
        if self.output_dir:
            distributed.on_rank0(lambda: run_repair.replace_log_line(self.output_dir, record), self.device,
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
