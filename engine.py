"""Train for one epoch, evaluate, and end the epoch (DeiT's engine, with exact distributed evaluation, gradient
accumulation, a graceful stop at optimizer-step boundaries, mid-epoch resume and a bounded number of skipped
non-finite steps that leave the model exactly as it was).

`train_one_epoch` runs a training.step.OptimizerStep per window of micro-batches; `TrainSettings` holds the loop's
settings for a run; it takes and returns a run.resume.EpochState, where training stands inside an epoch (with the
random-number state that makes a resumed epoch replay its batches); `evaluate_models` scores several models (the
model and its EMA) in one pass over the validation set. `EpochEnd` ends every epoch the same way on every rank, in
the same order: BatchNorm statistics and the EMA made rank 0's, the model and its EMA evaluated, every rank agreeing
whether that evaluation was cut short and whether to stop, the best accuracy noted, the checkpoints saved (the
epoch's log line inside them) and the line appended to log.txt and TensorBoard. An epoch whose evaluation a stop cut
short is saved without its accuracy; the resumed run evaluates it first (EpochEnd.evaluate_resumed)."""
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from timm.utils import distribute_bn, unwrap_model

from run import distributed
from run.checkpoint import RunCheckpoints
from run.distributed import get_world_size, is_dist_avail_and_initialized
from run.errors import NonFiniteLossError, eprint
from run.resume import EpochState, epoch_state_entries, get_rng_state, preserved_rng, set_rng_state
from training import image_folder
from training.step import OptimizerStep, autocast
from utils import MetricLogger, SmoothedValue


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
    where training continues: the stop point after a stop signal (_stop_point), else the start of the next epoch.
    The count of consecutive skipped steps carries over; more than `settings.max_bad_steps` of them raise
    NonFiniteLossError. Resuming in the middle of an epoch (`state.step` > 0) replays the batches before it
    (_replayed).
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
    epoch_rng_state = _epoch_start(epoch, state)
    batch_size = data_loader.batch_size or 1
    world = get_world_size()
    n_steps = len(data_loader)

    for i, (samples, targets) in enumerate(metric_logger.log_every(
            data_loader, settings.print_freq, f'Epoch: [{epoch}]', images_per_step=batch_size * world,
            before_line=pending.flush)):
        if _replayed(i, state):
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
            return _stop_point(state, i + 1, metric_logger, epoch_rng_state)

    pending.flush()
    return EpochResult(stats=_epoch_stats(metric_logger, optimizer, state, device),
                       stopped=bool(stop_flag is not None and stop_flag.requested),
                       state=EpochState(bad_steps=state.bad_steps))


def _epoch_start(epoch: int, state: EpochState) -> dict:
    """The random-number state the epoch's data iterator is created with (returned: a stop inside the epoch saves
    it): a resumed epoch's, restored from `state`, else this process's now."""
    if state.epoch_rng_state is not None:
        set_rng_state(state.epoch_rng_state)
    if state.step > 0:
        print(f'Resuming epoch {epoch} at step {state.step}: replaying the data order of the first {state.step} steps')
    return get_rng_state()


def _replayed(i: int, state: EpochState) -> bool:
    """The mid-epoch replay: whether batch `i` comes before the step a resumed epoch starts at (`state.step`, always a
    window boundary), so it is loaded again but not trained on (the random augmentations of the data-loader workers
    come out identical); at the last of them the random-number state saved at the stop point is restored."""
    if i >= state.step:
        return False
    if i == state.step - 1 and state.rng_state is not None:
        set_rng_state(state.rng_state)
    return True


def _stop_point(state: EpochState, next_step: int, metric_logger: MetricLogger, epoch_rng_state: dict) -> EpochResult:
    """The result of an epoch a stop signal cut short before `next_step`: where a resume continues (that step, this
    process's random-number state now and before the epoch's data iterator, the loss so far); no stats."""
    meter = metric_logger.meters['loss']
    return EpochResult(stats={}, stopped=True, state=replace(
        state, step=next_step, rng_state=get_rng_state(), epoch_rng_state=epoch_rng_state,
        loss_meter={'total': meter.total, 'count': meter.count}))


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
    return evaluate_models(data_loader, {'': model}, device, amp_dtype=amp_dtype, channels_last=channels_last,
                           print_freq=print_freq, header=header, sum_over_ranks=sum_over_ranks, stop_flag=stop_flag,
                           real=real)['']


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

    With `real` (datasets.RealLabels), the batches are (images, target, index) (datasets.WithIndex) and
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


