"""Resuming a run from its checkpoint, one path for every task: every rank loads the file rank 0 chose and checks
that it read the same state (load_agreed), the flags the command line changed since the checkpoint are noted
(changed_flags, note_changes), each rank's random-number state comes back when as many processes wrote it
(rank_rng_state), the weights, optimizer, schedule and fp16 scaler are loaded into the parts the run trains
(restore), and the run directory is repaired (output_dir.repair_after_resume). Classification continues at an epoch,
or inside one (EpochState: the step, the random-number state that replays its batches, the loss so far);
segmentation and detection at an iteration (resume_iteration_run; take_recorded_flags fills in the model and data
flags an evaluation or a resume leaves out from the checkpoint). Also the random-number state of every generator a
step draws from, and evaluating a checkpoint's classes against the data's.
"""
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from models.weight_files import is_safetensors
from run import distributed
from run.checkpoint import (
    IterationCheckpoints,
    RunCheckpoints,
    check_task,
    checkpoint_identity,
    comparable,
    describe_identity,
    load_checkpoint_file,
    saved_args,
)
from run.errors import CheckpointError, UserError, first_line
from run.output_dir import repair_after_resume
from run.weights import check_weights, load_weights_into, select_weights


# --------------------------------------------------------------------------------------------------
# Where training stands, and the random-number state
# --------------------------------------------------------------------------------------------------
def get_rng_state() -> dict:
    """torch, numpy and python RNG state (and this process's CUDA device's) as objects that
    torch.load(weights_only=True) reads back."""
    np_state = np.random.get_state()
    state = {
        'torch': torch.get_rng_state(),
        'numpy': {'name': str(np_state[0]), 'keys': torch.from_numpy(np_state[1].astype(np.int64)),
                  'pos': int(np_state[2]), 'has_gauss': int(np_state[3]), 'cached_gaussian': float(np_state[4])},
        'python': random.getstate(),  # (version, tuple of ints, float or None): plain already
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this process's own device only: another launch may see fewer GPUs per process
        state['cuda'] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    """Restore get_rng_state()'s result; the CUDA state goes to this process's current device."""
    torch.set_rng_state(state['torch'])
    n = state['numpy']
    np.random.set_state((n['name'], n['keys'].numpy().astype(np.uint32), n['pos'], n['has_gauss'],
                         n['cached_gaussian']))
    py = state['python']
    random.setstate((py[0], tuple(py[1]), py[2]))
    cuda = state.get('cuda')
    if cuda is not None and torch.cuda.is_available():
        device = torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):  # a list: every visible device's state, by device index
            cuda = cuda[device] if device < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


class preserved_rng:
    """Context manager: the torch/numpy/python RNG state is the same after the block as before."""

    def __enter__(self):
        self.state = get_rng_state()

    def __exit__(self, *exc):
        set_rng_state(self.state)
        return False


#: every rank's RNG state, in rank order (collective under torch.distributed)
gather_rng = distributed.gather_objects


def rng_state_entries() -> dict[str, Any]:
    """The checkpoint entry of every rank's random-number state now, ``rng_state`` (collective: every rank calls
    it)."""
    return {'rng_state': gather_rng(get_rng_state())}


def rank_rng_state(ckpt: dict[str, Any]) -> dict | None:
    """This process's random-number state in the checkpoint `ckpt` (its ``rng_state``, one entry per process) when
    as many processes wrote it as this run has; else None, with a note: the random draws then differ from those
    of an uninterrupted run."""
    rng, world = ckpt.get('rng_state'), distributed.get_world_size()
    if isinstance(rng, list) and len(rng) == world:
        return rng[distributed.get_rank()]
    writers = len(rng) if isinstance(rng, list) else 'an unknown number of'
    print(f'Note: the checkpoint was written by {writers} process(es), this run has {world}: random-number state '
          f'not restored')
    return None


