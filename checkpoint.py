"""The checkpoint format of NaLaFormer training runs: what a checkpoint holds, how it is written and read.

A training checkpoint is a dict with the reference checkpoints' entries (the weights in this model's key layout;
loaders also take the reference layout), loadable with ``torch.load(weights_only=True)``:

    model, model_ema         state dicts without a ``module.`` prefix (model_ema only with an EMA)
    optimizer, lr_scheduler  their state dicts
    scaler                   the fp16 GradScaler's state dict, or None
    epoch                    the last finished epoch (or, with ``step``, the epoch stopped in the middle)
    args                     the command line as a plain dict
    max_accuracy             best top-1 so far, max over the model and the EMA
    n_parameters             trainable parameters

and ours: ``best_weights`` ('model' or 'model_ema': which weights gave max_accuracy), ``best_epoch``,
``best_acc1`` (the two accuracies of that epoch), ``acc1`` (this epoch's two accuracies), ``log`` (the
epoch's log.txt record), ``files`` (the names this state was written to), ``rng_state`` (one entry per
process), ``train_carry`` (the skipped-step counts), mid-epoch stops add ``step``, ``epoch_rng_state`` and
``loss_meter`` (these and ``rng_state``, ``train_carry`` hold an ``train_state.EpochState``:
``train_state.epoch_state_entries`` and ``TrainingCheckpoints.resume``), and ``checksum`` (a sha256 of every
part, verified on load).

A state is serialised once, to its first file name; its other names (best.pth, checkpoint_NNNN.pth) are
independent files: reflinks of it where the filesystem has them (no data copied), else byte copies. Every name
is replaced by a rename, never rewritten in place, so a later write to one name, ours or a user's (``cp x
best.pth`` writes in place), leaves the others as they were.

Writing and reading the files is checkpoint_io.py's; the one rule by which loaders take a single set of weights
from a checkpoint, and the diagnosis of weights that do not fit a model, are in weights.py; the run
directory's rules and repairs in run_dir.py; the random-number and epoch state in engine.py.
"""
import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

import distributed
import metrics
import run_repair
from checkpoint_io import (
    checkpoint_identity,
    checksums,
    copy_atomic,
    describe_identity,
    load_checkpoint_file,
    save_atomic,
)
from errors import CheckpointError, CheckpointWriteError, UserError, first_line
from optimizer import FOLLOWED_OPTIMIZER_KEYS
from schedule import SCHEDULE_FLAGS
from train_state import SKIP_COUNTS_KEY, EpochState, set_rng_state
from weights import load_weights_into, select_weights


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


def _comparable(v: Any) -> Any:
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


# --------------------------------------------------------------------------------------------------
# Saving and resuming a training run
# --------------------------------------------------------------------------------------------------
def _global_batch(a: dict[str, Any]) -> int | None:
    try:
        return int(a['batch_size']) * int(a.get('world_size', 1)) * int(a.get('accum_steps', 1))
    except (KeyError, TypeError, ValueError):
        return None


def _ema_decay(a: dict[str, Any]) -> float | None:
    """The EMA decay a run used: --model-ema-decay ** (global batch / 512), None without an EMA."""
    gb = _global_batch(a)
    if not a.get('model_ema') or gb is None or a.get('model_ema_decay') is None:
        return None
    return float(a['model_ema_decay']) ** (gb / 512.0)




def _flag(name: str) -> str:
    return '--' + name.replace('_', '-')


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return not math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            pass
    return _comparable(a) != _comparable(b)


