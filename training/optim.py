"""What a run's optimizer does: the optimizer built from its flags (`OptimizerSettings`: timm's, with layer-wise LR
decay and, on GPUs, torch's fused Adam/AdamW kernel), the learning-rate schedule (`Schedule`: the base LR scaled by
the global batch, timm's scheduler stepped once per epoch, the notes when the LR lies below the floor it decays to
or the warmup lasts the whole run), the exponential moving average of the weights (--model-ema: timm's ModelEmaV3
with a cheaper update, its decay at the run's global batch), the checks of their flags that need them built, and
what a resumed run changes of them against its checkpoint, in flag terms; the warning of the dense-prediction
recipes when their global batch is not the one their LR was set for, and their weight-decay groups.
"""
from dataclasses import dataclass, fields
from typing import Any

import torch
from timm.utils import ModelEmaV3

from run import resume
from run.errors import first_line

# --------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------
#: the --opt names whose torch optimizer has a fused CUDA kernel (torch.optim.Adam and AdamW)
FUSED_OPTIMIZERS = ('adam', 'adamw')



@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer flags, each named as its argparse destination; `lr` is the run's base LR (scaled by the
    global batch: scaled_lr)."""
    opt: str
    lr: float
    weight_decay: float
    momentum: float
    opt_eps: float
    opt_betas: Any
    layer_decay: float | None


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """timm's optimizer of `settings` for `model`; --layer-decay scales each parameter group's LR by
    decay^(layers above it), layers as the model's group_matcher defines them.

    Adam/AdamW with every parameter on a GPU use torch's fused kernel: one kernel for all parameters, step
    counts kept on the GPU (the multi-tensor kernel reads each parameter's back to the host every step);
    its results differ from the multi-tensor kernel's by rounding only (docs/performance.md). Elsewhere
    torch's default, the multi-tensor kernel. A checkpoint's parameter groups carry the kernel choice of the
    run that wrote it; loading one keeps this run's choice."""
    from timm.optim import create_optimizer_v2
    fused = (settings.opt.lower().removeprefix('lookahead_') in FUSED_OPTIMIZERS
             and all(p.is_cuda for p in model.parameters()))
    optimizer = create_optimizer_v2(model, opt=settings.opt, lr=settings.lr, weight_decay=settings.weight_decay,
                                    momentum=settings.momentum, eps=settings.opt_eps, layer_decay=settings.layer_decay,
                                    **({'betas': tuple(settings.opt_betas)} if settings.opt_betas else {}),
                                    **({'fused': True} if fused else {}))
    # timm's Lookahead (--opt lookahead_*) loads its state through the optimizer it wraps, which holds the hooks
    getattr(optimizer, '_base_optimizer', optimizer).register_load_state_dict_pre_hook(_keep_kernel_choice)
    return optimizer


def _keep_kernel_choice(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer load_state_dict pre-hook: the loaded parameter groups take this optimizer's kernel
    settings (fused, foreach) instead of those of the run that saved them."""
    kernel = {k: optimizer.defaults[k] for k in ('fused', 'foreach') if k in optimizer.defaults}
    return {**state_dict, 'param_groups': [{**group, **kernel} for group in state_dict['param_groups']]}


def optimizer_problem(settings: OptimizerSettings) -> str | None:
    """The error line of --opt and its settings, None when fine: --opt against timm's optimizer registry (an optional
    `lookahead_` prefix, as timm allows), then the optimizer built once on a dummy parameter, so that missing
    packages and bad --opt-betas/--opt-eps/--momentum show before anything starts."""
    import difflib

    from timm.optim import list_optimizers
    known = list_optimizers()
    base = settings.opt.lower().removeprefix('lookahead_')
    if base not in known:
        close = difflib.get_close_matches(base, known, n=3)
        return (f'--opt {settings.opt}: unknown optimizer' + (f"; did you mean {', '.join(close)}?" if close else '')
                + f' ({len(known)} names in timm.optim.list_optimizers(), e.g. adamw, sgd, lamb)')
    try:
        build_optimizer(torch.nn.Linear(1, 1), settings)
    except Exception as e:  # any failure here is a bad flag or a missing optional package
        return f'--opt {settings.opt}: cannot build it with these flags ({first_line(e)})'
    return None




# --------------------------------------------------------------------------------------------------
# The learning-rate schedule
# --------------------------------------------------------------------------------------------------

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


def schedule_problem(schedule: Schedule, lr: float) -> str | None:
    """The error line of --sched and the flags that shape it, None when fine: the schedule built once on a dummy
    optimizer of LR `lr`, as timm checks its flag combinations (e.g. wsd's --decay-epochs against --epochs) only
    then."""
    try:
        build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr), schedule)
    except (ValueError, AssertionError, TypeError) as e:
        return f'--sched {schedule.sched}: {first_line(e)}'
    return None


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


# --------------------------------------------------------------------------------------------------
# The EMA of the weights
# --------------------------------------------------------------------------------------------------
def ema_decay(decay_at_512: float, global_batch: int) -> float:
    """The EMA decay per optimizer step of a run at `global_batch` images per step: --model-ema-decay, given
    for a global batch of 512, to the power global batch / 512, so that the EMA averages over the same number
    of images whatever the batch."""
    return decay_at_512 ** (global_batch / 512.0)


class ModelEma(ModelEmaV3):
    """timm's ModelEmaV3 (the EMA of parameters and buffers, on the model's device or `device`) whose update
    walks the modules' own tensor dicts instead of building two state dicts per step, which costs the host
    several milliseconds a step. The same tensors in the same order as the state dicts (each module's
    parameters, then its persistent buffers), the same foreach lerp: the same numbers. The module lists are
    gathered once per model; the tensors are looked up at every update, so moving a model (`.to()` replaces
    its buffers) is fine. Off the multi-tensor path (an EMA on another device than the model) timm's own
    update runs."""

    def __init__(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        super().__init__(model, *args, **kwargs)
        self._ema_modules = list(self.module.modules())
        self._model_modules: tuple = (None, [])  # (the model, its modules), for the model last updated from

    @staticmethod
    def _state_tensors(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
        """The tensors of the modules' state dict, in its order (module attributes: state_dict() would spend
        milliseconds on names, hooks and detached copies)."""
        tensors = []
        for m in modules:
            tensors += [p for p in m._parameters.values() if p is not None]
            tensors += [b for k, b in m._buffers.items() if b is not None and k not in m._non_persistent_buffers_set]
        return tensors

    def apply_update_(self, model: torch.nn.Module, decay: float) -> None:
        if not self.foreach:
            super().apply_update_(model, decay)
            return
        if self._model_modules[0] is not model:
            self._model_modules = (model, list(model.modules()))
        ema_values = self._state_tensors(self._ema_modules)
        model_values = self._state_tensors(self._model_modules[1])
        lerp_ema, lerp_model = [], []
        for ema_v, model_v in zip(ema_values, model_values):
            if ema_v.is_floating_point():
                lerp_ema.append(ema_v)
                lerp_model.append(model_v)
            else:
                ema_v.copy_(model_v)
        self._foreach_lerp_(lerp_ema, lerp_model, weight=1. - decay)


# --------------------------------------------------------------------------------------------------
# What a resumed run changes, in flag terms
# --------------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------------
# What changed since the checkpoint, in flag terms
# --------------------------------------------------------------------------------------------------
def _global_batch(a: dict[str, Any]) -> int | None:
    try:
        return int(a['batch_size']) * int(a.get('world_size', 1)) * int(a.get('accum_steps', 1))
    except (KeyError, TypeError, ValueError):
        return None


def _ema_decay(a: dict[str, Any]) -> float | None:
    """The EMA decay a run used (ema_decay at its global batch), None without an EMA."""
    gb = _global_batch(a)
    if not a.get('model_ema') or gb is None or a.get('model_ema_decay') is None:
        return None
    return ema_decay(float(a['model_ema_decay']), gb)


def flag_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What a resumed run (`now`, its command line as a dict) changes against the checkpoint's command line
    `saved`, in flag terms: the batch flags with the global batch, LR and EMA decay they give, then the
    LR-schedule flags. Empty when nothing changed or the checkpoint holds no command line."""
    if not saved:
        return []
    out = []
    sizes = [f'{"processes" if k == "world_size" else resume.flag_of(k)} {saved.get(k, 1)} -> {now.get(k, 1)}'
             for k in ('batch_size', 'world_size', 'accum_steps')
             if k in saved and resume.differs(saved.get(k, 1), now.get(k, 1))]
    effects = []
    gb_was, gb_now = _global_batch(saved), _global_batch(now)
    if gb_was is not None and gb_was != gb_now:
        effects.append(f'global batch {gb_was} -> {gb_now}')
    # both LRs are scaled by the global batch (not --unscale-lr)
    if 'lr' in saved and resume.differs(saved['lr'], now.get('lr')):
        effects.append(f'LR {float(saved["lr"]):.4g} -> {float(now["lr"]):.4g}')
    ema_was, ema_now = _ema_decay(saved), _ema_decay(now)
    if ema_was is not None and ema_now is not None and resume.differs(ema_was, ema_now):
        effects.append(f'EMA decay {ema_was:.8g} -> {ema_now:.8g}')
    if sizes or effects:
        out.append(', '.join(sizes) + (': ' if sizes and effects else '') + ', '.join(effects))
    out += resume.changed_flags(saved, now, SCHEDULE_FLAGS)
    return out




