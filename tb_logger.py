"""Optional TensorBoard logging of a training run (rank 0 only): per-step scalars under ``train/`` and
the epoch metrics of log.txt under ``epoch/``. TensorBoard is an optional dependency."""
import atexit
import math
import time
from typing import Any, Dict, Optional

INSTALL_HINT = '--log-dir needs TensorBoard, which is not installed: pip install tensorboard'


def tensorboard_missing() -> Optional[str]:
    """None when TensorBoard can be used, else a one-line message that says how to install it."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


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
        self._last_time: Optional[float] = None
        self._last_step: Optional[int] = None
        atexit.register(self.close)  # a stopped run still gets its last steps written

    def __call__(self, metrics: Dict[str, Any]) -> None:
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

    def log_epoch(self, stats: Dict[str, Any], epoch: int) -> None:
        """The epoch's line of log.txt (finite numbers only), then flush."""
        for key, value in stats.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key != 'epoch' and numeric and math.isfinite(value):
                self.writer.add_scalar(f'epoch/{key}', value, epoch)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (safe to call twice)."""
        self.writer.close()
