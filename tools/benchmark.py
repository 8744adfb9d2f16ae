"""Throughput, peak memory and efficiency of a NaLaFormer variant, alone or against timm models, measured
against the machine's own GEMM.

    python tools/benchmark.py --model NALAFORMER_T                      # fp32 train, batch 32, 224^2
    python tools/benchmark.py --model NALAFORMER_T --mode inference --dtype bf16
    python tools/benchmark.py --model NALAFORMER_XT --no-fast-path --compile --channels-last
    python tools/benchmark.py --model NALAFORMER_T --compare convnext_nano,pvt_v2_b1 -b 16
    python tools/benchmark.py --model NALAFORMER_T --compare convnext_tiny -b 16 --dtype fp32,bf16
    python tools/benchmark.py --compare convnext_tiny,swin_tiny_patch4_window7_224 -b 2 --sizes 224 512 1024

A measurement: warm-up steps, then timed steps (median step time, and the median process CPU time per
step, all threads). ``train`` times main.py's optimizer step (``training.step.OptimizerStep``:
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

The CPU allocator is the same for one model, ``--compare`` and the other benchmark programs: ``--cpu-malloc
system`` by default, a plain process as a user's own code (and timm's train.py) runs; ``retain`` adds
main.py's setting (glibc keeps freed memory instead of giving large blocks back to the OS, so activations
do not page-fault again every step). Every model of a run is stepped under the same setting; with the batch
slices NaLaFormer pays little under ``system`` (docs/performance.md). Under ``system`` the first steps
are slow until glibc's adaptive mmap threshold has grown, hence 4 warm-up steps by default on a CPU. The
output says which setting was used.

``--compare MODEL,MODEL`` steps --model and the named timm models interleaved in one process, in
inference and training, and prints GMACs, ms/step, img/s, efficiency, the ratio to the best of them and each
model's published ImageNet top-1 (``tools/published.py``, with sources);
with ``--compile`` every model is compiled (warm-up steps compile). Models that timm builds for one input size
(swin, vit) are built for the requested size. ``--sizes 224 512 1024`` repeats the comparison per square size
and ends with a table of img/s and peak step memory per model, size and mode.

The other measurements are programs of their own, with the same flags: ``tools/paper_throughput.py``
(eval-mode img/s of every variant as papers report it), ``tools/gpu_benchmark.py`` (the GPU comparison in
one command), ``tools/loader_speed.py`` (the recipe's train transform per DataLoader worker),
``tools/ema_speed.py`` (ms per EMA update) and ``tools/block_sweep.py`` (one NaLa block against one softmax
block over input sizes). Their flags here (``--preset``, ``--sweep``, ``--ema-update``, ``--data-loading``,
``--make-jpegs``, ``--make-photos``) print the command to run instead (exit 2).
"""
import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import timm

from models import PAPER_FIGURES, VARIANTS
from run.errors import FlagParser
from tools import timing


def model_macs(name: str, input_size: Sequence[int]) -> int:
    """fvcore multiply-adds of one image through the model (eval mode, as tools/flops.py counts)."""
    from tools.flops import count_flops
    model = timm.create_model(name)
    return count_flops(model, (3, *input_size))


#: what the peak-memory figure holds (the table footers and --help say it)
PEAK_NOTE = ('peak MiB: the most tensor memory live at once during one step above what was live before it '
             '(the gradients are freed first): in training the activations saved for backward, the gradients '
             "and every temporary, the optimizer step's included; in inference the forward's live activations. "
             'Parameters, buffers and optimizer state, live before the step, are not in it.')

