"""Throughput, peak memory and efficiency of a NaLaFormer variant against the machine's own GEMM.

    python tools/benchmark.py --model NALAFORMER_T                      # fp32 train, batch 32, 224^2
    python tools/benchmark.py --model NALAFORMER_T --mode inference --dtype bf16
    python tools/benchmark.py --model NALAFORMER_XT --no-fast-path --compile --channels-last
    python tools/benchmark.py --sweep --out docs/results/sweep  # NaLa vs softmax block, 224..1024
    python tools/benchmark.py --model NALAFORMER_T --compare convnext_nano,pvt_v2_b1 -b 16
    python tools/benchmark.py --model NALAFORMER_T --compare convnext_tiny -b 16 --dtype fp32,bf16
    python tools/benchmark.py --compare convnext_tiny,swin_tiny_patch4_window7_224 -b 2 --sizes 224 512 1024
    python tools/benchmark.py --preset paper
    python tools/benchmark.py --make-jpegs /tmp/jpegs --data-loading /tmp/jpegs

A measurement: warm-up steps, then timed steps (median step time, and the median process CPU time per
step, all threads). ``train`` times main.py's optimizer step (``optim_step.OptimizerStep``:
zero_grad(set_to_none), forward under autocast, the loss check, backward, AdamW step, fp16 loss scaling);
``inference`` times a no-grad forward in eval mode. ``--dtype fp32,bf16`` builds the model once per dtype
(the same initial weights) and steps them in turn, then prints each dtype's speed-up over the first (by
wall and by CPU time). MACs are fvcore's count of the model at batch 1 (the figure ``tools/flops.py``
prints) times the batch, times 3 for a training step (forward, input gradient, weight gradient). The
efficiency divides the achieved MAC/s by the MAC/s of a large square matrix product of the same dtype,
timed in this process right before every timed step, so figures compare across noisy runs and machines.
Peak memory is the most tensor memory live at once during one step above what was live before it (the
last step's gradients freed first): activations kept for backward, gradients and temporaries, not the
parameters, buffers and optimizer state (listed separately for one model); CUDA's allocator statistics
on a GPU, the profiler's allocation trace on a CPU. On a CPU a line warns when the process used less
than 80% of its threads' time during the timed steps: another job on the cores makes wall-time figures
low, which the CPU-time figures show less. ``--grad-checkpointing`` turns on timm's
``set_grad_checkpointing`` in every model that has it and names those that do not.

The CPU allocator is the same for one model, ``--compare`` and ``--preset``: ``--cpu-malloc system``
by default, a plain process as a user's own code (and timm's train.py) runs; ``retain`` adds main.py's
setting (glibc keeps freed memory instead of giving large blocks back to the OS, so activations do not
page-fault again every step). Every model of a run is stepped under the same setting; with the batch
slices NaLaFormer pays little under ``system`` (docs/performance.md). Under ``system`` the first steps
are slow until glibc's adaptive mmap threshold has grown, hence 4 warm-up steps by default on a CPU. The
output says which setting was used.

``--compare MODEL,MODEL`` steps --model and the named timm models interleaved in one process, in
inference and training, and prints GMACs, ms/step, img/s, efficiency, the ratio to the best of them and each
model's published ImageNet top-1 (``tools/published.py``, with sources);
with ``--compile`` every model is compiled (warm-up steps compile). Models that timm builds for one input size
(swin, vit) are built for the requested size. ``--sizes 224 512 1024`` repeats the comparison per square size
and ends with a table of img/s and peak step memory per model, size and mode.
``--preset paper [--tiny]`` prints eval-mode img/s of every variant at 224/384/512 as papers report it.
``--data-loading DIR`` times main.py's train transform per DataLoader worker.

``--sweep`` times one NaLa block and one softmax block of the same width (the chosen stage of the
chosen variant, default stage 2; batch 1) at input sizes 224..1024 and writes time (fastest step)
and peak memory per token to ``OUT.json`` and ``OUT.png``; on the fast path it adds the
plain softmax block, which forms the N x N matrix (up to ``--sweep-plain-max`` px).
"""
import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import timm
from timm.models import get_pretrained_cfg

import cpu
import engine
import models  # noqa: F401  (registers the variants)
import optim_step
import precision
from ema import ModelEma
from errors import FlagParser, unknown_model
from models import VARIANTS
from tools.published import published_top1

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}


def synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], None], device: torch.device, steps: int, warmup: int) -> list[float]:
    """Seconds per call, ``steps`` timed calls after ``warmup`` untimed ones."""
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


def model_macs(name: str, input_size: Sequence[int]) -> int:
    """fvcore multiply-adds of one image through the model (eval mode, as tools/flops.py counts)."""
    from tools.flops import count_flops
    model = timm.create_model(name)
    return count_flops(model, (3, *input_size))


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
    if device.type == 'cuda':
        synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return cpu_peak_bytes(fn)


def amp_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of a benchmark dtype (fp32: no autocast)."""
    return None if dtype == torch.float32 else dtype


#: what the peak-memory figure holds (the table footers and --help say it)
PEAK_NOTE = ('peak MiB: the most tensor memory live at once during one step above what was live before it '
             '(the gradients are freed first): in training the activations saved for backward, the gradients '
             "and every temporary, the optimizer step's included; in inference the forward's live activations. "
             'Parameters, buffers and optimizer state, live before the step, are not in it.')

#: below this share of its threads' time, the process was probably sharing its cores during the timed steps
CPU_BUSY_MIN = 0.8


def make_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, mode: str, dtype: torch.dtype,
              device: torch.device, compile_model: bool):
    """The function one benchmark step calls, and the optimizer (None for inference)."""
    fwd = torch.compile(model) if compile_model else model
    if mode == 'inference':
        model.eval()

        def step() -> None:
            with torch.no_grad(), precision.autocast(device, amp_dtype(dtype)):
                fwd(x)
        return step, None

    model.train()
    # main.py's AdamW: the fused kernel on a GPU (optimizer.build_optimizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05,
                                  **({'fused': True} if device.type == 'cuda' else {}))
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    optimizer_step = optim_step.OptimizerStep(optimizer, device, amp_dtype(dtype), scaler)
    cross_entropy = nn.CrossEntropyLoss()

    def criterion(samples: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(outputs, targets)

    def step() -> None:
        optimizer_step(fwd, criterion, x, target)
    return step, optimizer


def step_peak_bytes(step: Callable[[], None], optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """``peak_bytes`` of one step (PEAK_NOTE), the last step's gradients freed first: the measured step
    allocates its own, and blocks allocated before profiling and freed during it only draw a warning from
    the profiler."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    return peak_bytes(step, device)


def timed_rounds(steps: dict, dtypes: dict, args: argparse.Namespace, device: torch.device,
                 after_round: Callable[[int], None] | None = None) -> tuple[dict, dict, dict]:
    """``args.steps`` rounds of one step of every entry of ``steps`` (key -> step function), each right after
    a GEMM of its dtype (``dtypes``: key -> dtype name), the order rotating every round, so that a load change
    on a shared machine hits every entry alike; ``after_round(n)`` is called after round n. Returns per key
    the wall seconds, the process CPU seconds (all threads: user + system) of each step, and the GEMM rate
    (MAC/s) timed right before it."""
    keys = list(steps)
    times: dict = {k: [] for k in keys}
    cpu_times: dict = {k: [] for k in keys}
    gemms: dict = {k: [] for k in keys}
    for i in range(args.steps):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            gemms[key].append(gemm_macs_per_s(DTYPES[dtypes[key]], device, args.gemm_size, repeats=2))
            cpu_start = time.process_time()
            times[key].append(time_call(steps[key], device, 1, warmup=0)[0])
            cpu_times[key].append(time.process_time() - cpu_start)
        if after_round is not None:
            after_round(i + 1)
    return times, cpu_times, gemms


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