# --------------------------------------------------------------------------------------------------
# The end of an epoch
# --------------------------------------------------------------------------------------------------
def accuracy_line(stats: dict, n_images: int, tag: str = '', label: str = '') -> str:
    """The accuracy line of one evaluation of the validation set of `n_images` images."""
    line = f"Accuracy of the {tag}network{label} on the {stats['n']} test images: {stats['acc1']:.2f}%"
    if stats['n'] != n_images or stats.get('seen', stats['n']) != n_images:
        line += f" (evaluated {stats['n']} of {n_images} images; undecodable ones excluded)"
    return line


@dataclass
class EpochEnd:
    """What the end of every epoch of a run works with: the run's checkpoints (and the parts they save: the bare
    model, whose BatchNorm statistics are made rank 0's, and its EMA), the validation loader and what evaluates on
    it (the bare model or compiled, the EMA's compiled module or None), the training set (its undecodable files are
    counted) and TensorBoard's --log-dir with rank 0's logger (None elsewhere)."""
    checkpoints: RunCheckpoints
    loader_val: Any
    eval_model: torch.nn.Module
    eval_ema: torch.nn.Module | None
    dataset_train: Any
    log_dir: str
    tensorboard: Any
    amp_dtype: torch.dtype | None
    channels_last: bool
    print_freq: int
    sum_over_ranks: bool              # exact distributed evaluation (--dist-eval)
    stop_flag: Any

    @property
    def model(self) -> torch.nn.Module:
        return self.checkpoints.parts.model

    @property
    def model_ema(self) -> Any:
        return self.checkpoints.parts.model_ema

    @property
    def device(self) -> torch.device:
        return self.checkpoints.device

    def __call__(self, epoch: int, result: EpochResult) -> tuple[dict, dict | None, bool]:
        """End `epoch`, trained as `result` says: (the model's validation stats, the EMA's or None, whether
        every rank stops now)."""
        if distributed.is_dist_avail_and_initialized():
            # BatchNorm running statistics are per-rank (DDP re-broadcasts rank 0's before each forward) and
            # so are the EMA's: make every rank hold rank 0's, as in the checkpoint, before evaluating
            distribute_bn(self.model, distributed.get_world_size(), reduce=False)
            if self.model_ema is not None:  # a CPU EMA (--model-ema-force-cpu) goes through the device under NCCL
                distributed.broadcast_tensors_(list(self.model_ema.module.state_dict().values()), device=self.device)
        # distinct files: with repeated augmentation one bad file is read on up to 3 ranks
        bad = image_folder.bad_sample_count_all_ranks(self.dataset_train, self.device)
        return self.evaluate_and_save(epoch, result.stats, bad, lambda: epoch_state_entries(result.state),
                                      result.stopped)

    def evaluate_resumed(self, epoch: int, unevaluated: dict[str, Any]) -> tuple[dict, dict | None, bool]:
        """End `epoch` as an uninterrupted run would have, after a resume from its checkpoint, which a stop during
        its evaluation saved without its accuracy (`unevaluated`: its log record and where training stood, as
        resume.Resume holds them): the weights it ended with, EMA included, restored from that checkpoint, are
        evaluated, the best accuracy noted, the checkpoints saved again with it and its log.txt line completed.
        A stop that cuts this evaluation short too leaves everything as it was."""
        record = unevaluated['log']
        print(f'Epoch {epoch} was saved without its accuracy (a stop cut its evaluation short): evaluating it now, '
              f'with the weights it ended with')
        train_stats = {k[len('train_'):]: v for k, v in record.items() if k.startswith('train_')}
        entries = {k: v for k, v in unevaluated.items() if k != 'log'}
        return self.evaluate_and_save(epoch, train_stats, int(record.get('bad_train_images') or 0),
                                      lambda: entries, stopped=False, resumed=True)

    def evaluate_and_save(self, epoch: int, train_stats: dict, bad: int, entries: Callable[[], dict[str, Any]],
                          stopped: bool, resumed: bool = False) -> tuple[dict, dict | None, bool]:
        """Evaluate the weights after `epoch` (the RNG state left as it was), let every rank agree whether that was
        cut short and whether to stop, note the accuracy, save the checkpoints (`entries()`: where training
        stands, a collective) with the epoch's log record, and write that record to log.txt (`resumed`: in place
        of the line written without its accuracy) and TensorBoard. `stopped`: the epoch's training was stopped."""
        with preserved_rng():  # evaluating leaves the random stream as training left it (exact resume)
            test_stats, ema_stats = self.evaluate()
        # all ranks agree whether the evaluation was cut short and whether to stop after this epoch
        flags = [float(test_stats['aborted'] or bool(ema_stats and ema_stats['aborted'])),
                 float(self.stop_flag.requested or stopped)]
        if distributed.is_dist_avail_and_initialized():
            flags = distributed.all_reduce_max(flags, self.device)
        eval_aborted, stop_now = flags[0] > 0, flags[1] > 0
        if eval_aborted and resumed:  # its checkpoint and log line stay as they are: the next resume tries again
            print(f'Evaluation of epoch {epoch} interrupted by {self.stop_flag.name() or "a stop signal"} again: '
                  f'its checkpoint stays without its accuracy, and the same command evaluates it')
            return test_stats, ema_stats, True
        improved = self.report(epoch, test_stats, ema_stats, eval_aborted, bad)
        record = log_record(epoch, train_stats, None if eval_aborted else test_stats,
                            None if eval_aborted else ema_stats, self.checkpoints, bad)
        # the epoch's log line travels in the checkpoint: a crash before the append loses nothing
        self.checkpoints.save_epoch(epoch, {**entries(), 'log': record}, improved)
        if resumed:
            self.checkpoints.replace_log(record)
        else:
            self.checkpoints.append_log(record)
        if self.log_dir:  # every rank agrees on rank 0's write (the logger is rank 0's alone)
            distributed.on_rank0(lambda: self.tensorboard.log_epoch(record, epoch), self.device,
                                 f'--log-dir {self.log_dir}: cannot write TensorBoard events')
        return test_stats, ema_stats, stop_now

    def evaluate(self) -> tuple[dict, dict | None]:
        """The validation stats of the model and of its EMA (None without one), from one pass over the validation
        set: each batch goes through both. An EMA kept on the CPU (--model-ema-force-cpu) is evaluated on the
        device, where the data is."""
        options = dict(amp_dtype=self.amp_dtype, channels_last=self.channels_last, print_freq=self.print_freq,
                       sum_over_ranks=self.sum_over_ranks, stop_flag=self.stop_flag)
        if self.model_ema is None:
            return evaluate(self.loader_val, self.eval_model, self.device, **options), None
        with distributed.moved_to(self.model_ema.module, self.device):
            models = {'': self.eval_model, 'EMA': self.eval_ema or self.model_ema.module}
            stats = evaluate_models(self.loader_val, models, self.device, **options)
        return stats[''], stats['EMA']

    def report(self, epoch: int, test_stats: dict, ema_stats: dict | None, eval_aborted: bool, bad: int) -> bool:
        """Print the epoch's accuracy lines and the best so far; whether the epoch is the best (never when its
        evaluation was cut short: it is saved without its accuracy)."""
        improved = False
        if eval_aborted:
            print(f'Evaluation of epoch {epoch} interrupted by {self.stop_flag.name() or "a stop signal"}: '
                  f'the epoch is saved without its accuracy, and the same command evaluates it first')
        else:
            n_val = len(self.loader_val.dataset)
            print(accuracy_line(test_stats, n_val))
            if ema_stats:
                print(accuracy_line(ema_stats, n_val, 'EMA '))
            improved = self.checkpoints.record_accuracy(epoch, test_stats['acc1'],
                                                        ema_stats['acc1'] if ema_stats else None)
        print(f'Max accuracy: {self.checkpoints.max_accuracy:.2f}%'
              + (f'  (undecodable training images so far: {bad})' if bad else ''))
        return improved


def log_record(epoch: int, train_stats: dict, test_stats: dict | None, ema_stats: dict | None,
               checkpoints: RunCheckpoints, bad: int) -> dict[str, Any]:
    """The epoch's log.txt line (test_* and test_ema_* only when its evaluation finished)."""
    return {**{f'train_{k}': v for k, v in train_stats.items()},
            **({f'test_{k}': v for k, v in test_stats.items() if k != 'aborted'} if test_stats else {}),
            **({f'test_ema_{k}': v for k, v in ema_stats.items() if k != 'aborted'} if ema_stats else {}),
            'epoch': epoch, 'n_parameters': checkpoints.n_parameters, 'max_accuracy': checkpoints.max_accuracy,
            'bad_train_images': bad}