def global_batch_warning(*, batch_size: int, world: int, recipe_batch: int) -> str:
    """The warning when the images per optimizer step (`batch_size` x `world` processes) are not `recipe_batch`,
    for which a recipe's LR and schedule were set ('' when they are): there is no gradient accumulation to make up
    for fewer."""
    total = batch_size * world
    if total == recipe_batch:
        return ''
    ways = []
    if recipe_batch % batch_size == 0:
        ways.append(f'{recipe_batch // batch_size} processes x --batch-size {batch_size}')
    if recipe_batch % world == 0:
        ways.append(f'--batch-size {recipe_batch // world} on {world} process(es)')
    how = f': run {" or ".join(ways)}' if ways else ''
    return (f'Warning: global batch {total} ({world} process(es) x --batch-size {batch_size}) differs from the '
            f"recipe's {recipe_batch}, for which its LR and schedule are set; for {recipe_batch} images a step{how} "
            f'(there is no gradient accumulation)')


def weight_decay_groups(model: torch.nn.Module, weight_decay: float,
                        decay_all: bool = False) -> list[dict[str, Any]]:
    """AdamW's parameter groups of a dense task's model (segmentor, detector): weight decay on weight matrices and
    conv kernels, none on 1-d parameters (every norm's weight and bias, every bias) nor on what a submodule's
    no_weight_decay() names (timm's rule: Swin's position tables); `decay_all` decays every parameter (PVT's
    detection configs)."""
    skip = {f'{name}.{p}' for name, module in model.named_modules() if name
            for p in getattr(module, 'no_weight_decay', lambda: set())()}
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (decay if decay_all or not (p.ndim <= 1 or n in skip) else no_decay).append(p)
    return [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