def with_grad_checkpointing(model: nn.Module) -> bool:
    """Turn on timm's gradient checkpointing (``model.set_grad_checkpointing(True)``): True when the model
    takes it, False (the model unchanged) when it has none or refuses, as many timm models do with an
    assertion."""
    setter = getattr(model, 'set_grad_checkpointing', None)
    if setter is None:
        return False
    try:
        setter(True)
    except (AssertionError, NotImplementedError):
        return False
    return True


def build_model(name: str, device: torch.device, args: argparse.Namespace,
                input_size: Sequence[int] | None = None) -> tuple[nn.Module, bool | None]:
    """``create_any`` with the flags' memory format and --grad-checkpointing: (model, whether gradient
    checkpointing is on; None when not asked for)."""
    model = create_any(name, device, args.fast_path, input_size)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    checkpointing = with_grad_checkpointing(model) if args.grad_checkpointing else None
    return model, checkpointing


def benchmark_input(args: argparse.Namespace, height: int, width: int, device: torch.device) -> torch.Tensor:
    """A random batch in the memory format of the models ``build_model`` makes (--channels-last)."""
    x = torch.randn(args.batch_size, 3, height, width, device=device)
    return x.to(memory_format=torch.channels_last) if args.channels_last else x


def benchmark_model(args: argparse.Namespace) -> list[dict]:
    """One model in every ``--dtype`` (a model per dtype, the same initial weights), stepped in turn, each
    step right after a GEMM of its dtype (``timed_rounds``). One result dict per dtype, in --dtype order."""
    device = torch.device(args.device)
    height, width = (list(args.input_size) * 2)[:2]
    torch.manual_seed(0)
    x = benchmark_input(args, height, width, device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    steps, optimizers, statics, checkpointing = {}, {}, {}, None
    for dtype in args.dtypes:
        torch.manual_seed(0)
        model, checkpointing = build_model(args.model, device, args)
        steps[dtype], optimizers[dtype] = make_step(model, x, target, args.mode, DTYPES[dtype], device, args.compile)
        statics[dtype] = tensor_bytes(list(model.parameters()) + list(model.buffers()))
        for _ in range(args.warmup):
            steps[dtype]()
    times, cpu_times, gemms = timed_rounds(steps, {d: d for d in steps}, args, device)
    macs_per_image = model_macs(args.model, (height, width)) * (3 if args.mode == 'train' else 1)
    threads = torch.get_num_threads()
    results = []
    for dtype, step in steps.items():
        peak = step_peak_bytes(step, optimizers[dtype], device)
        static = statics[dtype]
        if optimizers[dtype] is not None:
            state = optimizers[dtype].state.values()
            static += tensor_bytes(t for s in state for t in s.values() if torch.is_tensor(t))
        step_time = statistics.median(times[dtype])
        results.append(dict(
            model=args.model, mode=args.mode, dtype=dtype, batch_size=args.batch_size,
            input_size=[height, width], fast_path=args.fast_path, channels_last=args.channels_last,
            compile=args.compile, grad_checkpointing=checkpointing, tf32=args.tf32_applied, device=str(device),
            threads=threads, cpu_malloc=args.cpu_malloc if device.type == 'cpu' else None,
            step_s_median=step_time, step_s_all=times[dtype], img_s=args.batch_size / step_time,
            cpu_s_median=statistics.median(cpu_times[dtype]), cpu_s_all=cpu_times[dtype],
            cpu_busy=cpu_busy(cpu_times[dtype], times[dtype], threads) if device.type == 'cpu' else None,
            gmacs_per_image=macs_per_image / 1e9, achieved_gmac_s=macs_per_image * args.batch_size / step_time / 1e9,
            gemm_gmac_s=statistics.median(gemms[dtype]) / 1e9, gemm_gmac_s_all=[g / 1e9 for g in gemms[dtype]],
            efficiency=statistics.median(macs_per_image * args.batch_size / t / g
                                         for t, g in zip(times[dtype], gemms[dtype])),
            peak_step_mib=peak / 2 ** 20, peak_step_mib_per_image=peak / 2 ** 20 / args.batch_size,
            static_mib=static / 2 ** 20))
    add_speedups(results, ('model', 'mode'))
    return results


def add_speedups(rows: list[dict], keys: Sequence[str]) -> None:
    """For every row of a dtype other than the first one listed, its img/s over the same entry's (equal
    ``keys``) in the first dtype: ``speedup_over`` (that dtype), ``speedup`` (wall time) and ``speedup_cpu``
    (CPU time per step)."""
    if not rows:
        return
    base_dtype = rows[0]['dtype']
    base = {repr([r[k] for k in keys]): r for r in rows if r['dtype'] == base_dtype}
    for r in rows:
        ref = base.get(repr([r[k] for k in keys]))
        if r['dtype'] != base_dtype and ref is not None:
            r.update(speedup_over=base_dtype, speedup=ref['step_s_median'] / r['step_s_median'],
                     speedup_cpu=ref['cpu_s_median'] / r['cpu_s_median'])


def tf32_note(r: dict, prefix: str) -> str:
    """'on'/'off' after `prefix` for a CUDA row (whether fp32 matmuls ran on TF32), nothing elsewhere."""
    return '' if r.get('tf32') is None else prefix + ('on' if r['tf32'] else 'off')


def checkpointing_note(rows: Sequence[dict]) -> str:
    """'; gradient checkpointing: on for ..., not supported by ...' for rows built with --grad-checkpointing."""
    asked = [r for r in rows if r.get('grad_checkpointing') is not None]
    if not asked:
        return ''
    on = list(dict.fromkeys(r['model'] for r in asked if r['grad_checkpointing']))
    off = list(dict.fromkeys(r['model'] for r in asked if not r['grad_checkpointing']))
    return ('; gradient checkpointing: ' + (f"on for {', '.join(on)}" if on else 'on for none')
            + (f" (not supported by {', '.join(off)}: run without)" if off else ''))


def print_result(r: dict) -> None:
    print(f"{r['model']} {r['mode']} {r['dtype']} batch {r['batch_size']} {r['input_size'][0]}x{r['input_size'][1]} "
          f"fast_path={r['fast_path']} channels_last={r['channels_last']} compile={r['compile']} "
          f"device={r['device']} threads={r['threads']}" + tf32_note(r, ' tf32=')
          + (f" cpu_malloc={r['cpu_malloc']}" if r.get('cpu_malloc') else '') + checkpointing_note([r]))
    print(f"  {r['img_s']:.2f} img/s  (median step {r['step_s_median'] * 1e3:.1f} ms of "
          f"{', '.join(f'{t * 1e3:.0f}' for t in r['step_s_all'])}; CPU {r['cpu_s_median'] * 1e3:.1f} ms per step"
          + (f", {100 * r['cpu_busy']:.0f}% of the threads' time" if r.get('cpu_busy') is not None else '') + ')')
    print(f"  {r['achieved_gmac_s']:.1f} GMAC/s achieved ({r['gmacs_per_image']:.3f} GMAC/image) vs "
          f"{r['gemm_gmac_s']:.1f} GMAC/s {r['dtype']} GEMM -> efficiency {100 * r['efficiency']:.1f}% "
          f"(median over steps, each against the GEMM timed right before it)")
    print(f"  peak memory {r['peak_step_mib']:.0f} MiB during a step ({r['peak_step_mib_per_image']:.1f} MiB/image) "
          f"+ {r['static_mib']:.0f} MiB params/buffers/optimizer state")
    if 'speedup' in r:
        print(f"  {r['dtype']} over {r['speedup_over']}: {r['speedup']:.2f}x img/s by wall time, "
              f"{r['speedup_cpu']:.2f}x by CPU time")


def print_results(results: Sequence[dict]) -> None:
    """``print_result`` of each dtype, what the peak figure holds, and the load warning if any."""
    for r in results:
        print_result(r)
    print(PEAK_NOTE)
    warning = load_warning(results)
    if warning:
        print(warning)


# ---- compare: our model against named timm models, interleaved in one process -------------------
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


def compare(args: argparse.Namespace) -> list[dict]:
    """``args.model`` and every ``--compare`` model, same input and batch, stepped in turn in every --dtype.

    Per mode: a model per name and dtype (the same initial weights in every dtype) is built and warmed up,
    then each round times one step of every model in every dtype (each right after a GEMM of its dtype),
    rotating the order every round, so that load changes on a shared machine hit all alike
    (``timed_rounds``). Efficiency: MAC/s of the median step over the median GEMM of that dtype in the whole
    mode. After the timed rounds, one more step of each gives its peak memory. One result dict per mode,
    dtype and model, in that order.
    """
    device = torch.device(args.device)
    height, width = (list(args.input_size) * 2)[:2]
    names = [args.model] + [n for n in args.compare if n != args.model]
    width_of_names = max(map(len, names))
    progress = Progress(f'{height}x{width}')
    macs = {}
    for name in names:
        macs[name] = model_macs_any(name, (height, width), args.fast_path)
        progress(f'{name:<{width_of_names}}  fvcore count: {macs[name] / 1e9:.3f} GMACs')
    torch.manual_seed(0)
    x = benchmark_input(args, height, width, device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    results = []
    for mode in args.modes:
        steps, optimizers, checkpointing = {}, {}, {}
        for name in names:
            for dtype in args.dtypes:
                torch.manual_seed(0)
                model, checkpointing[name] = build_model(name, device, args, (height, width))
                key = (name, dtype)
                steps[key], optimizers[key] = make_step(model, x, target, mode, DTYPES[dtype], device, args.compile)
                for _ in range(args.warmup):
                    steps[key]()
            progress(f'{name:<{width_of_names}}  {mode}: built, {args.warmup} warm-up steps'
                     + (f" in each of {', '.join(args.dtypes)}" if len(args.dtypes) > 1 else ''))
        each = 'model' if len(args.dtypes) == 1 else 'model in each dtype'
        line = f'{mode}: timed round {{}} of {args.steps} (one step of each {each})'
        times, cpu_times, gemms = timed_rounds(steps, {key: key[1] for key in steps}, args, device,
                                               lambda n, line=line: progress(line.format(n)))
        peaks = {}
        for key in steps:
            peaks[key] = step_peak_bytes(steps[key], optimizers[key], device)
            progress(f'{key[0]:<{width_of_names}}  {mode}'
                     + (f' {key[1]}' if len(args.dtypes) > 1 else '')
                     + f': peak memory of a step {peaks[key] / 2 ** 20:.0f} MiB')
        rows = compare_rows(args, mode, macs, checkpointing, times, cpu_times, gemms, peaks)
        add_peer_ratios(rows)
        results.extend(rows)
        steps.clear()
    add_speedups(results, ('model', 'mode', 'input_size'))
    return results


def compare_rows(args: argparse.Namespace, mode: str, macs: dict, checkpointing: dict, times: dict, cpu_times: dict,
                 gemms: dict, peaks: dict) -> list[dict]:
    """The result dicts of one mode of ``compare``, dtype by dtype, models in their order; efficiency
    against one GEMM rate per dtype (the median over the mode's rounds), so that the models' efficiencies
    compare as MACs x img/s do."""
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    input_size = (list(args.input_size) * 2)[:2]
    rows = []
    for dtype in args.dtypes:
        keys = [key for key in times if key[1] == dtype]
        all_gemms = [g for key in keys for g in gemms[key]]
        gemm = statistics.median(all_gemms)
        for name, _ in keys:
            key = (name, dtype)
            step_s = statistics.median(times[key])
            rows.append(dict(
                model=name, mode=mode, dtype=dtype, batch_size=args.batch_size, input_size=input_size,
                fast_path=args.fast_path if name.upper() in VARIANTS else None, channels_last=args.channels_last,
                compile=args.compile,
                grad_checkpointing=checkpointing[name], tf32=args.tf32_applied, device=str(device), threads=threads,
                cpu_malloc=args.cpu_malloc if device.type == 'cpu' else None, published_top1=published_top1(name),
                gmacs_per_image=macs[name] / 1e9, step_s_median=step_s, step_s_all=times[key],
                cpu_s_median=statistics.median(cpu_times[key]), cpu_s_all=cpu_times[key],
                cpu_busy=cpu_busy(cpu_times[key], times[key], threads) if device.type == 'cpu' else None,
                img_s=args.batch_size / step_s, peak_step_mib=peaks[key] / 2 ** 20,
                gemm_gmac_s=gemm / 1e9, gemm_gmac_s_all=[g / 1e9 for g in all_gemms],
                efficiency=macs[name] * (3 if mode == 'train' else 1) * args.batch_size / step_s / gemm))
    return rows


def add_peer_ratios(rows: list[dict]) -> None:
    """Each row's efficiency and img/s over the best --compare model's of its dtype (by efficiency), by wall
    time and by CPU time (user + system, all threads: less moved by other processes on a shared CPU)."""
    for dtype in dict.fromkeys(r['dtype'] for r in rows):
        same = [r for r in rows if r['dtype'] == dtype]
        best_peer = max(same[1:], key=lambda r: r['efficiency'], default=None)
        if best_peer is None:
            continue
        for r in same:
            r['best_peer'] = best_peer['model']
            r['efficiency_vs_best_peer'] = r['efficiency'] / best_peer['efficiency']
            r['img_s_vs_best_peer'] = r['img_s'] / best_peer['img_s']
            r['efficiency_cpu_vs_best_peer'] = (r['gmacs_per_image'] / r['cpu_s_median']) / (
                best_peer['gmacs_per_image'] / best_peer['cpu_s_median'])
            r['img_s_cpu_vs_best_peer'] = best_peer['cpu_s_median'] / r['cpu_s_median']


class Progress:
    """Prints one line per finished phase of a comparison, with the seconds since the comparison started."""

    def __init__(self, what: str) -> None:
        self.what, self.start = what, time.perf_counter()

    def __call__(self, line: str) -> None:
        print(f'  [{self.what}, {time.perf_counter() - self.start:6.1f} s] {line}', flush=True)


def model_macs_any(name: str, input_size: Sequence[int], fast_path: bool = True) -> int:
    """fvcore multiply-adds of one image (eval mode, batch 1) through any timm model."""
    from tools.flops import count_flops
    return count_flops(create_any(name, torch.device('cpu'), fast_path, input_size), (3, *input_size))


def print_compare(results: list[dict]) -> None:
    """The table of ``compare``'s rows, what its columns and the peak figure mean, the speed-ups of every
    dtype after the first, and the load warning if any."""
    first = results[0]
    dtypes = list(dict.fromkeys(r['dtype'] for r in results))
    print(f"{', '.join(dtypes)}, batch {first['batch_size']}, {first['input_size'][0]}x{first['input_size'][1]}, "
          f"device={first['device']}, threads={first['threads']}" + tf32_note(first, ', tf32=')
          + (f", cpu_malloc={first['cpu_malloc']}" if first.get('cpu_malloc') else '')
          + (', every model torch.compiled' if first.get('compile') else '') + checkpointing_note(results)
          + '; efficiency = fvcore MAC/s over a same-process GEMM of the same dtype (x3 MACs for a training step)')
    name_width = max(24, 2 + max(len(r['model']) for r in results))
    nan = float('nan')
    print(f"{'mode':<10}{'model':<{name_width}}{'dtype':<6}{'GMACs':>7}{'ms/step':>10}{'CPU ms':>9}{'img/s':>9}"
          f"{'peak MiB':>9}{'effic.':>8}{'eff/best':>10}{'img/s/best':>11}{'CPU eff/best':>13}"
          f"{'CPU img/s/best':>15}{'top-1':>7}")
    for r in results:
        print(f"{r['mode']:<10}{r['model']:<{name_width}}{r['dtype']:<6}{r['gmacs_per_image']:>7.3f}"
              f"{r['step_s_median'] * 1e3:>10.1f}{r['cpu_s_median'] * 1e3:>9.0f}{r['img_s']:>9.2f}"
              f"{r['peak_step_mib']:>9.0f}{100 * r['efficiency']:>7.1f}%"
              f"{r.get('efficiency_vs_best_peer', nan):>10.2f}{r.get('img_s_vs_best_peer', nan):>11.2f}"
              f"{r.get('efficiency_cpu_vs_best_peer', nan):>13.2f}{r.get('img_s_cpu_vs_best_peer', nan):>15.2f}"
              f"{r['published_top1'] if r['published_top1'] is not None else '-':>7}")
    if 'best_peer' in first:
        print('eff/best, img/s/best: against the best --compare model by efficiency (per mode and dtype); CPU '
              'eff/best, CPU img/s/best: the same from CPU time per step (process user + system, all threads)')
    print('top-1: published ImageNet-1k top-1 % at 224 px (sources in tools/published.py; - where none is listed)')
    print(PEAK_NOTE)
    print_speedups(results)
    warning = load_warning(results)
    if warning:
        print(warning)


def print_speedups(results: Sequence[dict]) -> None:
    """A table of each model's img/s in every dtype after the first over its img/s in the first (wall time
    and CPU time per step); nothing with one dtype."""
    rows = [r for r in results if 'speedup' in r]
    if not rows:
        return
    name_width = max(24, 2 + max(len(r['model']) for r in rows))
    print(f"{'mode':<10}{'model':<{name_width}}{'speed-up':<16}{'wall':>7}{'CPU':>7}")
    for r in rows:
        print(f"{r['mode']:<10}{r['model']:<{name_width}}{r['dtype'] + ' / ' + r['speedup_over']:<16}"
              f"{r['speedup']:>6.2f}x{r['speedup_cpu']:>6.2f}x")
    print('speed-up: img/s in the dtype over img/s in the first --dtype, the same model and mode, stepped in '
          'turn in this process (wall: median step time; CPU: median process CPU time per step)')


def compare_sizes(args: argparse.Namespace) -> list[dict]:
    """``compare`` at every ``--sizes`` side (square inputs), one size after another; each size's table
    is printed as it finishes, then one summary table of img/s and peak memory per size."""
    results = []
    for size in args.sizes:
        args.input_size = [size]
        rows = compare(args)
        print_compare(rows)
        results.extend(rows)
    return results


def print_size_table(results: list[dict]) -> None:
    """img/s and peak step memory of every model per input size, mode and dtype, and --model's img/s over
    the best --compare model's at that size, mode and dtype."""
    ours = results[0]['model']
    best: dict = {}
    for r in results:
        if r['model'] != ours:
            key = (r['input_size'][0], r['mode'], r['dtype'])
            best[key] = max(best.get(key, 0.0), r['img_s'])
    name_width = max(32, 2 + max(len(r['model']) for r in results))
    print(f"{'size':>6}  {'mode':<10}{'model':<{name_width}}{'dtype':<6}{'img/s':>9}{'peak MiB':>10}  "
          'img/s / best peer')
    for r in results:
        key = (r['input_size'][0], r['mode'], r['dtype'])
        ratio = f"{r['img_s'] / best[key]:.2f}" if r['model'] == ours and key in best else ''
        print(f"{r['input_size'][0]:>6}  {r['mode']:<10}{r['model']:<{name_width}}{r['dtype']:<6}{r['img_s']:>9.2f}"
              f"{r['peak_step_mib']:>10.0f}  {ratio}")
    print(PEAK_NOTE)


# ---- paper preset: eval-mode throughput of every variant, as vision papers report it -------------
PAPER_SIZES = (224, 384, 512)
TINY_PRESET = dict(models=['NALAFORMER_XT', 'NALAFORMER_T'], sizes=(32, 48), batch_size=2, warmup=1, steps=1)


def paper_preset(args: argparse.Namespace) -> list[dict]:
    """Inference img/s of each variant at each size: eval mode, no grad, autocast on a GPU (fp16 unless
    --dtype bf16), fp32 on a CPU, warm-up steps then the median of the timed steps."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    names = args.preset_models or list(VARIANTS)
    sizes = args.preset_sizes or PAPER_SIZES
    results = []
    for name in names:
        model = create_any(name, device, args.fast_path)
        params = sum(p.numel() for p in model.parameters())
        for size in sizes:
            torch.manual_seed(0)
            x = torch.randn(args.batch_size, 3, size, size, device=device)
            step = make_step(model, x, None, 'inference', dtype, device, args.compile)[0]
            times = time_call(step, device, args.steps, args.warmup)
            step_s = statistics.median(times)
            results.append(dict(model=name, input_size=[size, size], batch_size=args.batch_size, dtype=args.dtype,
                                device=str(device), threads=torch.get_num_threads(), params_m=params / 1e6,
                                cpu_malloc=args.cpu_malloc if device.type == 'cpu' else None,
                                step_s_median=step_s, step_s_all=times, img_s=args.batch_size / step_s))
            print(f'{name:<15}{size:>5}px  {args.batch_size / step_s:10.1f} img/s', flush=True)
        del model
    return results


def print_paper_table(results: list[dict]) -> None:
    first = results[0]
    sizes = sorted({r['input_size'][0] for r in results})
    print(f"inference throughput, eval mode, batch {first['batch_size']}, {first['dtype']}"
          f"{' autocast' if first['dtype'] != 'fp32' else ''}, device={first['device']}, "
          f"threads={first['threads']}" + (f", cpu_malloc={first['cpu_malloc']}" if first.get('cpu_malloc') else ''))
    print('| model | params (M) | ' + ' | '.join(f'{s}² img/s' for s in sizes) + ' |')
    print('|---|---:|' + '---:|' * len(sizes))
    for name in dict.fromkeys(r['model'] for r in results):
        rows = {r['input_size'][0]: r for r in results if r['model'] == name}
        cells = [f"{rows[s]['img_s']:.1f}" if s in rows else '' for s in sizes]
        print(f"| {name} | {next(iter(rows.values()))['params_m']:.1f} | " + ' | '.join(cells) + ' |')


# ---- GPU preset: training and inference against the models users would pick instead, the engine's ----
# ---- whole step, its host syncs, and the loader against the step, in one command of a few minutes -----
GPU_OURS = ('NALAFORMER_T', 'NALAFORMER_XT')
GPU_PEERS = ('convnext_tiny', 'swin_tiny_patch4_window7_224', 'pvt_v2_b2', 'efficientformerv2_s1')


class BatchList(list):
    """Batches that engine.train_one_epoch takes as a data loader."""

    def __init__(self, batches: list, batch_size: int) -> None:
        super().__init__(batches)
        self.batch_size = batch_size


def preset_model_row(name: str, label: str, fast_path: bool, compile_model: bool, x: torch.Tensor,
                     target: torch.Tensor, args: argparse.Namespace) -> dict:
    """Training and inference img/s and peak step memory of one model (``make_step``: main.py's optimizer
    step; a no-grad eval forward), with the time of the warm-up steps (which compile, with --compile)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    model = create_any(name, device, fast_path, x.shape[-2:])
    row = dict(part='model', model=label, name=name, fast_path=fast_path if name.upper() in VARIANTS else None,
               compile=compile_model, dtype=args.dtype, batch_size=x.shape[0], input_size=list(x.shape[-2:]),
               device=str(device), params_m=sum(p.numel() for p in model.parameters()) / 1e6)
    for mode in ('train', 'inference'):
        step = make_step(model, x, target, mode, dtype, device, compile_model)[0]
        start = time.perf_counter()
        for _ in range(max(args.warmup, 1 if compile_model else 0)):
            step()
        synchronize(device)
        row[f'{mode}_warmup_s'] = time.perf_counter() - start
        row[f'{mode}_img_s'] = x.shape[0] / statistics.median(time_call(step, device, args.steps, 0))
        row[f'{mode}_peak_mib'] = peak_bytes(step, device) / 2 ** 20
    print(f"{label:<28}{'compiled' if compile_model else 'eager':<9} train {row['train_img_s']:9.1f} img/s "
          f"{row['train_peak_mib']:7.0f} MiB   inference {row['inference_img_s']:9.1f} img/s "
          f"{row['inference_peak_mib']:7.0f} MiB   warm-up {row['train_warmup_s'] + row['inference_warmup_s']:5.1f} s",
          flush=True)
    del model
    if device.type == 'cuda':
        torch.cuda.empty_cache()
    return row


def host_syncs_per_step(epoch: Callable[[int], None], n: int) -> float:
    """The host syncs per step of ``epoch(steps)``: the warnings torch.cuda.set_sync_debug_mode('warn') gives
    for an epoch of ``n`` and one of ``2 n`` steps; their difference over ``n`` leaves out the epoch's own
    syncs at its start and end."""
    import warnings
    counts = []
    for length in (n, 2 * n):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            torch.cuda.set_sync_debug_mode('warn')
            try:
                epoch(length)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum('synchroniz' in str(w.message) for w in caught))
    return (counts[1] - counts[0]) / n


def preset_engine_row(name: str, x: torch.Tensor, target: torch.Tensor, args: argparse.Namespace) -> dict:
    """main.py's whole training step (engine.train_one_epoch: OptimizerStep with main.py's optimizer, the
    EMA update, the step's host read) against forward + backward alone, and on CUDA the host syncs per
    step (the warnings of torch.cuda.set_sync_debug_mode('warn'): the difference between two epoch
    lengths, so the epoch's own reads at its start and end drop out)."""
    import contextlib
    import io

    from cli import get_args_parser, settings
    from optimizer import OptimizerSettings, build_optimizer
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    model = create_any(name, device, True, x.shape[-2:]).train()
    cross_entropy = nn.CrossEntropyLoss()

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        with precision.autocast(device, amp_dtype(dtype)):
            loss = cross_entropy(model(x), target)
        loss.backward()
    bare_s = statistics.median(time_call(bare, device, args.steps, args.warmup))
    optimizer = build_optimizer(model, settings(OptimizerSettings, get_args_parser().parse_args(['--model', name])))
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    step = optim_step.OptimizerStep(optimizer, device, amp_dtype(dtype), scaler)
    ema = ModelEma(model, decay=0.9999)

    def epoch(n: int) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # the epoch's progress lines
            engine.train_one_epoch(model, lambda s, o, t: cross_entropy(o, t), BatchList([(x, target)] * n, len(x)),
                                   step, 0, engine.TrainSettings(print_freq=10 ** 9), model_ema=ema)
    epoch(max(args.warmup, 1))
    n = max(4 * args.steps, 1)
    engine_s = time_call(lambda: epoch(n), device, 1, 0)[0] / n
    syncs = host_syncs_per_step(epoch, n) if device.type == 'cuda' else None
    row = dict(part='engine', model=name, dtype=args.dtype, batch_size=len(x), device=str(device),
               bare_img_s=len(x) / bare_s, engine_img_s=len(x) / engine_s, engine_vs_bare=bare_s / engine_s,
               host_syncs_per_step=syncs, optimizer=type(optimizer).__name__,
               fused=bool(optimizer.defaults.get('fused')))
    print(f"{name:<28}engine step {row['engine_img_s']:9.1f} img/s   forward+backward {row['bare_img_s']:9.1f} img/s   "
          f"{100 * row['engine_vs_bare']:5.1f}%   host syncs per step: "
          + ('n/a off CUDA' if syncs is None else f'{syncs:.2f}'), flush=True)
    return row


def preset_loader_row(args: argparse.Namespace, engine_rows: list[dict]) -> dict:
    """img/s of main.py's training loader (its uint8 worker transform, batch --batch-size) on JPEGs cut from
    real photos at ImageNet's sizes, with --data-workers workers (default: every CPU of this process), and
    the workers each engine step would need at that rate per worker."""
    import math
    import tempfile

    from torchvision.datasets import ImageFolder

    from cpu import available_cpus
    workers = (args.data_workers or [available_cpus()])[0]
    with tempfile.TemporaryDirectory(prefix='nalaformer-photos-') as root:
        make_photo_jpegs(root, count=args.loader_images)
        dataset = ImageFolder(root, transform=recipe_train_transform(args.input_size[0], uint8=True))
        n_batches = max(8, 4 * workers)
        sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=n_batches * args.batch_size)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                                             num_workers=workers, pin_memory=args.device.startswith('cuda'))
        batches = iter(loader)
        next(batches)  # the workers' start and first batch
        start, seen = time.perf_counter(), 0
        for images, _ in batches:
            seen += images.shape[0]
        img_s = seen / (time.perf_counter() - start)
    per_worker = img_s / max(workers, 1)
    row = dict(part='loader', workers=workers, batch_size=args.batch_size, input_size=args.input_size[0],
               img_s=img_s, img_s_per_worker=per_worker,
               workers_needed={r['model']: math.ceil(r['engine_img_s'] / per_worker) for r in engine_rows})
    print(f"loader, {workers} workers (main.py's uint8 train transform, photo JPEGs): {img_s:.0f} img/s, "
          f"{per_worker:.0f} per worker; workers per GPU for the engine step: "
          + ', '.join(f'{k} {v}' for k, v in row['workers_needed'].items()), flush=True)
    return row


