"""What the benchmark programs share: timers, peak memory, the GEMM reference rate, whether the CPU was shared
during the timed steps, the models and the one step they time, the recipe's train transform, the flags of the
machine and the JSON lines.

The programs, each named for what it measures: ``tools/benchmark.py`` (one model, or against timm models),
``tools/paper_throughput.py``, ``tools/gpu_benchmark.py``, ``tools/loader_speed.py``, ``tools/ema_speed.py``,
``tools/block_sweep.py``; ``tools/profile_ops.py`` profiles the same step. Task benchmarks
(``segmentation/upernet_benchmark.py``) time their own step with ``time_call`` and ``peak_bytes`` from here.
This module imports no tool program and no task: the arrows point from the programs to it.

Peak memory is the most tensor memory live at once while a function runs, above what was live before it:
CUDA's allocator statistics on a GPU, the profiler's allocation trace on a CPU.
"""
import argparse
import json
import logging
import os
import time
from typing import Callable, Sequence

import timm
import torch
import torch.nn as nn
from timm.models import get_pretrained_cfg

import models  # noqa: F401  (registers the variants)
from models import VARIANTS
from run import process
from run.errors import unknown_model
from training import step as training_step

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}


def synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], None], device: torch.device, steps: int, warmup: int) -> list[float]:
    """Seconds per call, ``steps`` timed calls after ``warmup`` untimed ones (the device's queue drained
    before and after each)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def gemm_macs_per_s(dtype: torch.dtype, device: torch.device, size: int | None = None,
                    repeats: int = 5) -> float:
    """Multiply-adds per second of a large square matmul of ``dtype`` (best of ``repeats``)."""
    size = size or (8192 if device.type == 'cuda' else 2048)
    key = (dtype, str(device), size)
    if key not in _GEMM_OPERANDS:
        _GEMM_OPERANDS[key] = [torch.randn(size, size, device=device).to(dtype) for _ in range(2)]
    a, b = _GEMM_OPERANDS[key]
    times = time_call(lambda: torch.mm(a, b), device, repeats, warmup=1)
    return size ** 3 / min(times)


_GEMM_OPERANDS: dict = {}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def quiet_profiler() -> None:
    """Silence the profiler's tracing library (kineto), which logs every start and stop to stderr and, on a CPU
    machine with a CUDA build of torch, an ERROR line about the missing GPU. It reads its level when first used
    in a process (6: silent); a level the user set stays."""
    os.environ.setdefault('KINETO_LOG_LEVEL', '6')


def cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak tensor memory allocated on the CPU while ``fn`` runs, above the level before it."""
    from torch.profiler import ProfilerActivity, profile
    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = []
    for event in prof.profiler.kineto_results.events():
        if event.name() == '[memory]' and event.device_type() == torch.autograd.DeviceType.CPU:
            deltas.append((event.start_ns(), event.nbytes()))
    deltas.sort(key=lambda x: x[0])
    level = peak = 0
    for _, nbytes in deltas:
        level += nbytes
        peak = max(peak, level)
    return peak


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak tensor memory while ``fn`` runs above what was live before it, on ``device``."""
    if device.type == 'cuda':
        synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return cpu_peak_bytes(fn)


# ---- was the CPU shared during the timed steps? ----------------------------------------------------
#: below this share of its threads' time, the process was probably sharing its cores during the timed steps
CPU_BUSY_MIN = 0.8


def cpu_busy(cpu_times: Sequence[float], times: Sequence[float], threads: int) -> float:
    """The share of ``threads`` threads' time the process spent on the CPU during the timed steps: process
    CPU seconds over wall seconds x threads (1.0: every thread busy all the time)."""
    return sum(cpu_times) / max(sum(times) * threads, 1e-12)


def load_warning(rows: Sequence[dict], load1: float | None = None) -> str | None:
    """A warning line when the timed steps of ``rows`` kept fewer than CPU_BUSY_MIN of their threads busy; None
    on a GPU or when all were busy enough. The 1-minute load average (``os.getloadavg``, or ``load1``) tells
    the two causes apart: above the threads this process runs, another job shared the cores (wall-time
    figures are low); at or below them, the model's own steps left threads idle (small or single-threaded
    operations), which the wall-time figures rightly include."""
    low = [r for r in rows if r.get('cpu_busy') is not None and r['cpu_busy'] < CPU_BUSY_MIN]
    if not low:
        return None
    worst = min(low, key=lambda r: r['cpu_busy'])
    load1 = os.getloadavg()[0] if load1 is None else load1
    head = (f"warning: during the timed steps the process used {100 * worst['cpu_busy']:.0f}% of its "
            f"{worst['threads']} threads' time ({worst['model']} {worst['mode']} {worst['dtype']}; "
            f'{len(low)} of {len(rows)} rows below {100 * CPU_BUSY_MIN:.0f}%); 1-minute load average {load1:.2f}: ')
    if load1 > worst['threads'] + 0.5:
        return head + ('another job was probably on the cores, so wall-time figures are low; the CPU-time '
                       'figures are less affected')
    return head + ('no other job, so the steps themselves left threads idle (small or single-threaded '
                   'operations); the figures hold')


# ---- what is timed: a model and one step of it ------------------------------------------------------
def fixed_input_size(name: str) -> bool:
    """Whether timm builds ``name`` for one input size only (swin, vit: position tables, windows)."""
    cfg = get_pretrained_cfg(name)
    return bool(cfg is not None and cfg.fixed_input_size)


def create_any(name: str, device: torch.device, fast_path: bool,
               input_size: Sequence[int] | None = None) -> nn.Module:
    """A NaLaFormer variant with ``fast_path``, or any other timm model, untrained, 1000 classes. A model of
    fixed input size is built for ``input_size`` (height, width), as a user would build it for that size."""
    kwargs: dict = {}
    if name.upper() in VARIANTS:
        kwargs['fast_path'] = fast_path
    elif input_size is not None and fixed_input_size(name):
        kwargs['img_size'] = tuple(input_size)
    return timm.create_model(name, pretrained=False, num_classes=1000, **kwargs).to(device)


def make_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor | None, mode: str, dtype: torch.dtype,
              device: torch.device, *, compile_model: bool = False):
    """The function one benchmark step calls, and the optimizer (None for inference). ``train``: main.py's
    optimizer step (``training.step.OptimizerStep``: zero_grad(set_to_none), forward under autocast, the loss
    check, backward, AdamW step, fp16 loss scaling); ``inference``: a no-grad forward in eval mode."""
    fwd = torch.compile(model) if compile_model else model
    amp = None if dtype == torch.float32 else dtype
    if mode == 'inference':
        model.eval()

        def step() -> None:
            with torch.no_grad(), training_step.autocast(device, amp):
                fwd(x)
        return step, None

    model.train()
    # main.py's AdamW: the fused kernel on a GPU (optimizer.build_optimizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05,
                                  **({'fused': True} if device.type == 'cuda' else {}))
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    optimizer_step = training_step.OptimizerStep(optimizer, device, amp, scaler)
    cross_entropy = nn.CrossEntropyLoss()

    def criterion(samples: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(outputs, targets)

    def step() -> None:
        optimizer_step(fwd, criterion, x, target)
    return step, optimizer


def recipe_train_transform(input_size: int, uint8: bool = False):
    """main.py's training transform with the recipe's flags (every default) at ``input_size``."""
    import datasets
    from cli import get_args_parser, settings
    recipe = get_args_parser().parse_args(['--input-size', str(input_size)])
    cfg = datasets.data_config(recipe.model, recipe.input_size, recipe.eval_crop_ratio)
    return datasets.build_transform(True, cfg, settings(datasets.Augmentation, recipe), recipe.data_set, uint8)


# ---- the flags every program that steps a model takes, and the machine they set up -------------------
def add_machine_args(parser: argparse.ArgumentParser, *, tf32: bool = True, cpu_malloc: bool = True) -> None:
    """--device and --threads; --tf32 and --cpu-malloc where the program's figures depend on them."""
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    if tf32:
        parser.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=True,
                            help="fp32 matmuls/convolutions on CUDA's TF32 tensor cores, as main.py trains by "
                                 'default (--no-tf32: full fp32, as main.py --no-tf32)')
    if cpu_malloc:
        parser.add_argument('--cpu-malloc', choices=['retain', 'system'], default='system',
                            help="CPU allocator: system (the default of every benchmark program that takes it: a "
                                 "plain process, as a user's own code and timm's train.py run) or retain, main.py's "
                                 'default (process.retain_freed_cpu_memory); the output says which was used')


