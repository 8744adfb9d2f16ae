"""DeiT's utils: the metric logger of a loop (MetricLogger of SmoothedValues, with an img/s meter) and its progress
line, and the optional TensorBoard events of --log-dir (rank 0: per-step scalars under ``train/``, the epoch metrics
of log.txt under ``epoch/``; TensorBoard is an optional dependency). log.txt itself is written with the checkpoints
(run/checkpoint.py)."""
import atexit
import datetime
import math
import time
from collections import defaultdict, deque
from typing import Any

import numpy as np
import torch

from run import distributed
from run.distributed import all_reduce_sum, is_dist_avail_and_initialized


class SmoothedValue:
    """A series of numbers: median/average of the last `window_size` values and the average of all, summed over
    ranks by synchronize_between_processes (timm.utils.AverageMeter has neither the window nor the sum)."""

    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt or '{median:.4f} ({global_avg:.4f})'

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self, device='cpu'):
        if not is_dist_avail_and_initialized():
            return
        count, total = all_reduce_sum([self.count, self.total], device)
        self.count, self.total = int(count), total

    @property
    def median(self):
        return float(np.median(list(self.deque))) if self.deque else 0.0

    @property
    def avg(self):
        return float(np.mean(list(self.deque))) if self.deque else 0.0

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)

    @property
    def max(self):
        return max(self.deque) if self.deque else 0.0

    @property
    def value(self):
        return self.deque[-1] if self.deque else 0.0

    def __str__(self):
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg,
                               max=self.max, value=self.value)


class MetricLogger:
    """Named SmoothedValues of a loop, printed as one progress line every `print_freq` steps (log_every)."""

    def __init__(self, delimiter='  '):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, n=1, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(float(v), n=n)

    def __getattr__(self, attr):
        if attr in self.__dict__.get('meters', {}):
            return self.meters[attr]
        raise AttributeError(attr)

    def __str__(self):
        return self.delimiter.join(f'{name}: {meter}' for name, meter in self.meters.items())

    def synchronize_between_processes(self, device='cpu'):
        for meter in self.meters.values():
            meter.synchronize_between_processes(device)

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def log_every(self, iterable, print_freq, header='', images_per_step=None, before_line=None):
        """Yield from `iterable`, printing a progress line (ETA, meters, img/s) every `print_freq` steps;
        `before_line()`, when given, is called right before each line (to bring the meters up to date)."""
        total = len(iterable)
        start_time = end = time.time()
        iter_time = SmoothedValue(fmt='{avg:.4f}')
        data_time = SmoothedValue(fmt='{avg:.4f}')
        width = len(str(total))
        for i, obj in enumerate(iterable):
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0 or i == total - 1:
                if before_line is not None:
                    before_line()
                eta = str(datetime.timedelta(seconds=int(iter_time.global_avg * (total - i - 1))))
                ips = ''
                if images_per_step and iter_time.avg > 0:
                    ips = f'{self.delimiter}img/s: {images_per_step / iter_time.avg:.1f}'
                print(f'{header} [{i:>{width}}/{total}]{self.delimiter}eta: {eta}{self.delimiter}{self}'
                      f'{ips}{self.delimiter}time: {iter_time}{self.delimiter}data: {data_time}', flush=True)
            end = time.time()
        total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
        print(f'{header} Total time: {total_time}', flush=True)


# --------------------------------------------------------------------------------------------------
# TensorBoard (--log-dir)
# --------------------------------------------------------------------------------------------------
class TensorBoardLogger:
    """Callable once per optimizer step with a dict of numbers.

    ``step`` (the global step, epoch x steps per epoch + step, so a resumed run continues its curves) is
    the x axis; ``images`` (images in the step, all processes) turns into ``train/img_per_s`` from the
    time between steps (``time``, the step's ``time.perf_counter()``, when the engine hands over several
    steps' values at once; else the time of the call); every other number is written as ``train/<key>``
    (loss, lr, grad_norm, loss_scale, ... whatever the engine has). Non-numbers are skipped.
    """

    def __init__(self, log_dir: str, flush_secs: int = 30) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)
        self._last_time: float | None = None
        self._last_step: int | None = None
        atexit.register(self.close)  # a stopped run still gets its last steps written

    def __call__(self, metrics: dict[str, Any]) -> None:
        now = metrics.get('time', time.perf_counter())
        step = int(metrics.get('step', (self._last_step or 0) + 1))
        images = metrics.get('images')
        if images and self._last_time is not None and self._last_step == step - 1 and now > self._last_time:
            self.writer.add_scalar('train/img_per_s', images / (now - self._last_time), step)
        for key, value in metrics.items():
            if key in ('step', 'images', 'time'):
                continue
            value = value.item() if hasattr(value, 'item') else value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f'train/{key}', value, step)
        self._last_time, self._last_step = now, step

    def log_epoch(self, stats: dict[str, Any], epoch: int) -> None:
        """The epoch's line of log.txt (finite numbers only), then flush."""
        for key, value in stats.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key != 'epoch' and numeric and math.isfinite(value):
                self.writer.add_scalar(f'epoch/{key}', value, epoch)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (safe to call twice)."""
        self.writer.close()


def tensorboard_logger(log_dir: str, device: Any) -> TensorBoardLogger | None:
    """Rank 0's TensorBoard writer for --log-dir `log_dir` (None on the other ranks and without one). Every rank
    calls this: a writer that cannot start stops them all with one line instead of leaving them waiting."""
    if not log_dir:
        return None
    return distributed.on_rank0(lambda: TensorBoardLogger(log_dir), device,
                                f'--log-dir {log_dir}: cannot write TensorBoard events there')