def gpu_preset(args: argparse.Namespace) -> list[dict]:
    """The GPU comparison in one command, each part printed as it finishes: every model eager (ours on the
    fast and the plain path), main.py's whole step against forward + backward with its host syncs, the
    loader against the step, then the compiled models as long as --budget seconds last (a compiled row
    starts only when the slowest warm-up so far still fits)."""
    start = time.perf_counter()
    device = torch.device(args.device)
    height, width = (list(args.input_size) * 2)[:2]
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 3, height, width, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    ours = args.preset_models or list(GPU_OURS)
    peers = args.compare or list(GPU_PEERS)
    print(f'--preset gpu: {args.dtype}, batch {args.batch_size}, {height}x{width}, device {device}'
          + (f' ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else '')
          + f', budget {args.budget:.0f} s', flush=True)
    rows = []
    for name in ours:
        rows.append(preset_model_row(name, name, True, False, x, target, args))
        rows.append(preset_model_row(name, f'{name} (plain path)', False, False, x, target, args))
    rows += [preset_model_row(name, name, True, False, x, target, args) for name in peers]
    engine_rows = []
    for name in ours:
        engine_rows.append(preset_engine_row(name, x, target, args))
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    rows += engine_rows
    rows.append(preset_loader_row(args, engine_rows))
    if not args.preset_eager_only:
        slowest = 60.0  # a first guess at one compiled model's warm-up (compiling training and inference)
        for name in ours + peers:
            left = args.budget - (time.perf_counter() - start)
            if left < slowest:
                print(f'{name:<28}compiled skipped: {left:.0f} s of the budget left, a compiled warm-up took up '
                      f'to {slowest:.0f} s', flush=True)
                rows.append(dict(part='model', model=name, compile=True, skipped=True))
                continue
            row = preset_model_row(name, name, True, True, x, target, args)
            slowest = max(slowest, row['train_warmup_s'] + row['inference_warmup_s'])
            rows.append(row)
    print(f'--preset gpu took {time.perf_counter() - start:.0f} s')
    return rows


def print_gpu_tables(rows: list[dict]) -> None:
    """The preset's results as Markdown tables: models, engine step, loader."""
    model_rows = [r for r in rows if r['part'] == 'model' and not r.get('skipped')]
    print('| model | | train img/s | train peak MiB | inference img/s | inference peak MiB | warm-up s |')
    print('|---|---|---:|---:|---:|---:|---:|')
    for r in model_rows:
        print(f"| {r['model']} | {'compiled' if r['compile'] else 'eager'} | {r['train_img_s']:.1f} | "
              f"{r['train_peak_mib']:.0f} | {r['inference_img_s']:.1f} | {r['inference_peak_mib']:.0f} | "
              f"{r['train_warmup_s'] + r['inference_warmup_s']:.1f} |")
    print()
    print('| model | engine step img/s | forward+backward img/s | engine / bare | host syncs per step |')
    print('|---|---:|---:|---:|---:|')
    for r in (r for r in rows if r['part'] == 'engine'):
        syncs = '-' if r['host_syncs_per_step'] is None else f"{r['host_syncs_per_step']:.2f}"
        print(f"| {r['model']} | {r['engine_img_s']:.1f} | {r['bare_img_s']:.1f} | {100 * r['engine_vs_bare']:.1f}% "
              f"| {syncs} |")
    for r in (r for r in rows if r['part'] == 'loader'):
        print(f"\nloader: {r['workers']} workers, {r['img_s']:.0f} img/s ({r['img_s_per_worker']:.0f} per worker); "
              'workers per GPU for the engine step: ' + ', '.join(f'{k} {v}' for k, v in r['workers_needed'].items()))


# ---- data loading: the recipe's train pipeline, per DataLoader worker ------------------------------
def make_jpegs(root: str, count: int = 200, size: Sequence[int] = (500, 375), quality: int = 90,
               classes: int = 4) -> None:
    """``count`` JPEGs of ``size`` (width, height) in ``classes`` ImageFolder classes under ``root``:
    smooth structure at three scales plus grain, so that decoding costs about what a photo does."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    width, height = size
    for i in range(count):
        img = rng.normal(128, 10, (height, width, 3))
        for cells, amp in ((4, 90), (16, 50), (64, 25)):
            small = rng.uniform(0, 255, (max(1, cells * height // width), cells, 3)).astype(np.uint8)
            img += amp * (np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC)) / 127.5 - 1)
        folder = os.path.join(root, f'class{i % classes}')
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(os.path.join(folder, f'{i:05d}.jpg'), quality=quality)


def make_photo_jpegs(root: str, count: int = 200, quality: int = 90, classes: int = 4, seed: int = 0) -> None:
    """``count`` JPEGs (quality ``quality``) in ``classes`` ImageFolder classes under ``root``, cut from
    scikit-learn's two sample photos (china.jpg and flower.jpg, 640x427) and resized to ImageNet's usual
    sizes: the long side 500 px, the short side 333..400 px, one in four portrait. Real photos decode as
    ImageNet's JPEGs do; noise-like synthetic images (``make_jpegs``) decode several times slower."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images  # bundled with scikit-learn, never downloads
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)
    for i in range(count):
        photo = photos[i % len(photos)]
        short = int(rng.integers(333, 401))
        width, height = (short, 500) if rng.random() < 0.25 else (500, short)
        # a crop of the target's aspect ratio, 60..100% of the largest that fits, anywhere in the photo
        crop_w = min(photo.width, photo.height * width / height) * rng.uniform(0.6, 1.0)
        crop_h = crop_w * height / width
        left, top = rng.uniform(0, photo.width - crop_w), rng.uniform(0, photo.height - crop_h)
        img = photo.resize((width, height), Image.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
        folder = os.path.join(root, f'class{i % classes}')
        os.makedirs(folder, exist_ok=True)
        img.save(os.path.join(folder, f'{i:05d}.jpg'), quality=quality)


def recipe_train_transform(input_size: int, uint8: bool = False):
    """main.py's training transform with the recipe's flags (every default) at ``input_size``."""
    import datasets
    from cli import get_args_parser, settings
    recipe = get_args_parser().parse_args(['--input-size', str(input_size)])
    cfg = datasets.data_config(recipe.model, recipe.input_size, recipe.eval_crop_ratio)
    return datasets.build_transform(True, cfg, settings(datasets.Augmentation, recipe), recipe.data_set, uint8)


def _transform_times(dataset) -> tuple:
    """(wall s, process CPU s, per-image thread CPU s) of loading every item of ``dataset`` in this process."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, start = usage.ru_utime + usage.ru_stime, time.perf_counter()
    per_image = []
    for i in range(len(dataset)):
        thread_start = time.thread_time()
        dataset[i]
        per_image.append(time.thread_time() - thread_start)
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return wall, usage.ru_utime + usage.ru_stime - cpu0, per_image


def data_loading(args: argparse.Namespace) -> dict:
    """img/s of main.py's train transform (default recipe flags) on the ImageFolder ``args.data_loading``:
    in this process (what one DataLoader worker does with a core of its own: images per second of
    wall time and per second of CPU time), then through DataLoaders with ``--data-workers`` workers
    (time to the first batch of a fresh iterator and img/s after it). main.py's workers stop at the uint8
    crop (the device normalises and erases); the CPU time of the whole transform on the CPU (ToTensor,
    Normalize, RandomErasing in the worker, as before) is given too."""
    from torchvision.datasets import ImageFolder

    size = (list(args.input_size) * 2)[0]
    dataset = ImageFolder(args.data_loading, transform=recipe_train_transform(size, uint8=True))
    torch.manual_seed(0)
    dataset[0]
    wall, cpu, per_image = _transform_times(dataset)
    _, cpu_float, _ = _transform_times(ImageFolder(args.data_loading, transform=recipe_train_transform(size)))
    ms = sorted(1e3 * t for t in per_image)
    quantiles = {f'p{q}': ms[min(len(ms) - 1, int(q / 100 * len(ms)))] for q in (10, 50, 90, 99)}
    result = dict(data=args.data_loading, images=len(dataset), input_size=size,
                  threads=torch.get_num_threads(), one_worker_img_s_wall=len(dataset) / wall,
                  one_worker_img_s_cpu=len(dataset) / cpu, image_cpu_ms_mean=statistics.mean(ms),
                  image_cpu_ms=quantiles, cpu_transform_img_s_cpu=len(dataset) / cpu_float, loaders=[])
    print(f"train transform to uint8 (main.py's workers), {len(dataset)} images, in-process: "
          f'{len(dataset) / wall:.1f} img/s (wall), {len(dataset) / cpu:.1f} img/s per CPU second; CPU ms per '
          f'image: mean {statistics.mean(ms):.2f}, ' + ', '.join(f'{k} {v:.2f}' for k, v in quantiles.items()))
    print(f'the same with ToTensor, Normalize and RandomErasing on the CPU: {len(dataset) / cpu_float:.1f} img/s '
          f'per CPU second')
    for workers in args.data_workers or [0, 2]:
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                             num_workers=workers)
        start = time.perf_counter()
        batches = iter(loader)
        next(batches)
        first = time.perf_counter() - start
        start, seen = time.perf_counter(), 0
        for images, _ in batches:
            seen += images.shape[0]
        rate = seen / (time.perf_counter() - start) if seen else float('nan')
        result['loaders'].append(dict(workers=workers, batch_size=args.batch_size, first_batch_s=first, img_s=rate))
        print(f'DataLoader, {workers} workers, batch {args.batch_size}: first batch after {first:.2f} s, '
              f'then {rate:.1f} img/s')
    return result


# ---- EMA update: timm's ModelEmaV3 (two state dicts per update) against ema.ModelEma -------------
EMA_MODELS = ('NALAFORMER_XT', 'NALAFORMER_L')


def ema_update_times(args: argparse.Namespace) -> list[dict]:
    """ms per EMA update of each model (default XT and L) on ``args.device``: timm's ModelEmaV3 and main.py's
    ema.ModelEma, one update of each per round (interleaved), median over ``args.steps`` rounds after
    ``args.warmup``."""
    from timm.utils import ModelEmaV3
    device = torch.device(args.device)
    results = []
    for name in args.preset_models or EMA_MODELS:
        model = create_any(name, device, args.fast_path)
        emas = {'timm ModelEmaV3': ModelEmaV3(model, decay=0.9999),
                'ema.ModelEma': ModelEma(model, decay=0.9999)}
        times: dict[str, list[float]] = {k: [] for k in emas}
        for i in range(args.warmup + args.steps):
            for label, ema in emas.items():
                t = time_call(lambda ema=ema, model=model: ema.update(model), device, 1, warmup=0)[0]
                if i >= args.warmup:
                    times[label].append(t)
        row = dict(model=name, device=str(device), threads=torch.get_num_threads(),
                   tensors=len(model.state_dict()), params_m=sum(p.numel() for p in model.parameters()) / 1e6,
                   **{f'{label} ms': 1e3 * statistics.median(t) for label, t in times.items()})
        print(f"{name}: {row['tensors']} tensors, {row['params_m']:.1f} M parameters: "
              + ', '.join(f"{label} {row[f'{label} ms']:.2f} ms" for label in emas) + ' per update', flush=True)
        results.append(row)
    return results


# ---- sweep: one NaLa block vs one softmax block of the same width --------------------------------
def sweep(args: argparse.Namespace) -> dict:
    from models.nala import RoPE
    from models.nalaformer import NaLaBlock, set_fast_path
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    arch = VARIANTS[args.model.upper()]
    stage = args.sweep_stage
    dim, heads = arch['embed_dims'][stage], arch['num_heads'][stage]
    stride = 4 * 2 ** stage
    blocks = {
        'nala': NaLaBlock(dim, heads, arch['mlp_ratio'], linear=True),
        'softmax': NaLaBlock(dim, heads, arch['mlp_ratio'], linear=False),
    }
    if args.fast_path:   # the reference's softmax, which forms the N x N matrix
        blocks['softmax_plain'] = NaLaBlock(dim, heads, arch['mlp_ratio'], linear=False)
    for kind, block in blocks.items():
        set_fast_path(block, args.fast_path and kind != 'softmax_plain')
    rope = RoPE(dim, heads).to(device)
    results = dict(model=args.model, stage=stage, dim=dim, heads=heads, stride=stride, dtype=args.dtype,
                   mode=args.mode, batch_size=args.batch_size, fast_path=args.fast_path,
                   device=str(device), sizes=list(args.sweep_sizes), **{kind: [] for kind in blocks})
    for size in args.sweep_sizes:
        side = size // stride
        tokens = side * side
        for kind, block in blocks.items():
            if kind == 'softmax_plain' and size > args.sweep_plain_max:
                continue
            block = block.to(device)
            x = torch.randn(args.batch_size, dim, side, side, device=device, requires_grad=args.mode == 'train')

            def step(block=block, x=x, side=side) -> None:
                sin, cos = rope((side, side))
                if args.mode == 'train':
                    block.train()
                    with precision.autocast(device, amp_dtype(dtype)):
                        out = block(x, sin, cos)
                    out.float().sum().backward()
                else:
                    block.eval()
                    with torch.no_grad(), precision.autocast(device, amp_dtype(dtype)):
                        block(x, sin, cos)
            # small sizes take milliseconds: repeat them for >= 1 s and keep the fastest step, the
            # best estimate of the block's own cost on a machine shared with other processes
            times = time_call(step, device, args.steps, args.warmup)
            while sum(times) < args.sweep_min_seconds and len(times) < 200:
                times += time_call(step, device, args.steps, 0)
            peak = peak_bytes(step, device)
            t = min(times)
            row = dict(size=size, tokens=tokens, step_s=t, steps=len(times),
                       us_per_token=1e6 * t / (tokens * args.batch_size),
                       peak_mib=peak / 2 ** 20, kib_per_token=peak / 1024 / (tokens * args.batch_size))
            results[kind].append(row)
            print(f"{kind:>13} {size:>5}px  {tokens:>6} tokens  {row['us_per_token']:8.3f} us/token  "
                  f"{row['kib_per_token']:8.2f} KiB/token", flush=True)
    return results


def plot_sweep(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = {'nala': 'NaLa block', 'softmax': f"softmax block ({'fast' if results['fast_path'] else 'plain'} path)",
              'softmax_plain': 'softmax block (plain: N x N matrix)'}
    for kind, style in (('nala', 'o-'), ('softmax', 's--'), ('softmax_plain', 'x:')):
        rows = results.get(kind)
        if not rows:
            continue
        sizes = [r['size'] for r in rows]
        axes[0].plot(sizes, [r['us_per_token'] for r in rows], style, label=labels[kind])
        axes[1].plot(sizes, [r['kib_per_token'] for r in rows], style, label=labels[kind])
    title = (f"{results['model']} stage {results['stage'] + 1} block (C={results['dim']}, "
             f"{results['heads']} heads), {results['mode']}, {results['dtype']}, batch {results['batch_size']}")
    axes[0].set_ylabel('time per token (µs, fastest step)')
    axes[1].set_ylabel('peak memory per token (KiB)')
    for ax in axes:
        ax.set_xlabel('input size (px, square)')
        ax.set_xticks(results['sizes'])
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8, loc='best')
    axes[1].legend(fontsize=8, loc='upper left')
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_step_args(parser: argparse.ArgumentParser) -> None:
    """The flags of what one step runs: model, batch, size, mode, dtypes, paths, compile, device, allocator."""
    parser.add_argument('--model', default='NALAFORMER_T')
    parser.add_argument('--batch-size', '-b', type=int, default=None, help='default 32, or 1 with --sweep')
    parser.add_argument('--input-size', type=int, nargs='+', default=[224], help='side, or height width')
    parser.add_argument('--mode', choices=['train', 'inference'], default='train')
    parser.add_argument('--dtype', default=None, metavar='DTYPE[,DTYPE]',
                        help='fp32, or autocast to bf16 / fp16 (fp16 on GPU only); a comma list (fp32,bf16) steps '
                             'every model in each dtype in turn, interleaved, and prints the speed-up of each '
                             'dtype over the first (one model and --compare); default fp32, fp16 for --preset '
                             'on a GPU')
    parser.add_argument('--fast-path', action=argparse.BooleanOptionalAction, default=True,
                        help='the fast path (default); --no-fast-path runs the plain path, the reference math')
    parser.add_argument('--channels-last', action='store_true')
    parser.add_argument('--grad-checkpointing', action='store_true',
                        help="timm's set_grad_checkpointing(True) on every model that supports it (less memory, "
                             'more time per training step); the output names the models that do not')
    parser.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=True,
                        help="fp32 matmuls/convolutions on CUDA's TF32 tensor cores, as main.py trains by default "
                             '(--no-tf32: full fp32, as main.py --no-tf32)')
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    parser.add_argument('--cpu-malloc', choices=['retain', 'system'], default='system',
                        help="CPU allocator: system (default, for one model, --compare and --preset alike: a plain "
                             "process, as a user's own code and timm's train.py run) or retain, main.py's "
                             'default (cpu.retain_freed_cpu_memory); the output says which was used')
    parser.add_argument('--warmup', type=int, default=None,
                        help='untimed steps first (default 4 on a CPU, 2 on a GPU; see above)')
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--gemm-size', type=int, default=None,
                        help='side of the reference GEMM (default 2048 on CPU, 8192 on GPU)')
    parser.add_argument('--json', default=None, help='append the result as one JSON line to this file')


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    """The flags of --compare and --preset."""
    parser.add_argument('--compare', type=lambda s: [n for n in s.split(',') if n], default=None,
                        metavar='MODEL,MODEL',
                        help='timm models to step interleaved with --model (e.g. convnext_nano,pvt_v2_b1)')
    parser.add_argument('--sizes', type=int, nargs='+', default=None, metavar='SIDE',
                        help='with --compare: one comparison per square input size (e.g. 224 512 1024), then a '
                             'table of img/s and peak memory per size')
    parser.add_argument('--modes', nargs='+', choices=['inference', 'train'], default=['inference', 'train'],
                        help='modes timed by --compare')
    parser.add_argument('--preset', choices=['paper', 'gpu'], default=None,
                        help='paper: eval-mode img/s of every variant at 224/384/512 (batch 128 on a GPU with '
                             'fp16 autocast, 64 in fp32 on a CPU), printed as a table; gpu: training and '
                             'inference img/s and peak memory of T and XT (fast, plain, compiled) against '
                             f'{", ".join(GPU_PEERS)} (eager and compiled, --compare replaces them), bf16, batch '
                             "128; main.py's whole step against forward+backward and its host syncs; the loader "
                             'against the step (docs/performance.md)')
    parser.add_argument('--budget', type=float, default=330.0,
                        help='--preset gpu: seconds the whole preset may take; compiled rows that would not fit '
                             'are skipped (default 330)')
    parser.add_argument('--preset-eager-only', action='store_true', help='--preset gpu without the compiled rows')
    parser.add_argument('--loader-images', type=int, default=256,
                        help='--preset gpu: photo JPEGs the loader part writes and reads (default 256)')
    parser.add_argument('--preset-models', nargs='+', default=None,
                        help='variants for --preset (default: all for paper, T and XT for gpu)')
    parser.add_argument('--preset-sizes', type=int, nargs='+', default=None,
                        help=f'input sides for --preset (default {" ".join(map(str, PAPER_SIZES))})')
    parser.add_argument('--tiny', action='store_true',
                        help='--preset at a tiny size (XT and T, 32/48 px, batch 2, one step): a smoke test')


def add_other_args(parser: argparse.ArgumentParser) -> None:
    """The flags of data loading, the EMA update and the block sweep."""
    parser.add_argument('--data-loading', default=None, metavar='DIR',
                        help="img/s of main.py's train transform per DataLoader worker on the ImageFolder DIR")
    parser.add_argument('--make-jpegs', default=None, metavar='DIR',
                        help='first write 200 photo-like 500x375 JPEGs (quality 90) into DIR as an ImageFolder')
    parser.add_argument('--make-photos', default=None, metavar='DIR',
                        help="first write 200 JPEGs cut from scikit-learn's sample photos at ImageNet's sizes "
                             '(long side 500, short 333..400, quality 90) into DIR as an ImageFolder')
    parser.add_argument('--data-workers', type=int, nargs='+', default=None,
                        help='DataLoader worker counts timed by --data-loading (default 0 2); --preset gpu: the '
                             "loader's workers (default: every CPU available)")
    parser.add_argument('--ema-update', action='store_true',
                        help="ms per EMA update, timm's ModelEmaV3 against main.py's ema.ModelEma "
                             '(--preset-models, default XT and L)')
    parser.add_argument('--sweep', action='store_true', help='NaLa block vs softmax block over input sizes')
    parser.add_argument('--sweep-sizes', type=int, nargs='+', default=[224, 320, 448, 512, 640, 768, 896, 1024])
    parser.add_argument('--sweep-stage', type=int, default=1, help='stage (0-based) whose width the blocks use')
    parser.add_argument('--sweep-min-seconds', type=float, default=1.0,
                        help='repeat each sweep point until its steps took this long')
    parser.add_argument('--sweep-plain-max', type=int, default=768,
                        help='largest size for the plain softmax curve (its N x N matrix grows fast)')
    parser.add_argument('--out', default='sweep', help='--sweep writes OUT.json and OUT.png')


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(description=__doc__, epilog=PEAK_NOTE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(parser)
    add_compare_args(parser)
    add_other_args(parser)
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith('cuda')
    if args.preset:
        if args.tiny:
            for key, value in TINY_PRESET.items():
                setattr(args, 'preset_' + key if key in ('models', 'sizes') else key, value)
        args.batch_size = args.batch_size or (128 if on_gpu else 64)
        args.dtype = args.dtype or ('bf16' if args.preset == 'gpu' else 'fp16' if on_gpu else 'fp32')
    elif args.tiny:
        parser.error('--tiny goes with --preset paper')
    if args.batch_size is None:
        args.batch_size = 1 if args.sweep else 32
    if args.warmup is None:
        args.warmup = 2 if args.device.startswith('cuda') else 4
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that do not fit together or name unknown things: argparse's error (exit 2). Sets ``args.dtypes``
    (the --dtype list) and ``args.dtype`` (its first)."""
    args.dtypes = list(dict.fromkeys(d.strip() for d in (args.dtype or 'fp32').split(',') if d.strip())) or ['fp32']
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtype: unknown dtype(s) {unknown}; choose from {', '.join(DTYPES)} (a comma list: fp32,bf16)")
    args.dtype = args.dtypes[0]
    several = [flag for flag, on in (('--preset', args.preset), ('--sweep', args.sweep),
                                     ('--ema-update', args.ema_update), ('--data-loading', args.data_loading)) if on]
    if len(args.dtypes) > 1 and several:
        parser.error(f'{several[0]} takes one --dtype; several (--dtype {",".join(args.dtypes)}) go with one model '
                     'or --compare')
    if args.grad_checkpointing and several:
        parser.error(f'--grad-checkpointing goes with one model or --compare, not with {several[0]}')
    if args.model.upper() not in VARIANTS:
        parser.error('--model: ' + unknown_model(args.model, VARIANTS))
    unknown = [m for m in args.preset_models or [] if m.upper() not in VARIANTS]
    if unknown:
        parser.error('--preset-models: ' + unknown_model(unknown[0], VARIANTS))
    if args.compare is not None:
        unknown = [n for n in args.compare if not timm.is_model(n)]
        if unknown or not args.compare:
            parser.error(f'--compare: unknown timm model(s) {unknown}; pass comma-separated names that '
                         f'timm.list_models() lists, e.g. convnext_nano,pvt_v2_b1')
    if args.sizes and not args.compare:
        parser.error('--sizes needs --compare MODEL,MODEL (it sweeps the comparison over input sizes)')
    if len(args.input_size) not in (1, 2):
        parser.error('--input-size takes one side or height and width')
    if 'fp16' in args.dtypes and not args.device.startswith('cuda'):
        parser.error('fp16 needs a GPU (--device cuda)')


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.getLogger('fvcore').setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    # main.py's fp32 setting (TF32 on CUDA unless --no-tf32), so that fp32 figures are those training runs at;
    # None off CUDA, where there is no TF32
    args.tf32_applied = args.tf32 if precision.set_tf32(args.device, args.tf32) else None
    if not args.device.startswith('cuda') and args.cpu_malloc == 'retain':
        args.cpu_malloc = 'retain' if cpu.retain_freed_cpu_memory() else 'system'
    if args.sweep:
        results = sweep(args)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + '.json', 'w') as f:
            json.dump(results, f, indent=1)
        plot_sweep(results, args.out + '.png')
        print(f'wrote {args.out}.json and {args.out}.png')
        return results
    if args.ema_update:
        results = ema_update_times(args)
        write_jsonl(args.json, results)
        return results
    if args.make_jpegs:
        make_jpegs(args.make_jpegs)
        print(f'wrote 200 JPEGs under {args.make_jpegs}')
    if args.make_photos:
        make_photo_jpegs(args.make_photos)
        print(f'wrote 200 JPEGs of photos under {args.make_photos}')
    if args.data_loading:
        result = data_loading(args)
        write_jsonl(args.json, [result])
        return result
    if args.preset == 'gpu':
        results = gpu_preset(args)
        print_gpu_tables(results)
        write_jsonl(args.json, results)
        return results
    if args.preset:
        results = paper_preset(args)
        print_paper_table(results)
        write_jsonl(args.json, results)
        return results
    if args.compare and args.sizes:
        results = compare_sizes(args)
        print_size_table(results)
        write_jsonl(args.json, results)
        return results
    if args.compare:
        results = compare(args)
        print_compare(results)
        write_jsonl(args.json, results)
        return results
    results = benchmark_model(args)
    print_results(results)
    write_jsonl(args.json, results)
    return results[0] if len(results) == 1 else results


def write_jsonl(path: str | None, results: list[dict]) -> None:
    """Append each result as one JSON line to ``path`` (nothing without a path), with the time of writing."""
    if path:
        stamp = time.strftime('%Y-%m-%dT%H:%M:%S%z')
        with open(path, 'a') as f:
            f.writelines(json.dumps({'written': stamp, **r}) + '\n' for r in results)


if __name__ == '__main__':
    main()
