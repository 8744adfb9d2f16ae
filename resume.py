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
    """The epoch and EpochState the run continues from: after the checkpoint's epoch, or at the step inside it
    where a stop saved it, with every rank's random-number state when the same number of processes resumes and
    the data order of the epoch can be replayed (else the epoch restarts, with a note). Also this process's
    random-number state to set before the next epoch (None: not restored, or the EpochState holds it)."""
    # consecutive skipped steps survive epochs and resumes; the epoch's own count only a mid-epoch resume
    skip_counts = ckpt.get(SKIP_COUNTS_KEY) or {}
    bad_steps = int(skip_counts.get('bad_steps', 0))
    if ckpt.get('step'):
        r = Resume(int(ckpt['epoch']), EpochState(step=int(ckpt['step']), loss_meter=ckpt.get('loss_meter'),
                                                  bad_steps=bad_steps,
                                                  skipped_steps=int(skip_counts.get('skipped_steps', 0))))
    else:
        r = Resume(int(ckpt['epoch']) + 1, EpochState(bad_steps=bad_steps))
    world, rank = distributed.get_world_size(), distributed.get_rank()
    rng = ckpt.get('rng_state')
    order = data_order_changes(ckpt, saved, now, n_train_images) if r.state.step else []
    if order:
        # the data order of the rest of the epoch depends on these: a replay would feed other images
        print(f'Note: the checkpoint stopped inside epoch {r.start_epoch} at step {r.state.step}, and '
              f'{", ".join(order)} since then, so the rest of that epoch cannot be replayed in its order: '
              f'epoch {r.start_epoch} restarts from its first step')
        epoch_rng = ckpt.get('epoch_rng_state')
        r.state = EpochState(bad_steps=bad_steps, epoch_rng_state=epoch_rng[rank] if isinstance(epoch_rng, list)
                             and len(epoch_rng) == world else None)
        if r.state.epoch_rng_state is None:
            print(f'Note: the checkpoint was written by {len(rng) if isinstance(rng, list) else "?"} '
                  f'process(es), this run has {world}: random-number state not restored')
    elif isinstance(rng, list) and len(rng) == world:
        if not r.state.step:
            return r, rng[rank]
        r.state.rng_state, r.state.epoch_rng_state = rng[rank], ckpt['epoch_rng_state'][rank]
    else:
        writers = len(rng) if isinstance(rng, list) else 'an unknown number of'
        print(f'Note: the checkpoint was written by {writers} '
              f'process(es), this run has {world}: random-number state not restored')
    return r, None


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


def data_order_changes(ckpt: dict[str, Any], saved: dict[str, Any], now: dict[str, Any],
                       n_train_images: int | None) -> list[str]:
    """What differs between the run that wrote the mid-epoch checkpoint `ckpt` (its command line `saved`) and this
    one (`now`) among the things that decide which images each step of the epoch gets (processes, batch,
    accumulation, seed, sampler, training-set size)."""
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
