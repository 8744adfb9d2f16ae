"""What a segmentation run's checkpoint holds, how it is written and how a run resumes from it, on the
classification engine's machinery: the saver's writes (saver.write_state: rank 0 writes atomically with a checksum
and copies to the other names, every rank agrees on failures), log.txt lines (saver.append_log), the repairs of a
resume (run_repair.repair: the names a stop between two writes left behind, log.txt's missing line), the RNG state
of every rank (train_state.get_rng_state).

A checkpoint is a dict: ``task`` ('segmentation'), ``model`` (the Segmentor's state dict), ``optimizer``,
``scaler`` (fp16's GradScaler or None), ``iter`` (iterations done), ``args``, ``rng_state`` (one per process),
``bad_steps`` (consecutive skipped steps), ``best_miou`` and ``best_iter``, ``eval_due`` (the evaluation of
``iter`` is still to be done: the run stopped before it was saved), ``progress`` (the training losses not yet in
a log line), ``log`` (the last evaluation's log.txt record), ``files`` (the names it was written to),
``n_parameters`` and ``checksum``. The learning rate is a function of ``iter`` (train.lr_at), so no scheduler
state is needed.
"""
from dataclasses import dataclass
from typing import Any

import torch

from run import distributed
from run.checkpoint import (
    append_log,
    checkpoint_identity,
    comparable,
    describe_identity,
    in_directory,
    load_checkpoint_file,
    saved_args,
    write_state,
)
from run.errors import CheckpointError, first_line
from run.output_dir import repair
from run.resume import gather_rng, get_rng_state, set_rng_state
from run.weights import load_weights_into
from segmentation.backbone import TASK

#: the flags that shape the model: a checkpoint loads only into a model built with the same (--decoder first: the
#: recipe's defaults of the others depend on it)
MODEL_FLAGS = ('decoder', 'model', 'num_classes', 'channels', 'aux_weight')
#: the flags an evaluation or a resume takes from the checkpoint when the command line does not give them: the
#: model, the data pipeline's sizes and the evaluation protocol (their parser default is None: not given)
RECORDED_FLAGS = (*MODEL_FLAGS, 'drop_path', 'crop_size', 'img_scale', 'ratio_range', 'cat_max_ratio', 'eval_mode',
                  'slide_stride')


def check_task(ckpt: Any, path: str) -> None:
    """One line for a file that is not a segmentation checkpoint."""
    if not isinstance(ckpt, dict) or ckpt.get('task') != TASK:
        raise CheckpointError(f'{path} is not a segmentation checkpoint (a classification checkpoint or '
                              f'release?): start from its backbone with --pretrained {path}')


def _flag(key: str, value: Any) -> str:
    """'--img-scale 128 64': a flag as typed."""
    shown = ' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return f'--{key.replace("_", "-")} {shown}'


def _same_model(key: str, given: Any, saved: Any) -> bool:
    """Whether a model flag's two values build the same model (the aux weight: a head or none)."""
    if key == 'model':
        return str(given).upper() == str(saved).upper()
    if key == 'aux_weight':
        return bool(given) == bool(saved)
    return given == saved


def take_recorded_flags(args: Any, path: str, recipe: dict[str, Any]) -> None:
    """Fill in the flags of RECORDED_FLAGS the command line did not give (None): the value the checkpoint `path`
    (the one --eval measures or a run resumes; '' for none) records, else the recipe's default. Prints one line
    naming the recorded values taken that differ from the recipe, and one line naming the given values that differ
    from the recorded ones (the command line wins); a given model flag the checkpoint's weights cannot load into
    is one line (CheckpointError)."""
    recorded: dict[str, Any] = {}
    if path:
        ckpt = load_checkpoint_file(path, verify=False, mmap=True)  # the command line only: tensors not read
        check_task(ckpt, path)
        recorded = saved_args(ckpt)
    taken, overridden = [], []
    for key in RECORDED_FLAGS:
        given, saved = comparable(getattr(args, key)), comparable(recorded.get(key, recipe[key]))
        if given is None:
            setattr(args, key, saved)
            if key in recorded and saved != comparable(recipe[key]):
                taken.append(_flag(key, saved))
        elif key in recorded and given != saved:
            if key in MODEL_FLAGS and not _same_model(key, given, saved):
                raise CheckpointError(f'{path} holds a model built with {_flag(key, saved)}, this command passes '
                                      f'{_flag(key, given)}: leave the flag out (the checkpoint gives it)')
            overridden.append(f'{_flag(key, given)} (the checkpoint: {_flag(key, saved)})')
    if taken:
        print(f'{" ".join(taken)}: as recorded in {path} (pass a flag to choose another value)')
    if overridden:
        print(f'Note: {"; ".join(overridden)}: the command line differs from {path}; using the command line')


