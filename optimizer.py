"""The optimizer of a run: the flags it is built from (`OptimizerSettings`), timm's optimizer with layer-wise LR
decay and, on GPUs, torch's fused Adam/AdamW kernel, and the settings a resumed run takes from the command line
rather than from the checkpoint."""
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint import comparable
from errors import CheckpointError, first_line

#: the --opt names whose torch optimizer has a fused CUDA kernel (torch.optim.Adam and AdamW)
FUSED_OPTIMIZERS = ('adam', 'adamw')

#: the parameter-group settings that come from the command line also on resume (the LR comes from the schedule)
FOLLOWED_OPTIMIZER_KEYS = ('weight_decay', 'betas', 'eps', 'momentum', 'lr_scale')


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer flags, each named as its argparse destination; `lr` is the run's base LR (scaled by the
    global batch: schedule.scaled_lr)."""
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


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any], path: str, saved_opt: Any,
                         opt: str) -> None:
    """Load the optimizer `state` of checkpoint `path` (written by a run with --opt `saved_opt`, None where it does
    not record it) into `optimizer` (this run's, --opt `opt`), refusing one of another optimizer, then apply the
    command line's weight decay, betas, eps, momentum and layer-wise LR scale (as the LR schedule follows it)."""
    fresh = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    groups = state.get('param_groups') or [{}]
    kind = {k for k in ('betas', 'momentum') if k in groups[0]}
    if (saved_opt and str(saved_opt).lower() != str(opt).lower()) \
            or kind != {k for k in ('betas', 'momentum') if k in fresh[0]}:
        was = (f'--opt {saved_opt}' if saved_opt
               else f'an optimizer with {", ".join(sorted(kind)) or "other settings"}')
        raise CheckpointError(f'the optimizer state in {path} is from {was}, '
                              f'this run has --opt {opt}: '
                              f'relaunch with --opt {saved_opt or "as before"}, '
                              f'or start a new run from its weights with --finetune {path} in another --output_dir')
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f'the optimizer state in {path} does not fit this run ({first_line(e)}); were '
                              f'--model/--opt/--attn-only different? use --finetune to start from its weights') from e
    changed: dict[str, list[tuple[Any, Any]]] = {}
    for group, want in zip(optimizer.param_groups, fresh):
        for k in FOLLOWED_OPTIMIZER_KEYS:
            if k in want and comparable(group.get(k)) != comparable(want[k]):
                pair = (comparable(group.get(k)), comparable(want[k]))
                if pair not in changed.setdefault(k, []):
                    changed[k].append(pair)
                group[k] = want[k]
    if changed:
        print('Note: optimizer settings changed since the checkpoint ('
              + ', '.join(f'{k}: ' + ', '.join(f'{a} -> {b}' for a, b in changed[k][:3])
                          for k in FOLLOWED_OPTIMIZER_KEYS if k in changed)
              + '); following the command line')