@dataclass
class EpochState:
    """Where training stands inside an epoch: the first step not yet run, what a resume at that step needs,
    and the skipped-step counts. engine.train_one_epoch takes and returns it; epoch_state_entries and
    checkpoint.RunCheckpoints save it, resume loads it (docs/checkpoints.md#the-checkpoint-format)."""
    step: int = 0                           # the first step of the epoch not yet run (0: the epoch's start)
    rng_state: dict | None = None        # RNG state at `step` (a mid-epoch stop)
    epoch_rng_state: dict | None = None  # RNG state before the epoch's data iterator was created
    loss_meter: dict | None = None       # this rank's loss meter of the epoch so far: {'total': ..., 'count': ...}
    bad_steps: int = 0      # consecutive skipped optimizer steps, counted across epochs
    skipped_steps: int = 0  # optimizer steps skipped so far in this epoch


#: the checkpoint entry of EpochState's skipped-step counts
SKIP_COUNTS_KEY = 'train_carry'


def epoch_state_entries(state: EpochState) -> dict[str, Any]:
    """The checkpoint entries of where training stands (collective: every rank calls it). Between epochs
    (``state.step`` 0): every rank's RNG state now; inside an epoch: ``step``, every rank's RNG state at
    the stop and before the epoch's data iterator, and every rank's loss meter. Always the skipped-step counts."""
    skip_counts = {'bad_steps': state.bad_steps, 'skipped_steps': state.skipped_steps}
    if not state.step:
        return {**rng_state_entries(), SKIP_COUNTS_KEY: skip_counts}
    return {'step': state.step, 'rng_state': gather_rng(state.rng_state),
            'epoch_rng_state': gather_rng(state.epoch_rng_state),
            'loss_meter': distributed.gather_objects(state.loss_meter),
            SKIP_COUNTS_KEY: skip_counts}


# --------------------------------------------------------------------------------------------------
# The steps every task's resume takes
# --------------------------------------------------------------------------------------------------
def load_agreed(path: str, device: Any) -> Any:
    """Every rank loads `path` (rank 0's decision, output_dir.agree_on_resume_path) and checks that it read the
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
        distributed.agree_on_errors(err, device)
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
    distributed.agree_on_errors(err, device)
    return ckpt


def flag_of(key: str) -> str:
    """'--batch-size' of the argparse destination 'batch_size'."""
    return '--' + key.replace('_', '-')


def differs(a: Any, b: Any) -> bool:
    """Whether two values of a flag differ (floats up to rounding, a list read back from a checkpoint equal to the
    tuple it was)."""
    if isinstance(a, float) or isinstance(b, float):
        try:
            return not math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            pass
    return comparable(a) != comparable(b)


def changed_flags(saved: dict[str, Any], now: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """'--lr 0.001 -> 0.002' for each flag of `keys` (argparse destinations) whose value in this run's command line
    `now` differs from the checkpoint's `saved` (both as dicts)."""
    return [f'{flag_of(k)} {saved[k]} -> {now.get(k)}' for k in keys
            if k in saved and k in now and differs(saved[k], now[k])]


def note_changes(changes: Sequence[str]) -> None:
    """The note of what the command line changed since the checkpoint (changed_flags' lines; none when empty): the
    resumed run follows the command line."""
    if changes:
        print('Note: changed since the checkpoint: ' + '; '.join(changes) + '; following the command line')


def check_model_flags(saved: dict[str, Any], now: dict[str, Any], keys: Sequence[str], path: str,
                      same: Callable[[str, Any, Any], bool] | None = None) -> None:
    """Refuse, in one line (CheckpointError), the checkpoint `path` whose model was built with other values of the
    model flags `keys` than this run's (`saved`, `now`: the two command lines as dicts); `same(key, saved, given)`
    says when two values build the same model (default: equal)."""
    same = same or (lambda key, a, b: a == b)
    other = [f'{flag_of(k)} {saved[k]}' for k in keys if k in saved and not same(k, saved[k], now.get(k))]
    if other:
        raise CheckpointError(f'{path} holds a model built with {" ".join(other)}; pass the same flags')


# --------------------------------------------------------------------------------------------------
# Resuming a classification run
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeSettings:
    """The flags a resume reads, each named as its argparse destination."""
    model: str                # whose weights the checkpoint must hold
    opt: str                  # the optimizer state must be of this kind
    data_path: str | None     # where the data are now (a changed path is noted)
    start_epoch: int          # where a run without a checkpoint starts