@dataclass
class Resumed:
    """Where a run continues: the iteration, the consecutive skipped steps, the best mIoU so far and at which
    iteration, and the loaded checkpoint (None when the run starts afresh)."""
    start_iter: int = 0
    bad_steps: int = 0
    best_miou: float = -1.0
    best_iter: int | None = None
    eval_due: bool = False  # the evaluation of start_iter is still to be done
    progress: dict | None = None  # train.Progress's state
    ckpt: Any = None
    last_miou: float | None = None  # of the checkpoint's evaluation (its log record), when it has one


class SegCheckpoints:
    """Writes the checkpoints of one segmentation run into --output_dir and resumes a run from one."""

    def __init__(self, output_dir: str, run_args: dict[str, Any], model: torch.nn.Module, optimizer: Any,
                 scaler: Any, device: Any, n_parameters: int):
        self.run_args, self.model, self.optimizer, self.scaler = run_args, model, optimizer, scaler
        self.device, self.n_parameters = device, n_parameters
        self.output_dir = output_dir

    def save(self, done: int, names: list[str], extra: dict[str, Any]) -> None:
        """Write the state after `done` iterations to the first of `names`, then copy it to the others (rank 0;
        collective: every rank calls it, the RNG states are gathered)."""
        rng = gather_rng(get_rng_state())
        if not self.output_dir:
            return
        state = {'task': TASK, 'model': self.model.state_dict(), 'optimizer': self.optimizer.state_dict(),
                 'scaler': self.scaler.state_dict() if self.scaler is not None else None, 'iter': done,
                 'args': dict(self.run_args), 'rng_state': rng, 'n_parameters': self.n_parameters,
                 'files': list(names), **extra}
        write_state(state, self.output_dir, names, self.device)

    def append_log(self, record: dict[str, Any]) -> None:
        """One JSON line in --output_dir/log.txt (rank 0)."""
        append_log(self.output_dir, record, self.device)

    def load(self, path: str) -> Any:
        """`path` loaded on every rank, checked to be the same segmentation checkpoint everywhere (one line for a
        rank that cannot read it or reads another file, a classification checkpoint, a file of another model),
        its weights loaded into the model."""
        ckpt = distributed.on_every_rank(lambda: load_checkpoint_file(path), self.device, f'--resume {path}')
        distributed.check_same_everywhere({'checkpoint': describe_identity(checkpoint_identity(ckpt, path))},
                                          self.device, 'every node must see the same --output_dir and --resume file')
        check_task(ckpt, path)
        saved = saved_args(ckpt)
        other = [f'--{k.replace("_", "-")} {saved[k]}' for k in MODEL_FLAGS
                 if k in saved and saved[k] != self.run_args.get(k)
                 and not (k == 'aux_weight' and bool(saved[k]) == bool(self.run_args.get('aux_weight')))]
        if other:
            raise CheckpointError(f'{path} holds a model built with {" ".join(other)}; pass the same flags')
        load_weights_into(self.model, ckpt['model'], self.run_args['model'], path)
        return ckpt

    def resume(self, path: str) -> Resumed:
        """Continue the run of `path`: weights, optimizer, scaler, iteration, skipped-step count, best mIoU, and
        each rank's RNG state when the number of processes is the one that wrote it."""
        if not path:
            return Resumed()
        ckpt = self.load(path)
        try:
            self.optimizer.load_state_dict(ckpt['optimizer'])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f'the optimizer state in {path} does not fit this run ({first_line(e)}); start '
                                  f'a new run from its weights in another --output_dir') from e
        if self.scaler is not None and ckpt.get('scaler'):
            self.scaler.load_state_dict(ckpt['scaler'])
        saved = saved_args(ckpt)
        changed = [f'--{k.replace("_", "-")} {saved[k]} -> {self.run_args.get(k)}'
                   for k in ('batch_size', 'world_size', 'iters', 'lr', 'seed')
                   if k in saved and saved[k] != self.run_args.get(k)]
        if changed:
            print('Note: changed since the checkpoint: ' + '; '.join(changed) + '; following the command line')
        rng, world = ckpt.get('rng_state'), distributed.get_world_size()
        if isinstance(rng, list) and len(rng) == world:
            set_rng_state(rng[distributed.get_rank()])
        else:
            print(f'Note: the checkpoint was written by {len(rng) if isinstance(rng, list) else "?"} process(es), '
                  f'this run has {world}: random-number state not restored')
        if self.output_dir and in_directory(path, self.output_dir):
            distributed.on_rank0(lambda: repair(self.output_dir, path, ckpt, key='iter'), self.device,
                                 f'could not repair the files of {self.output_dir} from {path}')
        return Resumed(int(ckpt['iter']), int(ckpt.get('bad_steps', 0)), float(ckpt.get('best_miou', -1.0)),
                       ckpt.get('best_iter'), bool(ckpt.get('eval_due')), ckpt.get('progress'), ckpt,
                       (ckpt.get('log') or {}).get('mIoU'))

