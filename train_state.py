"""What a run trains and where training stands, for an exact resume: the trained objects (TrainingParts), the
random-number state of every generator a step draws from (torch, CUDA, numpy, python) and the position inside an
epoch (EpochState), and the checkpoint entries that hold them (epoch_state_entries)."""
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distributed import gather_objects


@dataclass
class TrainingParts:
    """What a training run trains and what its checkpoints hold besides the weights: the bare model (no DDP, not
    compiled), its EMA (or None), the optimizer, the LR scheduler and the fp16 GradScaler (or None)."""
    model: torch.nn.Module
    model_ema: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    loss_scaler: Any = None


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
gather_rng = gather_objects




@dataclass
class EpochState:
    """Where training stands inside an epoch: the first step not yet run, what a resume at that step needs,
    and the skipped-step counts. train_one_epoch takes and returns it; epoch_state_entries and
    saver.CheckpointSaver and resume.resume save and load it (docs/checkpoints.md#the-checkpoint-format)."""
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
        return {'rng_state': gather_rng(get_rng_state()), SKIP_COUNTS_KEY: skip_counts}
    return {'step': state.step, 'rng_state': gather_rng(state.rng_state),
            'epoch_rng_state': gather_rng(state.epoch_rng_state), 'loss_meter': gather_objects(state.loss_meter),
            SKIP_COUNTS_KEY: skip_counts}
