"""Resuming a training run from a checkpoint, and evaluating one: every rank loads the file rank 0 chose and
checks that it read the same state, the data are checked against the classes it was trained on, and what to
restore is decided (the LR schedule unless the command line changed it, where training stands: epoch, step,
random-number state), with a note for each thing that changed since the checkpoint. The saver then loads the
state into the parts it saves (CheckpointSaver.restore) and, after a training resume, brings the run directory
in line with it (CheckpointSaver.repair, which main.py calls).
"""
import math
import os
from dataclasses import dataclass, field
from typing import Any

import distributed
from checkpoint import comparable
from checkpoint_io import checkpoint_identity, describe_identity, load_checkpoint_file
from ema import ema_decay
from errors import CheckpointError, UserError, first_line
from models.weight_files import is_safetensors
from saver import CheckpointSaver, TrainingRestore
from schedule import SCHEDULE_FLAGS
from train_state import SKIP_COUNTS_KEY, EpochState


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


def resume(path: str, saver: CheckpointSaver, settings: ResumeSettings, recorded: dict[str, Any],
           eval_only: bool = False) -> Resume:
    """Load `path` into the parts `saver` saves: the model weights always; for training also the optimizer (with
    the command line's settings), schedule, EMA, scaler, best accuracy, epoch/step and RNG state. `recorded` is
    the command line the checkpoint records, as the start-up read it (checkpoint.recorded_args). What to restore
    is decided first, with its notes; the saver then loads it into the parts. '' starts afresh at --start_epoch."""
    if not path:
        return Resume(settings.start_epoch)
    ckpt = load_agreed(path, saver.device)
    training = not eval_only and isinstance(ckpt, dict) and all(
        k in ckpt for k in ('optimizer', 'lr_scheduler', 'epoch'))
    if training or eval_only:  # before the weights: other classes are the likelier cause of a head mismatch
        check_classes(ckpt, path, saver.classes, saver.n_train_images, settings.data_path, eval_only)
    r, restore = Resume(settings.start_epoch), None
    if training:
        schedule = _schedule_kept(ckpt, recorded, saver.parts.lr_scheduler, saver.run_args, settings.data_path)
        r, rng = _where_training_stands(ckpt, recorded, saver.run_args, saver.n_train_images)
        restore = TrainingRestore(settings.opt, recorded.get('opt'), schedule, rng)
    saver.restore(ckpt, path, settings.model, restore)
    print(f'Loaded weights from {path}')  # after the checks that may refuse the resume
    r.ckpt, r.training = ckpt, training
    if training:
        r.unevaluated = unevaluated_epoch(ckpt)
        where = f'epoch {r.start_epoch} step {r.state.step}' if r.state.step else f'epoch {r.start_epoch}'
        r.message = f'Resumed from {path}: continuing at {where}, best accuracy so far {saver.max_accuracy:.2f}%'
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


def load_agreed(path: str, device: Any) -> Any:
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


def _schedule_kept(ckpt: dict[str, Any], saved_args: dict[str, Any], lr_scheduler: Any, now: dict[str, Any],
                   data_path: str | None) -> bool:
    """Whether the checkpoint's LR schedule state is restored: yes unless the command line `now` changed it
    against the checkpoint's `saved_args` (then the command line's, with a note naming what changed: the flags,
    or without a recorded command line the schedule's own fields); a note when the data moved."""
    saved, fresh = ckpt['lr_scheduler'], lr_scheduler.state_dict()
    changed = sorted(k for k in fresh if k in saved and saved[k] != fresh[k])
    was = data_path_change(saved_args, data_path)
    if was:  # moving a data set is normal, but the best accuracy may now compare two validation sets
        print(f'Note: --data-path changed since the checkpoint: {was} -> {data_path}; continuing on the '
              f'images there (the best accuracy so far, {float(ckpt.get("max_accuracy", 0.0)):.2f}%, was '
              f'measured on the validation set of {was})')
    flags = flag_changes(saved_args, now)
    if flags:  # e.g. a longer --epochs: the schedule of the command line
        print('Note: changed since the checkpoint: ' + '; '.join(flags) + '; following the command line')
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
    world, rank = distributed.get_world_size(), distributed.get_rank()
    rng = ckpt.get('rng_state')
    if ckpt.get('step'):
        return _inside_the_epoch(ckpt, saved, now, n_train_images, bad_steps), None
    r = Resume(int(ckpt['epoch']) + 1, EpochState(bad_steps=bad_steps))
    if isinstance(rng, list) and len(rng) == world:
        return r, rng[rank]
    writers = len(rng) if isinstance(rng, list) else 'an unknown number of'
    print(f'Note: the checkpoint was written by {writers} process(es), this run has {world}: random-number state '
          f'not restored')
    return r, None


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


# --------------------------------------------------------------------------------------------------
# What changed since the checkpoint, in flag terms
# --------------------------------------------------------------------------------------------------
def _global_batch(a: dict[str, Any]) -> int | None:
    try:
        return int(a['batch_size']) * int(a.get('world_size', 1)) * int(a.get('accum_steps', 1))
    except (KeyError, TypeError, ValueError):
        return None


def _ema_decay(a: dict[str, Any]) -> float | None:
    """The EMA decay a run used (ema.ema_decay at its global batch), None without an EMA."""
    gb = _global_batch(a)
    if not a.get('model_ema') or gb is None or a.get('model_ema_decay') is None:
        return None
    return ema_decay(float(a['model_ema_decay']), gb)


def _flag(name: str) -> str:
    return '--' + name.replace('_', '-')


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return not math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            pass
    return comparable(a) != comparable(b)


def flag_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What a resumed run (`now`, its command line as a dict) changes against the checkpoint's command line
    `saved`, in flag terms: the batch flags with the global batch, LR and EMA decay they give, then the
    LR-schedule flags. Empty when nothing changed or the checkpoint holds no command line."""
    if not saved:
        return []
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
        if k in saved and k in now and _differs(saved[k], now[k]):
            out.append(f'{_flag(k)} changed ({saved[k]} -> {now[k]})')
    return out


def data_order_changes(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any],
                       n_train_images: int | None) -> list[str]:
    """What differs between the run that wrote the mid-epoch checkpoint `ckpt` (its command line `saved`) and this
    one (`now`) among the things that decide the order of the epoch's images (seed, sampler, training-set
    size)."""
    out = []
    for k in ('seed', 'repeated_aug'):
        if k in saved and k in now and _differs(saved[k], now[k]):
            out.append(f'{_flag(k)} changed ({saved[k]} -> {now[k]})')
    n = ckpt.get('n_train_images')
    if isinstance(n, int) and n_train_images is not None and n != n_train_images:
        out.append(f'the training set changed ({n} -> {n_train_images} images)')
    return out
