"""One optimizer step with its precision: the autocast region of --amp fp16/bf16, TF32 on CUDA (--tf32), the refusal of
bf16 where a GPU would only emulate it, and `OptimizerStep`, one optimizer step from a window of micro-batches
(autocast, gradient accumulation under DDP, the fp16 GradScaler, clipping, one agreed flag per step that skips a
non-finite window on every rank), and what the iteration loops of segmentation and detection read of it
(StopRequest, count_bad_steps). main.py trains with it through engine.train_one_epoch, segmentation/train.py and
detection/train.py directly; tools/timing.py times it.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from timm.utils import dispatch_clip_grad, unwrap_model

from models.compat import set_tf32_flags, total_norm
from run.distributed import is_dist_avail_and_initialized
from run.errors import NonFiniteLossError, UserError, eprint

# --------------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------------
#: --amp's choices and the autocast dtype of each (no --amp: fp32)
AMP_DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


def amp_dtype(amp: str | None) -> torch.dtype | None:
    """The autocast dtype of an --amp value, None for fp32."""
    return AMP_DTYPES.get(amp) if amp else None


def autocast(device: str | torch.device, amp_dtype: torch.dtype | None):
    """torch.autocast on `device`'s type to `amp_dtype`; nothing with None (fp32)."""
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype)


def set_tf32(device, enabled: bool = True) -> bool:
    """Let fp32 matmuls and convolutions use TF32 tensor cores on CUDA (as the reference trained), or force
    full fp32 (`enabled=False`). Does nothing off CUDA; returns whether the flags were set."""
    if torch.device(device).type != 'cuda':
        return False
    set_tf32_flags(enabled)
    return True


def check_bf16(device: Any) -> None:
    """Refuse --amp bf16 on a GPU without native bfloat16 (e.g. V100, T4), where torch would emulate it
    many times slower. Called after the process's GPU is made current, so every rank checks its own."""
    device = torch.device(device)
    if device.type == 'cuda' and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UserError(f'--amp bf16: {torch.cuda.get_device_name(device)} has no native bfloat16 (it would be '
                        f'emulated, many times slower); use --amp fp16')


# --------------------------------------------------------------------------------------------------
# The optimizer step
# --------------------------------------------------------------------------------------------------
@dataclass
class StepOutcome:
    """What one optimizer step did (`OptimizerStep` returns it at the last micro-batch of a window).
    `non_finite` is set when a non-finite loss skipped the step: this rank's loss, or 'on another rank'.
    The tensors stay on the device, so that returning them makes the host wait for nothing."""
    losses: torch.Tensor  # this rank's loss of every micro-batch of the window (a 1-d tensor on the device)
    non_finite: float | str | None = None
    overflow: bool = False  # fp16: inf/NaN gradients (finite losses); the optimizer step was skipped
    grad_norm: torch.Tensor | None = None  # L2 norm of the gradients before clipping (when asked for)
    stop: bool = False  # a stop was requested (on any rank)


def _no_sync(model, skip_sync: bool):
    """DDP's no_sync() on the micro-steps of an accumulation window that do not end it."""
    if skip_sync and hasattr(model, 'no_sync'):  # a DDP model (compiled or not); a bare module has none
        return model.no_sync()
    return nullcontext()