def flag_changes(saved: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What a resumed run changes against the checkpoint's command line, in flag terms: the batch flags with
    the global batch, LR and EMA decay they give, then the LR-schedule flags. Empty when nothing changed or
    the checkpoint holds no command line."""
    if not saved:
        return []
    now = vars(args)
    out = []
    sizes = [f'{"processes" if k == "world_size" else _flag(k)} {saved.get(k, 1)} -> {now.get(k, 1)}'
             for k in ('batch_size', 'world_size', 'accum_steps')
             if k in saved and _differs(saved.get(k, 1), now.get(k, 1))]
    effects = []
    gb_was, gb_now = _global_batch(saved), _global_batch(now)
    if gb_was is not None and gb_was != gb_now:
        effects.append(f'global batch {gb_was} -> {gb_now}')
    if 'lr' in saved and _differs(saved['lr'], now.get('lr')):  # both scaled by the global batch (not --unscale-lr)
        effects.append(f'LR {float(saved["lr"]):.4g} -> {float(now["lr"]):.4g}')
    ema_was, ema_now = _ema_decay(saved), _ema_decay(now)
    if ema_was is not None and ema_now is not None and _differs(ema_was, ema_now):
        effects.append(f'EMA decay {ema_was:.8g} -> {ema_now:.8g}')
    if sizes or effects:
        out.append(', '.join(sizes) + (': ' if sizes and effects else '') + ', '.join(effects))
    out += [f'{_flag(k)} {saved[k]} -> {now.get(k)}' for k in SCHEDULE_FLAGS
            if k in saved and k in now and _differs(saved[k], now[k])]
    return out


def data_path_change(saved: dict[str, Any], args: argparse.Namespace) -> str:
    """The checkpoint's --data-path when the command line names another directory, else ''. Paths are compared
    absolute and normalised (a relative one from the current directory), and two names of one existing
    directory (a link) are the same path."""
    was, now = saved.get('data_path'), getattr(args, 'data_path', None)
    if not was or not now:
        return ''
    a, b = (os.path.normpath(os.path.abspath(os.path.expanduser(str(p)))) for p in (was, now))
    if a == b:
        return ''
    try:
        if os.path.samefile(a, b):
            return ''
    except OSError:  # the old path is gone (the data set was moved)
        pass
    return str(was)


def data_order_changes(ckpt: dict[str, Any], args: argparse.Namespace, n_train_images: int | None) -> list[str]:
    """What differs from the run that wrote a mid-epoch checkpoint among the things that decide which images
    each step of the epoch gets (processes, batch, accumulation, seed, sampler, training-set size)."""
    saved, now = saved_args(ckpt), vars(args)
    rng = ckpt.get('rng_state')
    was_world = len(rng) if isinstance(rng, list) else saved.get('world_size')
    out = []
    if was_world is not None and was_world != distributed.get_world_size():
        out.append(f'the number of processes changed ({was_world} -> {distributed.get_world_size()})')
    for k in ('batch_size', 'accum_steps', 'seed', 'repeated_aug'):
        if k in saved and k in now and _differs(saved[k], now[k]):
            out.append(f'{_flag(k)} changed ({saved[k]} -> {now[k]})')
    n = ckpt.get('n_train_images')
    if isinstance(n, int) and n_train_images is not None and n != n_train_images:
        out.append(f'the training set changed ({n} -> {n_train_images} images)')
    return out


@dataclass
class Resume:
    """Where a resumed run continues: the epoch, the EpochState to start it with (a step inside it), the
    checkpoint it was read from (None when the run starts fresh), and the line that announces it (main.py
    prints it once --output_dir is known to take the run's checkpoints)."""
    start_epoch: int = 0
    state: EpochState = field(default_factory=EpochState)
    ckpt: Any = None
    message: str = ''


class TrainingCheckpoints:
    """Writes the checkpoints of one training run and restores a run from one.

    Rank 0 writes; a failed write stops every rank. ``record_accuracy`` keeps the best accuracy and
    which weights gave it; ``save`` writes the state once, to the first of the given names (checkpoint.pth),
    and copies it to the others in order; ``append_log`` adds the epoch's line to log.txt. ``resume``
    restores everything and repairs what a crash between those writes left behind."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, model_ema: Any, optimizer: Any,
                 lr_scheduler: Any, loss_scaler: Any, n_parameters: int, device: Any,
                 classes: Sequence[str] | None = None, n_train_images: int | None = None):
        self.args, self.model, self.model_ema = args, model, model_ema
        # the training data this run learns from, saved with every checkpoint and checked on resume
        self.classes = None if classes is None else [str(c) for c in classes]
        self.n_train_images = n_train_images
        self.optimizer, self.lr_scheduler, self.loss_scaler = optimizer, lr_scheduler, loss_scaler
        self.n_parameters, self.device = n_parameters, device
        self.output_dir = args.output_dir
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

    # ---- writing
    def state(self, epoch: int, names: Sequence[str], extra: dict[str, Any]) -> dict[str, Any]:
        state = {
            'model': self.model.state_dict(),
            'optimizer': self.optimizer.state_dict(),
            'lr_scheduler': self.lr_scheduler.state_dict(),
            'epoch': epoch,
            'scaler': self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            'args': args_to_dict(self.args),
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
        if self.model_ema is not None:
            state['model_ema'] = self.model_ema.module.state_dict()
        state.update(extra)
        state['checksum'] = {'sha256': checksums(state)}
        return state

    def save(self, epoch: int, extra: dict[str, Any], names: Sequence[str]) -> None:
        """Write the run's state after `epoch` to the first of `names` in --output_dir (nothing without one),
        then copy that file (a reflink where the filesystem has them) to the others, in order. Rank 0 writes;
        whatever stops it (a full disk, an object that cannot be pickled) stops every rank with one line."""
        if not self.output_dir:
            return
        first = os.path.join(self.output_dir, names[0])

        def write() -> None:
            try:
                save_atomic(self.state(epoch, names, extra), first)
                for name in names[1:]:
                    copy_atomic(first, os.path.join(self.output_dir, name))
            except UserError:
                raise
            except Exception as e:  # save_atomic names OSErrors; anything else (a pickling error) by its type
                raise CheckpointWriteError(f'could not write checkpoint {first}: {type(e).__name__}: '
                                           f'{first_line(e)}; the previous {names[0]} (if any) is kept') from e

        distributed.on_rank0(write, self.device, f'could not write checkpoint {first}')

    def append_log(self, record: dict[str, Any]) -> None:
        """Append the epoch's record to log.txt (rank 0; a failure stops every rank with one line). The record
        is also in the checkpoint, so a line lost to a crash or a full disk is written at the next resume."""
        if self.output_dir:
            distributed.on_rank0(lambda: metrics.write_log_line(self.output_dir, record), self.device,
                                 f'could not append to {os.path.join(self.output_dir, "log.txt")}')

    def estimate_bytes(self, resume_path: str = '') -> int:
        """Size of one checkpoint: the resumed file's, else weights (+ EMA) + two optimizer buffers per
        trainable parameter (AdamW's moments; an upper bound for SGD)."""
        if resume_path and os.path.isfile(resume_path):
            return os.path.getsize(resume_path)
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        trainable = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return weights * (2 if self.model_ema is not None else 1) + 2 * trainable

    # ---- resuming
    def resume(self, path: str, eval_only: bool = False) -> Resume:
        """Load `path`: the model weights always; for training also the optimizer (with the command
        line's settings), schedule, EMA, scaler, best accuracy, epoch/step and RNG state."""
        args = self.args
        r = Resume(args.start_epoch)
        if not path:
            return r
        ckpt = self._load_on_every_rank(path)
        training = not eval_only and isinstance(ckpt, dict) and all(
            k in ckpt for k in ('optimizer', 'lr_scheduler', 'epoch'))
        if training or eval_only:  # before the weights: other classes are the likelier cause of a head mismatch
            self._check_data(ckpt, path, eval_only)
        _, sd = select_weights(ckpt, path, 'model')
        load_weights_into(self.model, sd, args.model, path)
        r.ckpt = ckpt
        if not training:
            print(f'Loaded weights from {path}')
            return r
        self._load_optimizer(ckpt, path)
        print(f'Loaded weights from {path}')  # after the checks that may refuse the resume
        saved, fresh = ckpt['lr_scheduler'], self.lr_scheduler.state_dict()
        changed = sorted(k for k in fresh if k in saved and saved[k] != fresh[k])
        was = data_path_change(saved_args(ckpt), args)
        if was:  # moving a data set is normal, but the best accuracy may now compare two validation sets
            print(f'Note: --data-path changed since the checkpoint: {was} -> {args.data_path}; continuing on the '
                  f'images there (the best accuracy so far, {float(ckpt.get("max_accuracy", 0.0)):.2f}%, was '
                  f'measured on the validation set of {was})')
        flags = flag_changes(saved_args(ckpt), args)
        if flags:  # e.g. a longer --epochs: follow the command line, not the old schedule (DeiT did not)
            print('Note: changed since the checkpoint: ' + '; '.join(flags) + '; following the command line')
        elif changed:  # a checkpoint without its command line: name the schedule's own fields
            print('Note: the LR schedule changed since the checkpoint ('
                  + ', '.join(f'{k}: {saved[k]} -> {fresh[k]}' for k in changed[:4]) + '); following the command line')
        if not changed:
            self.lr_scheduler.load_state_dict(saved)
        if self.model_ema is not None:
            if isinstance(ckpt.get('model_ema'), dict):
                load_weights_into(self.model_ema.module, select_weights(ckpt, path, 'model_ema')[1], args.model, path)
            else:
                print('Warning: the checkpoint has no EMA weights; the EMA restarts from the model weights')
                self.model_ema.module.load_state_dict(self.model.state_dict())
        if self.loss_scaler is not None and ckpt.get('scaler'):
            self.loss_scaler.load_state_dict(ckpt['scaler'])
        self.max_accuracy = float(ckpt.get('max_accuracy', 0.0))
        self.best = {k: ckpt.get(k) for k in self.best}
        # consecutive skipped steps survive epochs and resumes; the epoch's own count only a mid-epoch resume
        skip_counts = ckpt.get(SKIP_COUNTS_KEY) or {}
        if ckpt.get('step'):
            r.start_epoch = int(ckpt['epoch'])
            r.state = EpochState(step=int(ckpt['step']), loss_meter=ckpt.get('loss_meter'),
                                 bad_steps=int(skip_counts.get('bad_steps', 0)),
                                 skipped_steps=int(skip_counts.get('skipped_steps', 0)))
        else:
            r.start_epoch = int(ckpt['epoch']) + 1
            r.state = EpochState(bad_steps=int(skip_counts.get('bad_steps', 0)))
        world, rank = distributed.get_world_size(), distributed.get_rank()
        rng = ckpt.get('rng_state')
        order = data_order_changes(ckpt, args, self.n_train_images) if r.state.step else []
        if order:
            # the data order of the rest of the epoch depends on these: a replay would feed other images
            print(f'Note: the checkpoint stopped inside epoch {r.start_epoch} at step {r.state.step}, and '
                  f'{", ".join(order)} since then, so the rest of that epoch cannot be replayed in its order: '
                  f'epoch {r.start_epoch} restarts from its first step')
            epoch_rng = ckpt.get('epoch_rng_state')
            r.state = EpochState(bad_steps=r.state.bad_steps,
                                 epoch_rng_state=epoch_rng[rank] if isinstance(epoch_rng, list)
                                 and len(epoch_rng) == world else None)
            if r.state.epoch_rng_state is None:
                print(f'Note: the checkpoint was written by {len(rng) if isinstance(rng, list) else "?"} '
                      f'process(es), this run has {world}: random-number state not restored')
        elif isinstance(rng, list) and len(rng) == world:
            if r.state.step:
                r.state.rng_state, r.state.epoch_rng_state = rng[rank], ckpt['epoch_rng_state'][rank]
            else:
                set_rng_state(rng[rank])
        else:
            writers = len(rng) if isinstance(rng, list) else 'an unknown number of'
            print(f'Note: the checkpoint was written by {writers} '
                  f'process(es), this run has {world}: random-number state not restored')
        if self.output_dir:
            distributed.on_rank0(lambda: run_repair.repair(self.output_dir, path, ckpt), self.device,
                                 f'could not repair the files of {self.output_dir} from {path}')
        where = f'epoch {r.start_epoch} step {r.state.step}' if r.state.step else f'epoch {r.start_epoch}'
        r.message = f'Resumed from {path}: continuing at {where}, best accuracy so far {self.max_accuracy:.2f}%'
        return r

    def _load_on_every_rank(self, path: str) -> Any:
        """Every rank loads `path` (rank 0's decision, run_dir.agree_on_resume_path) and checks that it read the
        checkpoint rank 0 read (epoch, step, checksum): a rank that cannot read it, or reads another file under
        that name (node-local directories, NFS lag), stops every rank with one line instead of training on from
        another state."""
        ckpt, err = None, None
        try:
            ckpt = load_checkpoint_file(path)
        except UserError as e:
            err = e
        except Exception as e:  # e.g. no permission to read it on this node
            err = CheckpointError(f'cannot read checkpoint {path}: {type(e).__name__}: {first_line(e)}')
        if not distributed.is_dist_avail_and_initialized():
            distributed.agree_on_errors(err, self.device)
            return ckpt
        mine = checkpoint_identity(ckpt, path) if err is None else None
        theirs = distributed.broadcast_object(mine)
        fix = 'every node must see the same --output_dir (a shared filesystem) and --resume file'
        if err is not None and theirs is not None:  # rank 0 read it, this rank cannot
            err = CheckpointError(f'{distributed.where()} cannot read {path}, which rank 0 resumes from '
                                  f'({first_line(err)}): {fix}')
        elif err is None and theirs is not None and mine != theirs:
            err = CheckpointError(f'{distributed.where()} reads another {path} than rank 0 ({describe_identity(mine)}'
                                  f' here, {describe_identity(theirs)} on rank 0): {fix}')
        distributed.agree_on_errors(err, self.device)
        return ckpt

    def _check_data(self, ckpt: Any, path: str, eval_only: bool = False) -> None:
        """Refuse to continue a run, or (`eval_only`) to evaluate a checkpoint, on other classes than it was
        trained on (labels would silently mean other things); note a changed number of training images. An
        evaluation that cannot compare (no classes recorded, or labels without names) says so."""
        saved = ckpt.get('classes') if isinstance(ckpt, dict) else None
        if eval_only and self.classes is None:
            print(f'Note: the validation labels are class indices, so they are not checked against the classes '
                  f'{path} was trained on')
        elif eval_only and not isinstance(saved, (list, tuple)):
            print(f'Note: {path} does not record the classes it was trained on (e.g. a reference checkpoint), so '
                  f'they are not checked: the accuracy assumes they are these {len(self.classes)} classes, in '
                  f'this order')
        if isinstance(saved, (list, tuple)) and self.classes is not None and list(saved) != self.classes:
            i = next((i for i, (a, b) in enumerate(zip(saved, self.classes)) if a != b), None)
            if i is not None:
                what = f'class {i} is {saved[i]!r} in the checkpoint but {self.classes[i]!r} in the data'
            else:
                longer, name = (saved, 'the checkpoint') if len(saved) > len(self.classes) else (self.classes,
                                                                                                  'the data')
                i = min(len(saved), len(self.classes))
                what = (f'the checkpoint has {len(saved)} classes, the data {len(self.classes)} '
                        f'(class {i} {longer[i]!r} only in {name})')
            fix = ('evaluate it on the data of that run (here its labels would count as other classes), or '
                   f'fine-tune it on these classes with --finetune {path}' if eval_only else
                   f'resume with the data of that run, or start a new run from its weights with --finetune {path} '
                   f'in another --output_dir')
            raise CheckpointError(f'{path} was trained on other classes than --data-path '
                                  f'{self.args.data_path} holds: {what}; {fix}')
        n = ckpt.get('n_train_images') if isinstance(ckpt, dict) else None
        if isinstance(n, int) and self.n_train_images is not None and n != self.n_train_images:
            print(f'Note: the training set has {self.n_train_images} images, {n} when the checkpoint was written '
                  f'(same classes); continuing on the images there are now')

    def _load_optimizer(self, ckpt: dict[str, Any], path: str) -> None:
        """Load the optimizer state, refusing one of another optimizer, then apply the command line's
        weight decay, betas, eps, momentum and layer-wise LR scale (as the LR schedule follows it)."""
        fresh = [{k: v for k, v in g.items() if k != 'params'} for g in self.optimizer.param_groups]
        groups = ckpt['optimizer'].get('param_groups') or [{}]
        saved_opt = saved_args(ckpt).get('opt')
        kind = {k for k in ('betas', 'momentum') if k in groups[0]}
        if (saved_opt and str(saved_opt).lower() != str(self.args.opt).lower()) \
                or kind != {k for k in ('betas', 'momentum') if k in fresh[0]}:
            was = (f'--opt {saved_opt}' if saved_opt
                   else f'an optimizer with {", ".join(sorted(kind)) or "other settings"}')
            raise CheckpointError(f'the optimizer state in {path} is from {was}, '
                                  f'this run has --opt {self.args.opt}: '
                                  f'relaunch with --opt {saved_opt or "as before"}, '
                                  f'or start a new run from its weights with --finetune {path} in another --output_dir')
        try:
            self.optimizer.load_state_dict(ckpt['optimizer'])
        except (ValueError, KeyError) as e:
            raise CheckpointError(f'the optimizer state in {path} does not fit this run ({first_line(e)}); '
                                  f'were --opt/--attn-only different? use --finetune to start from its weights') from e
        changed: dict[str, list[tuple[Any, Any]]] = {}
        for group, want in zip(self.optimizer.param_groups, fresh):
            for k in FOLLOWED_OPTIMIZER_KEYS:
                if k in want and _comparable(group.get(k)) != _comparable(want[k]):
                    pair = (_comparable(group.get(k)), _comparable(want[k]))
                    if pair not in changed.setdefault(k, []):
                        changed[k].append(pair)
                    group[k] = want[k]
        if changed:
            print('Note: optimizer settings changed since the checkpoint ('
                  + ', '.join(f'{k}: ' + ', '.join(f'{a} -> {b}' for a, b in changed[k][:3])
                              for k in FOLLOWED_OPTIMIZER_KEYS if k in changed)
                  + '); following the command line')

