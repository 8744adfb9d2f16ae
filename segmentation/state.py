"""What a segmentation run's checkpoint holds and how a run resumes from it, on the run machinery every task shares:
the checkpoints are run.checkpoint.IterationCheckpoints (state: task, model, optimizer, scaler, iter, args, ...),
the resume is run.resume.resume_iterations (the same rank-agreed load, changed-flag notes, per-world random-number
state and run-directory repair as classification's). Here: the flags that shape the model, those a checkpoint
gives when the command line leaves them out, and where a resumed run continues (Resumed).

A segmentation checkpoint adds to IterationCheckpoints' entries the loop's own (train.Run.extra): ``rng_state``
(one per process), ``bad_steps`` (consecutive skipped steps), ``best_miou`` and ``best_iter``, ``eval_due`` (the
evaluation of ``iter`` is still to be done: the run stopped before it was saved), ``progress`` (the training losses
not yet in a log line) and ``log`` (the last evaluation's log.txt record). The learning rate is a function of
``iter`` (train.lr_at), so no scheduler state is needed.
"""
from dataclasses import dataclass
from typing import Any

from run import resume
from run.checkpoint import IterationCheckpoints, check_task, comparable, load_checkpoint_file, saved_args
from run.errors import CheckpointError
from segmentation.backbone import TASK

#: the flags that shape the model: a checkpoint loads only into a model built with the same (--decoder first: the
#: recipe's defaults of the others depend on it)
MODEL_FLAGS = ('decoder', 'model', 'num_classes', 'channels', 'aux_weight')
#: the flags an evaluation or a resume takes from the checkpoint when the command line does not give them: the
#: model, the data pipeline's sizes and the evaluation protocol (their parser default is None: not given)
RECORDED_FLAGS = (*MODEL_FLAGS, 'drop_path', 'crop_size', 'img_scale', 'ratio_range', 'cat_max_ratio', 'eval_mode',
                  'slide_stride')
#: the flags whose change since the checkpoint a resumed run notes (it follows the command line)
NOTED_FLAGS = ('batch_size', 'world_size', 'iters', 'lr', 'seed')


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
        check_task(ckpt, path, TASK)
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
    progress: dict | None = None  # train.IterationProgress's state
    ckpt: Any = None
    last_miou: float | None = None  # of the checkpoint's evaluation (its log record), when it has one


def _builds_same(key: str, saved: Any, given: Any) -> bool:
    """Whether a checkpoint's model flag and this run's build the same model when its weights are loaded (the aux
    weight: a head or none)."""
    return saved == given or (key == 'aux_weight' and bool(saved) == bool(given))


def load_checkpoint_weights(path: str, checkpoints: IterationCheckpoints) -> dict[str, Any]:
    """`path` loaded on every rank, checked to be the same segmentation checkpoint everywhere (one line for a rank
    that cannot read it or reads another file, a classification checkpoint, a file of another model), its weights
    loaded into the model (--eval)."""
    return resume.load_iteration_checkpoint(path, checkpoints, MODEL_FLAGS, _builds_same)


def resume_from(path: str, checkpoints: IterationCheckpoints) -> Resumed:
    """Continue the run of `path` ('' for none: a fresh start): weights, optimizer, scaler, each rank's RNG state
    when the number of processes is the one that wrote it (run.resume.resume_iterations), then the iteration,
    skipped-step count, best mIoU and what the checkpoint's loop kept."""
    if not path:
        return Resumed()
    ckpt = resume.resume_iterations(path, checkpoints, model_flags=MODEL_FLAGS, noted_flags=NOTED_FLAGS,
                                    same=_builds_same)
    return Resumed(start_iter=int(ckpt['iter']), bad_steps=int(ckpt.get('bad_steps', 0)),
                   best_miou=float(ckpt.get('best_miou', -1.0)), best_iter=ckpt.get('best_iter'),
                   eval_due=bool(ckpt.get('eval_due')), progress=ckpt.get('progress'), ckpt=ckpt,
                   last_miou=(ckpt.get('log') or {}).get('mIoU'))