class OptimizerStep:
    """One optimizer step from `accum_steps` consecutive micro-batches.

    Each micro-batch runs `criterion(samples, model(samples), targets)` under autocast (`amp_dtype`) and
    the backward of loss / window length, scaled by the fp16 `scaler` (a torch.amp.GradScaler) when there
    is one; the micro-batches that do not end the window run under DDP's no_sync(), so gradients are
    exchanged once per optimizer step. Every micro-batch runs its backward, also after a non-finite loss
    (whose gradients come out non-finite), so every rank issues the same collectives in the same order
    (SyncBatchNorm's backward all-reduces even under no_sync()) and no DDP forward is left without its
    backward.

    The host waits for the device once per optimizer step, after the window's last backward is queued: one
    small tensor built on the device says whether all losses of the window were finite, whether the fp16
    gradients overflowed and whether a stop was requested, agreed over the ranks by one all-reduce. Then the
    gradients are unscaled, clipped (timm's dispatch_clip_grad, `clip_grad`/`clip_mode`) and the optimizer
    steps. A window with a non-finite loss on any rank is skipped: no optimizer step, the loss scale as it
    was, and every buffer of the bare model (BatchNorm running statistics) put back as it was before the
    window. An fp16 overflow skips the optimizer step and lowers the loss scale, as GradScaler.step and
    update do. The epoch's last window may be shorter. `model` may be DDP-wrapped and/or compiled."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: str | torch.device,
                 amp_dtype: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None,
                 clip_grad: float | None = None, clip_mode: str = 'norm', accum_steps: int = 1):
        self.optimizer, self.device = optimizer, torch.device(device)
        self.amp_dtype, self.scaler = amp_dtype, scaler
        self.clip_grad, self.clip_mode = clip_grad, clip_mode
        self.accum_steps = max(1, int(accum_steps))
        self._window_end: int | None = None  # the open window's end; None between windows
        self._window_len = 1
        self._buffers: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._buffer_modules: tuple = (None, [])  # (the bare model, its modules that hold buffers)

    def __call__(self, model: torch.nn.Module, criterion: Callable[..., torch.Tensor], samples: Any, targets: Any,
                 index: int = 0, n_steps: int | None = None, stop_flag: Any = None,
                 grad_norm: bool = False) -> StepOutcome | None:
        """Run micro-batch `index` of an epoch of `n_steps` (None: no end). Returns None inside a window,
        the StepOutcome at its last micro-batch. `stop_flag` (a run.process.StopFlag) is read once per optimizer
        step; `grad_norm` asks for the gradient norm in the outcome."""
        if self._window_end is None:  # the first micro-batch of a window
            end = (index // self.accum_steps + 1) * self.accum_steps
            self._window_end = end if n_steps is None else min(end, n_steps)
            self._window_len = self._window_end - index
            # a skipped step must not leave inf/NaN BatchNorm statistics behind: keep the buffers to restore
            self._buffers = [b.detach().clone() for b in self._model_buffers(model)]
            self._losses = []
            self.optimizer.zero_grad(set_to_none=True)
        last = index + 1 >= self._window_end
        # DDP decides at forward time whether the backward all-reduces: the micro-batches that do not end the
        # window run forward and backward under no_sync()
        with _no_sync(model, not last):
            with autocast(self.device, self.amp_dtype):
                loss = criterion(samples, model(samples), targets)
            self._losses.append(loss.detach())
            self._backward(loss)
        if not last:
            return None
        self._window_end = None
        return self._step(model, stop_flag, grad_norm)

    def _model_buffers(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The buffers of the bare model (BatchNorm statistics), those of model.buffers(), from the modules that
        hold any: the modules are gathered once per model (walking every module costs the host more than
        copying the buffers); the tensors are looked up at every call, as .to() replaces them."""
        bare = unwrap_model(model)
        if self._buffer_modules[0] is not bare:
            self._buffer_modules = (bare, [m for m in bare.modules() if m._buffers])
        return [b for m in self._buffer_modules[1] for b in m._buffers.values() if b is not None]

    def _backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self._window_len if self._window_len > 1 else loss  # x / 1 is x: no op to run and undo
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()

    def _flags(self, losses: torch.Tensor, grads: list[torch.Tensor], stop_flag: Any) -> tuple[bool, bool, bool, bool]:
        """(a non-finite loss on this rank, on any rank, non-finite fp16 gradients on any rank, a stop request on
        any rank), with the step's one wait for the device. Under torch.distributed or with a loss scaler, this
        rank's flags are built on the device - a non-finite loss, non-finite (scaled fp16) gradients
        (GradScaler's own test, which its step would read back by itself) and the stop request - and agreed by
        one all-reduce; one process without a scaler reads its window's losses and checks them on the host
        (cheaper than the device-side test on a CPU), the stop request being the host's own."""
        stop_here = stop_flag is not None and stop_flag.requested
        if self.scaler is None and not is_dist_avail_and_initialized():
            bad = not all(math.isfinite(v) for v in losses.tolist())
            return bad, bad, False, stop_here
        flags = torch.stack([
            ~torch.isfinite(losses).all(),
            ~torch.isfinite(total_norm(grads, math.inf)) if self.scaler is not None and grads
            else torch.zeros((), dtype=torch.bool, device=losses.device),
            torch.full((), stop_here, dtype=torch.bool, device=losses.device),
        ]).float()
        agreed = flags.clone()
        if is_dist_avail_and_initialized():
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        bad_here, bad, overflow, stop = (v > 0 for v in torch.cat([flags[:1], agreed]).tolist())
        return bad_here, bad, overflow, stop

    def _step(self, model, stop_flag, grad_norm: bool) -> StepOutcome:
        losses, self._losses = torch.stack(self._losses), []
        buffers, self._buffers = self._buffers, []
        grads = [p.grad for p in model.parameters() if p.grad is not None] if self.scaler is not None or grad_norm \
            else []
        bad_here, bad, overflow, stop = self._flags(losses, grads, stop_flag)
        outcome = StepOutcome(losses=losses, stop=stop)
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for b, saved in zip(self._model_buffers(model), buffers):
                    b.copy_(saved)
            # a skipped window is rare: naming its loss may read the losses back once more
            outcome.non_finite = (next(v for v in losses.tolist() if not math.isfinite(v)) if bad_here
                                  else 'on another rank')
            return outcome
        if self.scaler is not None:
            # the device-side unscale also records the overflow test for update(); GradScaler.step would repeat
            # that test on the host, so the optimizer steps directly when the test above found no overflow
            self.scaler.unscale_(self.optimizer)
        if grad_norm:
            outcome.grad_norm = total_norm(grads) if grads else torch.zeros((), device=self.device)
        if overflow:
            outcome.overflow = True
        else:
            if self.clip_grad is not None:
                dispatch_clip_grad(model.parameters(), self.clip_grad, mode=self.clip_mode)
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()  # backs off after an overflow, grows after enough finite steps
        return outcome


