"""Train for one epoch and evaluate (DeiT's engine, with exact distributed evaluation, gradient accumulation,
a graceful stop at optimizer-step boundaries, mid-epoch resume and a bounded number of skipped non-finite
steps that leave the model exactly as it was).

`train_one_epoch` runs an optim_step.OptimizerStep per window of micro-batches; `TrainSettings` holds the loop's
settings for a run; it takes and returns a train_state.EpochState, where training stands inside an epoch (with
the random-number state that makes a resumed epoch replay its batches); `evaluate_models` scores several models
(the model and its EMA) in one pass over the validation set."""
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from timm.utils import unwrap_model

from distributed import get_world_size, is_dist_avail_and_initialized
from errors import NonFiniteLossError, eprint
from metrics import MetricLogger, SmoothedValue
from optim_step import OptimizerStep
from precision import autocast
from train_state import EpochState, get_rng_state, set_rng_state


@dataclass
class EpochResult:
    """An epoch's stats, whether a stop signal ended it, and the state training continues from: the stop
    point (`state.step` > 0: the epoch was cut short; `stats` is then empty) or the next epoch's start."""
    stats: dict
    stopped: bool = False
    state: EpochState = field(default_factory=EpochState)


@dataclass(frozen=True)
class TrainSettings:
    """Settings of the training loop that hold for a whole run (the optimizer step's are in OptimizerStep)."""
    channels_last: bool = False  # feed the batches in channels-last memory format
    print_freq: int = 10         # a progress line every print_freq steps
    max_bad_steps: int = 20      # more consecutive skipped optimizer steps raise NonFiniteLossError
    train_mode: bool = True      # model.train(train_mode) for the epoch (DeiT's --train-mode)


class _StepValues:
    """The values of the optimizer steps since the last progress line, kept on the device until a line is
    printed: the losses of the loss meter and, with a per-step logger, the logger's values. `flush` reads them
    back in one go and feeds the meter and the logger the same numbers, in the same order, as if each step had
    read its own."""

    def __init__(self, metric_logger: MetricLogger, logger: Callable[[dict], None] | None):
        self.metric_logger, self.logger = metric_logger, logger
        self.steps: list[tuple] = []  # (losses, whether the meter counts them, the logger's dict or None)

    def add(self, losses: torch.Tensor, counted: bool, logged: dict | None) -> None:
        self.steps.append((losses, counted, logged))

    def flush(self) -> None:
        if not self.steps:
            return
        tensors = []
        for losses, _, logged in self.steps:
            tensors.append(losses.detach().reshape(-1).float())
            tensors.extend(v.detach().reshape(1).float() for v in (logged or {}).values() if torch.is_tensor(v))
        values = iter(torch.cat(tensors).tolist())  # the one wait for the device
        steps, self.steps = self.steps, []
        for losses, counted, logged in steps:
            loss_values = [next(values) for _ in range(losses.numel())]
            if counted:
                for value in loss_values:
                    self.metric_logger.update(loss=value)
            if logged is not None and self.logger is not None:
                logged = {k: next(values) if torch.is_tensor(v) else v for k, v in logged.items()}
                self.logger({**logged, 'loss': sum(loss_values) / len(loss_values)})


def _scale_of(scaler: torch.amp.GradScaler) -> torch.Tensor | float:
    """The loss scale now, as a copy of GradScaler's scale tensor (its get_scale() waits for the device)."""
    scale = scaler._get_scale_async()
    return scale.detach().clone() if scale is not None else scaler.get_scale()