@dataclass
class Resume:
    """Where a resumed run continues: the epoch, the EpochState to start it with (a step inside it), the
    checkpoint it was read from (None when the run starts fresh), whether its training state was restored (not
    only its weights), and the line that announces it (main.py prints it once --output_dir is known to take the
    run's checkpoints)."""
    start_epoch: int = 0
    state: EpochState = field(default_factory=EpochState)
    ckpt: Any = None
    training: bool = False
    message: str = ''
    unevaluated: dict[str, Any] | None = None  # unevaluated_epoch's entries: the epoch before start_epoch to evaluate


@dataclass(frozen=True)
class TrainingRestore:
    """What a training resume restores besides the weights, as resume.py decided it."""
    opt: str                  # this run's --opt: the optimizer state must be of its kind
    saved_opt: Any            # the --opt the checkpoint records (None where it records none)
    schedule: bool            # the checkpoint's LR schedule state (False: the command line changed the schedule)
    rng_state: dict | None    # this process's random-number state to set now (None: not restored here)


#: the parameter-group settings that come from the command line also on resume (the LR comes from the schedule)
FOLLOWED_OPTIMIZER_KEYS = ('weight_decay', 'betas', 'eps', 'momentum', 'lr_scale')


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any], path: str, saved_opt: Any,
                         opt: str) -> None:
    """Load the optimizer `state` of checkpoint `path` (written by a run with --opt `saved_opt`, None where it does
    not record it) into `optimizer` (this run's, --opt `opt`), refusing one of another optimizer, then apply the
    command line's weight decay, betas, eps, momentum and layer-wise LR scale (as the LR schedule follows it)."""
    fresh = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    groups = state.get('param_groups') or [{}]
    kind = {k for k in ('betas', 'momentum') if k in groups[0]}
    if (saved_opt and str(saved_opt).lower() != str(opt).lower()) \
            or kind != {k for k in ('betas', 'momentum') if k in fresh[0]}:
        was = (f'--opt {saved_opt}' if saved_opt
               else f'an optimizer with {", ".join(sorted(kind)) or "other settings"}')
        raise CheckpointError(f'the optimizer state in {path} is from {was}, '
                              f'this run has --opt {opt}: '
                              f'relaunch with --opt {saved_opt or "as before"}, '
                              f'or start a new run from its weights with --finetune {path} in another --output_dir')
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f'the optimizer state in {path} does not fit this run ({first_line(e)}); were '
                              f'--model/--opt/--attn-only different? use --finetune to start from its weights') from e
    changed: dict[str, list[tuple[Any, Any]]] = {}
    for group, want in zip(optimizer.param_groups, fresh):
        for k in FOLLOWED_OPTIMIZER_KEYS:
            if k in want and comparable(group.get(k)) != comparable(want[k]):
                pair = (comparable(group.get(k)), comparable(want[k]))
                if pair not in changed.setdefault(k, []):
                    changed[k].append(pair)
                group[k] = want[k]
    if changed:
        print('Note: optimizer settings changed since the checkpoint ('
              + ', '.join(f'{k}: ' + ', '.join(f'{a} -> {b}' for a, b in changed[k][:3])
                          for k in FOLLOWED_OPTIMIZER_KEYS if k in changed)
              + '); following the command line')


def restore(checkpoints: RunCheckpoints, ckpt: dict[str, Any], path: str, model_name: str,
            training: TrainingRestore | None) -> None:
    """Load the checkpoint `ckpt` (read from `path`) into the parts `checkpoints` saves, the inverse of its
    ``state``: with `training` the optimizer state (refused when of another kind than --opt; then the command
    line's settings), the LR schedule, the fp16 loss scale, the best accuracy and the random-number state as
    `training` says, and the EMA weights (from the model's when the checkpoint has none, with a warning); always the
    model weights of `model_name`. The weights and the optimizer's kind are checked before anything is loaded: a
    refusal (one line) leaves every part as it was."""
    parts = checkpoints.parts
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
        checkpoints.restore_best(ckpt)
        if training.rng_state is not None:
            set_rng_state(training.rng_state)
    for module, sd in weights:
        module.load_state_dict(sd, strict=True)
    if ema is not None and not ema_saved:
        print('Warning: the checkpoint has no EMA weights; the EMA restarts from the model weights')
        ema.module.load_state_dict(parts.model.state_dict())