def step_peak_bytes(step: Callable[[], None], optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """``peak_bytes`` of one step (PEAK_NOTE), the last step's gradients freed first: the measured step
    allocates its own, and blocks allocated before profiling and freed during it only draw a warning from
    the profiler."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    return timing.peak_bytes(step, device)


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
            gemms[key].append(timing.gemm_macs_per_s(timing.DTYPES[dtypes[key]], device, args.gemm_size, repeats=2))
            cpu_start = time.process_time()
            times[key].append(timing.time_call(steps[key], device, 1, warmup=0)[0])
            cpu_times[key].append(time.process_time() - cpu_start)
        if after_round is not None:
            after_round(i + 1)
    return times, cpu_times, gemms


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


def build_stepped_model(name: str, device: torch.device, args: argparse.Namespace,
                        input_size: Sequence[int] | None = None) -> tuple[nn.Module, bool | None]:
    """``timing.create_any`` with the flags' memory format and --grad-checkpointing: (model, whether gradient
    checkpointing is on; None when not asked for)."""
    model = timing.create_any(name, device, args.fast_path, input_size)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    checkpointing = with_grad_checkpointing(model) if args.grad_checkpointing else None
    return model, checkpointing


def benchmark_input(args: argparse.Namespace, height: int, width: int, device: torch.device) -> torch.Tensor:
    """A random batch in the memory format of the models ``build_stepped_model`` makes (--channels-last)."""
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
        model, checkpointing = build_stepped_model(args.model, device, args)
        steps[dtype], optimizers[dtype] = timing.make_step(
            model, x, target, args.mode, timing.DTYPES[dtype], device, compile_model=args.compile)
        statics[dtype] = timing.tensor_bytes(list(model.parameters()) + list(model.buffers()))
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
            static += timing.tensor_bytes(t for s in state for t in s.values() if torch.is_tensor(t))
        step_time = statistics.median(times[dtype])
        results.append(dict(
            model=args.model, mode=args.mode, dtype=dtype, batch_size=args.batch_size,
            input_size=[height, width], fast_path=args.fast_path, channels_last=args.channels_last,
            compile=args.compile, grad_checkpointing=checkpointing, tf32=args.tf32_applied, device=str(device),
            threads=threads, cpu_malloc=args.cpu_malloc if device.type == 'cpu' else None,
            step_s_median=step_time, step_s_all=times[dtype], img_s=args.batch_size / step_time,
            cpu_s_median=statistics.median(cpu_times[dtype]), cpu_s_all=cpu_times[dtype],
            cpu_busy=timing.cpu_busy(cpu_times[dtype], times[dtype], threads) if device.type == 'cpu' else None,
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
    warning = timing.load_warning(results)
    if warning:
        print(warning)


# ---- compare: our model against named timm models, interleaved in one process -------------------
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
    progress = PhasePrinter(f'{height}x{width}')
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
                model, checkpointing[name] = build_stepped_model(name, device, args, (height, width))
                key = (name, dtype)
                steps[key], optimizers[key] = timing.make_step(
                    model, x, target, mode, timing.DTYPES[dtype], device, compile_model=args.compile)
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
        rows = compare_rows(args, mode, macs=macs, checkpointing=checkpointing, times=times, cpu_times=cpu_times,
                            gemms=gemms, peaks=peaks)
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
                cpu_busy=timing.cpu_busy(cpu_times[key], times[key], threads) if device.type == 'cpu' else None,
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


class PhasePrinter:
    """Prints one line per finished phase of a comparison, with the seconds since the comparison started."""

    def __init__(self, what: str) -> None:
        self.what, self.start = what, time.perf_counter()

    def __call__(self, line: str) -> None:
        print(f'  [{self.what}, {time.perf_counter() - self.start:6.1f} s] {line}', flush=True)


def model_macs_any(name: str, input_size: Sequence[int], fast_path: bool = True) -> int:
    """fvcore multiply-adds of one image (eval mode, batch 1) through any timm model."""
    from tools.flops import count_flops
    return count_flops(timing.create_any(name, torch.device('cpu'), fast_path, input_size), (3, *input_size))


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
    warning = timing.load_warning(results)
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


# ---- published top-1 of the models --compare is run against --------------------------------------------
# ImageNet-1k top-1 (%, 224 px, trained on ImageNet-1k only) of those timm models, each with the paper it comes
# from; the NaLaFormer variants' figures are the paper's (models.PAPER_FIGURES)
#: timm model name -> (top-1 %, source)
PUBLISHED_TOP1: dict[str, tuple[float, str]] = {
    'convnext_tiny': (82.1, 'ConvNeXt-T: Liu et al., A ConvNet for the 2020s, CVPR 2022, arXiv:2201.03545'),
    'pvt_v2_b2': (82.0, 'PVTv2-B2: Wang et al., PVT v2: Improved Baselines with Pyramid Vision Transformer, '
                        'CVMJ 2022, arXiv:2106.13797'),
    'pvt_v2_b1': (78.7, 'PVTv2-B1: Wang et al., PVT v2, CVMJ 2022, arXiv:2106.13797'),
    'swin_tiny_patch4_window7_224': (81.2, 'Swin-T: Liu et al., Swin Transformer: Hierarchical Vision '
                                           'Transformer using Shifted Windows, ICCV 2021, arXiv:2103.14030'),
    'efficientformerv2_s1': (79.0, 'EfficientFormerV2-S1 (trained with distillation): Li et al., Rethinking '
                                   'Vision Transformers for MobileNet Size and Speed, ICCV 2023, arXiv:2212.08059'),
}


def published_top1(name: str) -> float | None:
    """The published ImageNet-1k top-1 of a NaLaFormer variant or a listed timm model (a pretrained tag
    such as ``.fb_in1k`` is ignored), or None where none is listed."""
    if name.upper() in PAPER_FIGURES:
        return PAPER_FIGURES[name.upper()][2]
    entry = PUBLISHED_TOP1.get(name.split('.', 1)[0])
    return entry[0] if entry else None


# ---- the command line -------------------------------------------------------------------------------
#: the measurements that are programs of their own, by the flag that chose them here (in the order that
#: flag took precedence when several were given): what it measures, its program, and whether the flag stays
#: on that program's command line
MOVED = (('--sweep', 'the block sweep', 'tools/block_sweep.py', False),
         ('--ema-update', 'the EMA update timing', 'tools/ema_speed.py', False),
         ('--make-jpegs', 'the data-loading benchmark', 'tools/loader_speed.py', True),
         ('--make-photos', 'the data-loading benchmark', 'tools/loader_speed.py', True),
         ('--data-loading', 'the data-loading benchmark', 'tools/loader_speed.py', True))
PRESETS = {'gpu': ('the GPU comparison', 'tools/gpu_benchmark.py'),
           'paper': ('the paper throughput table', 'tools/paper_throughput.py')}


def moved_command(argv: Sequence[str]) -> str | None:
    """The one line for a command line that asks for a measurement that is a program of its own (--sweep,
    --ema-update, --make-jpegs, --make-photos, --data-loading, --preset paper|gpu): that program with the
    same flags, without the one that chose it; None for a command line of this program."""
    argv = list(argv)

    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + '=') for a in argv)
    rest, preset = list(argv), None
    for i, a in enumerate(argv):
        if a == '--preset' or a.startswith('--preset='):
            preset = a.split('=', 1)[1] if '=' in a else (argv[i + 1] if i + 1 < len(argv) else '')
            del rest[i:i + (1 if '=' in a else 2)]
            break
    chosen = next((entry for entry in MOVED if given(entry[0])), None)
    if chosen is None and preset is None:
        return None
    if chosen is None:
        if preset not in PRESETS:
            return (f'--preset {preset}: each preset is a program of its own: python tools/paper_throughput.py '
                    '(paper), python tools/gpu_benchmark.py (gpu)')
        flag, (label, program) = f'--preset {preset}', PRESETS[preset]
    else:
        flag, label, program, keep = chosen
        rest = [a for a in rest if keep or not (a == flag or a.startswith(flag + '='))]
    return f'{label} ({flag}) is a program of its own: python {program}' + (f' {shlex.join(rest)}' if rest else '')


def add_step_args(parser: argparse.ArgumentParser) -> None:
    """The flags of what one step runs: model, batch, size, mode, dtypes, paths, compile, device, allocator."""
    parser.add_argument('--model', default='NALAFORMER_T')
    parser.add_argument('--batch-size', '-b', type=int, default=32)
    parser.add_argument('--input-size', type=int, nargs='+', default=[224], help='side, or height width')
    parser.add_argument('--mode', choices=['train', 'inference'], default='train')
    parser.add_argument('--dtype', default='fp32', metavar='DTYPE[,DTYPE]',
                        help='fp32, or autocast to bf16 / fp16 (fp16 on GPU only); a comma list (fp32,bf16) steps '
                             'every model in each dtype in turn, interleaved, and prints the speed-up of each '
                             'dtype over the first (one model and --compare); default fp32')
    parser.add_argument('--fast-path', action=argparse.BooleanOptionalAction, default=True,
                        help='the fast path (default); --no-fast-path runs the plain path, the reference math')
    parser.add_argument('--channels-last', action='store_true')
    parser.add_argument('--grad-checkpointing', action='store_true',
                        help="timm's set_grad_checkpointing(True) on every model that supports it (less memory, "
                             'more time per training step); the output names the models that do not')
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    timing.add_machine_args(parser)
    timing.add_step_count_args(parser)
    parser.add_argument('--gemm-size', type=int, default=None,
                        help='side of the reference GEMM (default 2048 on CPU, 8192 on GPU)')
    timing.add_json_arg(parser)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    """The flags of --compare."""
    parser.add_argument('--compare', type=lambda s: [n for n in s.split(',') if n], default=None,
                        metavar='MODEL,MODEL',
                        help='timm models to step interleaved with --model (e.g. convnext_nano,pvt_v2_b1)')
    parser.add_argument('--sizes', type=int, nargs='+', default=None, metavar='SIDE',
                        help='with --compare: one comparison per square input size (e.g. 224 512 1024), then a '
                             'table of img/s and peak memory per size')
    parser.add_argument('--modes', nargs='+', choices=['inference', 'train'], default=['inference', 'train'],
                        help='modes timed by --compare')


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(description=__doc__, epilog=PEAK_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(parser)
    add_compare_args(parser)
    moved = moved_command(sys.argv[1:] if argv is None else argv)
    if moved:
        parser.exit(2, moved + '\n')
    args = parser.parse_args(argv)
    timing.default_warmup(args)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that do not fit together or name unknown things: argparse's error (exit 2). Sets ``args.dtypes``
    (the --dtype list) and ``args.dtype`` (its first)."""
    args.dtypes = timing.dtype_list(parser, args.dtype)
    args.dtype = args.dtypes[0]
    timing.check_variants(parser, [args.model], '--model')
    timing.check_timm_models(parser, args.compare)
    if args.sizes and not args.compare:
        parser.error('--sizes needs --compare MODEL,MODEL (it sweeps the comparison over input sizes)')
    if len(args.input_size) not in (1, 2):
        parser.error('--input-size takes one side or height and width')
    timing.check_fp16(parser, args.dtypes, args.device)


def main(argv: Sequence[str] | None = None) -> dict | list[dict]:
    args = parse_args(argv)
    timing.setup_machine(args)
    if args.compare and args.sizes:
        results = compare_sizes(args)
        print_size_table(results)
    elif args.compare:
        results = compare(args)
        print_compare(results)
    else:
        results = benchmark_model(args)
        print_results(results)
    timing.write_jsonl(args.json, results)
    return results[0] if len(results) == 1 and not args.compare else results

if __name__ == '__main__':
    main()