def _count_skipped(state: EpochState, out: Any, epoch: int, i: int, max_bad: int) -> bool:
    """Count the optimizer step `out` (a StepOutcome at step `i`) in `state`'s skipped-step counts: a non-finite
    loss or an fp16 overflow is one more consecutive skipped step (more than `max_bad` in a row raise
    NonFiniteLossError), any other step ends the run of skipped ones. Whether the weights were updated from the
    window's loss (the EMA follows them then; after an overflow too, as the optimizer step is skipped)."""
    if out.non_finite is not None:
        state.bad_steps += 1
        state.skipped_steps += 1
        eprint(f'warning: non-finite loss ({out.non_finite}) at epoch {epoch} step {i}; step skipped '
               f'({state.bad_steps}/{max_bad} consecutive)')
        if state.bad_steps > max_bad:
            raise NonFiniteLossError(
                f'non-finite loss ({out.non_finite}) at epoch {epoch} step {i}: {state.bad_steps} consecutive bad '
                f'steps (more than --max-bad-steps {max_bad}); stopped, the last checkpoint is left intact')
        return False
    if out.overflow:
        state.bad_steps += 1
        state.skipped_steps += 1
        if state.bad_steps > max_bad:
            raise NonFiniteLossError(
                f'non-finite gradients at epoch {epoch} step {i}: {state.bad_steps} consecutive fp16 '
                f'steps skipped (more than --max-bad-steps {max_bad}); stopped, the last '
                f'checkpoint is left intact')
    else:
        state.bad_steps = 0
    return True


def _logged_values(out: Any, step: OptimizerStep, global_step: int, lr: float, images_per_batch: int) -> dict:
    """A per-step logger's values of the optimizer step `out`: the global step, the time, the LR, the images of
    the window, the gradient norm (when the loss was finite) and the fp16 loss scale, tensors left on the device
    (the loss is added when they are read)."""
    return {'step': global_step, 'time': time.perf_counter(), 'lr': lr,
            'images': images_per_batch * out.losses.numel(),
            **({'grad_norm': out.grad_norm} if out.non_finite is None else {}),
            **({'loss_scale': _scale_of(step.scaler)} if step.scaler is not None else {})}


def train_one_epoch(model: torch.nn.Module, criterion: Callable[..., torch.Tensor], data_loader: Any,
                    step: OptimizerStep, epoch: int, settings: TrainSettings | None = None, model_ema: Any = None,
                    mixup_fn: Callable | None = None, state: EpochState | None = None, stop_flag: Any = None,
                    logger: Callable[[dict], None] | None = None,
                    random_erasing: Callable | None = None) -> EpochResult:
    """One pass over `data_loader`, one `step` (OptimizerStep) per window of micro-batches, on `step.device`
    with `step.optimizer`. `model` may be DDP-wrapped and/or compiled; `model_ema` follows the bare module.
    Each batch on the device goes through `random_erasing` (per image), then `mixup_fn`. `logger`, when given,
    is called with the values of every optimizer step, in order; the values of the steps since the last
    progress line are read from the device when the line is printed (every `settings.print_freq` steps).

    `state` (an EpochState; a fresh epoch without one) is where the epoch starts; the result's state is
    where training continues: the stop point after a stop signal, else the start of the next epoch. The
    count of consecutive skipped steps carries over; more than `settings.max_bad_steps` of them raise
    NonFiniteLossError.

    Resuming in the middle of an epoch (`state.step` > 0, always a window boundary): the RNG state from
    before the epoch's data iterator was created is restored, the first `state.step` batches are loaded
    again but not trained on (so the random augmentations of data-loader workers come out identical), then
    the RNG state saved at the stop point is restored.
    """
    settings = settings or TrainSettings()
    state = replace(state) if state is not None else EpochState()
    model.train(settings.train_mode)
    device, optimizer = step.device, step.optimizer
    metric_logger = MetricLogger(delimiter='  ')
    metric_logger.add_meter('lr', SmoothedValue(window_size=1, fmt='{value:.6f}'))
    if state.loss_meter:  # a resumed epoch: its loss so far
        metric_logger.meters['loss'].total, metric_logger.meters['loss'].count = (state.loss_meter['total'],
                                                                                   state.loss_meter['count'])
    pending = _StepValues(metric_logger, logger)

    if state.epoch_rng_state is not None:
        set_rng_state(state.epoch_rng_state)
    epoch_rng_state = get_rng_state()
    start_step = state.step
    if start_step > 0:
        print(f'Resuming epoch {epoch} at step {start_step}: replaying the data order of the first {start_step} steps')
    batch_size = data_loader.batch_size or 1
    world = get_world_size()
    n_steps = len(data_loader)

    for i, (samples, targets) in enumerate(metric_logger.log_every(
            data_loader, settings.print_freq, f'Epoch: [{epoch}]', images_per_step=batch_size * world,
            before_line=pending.flush)):
        if i < start_step:
            if i == start_step - 1 and state.rng_state is not None:
                set_rng_state(state.rng_state)
            continue
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if settings.channels_last:
            samples = samples.contiguous(memory_format=torch.channels_last)
        if random_erasing is not None:
            samples = random_erasing(samples)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)
        out = step(model, criterion, samples, targets, i, n_steps, stop_flag=stop_flag, grad_norm=logger is not None)
        if out is None:  # inside an accumulation window
            continue

        if _count_skipped(state, out, epoch, i, settings.max_bad_steps) and model_ema is not None:
            model_ema.update(unwrap_model(model))
        metric_logger.update(lr=max(g['lr'] for g in optimizer.param_groups))  # the head's LR under --layer-decay
        logged = None
        if logger is not None:  # e.g. TensorBoard: one call per optimizer step, the loss added when read
            logged = _logged_values(out, step, epoch * n_steps + i, metric_logger.lr.value, batch_size * world)
        pending.add(out.losses, out.non_finite is None, logged)

        if out.stop and i + 1 < n_steps:
            pending.flush()
            meter = metric_logger.meters['loss']
            return EpochResult(stats={}, stopped=True, state=replace(
                state, step=i + 1, rng_state=get_rng_state(), epoch_rng_state=epoch_rng_state,
                loss_meter={'total': meter.total, 'count': meter.count}))

    pending.flush()
    return EpochResult(stats=_epoch_stats(metric_logger, optimizer, state, device),
                       stopped=bool(stop_flag is not None and stop_flag.requested),
                       state=EpochState(bad_steps=state.bad_steps))


