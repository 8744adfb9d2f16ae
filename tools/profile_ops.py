"""Where a step's CPU time goes: per stage and per op family, NaLaFormer against timm models.

    python tools/profile_ops.py --model NALAFORMER_T --compare convnext_tiny,swin_tiny_patch4_window7_224 \\
        --sizes 512 1024 --batch-sizes 2 1 --threads 2 --json profile.jsonl

One step per model, size and mode (``inference``: no-grad eval forward; ``train``: forward, backward and
AdamW step, as tools/benchmark.py times them) runs under ``torch.profiler`` (CPU only; fp32, or autocast to
bf16 with ``--dtype bf16``). Forward ops are attributed by ``record_function`` ranges the tool opens around
the model's parts (module hooks, and wrappers of NaLaFormer's attention cores and fast-path functions,
``FAST_PATH_FUNCTIONS``); backward ops inherit stage and
family from the forward op that created their autograd node (its sequence number). Every op's self time
goes to exactly one (stage, family) cell, so the cells sum to the profiled step.

Stages: ``stem``, ``stage1``..``stage4`` (each with the downsample that leads into it), ``head`` (pool,
classifier, loss), ``optimizer`` (AdamW step, zero_grad, gradient accumulation). Families:
``nala_core`` and ``softmax_attn`` (the attention cores: everything between q/k/v and the output heads;
swin's window attention without its linears), ``dwconv`` (depthwise convs: CPE, FFN, LePE, ConvNeXt's),
``conv`` (dense convs: stem, downsample), ``linear``, ``ffn`` (NaLaFormer's fast path: everything in the
FFN after fc1, i.e. GELU, the depthwise conv and fc2, one function with its own backward; on the plain path
these count as other, dwconv and linear), ``norm`` (layer and batch norms, the fast path's gated LN), ``copies`` (copy,
cat, stack, roll, pad and dtype or layout conversions outside the cores), ``other`` (activations,
residuals, gating, Python time between ops) and ``optimizer``.
"""
import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import timm
import torch
import torch.nn as nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import models.nala as nala  # noqa: E402
import models.nalaformer as nalaformer  # noqa: E402
from models import VARIANTS  # noqa: E402
from run.errors import FlagParser, unknown_model  # noqa: E402
from tools.timing import DTYPES, create_any, make_step, quiet_profiler  # noqa: E402

STAGES = ('stem', 'stage1', 'stage2', 'stage3', 'stage4', 'head', 'optimizer')
FAMILIES = ('nala_core', 'softmax_attn', 'dwconv', 'conv', 'linear', 'ffn', 'norm', 'copies', 'other', 'optimizer')
CORE_FAMILIES = ('nala_core', 'softmax_attn')
#: ops that only move or convert data; outside the attention cores they count as ``copies``
COPY_OPS = frozenset({
    'aten::copy_', 'aten::clone', 'aten::contiguous', 'aten::cat', 'aten::stack', 'aten::_to_copy', 'aten::to',
    'aten::roll', 'aten::constant_pad_nd', 'aten::pad', 'aten::index', 'aten::index_select', 'aten::flip',
    'aten::repeat',
})
STAGE_TAG, FAMILY_TAG = 'stage::', 'family::'
Tags = tuple[str | None, str | None, bool]  # (stage, family, under the optimizer)
#: the fast path's functions that the blocks look up in their modules at call time, with their family
FAST_PATH_FUNCTIONS = ((nala, 'lepe_fast', 'dwconv'), (nalaformer, 'conv_residual_fast', 'dwconv'),
                       (nalaformer, 'conv_ffn_fast', 'ffn'), (nala, 'gated_norm_fast', 'norm'))
OPTIMIZER_PREFIXES = ('Optimizer.', 'optimizer', 'autograd::engine::evaluate_function: torch::autograd::AccumulateGrad')


def module_family(module: nn.Module) -> str | None:
    """The op family of a module's own call, or None for containers."""
    if isinstance(module, nn.Linear):
        return 'linear'
    if isinstance(module, nn.Conv2d):
        return 'dwconv' if module.groups > 1 and module.groups == module.in_channels else 'conv'
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)):
        return 'norm'
    if type(module).__name__ in ('WindowAttention', 'Attention'):  # timm's softmax attention (swin, vit)
        return 'softmax_attn'
    return None