# --------------------------------------------------------------------------------------------------
# What an iteration loop reads of the step
# --------------------------------------------------------------------------------------------------
class StopRequest:
    """What the optimizer step reads as this process's stop request (`requested`, agreed over the processes by
    the step): a stop signal, or a training batch this process could not read (`error`, its one line)."""

    def __init__(self, stop_flag: Any):
        self.stop_flag, self.error = stop_flag, None

    @property
    def requested(self) -> bool:
        return self.stop_flag.requested or self.error is not None


def count_bad_steps(bad: int, out: StepOutcome, iteration: int, max_bad_steps: int) -> int:
    """The consecutive skipped steps after `out` (a non-finite loss, an fp16 overflow), `bad` before it; a warning
    for a non-finite loss; more than `max_bad_steps` end the run (NonFiniteLossError, the last checkpoint kept)."""
    bad = bad + 1 if out.non_finite is not None or out.overflow else 0
    if out.non_finite is not None:
        eprint(f'warning: non-finite loss ({out.non_finite}) at iteration {iteration}; step skipped ({bad}/'
               f'{max_bad_steps} consecutive)')
    if bad > max_bad_steps:
        raise NonFiniteLossError(f'{bad} consecutive skipped steps at iteration {iteration} (more than '
                                 f'--max-bad-steps {max_bad_steps}); stopped, the last checkpoint is kept')
    return bad