def resume(path: str, checkpoints: RunCheckpoints, settings: ResumeSettings, recorded: dict[str, Any], *,
           eval_only: bool = False, changes: Sequence[str] = ()) -> Resume:
    """Load `path` into the parts `checkpoints` saves: the model weights always; for training also the optimizer
    (with the command line's settings), schedule, EMA, scaler, best accuracy, epoch/step and RNG state, then the
    run directory repaired. `recorded` is the command line the checkpoint records, as the start-up read it
    (checkpoint.recorded_args); `changes` what this command line changes against it, in flag terms
    (training.optim.flag_changes), noted when training continues. What to restore is decided first, with its notes;
    restore then loads it. '' starts afresh at --start_epoch."""
    if not path:
        return Resume(settings.start_epoch)
    ckpt = load_agreed(path, checkpoints.device)
    training = not eval_only and isinstance(ckpt, dict) and all(
        k in ckpt for k in ('optimizer', 'lr_scheduler', 'epoch'))
    if training or eval_only:  # before the weights: other classes are the likelier cause of a head mismatch
        check_classes(ckpt, path, checkpoints.classes, checkpoints.n_train_images, settings.data_path, eval_only)
    r, what = Resume(settings.start_epoch), None
    if training:
        schedule = _schedule_kept(ckpt, recorded, checkpoints.parts.lr_scheduler, settings.data_path, changes)
        r, rng = _where_training_stands(ckpt, recorded, checkpoints.run_args, checkpoints.n_train_images)
        what = TrainingRestore(settings.opt, recorded.get('opt'), schedule, rng)
    restore(checkpoints, ckpt, path, settings.model, what)
    print(f'Loaded weights from {path}')  # after the checks that may refuse the resume
    r.ckpt, r.training = ckpt, training
    if training:
        r.unevaluated = unevaluated_epoch(ckpt)
        where = f'epoch {r.start_epoch} step {r.state.step}' if r.state.step else f'epoch {r.start_epoch}'
        r.message = (f'Resumed from {path}: continuing at {where}, best accuracy so far '
                     f'{checkpoints.max_accuracy:.2f}%')
        repair_after_resume(checkpoints.output_dir, path, ckpt, checkpoints.device)
    return r