def _epoch_stats(metric_logger: MetricLogger, optimizer: Any, state: EpochState, device: Any) -> dict:
    """The epoch's averaged stats over every rank (loss, LR at its end, skipped steps), printed."""
    metric_logger.synchronize_between_processes(device)
    print('Averaged stats:', metric_logger)
    stats = {k: meter.global_avg for k, meter in metric_logger.meters.items()}
    stats['lr'] = max(g['lr'] for g in optimizer.param_groups)
    stats.setdefault('loss', float('nan'))
    stats['skipped_steps'] = state.skipped_steps
    return stats


def evaluate(data_loader, model, device, amp_dtype=None, channels_last=False, print_freq=10, header='Test:',
             sum_over_ranks=False, stop_flag=None, real=None):
    """`evaluate_models` of one model: its stats."""
    return evaluate_models(data_loader, {'': model}, device, amp_dtype, channels_last, print_freq, header,
                           sum_over_ranks, stop_flag, real)['']


def _stats_of(row: list[float], k: int, with_real: bool) -> dict:
    """The stats of one model from its row of summed counts (evaluate_models), top-k named by its `k`."""
    loss_sum, correct1, correct5, n, seen, aborted, *real_counts = row
    n, seen = int(round(n)), int(round(seen))
    stats = {
        'loss': loss_sum / n if n else float('nan'),
        'acc1': 100.0 * correct1 / n if n else float('nan'),
        f'acc{k}': 100.0 * correct5 / n if n else float('nan'),  # one class: acc1 again, the same
        'n': n,
        'seen': seen,
        'aborted': aborted > 0,
    }
    if with_real:
        real1, real5, n_real = real_counts
        stats['real'] = {'acc1': 100.0 * real1 / n_real if n_real else float('nan'),
                         'acc5': 100.0 * real5 / n_real if n_real else float('nan'), 'n': int(round(n_real))}
    return stats


#: the k of the top-k accuracy reported next to top-1; a model of fewer classes reports top-(its classes)
TOP_K = 5


def topk_key(stats: dict) -> str | None:
    """The key of the top-k accuracy in `evaluate_models` stats: 'acc5', or 'acc3' for 3 classes (top-5 of 3
    classes is top-3 under another name); None for one class, whose only top-k is top-1."""
    return next((k for k in stats if k.startswith('acc') and k[3:].isdigit() and k != 'acc1'), None)


def result_line(stats: dict) -> str:
    """'* Acc@1 80.000 Acc@5 95.000 loss 0.812  (50000 images)' (Acc@3 with 3 classes) of one evaluation."""
    key = topk_key(stats)
    topk = f' Acc@{key[3:]} {stats[key]:.3f}' if key else ''
    return f"* Acc@1 {stats['acc1']:.3f}{topk} loss {stats['loss']:.3f}  ({stats['n']} images)"


