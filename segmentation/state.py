"""What a segmentation run's checkpoint holds and how a run resumes from it, on the run machinery every task shares:
the checkpoints are run.checkpoint.IterationCheckpoints (state: task, model, optimizer, scaler, iter, args, ...),
the resume is run.resume.resume_iterations (the same rank-agreed load, changed-flag notes, per-world random-number
state and run-directory repair as classification's). Here: the flags that shape the model, those a checkpoint
gives when the command line leaves them out, and where a resumed run continues (resume_from).

A segmentation checkpoint adds to IterationCheckpoints' entries the loop's own (train.Run.extra): ``rng_state``
(one per process), ``bad_steps`` (consecutive skipped steps), ``best_miou`` and ``best_iter``, ``eval_due`` (the
evaluation of ``iter`` is still to be done: the run stopped before it was saved), ``progress`` (the training losses
not yet in a log line) and ``log`` (the last evaluation's log.txt record). The learning rate is a function of
``iter`` (train.poly_lr), so no scheduler state is needed.
"""
from typing import Any

from run import resume
from run.checkpoint import IterationCheckpoints

#: the flags that shape the model: a checkpoint loads only into a model built with the same (--decoder first: the
#: recipe's defaults of the others depend on it)
MODEL_FLAGS = ('decoder', 'model', 'num_classes', 'channels', 'aux_weight')
#: the flags an evaluation or a resume takes from the checkpoint when the command line does not give them: the
#: model, the data pipeline's sizes and the evaluation protocol (their parser default is None: not given)
RECORDED_FLAGS = (*MODEL_FLAGS, 'drop_path', 'crop_size', 'img_scale', 'ratio_range', 'cat_max_ratio', 'eval_mode',
                  'slide_stride')
#: the flags whose change since the checkpoint a resumed run notes (it follows the command line)
NOTED_FLAGS = ('batch_size', 'world_size', 'iters', 'lr', 'seed')


def builds_same(key: str, saved: Any, given: Any) -> bool:
    """Whether a checkpoint's model flag and this run's build the same model when its weights are loaded (a model
    name in any case, the aux weight: a head or none)."""
    if key == 'model':
        return str(saved).upper() == str(given).upper()
    return saved == given or (key == 'aux_weight' and bool(saved) == bool(given))


def load_checkpoint_weights(path: str, checkpoints: IterationCheckpoints) -> dict[str, Any]:
    """`path` loaded on every rank, checked to be the same segmentation checkpoint everywhere (one line for a rank
    that cannot read it or reads another file, a classification checkpoint, a file of another model), its weights
    loaded into the model (--eval)."""
    return resume.load_iteration_checkpoint(path, checkpoints, MODEL_FLAGS, builds_same)


def resume_from(path: str, checkpoints: IterationCheckpoints) -> resume.IterationResume:
    """Continue the run of `path` ('' for none: a fresh start): weights, optimizer, scaler, each rank's RNG state
    when the number of processes is the one that wrote it, then the iteration, skipped-step count, best mIoU and
    what the checkpoint's loop kept (run.resume.resume_iteration_run)."""
    return resume.resume_iteration_run(path, checkpoints, model_flags=MODEL_FLAGS, noted_flags=NOTED_FLAGS,
                                       best_key='best_miou', score_key='mIoU', same=builds_same)