def unevaluated_epoch(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The entries of a checkpoint of a finished epoch that a stop during its evaluation saved without its accuracy
    (no ``acc1``, a log record without test_* entries): that log record and where training stood (the RNG states and
    skipped-step counts), with which the resumed run saves the epoch again once it has evaluated it. None for
    any other checkpoint (an evaluated epoch, a stop inside an epoch, a reference checkpoint)."""
    if ckpt.get('step') or 'acc1' not in ckpt or ckpt['acc1'] is not None or not isinstance(ckpt.get('log'), dict):
        return None
    return {k: ckpt[k] for k in ('log', 'rng_state', SKIP_COUNTS_KEY) if k in ckpt}


def check_resumable(path: str, eval_only: bool) -> None:
    """Refuse in one line to continue training from a release (tools/release.py's safetensors): it holds weights
    only, no optimizer state, LR schedule or epoch to continue from; --finetune starts a run from them."""
    if path and not eval_only and is_safetensors(path):
        raise CheckpointError(f'--resume {path} is a release (weights only: no optimizer state, LR schedule or epoch '
                              f'to continue from): start a training run from its weights with --finetune {path}, '
                              f'or evaluate it with --eval --resume {path}')


def check_classes(ckpt: Any, path: str, classes: list[str] | None, n_train_images: int | None,
                  data_path: str | None, eval_only: bool = False) -> None:
    """Refuse to continue a run, or (`eval_only`) to evaluate a checkpoint, on other classes than it was
    trained on (labels would silently mean other things); note a changed number of training images. An
    evaluation that cannot compare (no classes recorded, or labels without names) says so."""
    saved = ckpt.get('classes') if isinstance(ckpt, dict) else None
    if eval_only and classes is None:
        print(f'Note: the validation labels are class indices, so they are not checked against the classes '
              f'{path} was trained on')
    elif eval_only and not isinstance(saved, (list, tuple)):
        print(f'Note: {path} does not record the classes it was trained on (e.g. a reference checkpoint), so '
              f'they are not checked: the accuracy assumes they are these {len(classes)} classes, in this order')
    if isinstance(saved, (list, tuple)) and classes is not None and list(saved) != classes:
        fix = ('evaluate it on the data of that run (here its labels would count as other classes), or '
               f'fine-tune it on these classes with --finetune {path}' if eval_only else
               f'resume with the data of that run, or start a new run from its weights with --finetune {path} '
               f'in another --output_dir')
        raise CheckpointError(f'{path} was trained on other classes than --data-path {data_path} holds: '
                              f'{_first_difference(list(saved), classes)}; {fix}')
    n = ckpt.get('n_train_images') if isinstance(ckpt, dict) else None
    if isinstance(n, int) and n_train_images is not None and n != n_train_images:
        print(f'Note: the training set has {n_train_images} images, {n} when the checkpoint was written '
              f'(same classes); continuing on the images there are now')


def _first_difference(saved: list[str], classes: list[str]) -> str:
    """Where the checkpoint's classes and the data's part, in words."""
    i = next((i for i, (a, b) in enumerate(zip(saved, classes)) if a != b), None)
    if i is not None:
        return f'class {i} is {saved[i]!r} in the checkpoint but {classes[i]!r} in the data'
    longer, name = (saved, 'the checkpoint') if len(saved) > len(classes) else (classes, 'the data')
    i = min(len(saved), len(classes))
    return f'the checkpoint has {len(saved)} classes, the data {len(classes)} (class {i} {longer[i]!r} only in {name})'


def _schedule_kept(ckpt: dict[str, Any], recorded: dict[str, Any], lr_scheduler: Any, data_path: str | None,
                   changes: Sequence[str]) -> bool:
    """Whether the checkpoint's LR schedule state is restored: yes unless the command line changed it against the
    command line the checkpoint records (then the command line's, with a note naming what changed: the flags of
    `changes`, or without them the schedule's own fields); a note when the data moved."""
    saved, fresh = ckpt['lr_scheduler'], lr_scheduler.state_dict()
    changed = sorted(k for k in fresh if k in saved and saved[k] != fresh[k])
    was = data_path_change(recorded, data_path)
    if was:  # moving a data set is normal, but the best accuracy may now compare two validation sets
        print(f'Note: --data-path changed since the checkpoint: {was} -> {data_path}; continuing on the '
              f'images there (the best accuracy so far, {float(ckpt.get("max_accuracy", 0.0)):.2f}%, was '
              f'measured on the validation set of {was})')
    if changes:  # e.g. a longer --epochs: the schedule of the command line
        note_changes(changes)
    elif changed:
        print('Note: the LR schedule changed since the checkpoint ('
              + ', '.join(f'{k}: {saved[k]} -> {fresh[k]}' for k in changed[:4]) + '); following the command line')
    return not changed


def _where_training_stands(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any],
                           n_train_images: int | None) -> tuple[Resume, dict | None]:
    """The epoch and EpochState the run continues from: after the checkpoint's epoch, or inside it where a stop
    saved it (_inside_the_epoch). Also this process's random-number state to set before the next epoch (None: not
    restored, or the EpochState holds it)."""
    # consecutive skipped steps survive epochs and resumes; the epoch's own count only a mid-epoch resume
    skip_counts = ckpt.get(SKIP_COUNTS_KEY) or {}
    bad_steps = int(skip_counts.get('bad_steps', 0))
    if ckpt.get('step'):
        return _inside_the_epoch(ckpt, saved, now, n_train_images, bad_steps), None
    return Resume(int(ckpt['epoch']) + 1, EpochState(bad_steps=bad_steps)), rank_rng_state(ckpt)


def _inside_the_epoch(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any], n_train_images: int | None,
                      bad_steps: int) -> Resume:
    """Where a run resumes from a stop inside an epoch: at the stop's step, replayed exactly (every rank's
    random-number state) when the processes, batch and accumulation are the checkpoint's; with another number of
    processes, --batch-size or --accum-steps, at the step of this run where the epoch's images continue in their
    order (continued_step), when there is one; else, or when the order itself changed (seed, sampler, training
    set), from the epoch's first step. Each but the exact replay with a note."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    epoch, step = int(ckpt['epoch']), int(ckpt['step'])
    skip_counts = ckpt.get(SKIP_COUNTS_KEY) or {}
    rng, epoch_rng = ckpt.get('rng_state'), ckpt.get('epoch_rng_state')
    same_world = isinstance(rng, list) and len(rng) == world
    order, split = data_order_changes(ckpt, saved, now, n_train_images), split_changes(ckpt, saved, now)
    new_step = None if order else step if not split else continued_step(ckpt, saved, now)
    if new_step is None:
        # the images of the rest of the epoch depend on these: a replay would feed other images
        print(f'Note: the checkpoint stopped inside epoch {epoch} at step {step}, and {", ".join(order + split)} '
              f'since then, so the rest of that epoch cannot be replayed in its order: epoch {epoch} restarts from '
              f'its first step')
        state = EpochState(bad_steps=bad_steps, epoch_rng_state=epoch_rng[rank] if same_world
                           and isinstance(epoch_rng, list) else None)
        if state.epoch_rng_state is None:
            print(f'Note: the checkpoint was written by {len(rng) if isinstance(rng, list) else "?"} '
                  f'process(es), this run has {world}: random-number state not restored')
        return Resume(epoch, state)
    try:  # the meter averages batch losses: counted in this run's batches, the average stays one per image
        batches = int(saved['batch_size']) / int(now['batch_size'])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        batches = 1.0
    state = EpochState(step=new_step, loss_meter=_loss_meter(ckpt.get('loss_meter'), world, rank, batches),
                       bad_steps=bad_steps, skipped_steps=int(skip_counts.get('skipped_steps', 0)))
    if same_world:  # every rank's streams continue (under another batch split they feed other draws)
        state.rng_state = rng[rank]
        state.epoch_rng_state = epoch_rng[rank] if isinstance(epoch_rng, list) else None
    elif not split:
        print(f'Note: the checkpoint was written by an unknown number of process(es), this run has {world}: '
              f'random-number state not restored')
    if split:
        drawn = ('' if same_world else f'; the checkpoint was written by {len(rng) if isinstance(rng, list) else "?"}'
                 f' process(es), this run has {world}: random-number state not restored, so random augmentation, '
                 f'Mixup/CutMix, random erasing and drop path draw other values than an uninterrupted run')
        print(f'Note: the checkpoint stopped inside epoch {epoch} at step {step}, and {", ".join(split)} since '
              f'then: the epoch continues at step {new_step} of this run, with the images of its order that '
              f'the stop had not reached{drawn}')
    return Resume(epoch, state)


def continued_step(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any]) -> int | None:
    """The step of this run (batches per process) at which it has taken as many images of the epoch's order as the
    checkpoint's stop had (its step x --batch-size x processes), when that ends one of its optimizer steps (a
    whole --accum-steps window); None otherwise, or when the checkpoint records no batch. Every training sampler
    here deals the epoch's order out to the processes in turn, one image each, so a step of any split into
    processes and micro-batches takes the next --batch-size x processes x --accum-steps images of the order."""
    rng = ckpt.get('rng_state')
    try:
        was_world = len(rng) if isinstance(rng, list) else int(saved['world_size'])
        taken = int(ckpt['step']) * int(saved['batch_size']) * was_world
        per_step = int(now['batch_size']) * distributed.get_world_size()
        window = per_step * int(now.get('accum_steps') or 1)
    except (KeyError, TypeError, ValueError):
        return None
    return taken // per_step if taken % window == 0 else None


def _loss_meter(saved: Any, world: int, rank: int, batches: float = 1.0) -> dict | None:
    """This process's part of the epoch's loss meter (its batch losses, summed over the processes at the epoch's
    end): its own when the checkpoint holds one per process of as many processes; with another number, all of
    them summed on rank 0 and nothing on the others. `batches`: how many of this run's batches one of the
    checkpoint's makes (its --batch-size over ours), by which the count and total are scaled, so that the epoch's
    average weighs every image alike. A checkpoint holding one meter (rank 0's) gives it to every rank."""
    if not isinstance(saved, list):
        return saved
    if len(saved) == world:
        meter = saved[rank]
    elif rank:
        return {'total': 0.0, 'count': 0}
    else:
        meters = [m for m in saved if isinstance(m, dict)]
        meter = {'total': sum(float(m['total']) for m in meters), 'count': sum(int(m['count']) for m in meters)}
    if batches == 1.0 or not isinstance(meter, dict):
        return meter
    return {'total': float(meter['total']) * batches, 'count': round(int(meter['count']) * batches)}


def data_path_change(saved: dict[str, Any], data_path: str | None) -> str:
    """The checkpoint's --data-path when `data_path` names another directory, else ''. Paths are compared
    absolute and normalised (a relative one from the current directory), and two names of one existing
    directory (a link) are the same path."""
    was, now = saved.get('data_path'), data_path
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


def split_changes(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the run that wrote the mid-epoch checkpoint `ckpt` (its command line `saved`) and this
    one (`now`) in how a step's images are split into processes and micro-batches (processes, batch,
    accumulation): the order of the epoch's images stays, the stop's step may map onto another (continued_step)."""
    rng = ckpt.get('rng_state')
    was_world = len(rng) if isinstance(rng, list) else saved.get('world_size')
    out = []
    if was_world is not None and was_world != distributed.get_world_size():
        out.append(f'the number of processes changed ({was_world} -> {distributed.get_world_size()})')
    for k in ('batch_size', 'accum_steps'):
        if k in saved and k in now and differs(saved[k], now[k]):
            out.append(f'{flag_of(k)} changed ({saved[k]} -> {now[k]})')
    return out


def data_order_changes(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any],
                       n_train_images: int | None) -> list[str]:
    """What differs between the run that wrote the mid-epoch checkpoint `ckpt` (its command line `saved`) and this
    one (`now`) among the things that decide the order of the epoch's images (seed, sampler, training-set
    size)."""
    out = []
    for k in ('seed', 'repeated_aug'):
        if k in saved and k in now and differs(saved[k], now[k]):
            out.append(f'{flag_of(k)} changed ({saved[k]} -> {now[k]})')
    n = ckpt.get('n_train_images')
    if isinstance(n, int) and n_train_images is not None and n != n_train_images:
        out.append(f'the training set changed ({n} -> {n_train_images} images)')
    return out


# --------------------------------------------------------------------------------------------------
# Resuming a run counted in iterations (segmentation, detection)
# --------------------------------------------------------------------------------------------------
def load_iteration_checkpoint(path: str, checkpoints: IterationCheckpoints, model_flags: Sequence[str],
                              same: Callable[[str, Any, Any], bool] | None = None) -> dict[str, Any]:
    """`path` loaded on every rank and checked to be the same state everywhere (load_agreed), a checkpoint of the
    run's task (checkpoint.check_task) of a model built with the run's `model_flags` (check_model_flags, `same`
    as there), its weights loaded into the bare model strictly."""
    ckpt = load_agreed(path, checkpoints.device)
    check_task(ckpt, path, checkpoints.task)
    check_model_flags(saved_args(ckpt), checkpoints.run_args, model_flags, path, same)
    load_weights_into(checkpoints.parts.model, ckpt['model'], checkpoints.run_args['model'], path)
    return ckpt


def resume_iterations(path: str, checkpoints: IterationCheckpoints, *, model_flags: Sequence[str],
                      noted_flags: Sequence[str],
                      same: Callable[[str, Any, Any], bool] | None = None) -> dict[str, Any]:
    """Continue the run of the checkpoint `path` (an IterationCheckpoints state): its weights
    (load_iteration_checkpoint), optimizer and fp16 scaler, a note of the `noted_flags` the command line changed,
    each rank's random-number state when as many processes wrote it, and the run directory repaired. Returns the
    loaded checkpoint, whose ``iter`` and task entries say where the run continues."""
    ckpt = load_iteration_checkpoint(path, checkpoints, model_flags, same)
    parts = checkpoints.parts
    try:
        parts.optimizer.load_state_dict(ckpt['optimizer'])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f'the optimizer state in {path} does not fit this run ({first_line(e)}); start '
                              f'a new run from its weights in another --output_dir') from e
    if parts.loss_scaler is not None and ckpt.get('scaler'):
        parts.loss_scaler.load_state_dict(ckpt['scaler'])
    note_changes(changed_flags(saved_args(ckpt), checkpoints.run_args, noted_flags))
    rng = rank_rng_state(ckpt)
    if rng is not None:
        set_rng_state(rng)
    repair_after_resume(checkpoints.output_dir, path, ckpt, checkpoints.device, key=checkpoints.progress_key)
    return ckpt


def _flag_value(key: str, value: Any) -> str:
    """'--img-scale 128 64': a flag as typed."""
    shown = ' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return f'{flag_of(key)} {shown}'


def take_recorded_flags(args: Any, path: str, defaults: Any, *, task: str, recorded_flags: Sequence[str],
                        model_flags: Sequence[str], same: Callable[[str, Any, Any], bool] | None = None) -> None:
    """Fill in the flags of `recorded_flags` the command line did not give (None): the value the `task` checkpoint
    `path` (the one --eval measures or a run resumes; '' for none) records, else `defaults[key]` (the recipe's).
    Prints one line naming the recorded values taken that differ from the defaults, and one line naming the given
    values that differ from the recorded ones (the command line wins); a given flag of `model_flags` whose value
    builds another model than the checkpoint's (`same(key, saved, given)`, default: equal) is one line
    (CheckpointError)."""
    same = same or (lambda key, a, b: a == b)
    recorded: dict[str, Any] = {}
    if path:
        ckpt = load_checkpoint_file(path, verify=False, mmap=True)  # the command line only: tensors not read
        check_task(ckpt, path, task)
        recorded = saved_args(ckpt)
    taken, overridden = [], []
    for key in recorded_flags:
        given, saved = comparable(getattr(args, key)), comparable(recorded.get(key, defaults[key]))
        if given is None:
            setattr(args, key, saved)
            if key in recorded and saved != comparable(defaults[key]):
                taken.append(_flag_value(key, saved))
        elif key in recorded and given != saved:
            if key in model_flags and not same(key, saved, given):
                raise CheckpointError(f'{path} holds a model built with {_flag_value(key, saved)}, this command '
                                      f'passes {_flag_value(key, given)}: leave the flag out (the checkpoint gives it)')
            overridden.append(f'{_flag_value(key, given)} (the checkpoint: {_flag_value(key, saved)})')
    if taken:
        print(f'{" ".join(taken)}: as recorded in {path} (pass a flag to choose another value)')
    if overridden:
        print(f'Note: {"; ".join(overridden)}: the command line differs from {path}; using the command line')


@dataclass
class IterationResume:
    """Where a run counted in iterations continues: the iteration, the consecutive skipped steps, the best score so
    far (mIoU, box AP) and at which iteration, whether the evaluation of `start_iter` is still due, the loop's
    progress state, the score of the checkpoint's own evaluation (`last`), and the loaded checkpoint (None when the
    run starts afresh)."""
    start_iter: int = 0
    bad_steps: int = 0
    best: float = -1.0
    best_iter: int | None = None
    eval_due: bool = False
    progress: dict | None = None
    last: float | None = None
    ckpt: Any = None


def resume_iteration_run(path: str, checkpoints: IterationCheckpoints, *, model_flags: Sequence[str],
                         noted_flags: Sequence[str], best_key: str, score_key: str,
                         same: Callable[[str, Any, Any], bool] | None = None) -> IterationResume:
    """Continue the run of `path` ('' for none: a fresh start) through resume_iterations, then read the loop's own
    entries: ``iter``, ``bad_steps``, the best score under `best_key` with ``best_iter``, ``eval_due``, ``progress``
    and the last evaluation's score (`score_key` of its ``log`` record)."""
    if not path:
        return IterationResume()
    ckpt = resume_iterations(path, checkpoints, model_flags=model_flags, noted_flags=noted_flags, same=same)
    return IterationResume(start_iter=int(ckpt['iter']), bad_steps=int(ckpt.get('bad_steps', 0)),
                           best=float(ckpt.get(best_key, -1.0)), best_iter=ckpt.get('best_iter'),
                           eval_due=bool(ckpt.get('eval_due')), progress=ckpt.get('progress'),
                           last=(ckpt.get('log') or {}).get(score_key), ckpt=ckpt)
