"""Train for one epoch and evaluate (DeiT's engine, with exact distributed evaluation, a graceful stop at
step boundaries, mid-epoch resume and a bounded number of skipped non-finite steps)."""
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch
from timm.utils import dispatch_clip_grad

import utils


@dataclass
class EpochResult:
    stats: dict
    stopped: bool = False            # a stop signal ended the epoch early
    next_step: int = 0               # first step not yet run (when stopped)
    rng_state: Optional[dict] = None  # RNG state at the stop point
    epoch_rng_state: Optional[dict] = None  # RNG state before the epoch's data iterator was created
    loss_meter: dict = field(default_factory=dict)


def autocast(device, amp_dtype):
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype)


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler=None, amp_dtype=None,
                    clip_grad=None, clip_mode='norm', model_ema=None, mixup_fn=None, set_training_mode=True,
                    args=None, stop_flag=None, start_step=0, resume_rng_state=None, epoch_rng_state=None,
                    loss_meter_state=None, bce_loss=False, channels_last=False, print_freq=10,
                    max_bad_steps=20, num_classes=None, ema_source=None, logger=None):
    """One pass over `data_loader`. `model` may be DDP-wrapped and/or compiled; `ema_source` is the bare
    module the EMA follows.

    Resuming in the middle of an epoch (`start_step` > 0): the RNG state from before the epoch's data
    iterator was created is restored, the first `start_step` batches are loaded again but not trained on
    (so the random augmentations of data-loader workers come out identical), then the RNG state saved at
    the stop point is restored.
    """
    model.train(set_training_mode)
    device = torch.device(device)
    distributed = utils.is_dist_avail_and_initialized()
    metric_logger = utils.MetricLogger(delimiter='  ')
    metric_logger.add_meter('lr', utils.SmoothedValue(window_size=1, fmt='{value:.6f}'))
    if loss_meter_state:
        metric_logger.meters['loss'].total = loss_meter_state['total']
        metric_logger.meters['loss'].count = loss_meter_state['count']
    header = f'Epoch: [{epoch}]'

    if epoch_rng_state is not None:
        utils.set_rng_state(epoch_rng_state)
    epoch_rng_state = utils.get_rng_state()
    if start_step > 0:
        print(f'Resuming epoch {epoch} at step {start_step}: replaying the data order of the first {start_step} steps')
    batch_size = data_loader.batch_size or 1
    world = utils.get_world_size()
    bad_steps = 0
    n_steps = len(data_loader)

    for step, (samples, targets) in enumerate(metric_logger.log_every(
            data_loader, print_freq, header, images_per_step=batch_size * world)):
        if step < start_step:
            if step == start_step - 1 and resume_rng_state is not None:
                utils.set_rng_state(resume_rng_state)
            continue
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            samples = samples.contiguous(memory_format=torch.channels_last)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)
        if bce_loss:
            if targets.ndim == 1:
                targets = torch.nn.functional.one_hot(targets, num_classes).to(samples.dtype)
            targets = targets.gt(0.0).type(targets.dtype)

        with autocast(device, amp_dtype):
            outputs = model(samples)
            loss = criterion(samples, outputs, targets)
        loss_value = loss.item()
        finite = math.isfinite(loss_value)

        # one small collective per step: do all ranks have a finite loss, did any rank get a stop signal?
        stop_req = bool(stop_flag is not None and stop_flag.requested)
        if distributed:
            bad_any, stop_any = utils.all_reduce_max([0.0 if finite else 1.0, 1.0 if stop_req else 0.0], device)
            finite, stop_req = bad_any == 0.0, stop_any > 0.0

        optimizer.zero_grad(set_to_none=True)
        if not finite:
            bad_steps += 1
            utils.eprint(f'warning: non-finite loss ({loss_value}) at epoch {epoch} step {step}; step skipped '
                         f'({bad_steps}/{max_bad_steps} consecutive)')
            if bad_steps > max_bad_steps:
                raise utils.NonFiniteLossError(
                    f'non-finite loss ({loss_value}) at epoch {epoch} step {step}: {bad_steps} consecutive bad steps '
                    f'(more than --max-bad-steps {max_bad_steps}); stopped, the last checkpoint is left intact')
        else:
            if loss_scaler is not None:
                scale_before = loss_scaler.get_scale()
                loss_scaler.scale(loss).backward()
                if clip_grad is not None:
                    loss_scaler.unscale_(optimizer)
                    dispatch_clip_grad(model.parameters(), clip_grad, mode=clip_mode)
                loss_scaler.step(optimizer)
                loss_scaler.update()
                if loss_scaler.get_scale() < scale_before:  # fp16 overflow: the scaler skipped this step
                    bad_steps += 1
                    if bad_steps > max_bad_steps:
                        raise utils.NonFiniteLossError(
                            f'non-finite gradients at epoch {epoch} step {step}: {bad_steps} consecutive fp16 steps '
                            f'skipped (more than --max-bad-steps {max_bad_steps}); stopped, the last checkpoint is left intact')
                else:
                    bad_steps = 0
            else:
                loss.backward()
                if clip_grad is not None:
                    dispatch_clip_grad(model.parameters(), clip_grad, mode=clip_mode)
                optimizer.step()
                bad_steps = 0
            if model_ema is not None:
                model_ema.update(ema_source if ema_source is not None else model)
            metric_logger.update(loss=loss_value)
        metric_logger.update(lr=max(g['lr'] for g in optimizer.param_groups))  # the head's LR under --layer-decay
        if logger is not None:  # e.g. TensorBoard: one call per optimizer step
            logger({'step': epoch * n_steps + step, 'loss': loss_value, 'lr': metric_logger.lr.value,
                    'images': batch_size * world, **({'loss_scale': loss_scaler.get_scale()} if loss_scaler else {})})

        if stop_req and step + 1 < n_steps:
            meter = metric_logger.meters['loss']
            return EpochResult(stats={}, stopped=True, next_step=step + 1, rng_state=utils.get_rng_state(),
                               epoch_rng_state=epoch_rng_state,
                               loss_meter={'total': meter.total, 'count': meter.count})

    metric_logger.synchronize_between_processes(device)
    print('Averaged stats:', metric_logger)
    stats = {k: meter.global_avg for k, meter in metric_logger.meters.items()}
    stats['lr'] = max(g['lr'] for g in optimizer.param_groups)
    stats.setdefault('loss', float('nan'))
    return EpochResult(stats=stats, stopped=bool(stop_flag is not None and stop_flag.requested))


@torch.no_grad()
def evaluate(data_loader, model, device, amp_dtype=None, channels_last=False, print_freq=10, header='Test:',
             sum_over_ranks=False, stop_flag=None):
    """Top-1/top-5 and loss from exact counts. With `sum_over_ranks` (dist-eval) the counts of every rank
    are summed with all_reduce, so each image counts once whatever the number of processes.
    A stop signal ends the loop early: stats['aborted'] is then true (on every rank with dist-eval)."""
    criterion = torch.nn.CrossEntropyLoss(reduction='sum')
    device = torch.device(device)
    metric_logger = utils.MetricLogger(delimiter='  ')
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
        loss_sum, correct1, correct5, n, seen, aborted = utils.all_reduce_sum(
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