def add_step_count_args(parser: argparse.ArgumentParser, steps: int = 5) -> None:
    """--warmup (default by device, ``default_warmup``) and --steps."""
    parser.add_argument('--warmup', type=int, default=None,
                        help='untimed steps first (default 4 on a CPU, 2 on a GPU: under the system allocator '
                             "the first CPU steps are slow until glibc's mmap threshold has grown)")
    parser.add_argument('--steps', type=int, default=steps)


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--json', default=None, help='append the result as one JSON line to this file')


def default_warmup(args: argparse.Namespace) -> None:
    """--warmup's default: 2 on a GPU, 4 on a CPU."""
    if args.warmup is None:
        args.warmup = 2 if args.device.startswith('cuda') else 4


def one_dtype(parser: argparse.ArgumentParser, args: argparse.Namespace, default: str) -> None:
    """Checks --dtype of a program that takes one dtype and sets ``args.dtype`` (``default`` when not given);
    argparse's error (exit 2) for a list, an unknown dtype or fp16 off a GPU."""
    names = dtype_list(parser, args.dtype or default)
    if len(names) > 1:
        parser.error(f'{parser.prog} takes one --dtype; several (--dtype {",".join(names)}) go with one model '
                     'or --compare (tools/benchmark.py)')
    args.dtype = names[0]
    check_fp16(parser, names, args.device)


