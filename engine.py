"""Train for one epoch and evaluate (DeiT's engine, with exact distributed evaluation, gradient accumulation,
a graceful stop at optimizer-step boundaries, mid-epoch resume and a bounded number of skipped non-finite
steps that leave the model exactly as it was)."""
import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from timm.utils import dispatch_clip_grad

from checkpoint import get_rng_state, set_rng_state
from distributed import all_reduce_max, all_reduce_sum, get_world_size, is_dist_avail_and_initialized
from errors import NonFiniteLossError, eprint
from metrics import MetricLogger, SmoothedValue


@dataclass
class TrainCarry:
    """Training-loop state that outlives one epoch (and is saved for a resume)."""
    bad_steps: int = 0      # consecutive skipped optimizer steps, counted across epochs
    skipped_steps: int = 0  # optimizer steps skipped so far in the current epoch

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict | None) -> 'TrainCarry':
        return cls(**{k: int(v) for k, v in (state or {}).items() if k in cls.__dataclass_fields__})


@dataclass
class EpochResult:
    stats: dict
    stopped: bool = False            # a stop signal ended the epoch early
    next_step: int = 0               # first step not yet run (when stopped)
    rng_state: Optional[dict] = None  # RNG state at the stop point
    epoch_rng_state: Optional[dict] = None  # RNG state before the epoch's data iterator was created
    loss_meter: dict = field(default_factory=dict)
    carry: TrainCarry = field(default_factory=TrainCarry)


def autocast(device, amp_dtype):
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype)


def set_tf32(device, enabled: bool = True) -> bool:
    """Let fp32 matmuls and convolutions use TF32 tensor cores on CUDA (as the reference trained), or force
    full fp32 (`enabled=False`). Does nothing off CUDA; returns whether the flags were set."""
    if torch.device(device).type != 'cuda':
        return False
    if hasattr(torch.backends.cuda.matmul, 'fp32_precision'):  # torch >= 2.9: the allow_tf32 flags are deprecated
        precision = 'tf32' if enabled else 'ieee'
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    return True