def stage_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(stage name, module) of a backbone's stem and stages: NaLaFormer's, ConvNeXt's and swin's layout."""
    found = []
    for attr in ('patch_embed', 'stem'):
        if isinstance(getattr(model, attr, None), nn.Module):
            found.append(('stem', getattr(model, attr)))
            break
    for attr in ('layers', 'stages'):
        stages = getattr(model, attr, None)
        if isinstance(stages, (nn.Sequential, nn.ModuleList)):
            found.extend((f'stage{i + 1}', stage) for i, stage in enumerate(stages))
            break
    return found


def _open_range(name: str) -> Callable:
    def pre_hook(module: nn.Module, args) -> None:
        module._profile_ranges = getattr(module, '_profile_ranges', [])
        module._profile_ranges.append(record_function(name).__enter__())
    return pre_hook


def _close_range(module: nn.Module, args, output) -> None:
    module._profile_ranges.pop().__exit__(None, None, None)


def _ranged(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapper


@contextmanager
def labelled(model: nn.Module) -> Iterator[None]:
    """Open a ``record_function`` range around each stage and each module or function of a known
    family while the model runs; everything is undone on exit."""
    handles = []
    for name, module in stage_modules(model):
        handles.append(module.register_forward_pre_hook(_open_range(STAGE_TAG + name)))
        handles.append(module.register_forward_hook(_close_range))
    cores = []
    for module in model.modules():
        family = module_family(module)
        if family is not None:
            handles.append(module.register_forward_pre_hook(_open_range(FAMILY_TAG + family)))
            handles.append(module.register_forward_hook(_close_range))
        if isinstance(module, nala.GatedAttention):
            family = 'nala_core' if isinstance(module, nala.NaLaAttention) else 'softmax_attn'
            module.core = _ranged(FAMILY_TAG + family, module.core)  # an instance attribute shadows the method
            cores.append(module)
    patched = [(owner, attr, family) for owner, attr, family in FAST_PATH_FUNCTIONS if hasattr(owner, attr)]
    originals = [getattr(owner, attr) for owner, attr, _ in patched]
    for (owner, attr, family), fn in zip(patched, originals):
        setattr(owner, attr, _ranged(FAMILY_TAG + family, fn))
    try:
        yield
    finally:
        for (owner, attr, _), fn in zip(patched, originals):
            setattr(owner, attr, fn)
        for module in cores:
            del module.core
        for handle in handles:
            handle.remove()


def _tags(event, cache: dict[int, Tags]) -> Tags:
    """(innermost stage, innermost family, under the optimizer) from an event's enclosing ranges."""
    key = id(event)
    if key in cache:
        return cache[key]
    parent = event.cpu_parent
    stage, family, optimizer = _tags(parent, cache) if parent is not None else (None, None, False)
    name = event.name
    if name.startswith(STAGE_TAG):
        stage = name[len(STAGE_TAG):]
    elif name.startswith(FAMILY_TAG):
        family = name[len(FAMILY_TAG):]
    elif name.startswith(OPTIMIZER_PREFIXES):
        optimizer = True
    cache[key] = (stage, family, optimizer)
    return cache[key]


def _backward_root(event):
    """The autograd engine's node call that an event runs under, or None in the forward pass."""
    while event is not None:
        if event.name.startswith('autograd::engine::evaluate_function'):
            return event
        event = event.cpu_parent
    return None


def attribute(events) -> dict[str, dict[str, float]]:
    """Self CPU milliseconds per (stage, family) cell; every event's self time in exactly one cell."""
    cache: dict[int, Tags] = {}
    forward_of: dict[int, tuple[str | None, str | None]] = {}
    roots = {}
    for event in events:
        root = _backward_root(event)
        roots[id(event)] = root
        if root is None and event.sequence_nr >= 0 and event.sequence_nr not in forward_of:
            stage, family, _ = _tags(event, cache)
            forward_of[event.sequence_nr] = (stage, family)
    cells: dict[str, dict[str, float]] = {s: {f: 0.0 for f in FAMILIES} for s in STAGES}
    for event in events:
        stage, family, optimizer = _tags(event, cache)
        root = roots[id(event)]
        if root is not None:
            stage, family = forward_of.get(root.sequence_nr, (None, None))
            optimizer = optimizer or root.sequence_nr < 0  # gradient accumulation into .grad
        if optimizer:
            stage, family = 'optimizer', 'optimizer'
        stage = stage or 'head'
        if family not in CORE_FAMILIES and family != 'optimizer' and event.name in COPY_OPS:
            family = 'copies'
        cells[stage][family or 'other'] += event.self_cpu_time_total / 1e3
    return cells


def profile_step(step: Callable[[], None], steps: int = 1) -> tuple[dict[str, dict[str, float]], float]:
    """Cells of ``steps`` profiled calls of ``step`` (per call), and the profiled wall seconds per call."""
    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    cells = attribute(prof.events())
    return {s: {f: v / steps for f, v in row.items()} for s, row in cells.items()}, wall