def dtype_list(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The dtype names of a --dtype value (a comma list), each known, without repeats."""
    names = list(dict.fromkeys(d.strip() for d in text.split(',') if d.strip())) or ['fp32']
    unknown = [d for d in names if d not in DTYPES]
    if unknown:
        parser.error(f"--dtype: unknown dtype(s) {unknown}; choose from {', '.join(DTYPES)} (a comma list: fp32,bf16)")
    return names


def check_fp16(parser: argparse.ArgumentParser, names: Sequence[str], device: str) -> None:
    if 'fp16' in names and not device.startswith('cuda'):
        parser.error('fp16 needs a GPU (--device cuda)')


def check_variants(parser: argparse.ArgumentParser, names: Sequence[str] | None, flag: str) -> None:
    """argparse's error when ``names`` (of ``flag``) holds a name that is not a NaLaFormer variant."""
    unknown = [m for m in names or [] if m.upper() not in VARIANTS]
    if unknown:
        parser.error(f'{flag}: ' + unknown_model(unknown[0], VARIANTS))


def check_timm_models(parser: argparse.ArgumentParser, names: Sequence[str] | None) -> None:
    """argparse's error for a --compare list that is empty or names a model timm does not list."""
    if names is not None:
        unknown = [n for n in names if not timm.is_model(n)]
        if unknown or not names:
            parser.error(f'--compare: unknown timm model(s) {unknown}; pass comma-separated names that '
                         f'timm.list_models() lists, e.g. convnext_nano,pvt_v2_b1')


def setup_machine(args: argparse.Namespace) -> None:
    """--threads, main.py's fp32 setting (TF32 on CUDA unless --no-tf32, so that fp32 figures are those
    training runs at; ``args.tf32_applied``: None off CUDA, where there is no TF32) and --cpu-malloc
    (``args.cpu_malloc``: the setting in force); fvcore's warnings about uncounted ops off."""
    logging.getLogger('fvcore').setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    tf32 = getattr(args, 'tf32', None)
    if tf32 is not None:
        args.tf32_applied = tf32 if training_step.set_tf32(args.device, tf32) else None
    if not args.device.startswith('cuda') and getattr(args, 'cpu_malloc', None) == 'retain':
        args.cpu_malloc = 'retain' if process.retain_freed_cpu_memory() else 'system'


def write_jsonl(path: str | None, results: list[dict]) -> None:
    """Append each result as one JSON line to ``path`` (nothing without a path), with the time of writing."""
    if path:
        stamp = time.strftime('%Y-%m-%dT%H:%M:%S%z')
        with open(path, 'a') as f:
            f.writelines(json.dumps({'written': stamp, **r}) + '\n' for r in results)