def _no_sync(model, skip_sync: bool):
    """DDP's no_sync() on the micro-steps of an accumulation window that do not end it."""
    if skip_sync and hasattr(model, 'no_sync'):  # a DDP model (compiled or not); a bare module has none
        return model.no_sync()
    return nullcontext()


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler=None, amp_dtype=None,
                    clip_grad=None, clip_mode='norm', model_ema=None, mixup_fn=None, set_training_mode=True,
                    args=None, stop_flag=None, start_step=0, resume_rng_state=None, epoch_rng_state=None,
                    loss_meter_state=None, channels_last=False, print_freq=10,
                    max_bad_steps=20, ema_source=None, accum_steps=1, carry=None, logger=None):
    """One pass over `data_loader`. `model` may be DDP-wrapped and/or compiled; `ema_source` is the bare
    module the EMA follows (and whose buffers a skipped step restores).

    Gradients of `accum_steps` consecutive batches (loss divided by the window's length) make one optimizer
    step; the epoch's last window may be shorter. Clipping, the optimizer step, the EMA update, the
    non-finite check and the stop check happen once per window. A window with a non-finite loss on any rank
    is skipped: no optimizer step, no EMA update, and every buffer (BatchNorm running statistics) is put
    back as it was before the window. `carry` (a `TrainCarry`) holds the count of consecutive skipped steps
    across epochs and the current epoch's skipped steps; the updated one is returned in the result.

    Resuming in the middle of an epoch (`start_step` > 0, always a window boundary): the RNG state from
    before the epoch's data iterator was created is restored, the first `start_step` batches are loaded
    again but not trained on (so the random augmentations of data-loader workers come out identical), then
    the RNG state saved at the stop point is restored.
    """
    model.train(set_training_mode)
    device = torch.device(device)
    distributed = is_dist_avail_and_initialized()
    module = ema_source if ema_source is not None else model
    carry = TrainCarry(**asdict(carry)) if carry is not None else TrainCarry()
    accum_steps = max(1, int(accum_steps))
    metric_logger = MetricLogger(delimiter='  ')
    metric_logger.add_meter('lr', SmoothedValue(window_size=1, fmt='{value:.6f}'))
    if loss_meter_state:
        metric_logger.meters['loss'].total = loss_meter_state['total']
        metric_logger.meters['loss'].count = loss_meter_state['count']
    header = f'Epoch: [{epoch}]'

    if epoch_rng_state is not None:
        set_rng_state(epoch_rng_state)
    epoch_rng_state = get_rng_state()
    if start_step > 0:
        print(f'Resuming epoch {epoch} at step {start_step}: replaying the data order of the first {start_step} steps')
    batch_size = data_loader.batch_size or 1
    world = get_world_size()
    n_steps = len(data_loader)
    window_end = 0
    saved_buffers, losses, window_finite, window_loss = [], [], True, float('nan')

    for step, (samples, targets) in enumerate(metric_logger.log_every(
            data_loader, print_freq, header, images_per_step=batch_size * world)):
        if step < start_step:
            if step == start_step - 1 and resume_rng_state is not None:
                set_rng_state(resume_rng_state)
            continue
        if step >= window_end:  # the first micro-step of an accumulation window
            window_end = min((step // accum_steps + 1) * accum_steps, n_steps)
            window_len = window_end - step
            # a skipped step must not leave inf/NaN BatchNorm statistics behind: keep the buffers to restore
            saved_buffers = [b.detach().clone() for b in module.buffers()]
            losses, window_finite = [], True
            optimizer.zero_grad(set_to_none=True)
        last = step + 1 == window_end
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            samples = samples.contiguous(memory_format=torch.channels_last)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)

        # DDP decides at forward time whether the backward all-reduces: the micro-steps that do not end the
        # window run forward and backward under no_sync(), so gradients are exchanged once per optimizer step
        with _no_sync(model, not last):
            with autocast(device, amp_dtype):
                outputs = model(samples)
                loss = criterion(samples, outputs, targets)
            loss_value = loss.item()
            window_finite = window_finite and math.isfinite(loss_value)
            if not math.isfinite(loss_value):
                window_loss = loss_value
            losses.append(loss_value)
            if not last:
                if window_finite:  # a local backward; a skipped window needs none
                    scaled = loss / window_len
                    (loss_scaler.scale(scaled) if loss_scaler is not None else scaled).backward()
                continue

        # one small collective per optimizer step: do all ranks have finite losses, did any get a stop signal?
        stop_req = bool(stop_flag is not None and stop_flag.requested)
        finite = window_finite
        if distributed:
            bad_any, stop_any = all_reduce_max([0.0 if finite else 1.0, 1.0 if stop_req else 0.0], device)
            finite, stop_req = bad_any == 0.0, stop_any > 0.0

        if not finite:
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for b, saved in zip(module.buffers(), saved_buffers):
                    b.copy_(saved)
            carry.bad_steps += 1
            carry.skipped_steps += 1
            bad_value = window_loss if not window_finite else 'on another rank'
            eprint(f'warning: non-finite loss ({bad_value}) at epoch {epoch} step {step}; step skipped '
                   f'({carry.bad_steps}/{max_bad_steps} consecutive)')
            if carry.bad_steps > max_bad_steps:
                raise NonFiniteLossError(
                    f'non-finite loss ({bad_value}) at epoch {epoch} step {step}: {carry.bad_steps} consecutive bad '
                    f'steps (more than --max-bad-steps {max_bad_steps}); stopped, the last checkpoint is left intact')
        else:
            scaled = loss / window_len
            if loss_scaler is not None:
                scale_before = loss_scaler.get_scale()
                loss_scaler.scale(scaled).backward()
                if clip_grad is not None or logger is not None:
                    loss_scaler.unscale_(optimizer)
                grad_norm = _grad_norm(model) if logger is not None else None
                if clip_grad is not None:
                    dispatch_clip_grad(model.parameters(), clip_grad, mode=clip_mode)
                loss_scaler.step(optimizer)
                loss_scaler.update()
                if loss_scaler.get_scale() < scale_before:  # fp16 overflow: the scaler skipped this step
                    carry.bad_steps += 1
                    carry.skipped_steps += 1
                    if carry.bad_steps > max_bad_steps:
                        raise NonFiniteLossError(
                            f'non-finite gradients at epoch {epoch} step {step}: {carry.bad_steps} consecutive fp16 '
                            f'steps skipped (more than --max-bad-steps {max_bad_steps}); stopped, the last '
                            f'checkpoint is left intact')
                else:
                    carry.bad_steps = 0
            else:
                scaled.backward()
                grad_norm = _grad_norm(model) if logger is not None else None
                if clip_grad is not None:
                    dispatch_clip_grad(model.parameters(), clip_grad, mode=clip_mode)
                optimizer.step()
                carry.bad_steps = 0
            if model_ema is not None:
                model_ema.update(module)
            for value in losses:
                metric_logger.update(loss=value)
        metric_logger.update(lr=max(g['lr'] for g in optimizer.param_groups))  # the head's LR under --layer-decay
        if logger is not None:  # e.g. TensorBoard: one call per optimizer step
            logger({'step': epoch * n_steps + step, 'loss': sum(losses) / len(losses), 'lr': metric_logger.lr.value,
                    'images': batch_size * world * len(losses),
                    **({'grad_norm': grad_norm} if finite else {}),
                    **({'loss_scale': loss_scaler.get_scale()} if loss_scaler else {})})

        if stop_req and step + 1 < n_steps:
            meter = metric_logger.meters['loss']
            return EpochResult(stats={}, stopped=True, next_step=step + 1, rng_state=get_rng_state(),
                               epoch_rng_state=epoch_rng_state,
                               loss_meter={'total': meter.total, 'count': meter.count}, carry=carry)

    metric_logger.synchronize_between_processes(device)
    print('Averaged stats:', metric_logger)
    stats = {k: meter.global_avg for k, meter in metric_logger.meters.items()}
    stats['lr'] = max(g['lr'] for g in optimizer.param_groups)
    stats.setdefault('loss', float('nan'))
    stats['skipped_steps'] = carry.skipped_steps
    return EpochResult(stats=stats, stopped=bool(stop_flag is not None and stop_flag.requested), carry=carry)


def _grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of all gradients (unscaled, before clipping), for the per-step log."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


@torch.no_grad()
def evaluate(data_loader, model, device, amp_dtype=None, channels_last=False, print_freq=10, header='Test:',
             sum_over_ranks=False, stop_flag=None):
    """Top-1/top-5 and loss from exact counts. With `sum_over_ranks` (dist-eval) the counts of every rank
    are summed with all_reduce, so each image counts once whatever the number of processes.
    A stop signal ends the loop early: stats['aborted'] is then true (on every rank with dist-eval)."""
    criterion = torch.nn.CrossEntropyLoss(reduction='sum')
    device = torch.device(device)
    metric_logger = MetricLogger(delimiter='  ')
    model.eval()
    loss_sum = correct1 = correct5 = n = seen = aborted = 0.0
    for images, target in metric_logger.log_every(data_loader, print_freq, header,
                                                   images_per_step=data_loader.batch_size):
        if stop_flag is not None and stop_flag.requested:
            aborted = 1.0
            break
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(device, amp_dtype):
            output = model(images)
        output = output.float()
        # targets < 0 mark images that could not be decoded (datasets.IGNORE_TARGET): not counted
        valid = target >= 0
        loss_sum += criterion(output[valid], target[valid]).item() if valid.any() else 0.0
        maxk = min(5, output.shape[1])
        pred = output.topk(maxk, dim=1).indices
        hit = pred.eq(target.view(-1, 1)) & valid.view(-1, 1)
        correct1 += hit[:, :1].sum().item()
        correct5 += hit[:, :maxk].sum().item()
        n += valid.sum().item()
        seen += target.shape[0]
        metric_logger.update(loss=loss_sum / max(n, 1))
    if sum_over_ranks:
        loss_sum, correct1, correct5, n, seen, aborted = all_reduce_sum(
            [loss_sum, correct1, correct5, n, seen, aborted], device)
    n, seen = int(round(n)), int(round(seen))
    stats = {
        'loss': loss_sum / n if n else float('nan'),
        'acc1': 100.0 * correct1 / n if n else float('nan'),
        'acc5': 100.0 * correct5 / n if n else float('nan'),
        'n': n,
        'seen': seen,
        'aborted': aborted > 0,
    }
    if stats['aborted']:
        print(f'{header} interrupted by a stop signal after {n} images')
        return stats
    print(f"* Acc@1 {stats['acc1']:.3f} Acc@5 {stats['acc5']:.3f} loss {stats['loss']:.3f}  ({n} images)")
    return stats
