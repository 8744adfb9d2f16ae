"""The learning-rate schedule of a run: the flags that shape it (`Schedule`), the base LR scaled by the global
batch, the timm scheduler built from them and stepped once per epoch, and the notes when the LR lies below the
floor the schedule decays to and when the warmup lasts the whole run."""
from dataclasses import dataclass, fields
from typing import Any

import torch

# the schedules of timm's create_scheduler_v2 that fit a per-epoch step without a metric: 'plateau' needs a
# validation metric at every step, is deprecated by timm and cannot save its state in a checkpoint (a resumed
# run would restart it); 'none' builds no scheduler at all
SCHEDULERS = ('cosine', 'tanh', 'step', 'constant', 'multistep', 'poly', 'wsd', 'rsqrt')

#: the schedules that decay towards --min-lr (timm's create_scheduler_v2 gives it to these as their floor)
DECAY_TO_MIN_LR = ('cosine', 'tanh', 'poly', 'wsd', 'rsqrt')


@dataclass(frozen=True)
class Schedule:
    """The flags that shape the LR schedule, each named as its argparse destination (--warmup-epochs:
    warmup_epochs). A resumed run compares them with the checkpoint's and follows the command line."""
    sched: str
    epochs: int
    warmup_epochs: int
    warmup_lr: float
    min_lr: float
    decay_epochs: float
    cooldown_epochs: int
    decay_rate: float
    lr_noise: Any
    lr_noise_pct: float
    lr_noise_std: float
    seed: int


#: the names of the flags that shape the schedule
SCHEDULE_FLAGS = tuple(f.name for f in fields(Schedule))


def scaled_lr(lr: float, global_batch: int, unscale_lr: bool = False) -> float:
    """The run's base LR: --lr given for a global batch of 512, scaled linearly to `global_batch` (images per
    optimizer step); --unscale-lr takes --lr as it is."""
    return lr if unscale_lr else lr * global_batch / 512.0


def build_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule) -> Any:
    """timm's scheduler of `schedule`, stepped per epoch with `start_epoch`: warmup from --warmup-lr over
    --warmup-epochs, then --sched down to --min-lr."""
    from timm.scheduler import create_scheduler_v2
    lr_scheduler, _ = create_scheduler_v2(
        optimizer, sched=schedule.sched, num_epochs=schedule.epochs, decay_epochs=schedule.decay_epochs,
        cooldown_epochs=schedule.cooldown_epochs, decay_rate=schedule.decay_rate, min_lr=schedule.min_lr,
        warmup_lr=schedule.warmup_lr, warmup_epochs=schedule.warmup_epochs, noise=schedule.lr_noise,
        noise_pct=schedule.lr_noise_pct, noise_std=schedule.lr_noise_std, noise_seed=schedule.seed,
        step_on_epochs=True)
    return lr_scheduler


def start_epoch(lr_scheduler: Any, epoch: int) -> None:
    """Set the LR of `epoch`, before its first step: epoch e trains at the schedule's LR of epoch e."""
    lr_scheduler.step(epoch)


def lr_floor_note(lr: float, schedule: Schedule, global_batch: int, unscale_lr: bool) -> str:
    """A note when the run's LR (`lr`, scaled by the global batch unless --unscale-lr) lies below --min-lr,
    naming both and the fixes: the schedule would then rise to --min-lr instead of decaying to it. '' otherwise."""
    if schedule.sched not in DECAY_TO_MIN_LR or lr >= schedule.min_lr:
        return ''
    what = (f'--lr {lr:.3g}' if unscale_lr else
            f'the LR {lr:.3g} (--lr {lr * 512.0 / global_batch:.3g} x global batch {global_batch} / 512)')
    fix = ('raise --lr or lower --min-lr' if unscale_lr else
           'use a larger batch, --unscale-lr (the --lr as given), or a lower --min-lr')
    return (f'Note: {what} is below --min-lr {schedule.min_lr:.3g}, so the {schedule.sched} schedule rises to '
            f'--min-lr instead of decaying to it: {fix}')


def warmup_note(lr: float, schedule: Schedule) -> str:
    """A note when --warmup-epochs is not below --epochs: the LR then rises for the whole run and never reaches
    the run's LR `lr` (nor decays), naming the LR of the last epoch and the fix. '' otherwise."""
    if schedule.warmup_epochs < schedule.epochs:
        return ''
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    lr_scheduler = build_lr_scheduler(optimizer, schedule)
    start_epoch(lr_scheduler, schedule.epochs - 1)
    last, fewer = optimizer.param_groups[0]['lr'], schedule.epochs - 1
    return (f'Note: --warmup-epochs {schedule.warmup_epochs} is not below --epochs {schedule.epochs}: the LR rises '
            f'from --warmup-lr {schedule.warmup_lr:.3g} for the whole run, to {last:.3g} in the last epoch, and never '
            f"reaches the LR {lr:.3g} nor decays: use --warmup-epochs {fewer}{' or fewer' if fewer else ''}")