@torch.no_grad()
def evaluate_models(data_loader: Any, models: dict[str, torch.nn.Module], device: Any,
                    amp_dtype: torch.dtype | None = None, channels_last: bool = False, print_freq: int = 10,
                    header: str = 'Test:', sum_over_ranks: bool = False, stop_flag: Any = None,
                    real: Any = None) -> dict[str, dict]:
    """Top-1, top-5 (with fewer classes top-(classes), named so: 'acc3' for 3, topk_key) and loss from exact counts
    of each of `models` (label -> model, e.g. the model and its EMA), from one pass over `data_loader`: each batch
    goes through every model, so the images are decoded once. With `sum_over_ranks` (dist-eval) the counts of
    every rank are summed with all_reduce, so each image counts once whatever the number of processes.
    A stop signal ends the loop early: stats['aborted'] is then true (on every rank with dist-eval).

    With `real` (eval_sets.RealLabels), the batches are (images, target, index) (eval_sets.WithIndex) and
    stats['real'] holds the ImageNet-ReaL top-1/top-5 of the same predictions and `n`, the images scored
    (those with a ReaL label); its counts travel in the same collective as the others.

    The sums stay on the device: the host waits for the GPU only on the batches that print a progress
    line and once at the end, not on every batch. Returns label -> stats, in the order of `models`."""
    device = torch.device(device)
    metric_logger = MetricLogger(delimiter='  ')
    for m in models.values():
        m.eval()
    meter = {label: f'{label} loss' if label else 'loss' for label in models}
    # per model: loss sum, top-1 hits, top-5 hits, counted images, images seen, aborted (float64: counts stay
    # exact), then with `real` its top-1 hits, top-5 hits and scored images
    sums = torch.zeros(len(models), 6 if real is None else 9, dtype=torch.float64, device=device)
    seen, top_k = 0, dict.fromkeys(models, TOP_K)  # images seen (known on the host); per model: its top-k's k
    total = len(data_loader)
    for i, (images, target, *index) in enumerate(metric_logger.log_every(data_loader, print_freq, header,
                                                                           images_per_step=data_loader.batch_size)):
        if stop_flag is not None and stop_flag.requested:
            sums[:, 5] = 1.0
            break
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        # targets < 0 mark images that could not be decoded (image_folder.IGNORE_TARGET): not counted; masks
        # rather than boolean indexing, whose output size the host would have to wait for
        valid = target >= 0
        for k, (label, model) in enumerate(models.items()):
            with autocast(device, amp_dtype):
                output = model(images)
            output = output.float()
            loss = torch.nn.functional.cross_entropy(output, target.clamp(min=0), reduction='none')
            maxk = top_k[label] = min(TOP_K, output.shape[1])
            top = output.topk(maxk, dim=1).indices
            hit = top.eq(target.view(-1, 1)) & valid.view(-1, 1)
            sums[k, :4] += torch.stack([torch.where(valid, loss, 0.0).sum(dtype=torch.float64),
                                        hit[:, :1].sum(dtype=torch.float64), hit[:, :maxk].sum(dtype=torch.float64),
                                        valid.sum(dtype=torch.float64)])
            if real is not None:
                sums[k, 6:] += real.count(top, index[0].to(device, non_blocking=True), valid)
        seen += target.shape[0]
        if i % print_freq == 0 or i == total - 1:  # the batches log_every prints a line after
            metric_logger.update(**{meter[label]: sums[k, 0] / sums[k, 3].clamp(min=1)
                                    for k, label in enumerate(models)})
    sums[:, 4] = seen
    if sum_over_ranks and is_dist_avail_and_initialized():  # one collective; a stop on any rank shows on all
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM)
    results = {label: _stats_of(row, top_k[label], real is not None)
               for label, row in zip(models, sums.tolist())}  # the one wait for the device
    for stats in results.values():  # a stop cuts the pass short for every model alike
        if stats['aborted']:
            print(f"{header} interrupted by a stop signal after {stats['n']} images")
            break
        print(result_line(stats))
    return results