def summarise(cells: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Totals per stage and per family (ms) and the overall total."""
    by_stage = {s: sum(row.values()) for s, row in cells.items()}
    by_family = {f: sum(cells[s][f] for s in cells) for f in FAMILIES}
    return dict(stages=by_stage, families=by_family, total_ms=sum(by_stage.values()))


def run(model_name: str, size: int, batch_size: int, mode: str, steps: int, warmup: int,
        fast_path: bool = True, dtype: str = 'fp32') -> dict:
    """Profile one model at one square size and mode; one result dict."""
    device = torch.device('cpu')
    torch.manual_seed(0)
    x = torch.randn(batch_size, 3, size, size)
    target = torch.randint(0, 1000, (batch_size,))
    model = create_any(model_name, device, fast_path, (size, size))
    step, _ = make_step(model, x, target, mode, DTYPES[dtype], device)
    for _ in range(warmup):
        step()
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
    with labelled(model):
        cells, profiled_s = profile_step(step, steps)
    summary = summarise(cells)
    return dict(model=model_name, size=size, batch_size=batch_size, mode=mode, threads=torch.get_num_threads(),
                fast_path=fast_path, dtype=dtype, step_ms=1e3 * statistics.median(plain),
                profiled_step_ms=1e3 * profiled_s, img_s=batch_size / statistics.median(plain), cells=cells, **summary)


def format_result(r: dict) -> str:
    """A stage x family table of one result (ms per step, shares of the total)."""
    total = r['total_ms']
    families = [f for f in FAMILIES if r['families'][f] > 0]
    head = f"{'stage':<10}" + ''.join(f'{f:>13}' for f in families) + f"{'total':>11}{'share':>8}"
    lines = [f"{r['model']} {r['size']}px batch {r['batch_size']} {r['mode']} {r.get('dtype', 'fp32')}: "
             f"{r['step_ms']:.0f} ms/step "
             f"unprofiled, {total:.0f} ms profiled ({r['img_s']:.2f} img/s, {r['threads']} threads)", head]
    for stage in STAGES:
        row = r['cells'][stage]
        if r['stages'][stage] > 0:
            lines.append(f'{stage:<10}' + ''.join(f'{row[f]:>13.1f}' for f in families)
                         + f"{r['stages'][stage]:>11.1f}{100 * r['stages'][stage] / total:>7.1f}%")
    lines.append(f"{'total':<10}" + ''.join(f"{r['families'][f]:>13.1f}" for f in families) + f'{total:>11.1f}')
    lines.append(f"{'share':<10}" + ''.join(f"{100 * r['families'][f] / total:>12.1f}%" for f in families))
    return '\n'.join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default='NALAFORMER_T')
    parser.add_argument('--compare', type=lambda s: [n for n in s.split(',') if n], default=[],
                        help='comma-separated timm models profiled after --model')
    parser.add_argument('--sizes', type=int, nargs='+', default=[224], metavar='SIDE')
    parser.add_argument('--batch-sizes', type=int, nargs='+', default=[1], metavar='B',
                        help='one batch size for all sizes, or one per size')
    parser.add_argument('--modes', nargs='+', choices=['inference', 'train'], default=['inference', 'train'])
    parser.add_argument('--steps', type=int, default=1, help='profiled (and unprofiled timed) steps')
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads')
    parser.add_argument('--fast-path', action=argparse.BooleanOptionalAction, default=True,
                        help="NaLaFormer's fast path (default) or the plain path")
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32',
                        help='fp32, or autocast to bf16 as tools/benchmark.py --dtype bf16')
    parser.add_argument('--json', default=None, help='append one JSON line per result to this file')
    args = parser.parse_args(argv)
    if len(args.batch_sizes) not in (1, len(args.sizes)):
        parser.error(f'--batch-sizes takes one value or one per size ({len(args.sizes)}), '
                     f'got {len(args.batch_sizes)}')
    unknown = [n for n in [args.model, *args.compare] if not timm.is_model(n)]
    if unknown:
        parser.error(('--model: ' if unknown[0] == args.model else '--compare: ')
                     + unknown_model(unknown[0], VARIANTS, timm.list_models()))
    if args.steps < 1 or args.warmup < 0:
        parser.error(f'--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}')
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = args.batch_sizes * len(args.sizes) if len(args.batch_sizes) == 1 else args.batch_sizes
    results = []
    for size, batch_size in zip(args.sizes, batch_sizes):
        for mode in args.modes:
            for name in [args.model] + [n for n in args.compare if n != args.model]:
                result = run(name, size, batch_size, mode, steps=args.steps, warmup=args.warmup,
                             fast_path=args.fast_path, dtype=args.dtype)
                print(format_result(result) + '\n', flush=True)
                results.append(result)
                if args.json:
                    with open(args.json, 'a') as f:
                        f.write(json.dumps(dict(result, written=time.strftime('%Y-%m-%d %H:%M:%S'))) + '\n')
    return results


if __name__ == '__main__':
    main()
