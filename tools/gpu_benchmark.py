"""The GPU comparison in one command of a few minutes: training and inference img/s and peak memory of T and
XT (fast path, plain path, compiled) against the models users would pick instead, main.py's whole training
step against forward + backward with its host syncs, and the data loader against the step.

    python tools/gpu_benchmark.py --json docs/results/gpu_preset_DATE.jsonl    # one H100 or H200
    python tools/gpu_benchmark.py --compare convnext_tiny,pvt_v2_b2 --preset-models NALAFORMER_T --budget 600
    python tools/gpu_benchmark.py --device cpu --dtype fp32 --input-size 32 -b 2 --steps 1 --warmup 0 \\
        --preset-models NALAFORMER_XT --compare convnext_atto --preset-eager-only --loader-images 4 --data-workers 0

Each part prints its line as it finishes, then all of them as Markdown tables: every model eager (ours on
the fast and the plain path; ``--compare`` replaces the peers), main.py's step
(``engine.train_one_epoch``: OptimizerStep with main.py's optimizer, the EMA update, the step's host read)
against forward + backward alone, with the host syncs per step on CUDA; main.py's training loader (its
uint8 worker transform) on JPEGs of real photos against the step (workers per GPU); then the compiled
models while ``--budget`` seconds last. Peak memory is that of one step above what was live before it
(``tools/benchmark.py``'s measure). bf16, batch 128 (64 on a CPU), 224² by default.
"""
import argparse
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import engine
from models import VARIANTS
from run.errors import FlagParser
from tools import timing
from tools.synthetic import make_photo_jpegs
from training.optim import ModelEma
from training.step import OptimizerStep, amp_dtype, autocast

GPU_OURS = ('NALAFORMER_T', 'NALAFORMER_XT')
GPU_PEERS = ('convnext_tiny', 'swin_tiny_patch4_window7_224', 'pvt_v2_b2', 'efficientformerv2_s1')


class BatchList(list):
    """Batches that engine.train_one_epoch takes as a data loader."""

    def __init__(self, batches: list, batch_size: int) -> None:
        super().__init__(batches)
        self.batch_size = batch_size


def preset_model_row(name: str, label: str, x: torch.Tensor, target: torch.Tensor, args: argparse.Namespace, *,
                     fast_path: bool = True, compile_model: bool = False) -> dict:
    """Training and inference img/s and peak step memory of one model (``make_step``: main.py's optimizer
    step; a no-grad eval forward), with the time of the warm-up steps (which compile, with --compile)."""
    device, dtype = torch.device(args.device), timing.DTYPES[args.dtype]
    torch.manual_seed(0)
    model = timing.create_any(name, device, fast_path, x.shape[-2:])
    row = dict(part='model', model=label, name=name, fast_path=fast_path if name.upper() in VARIANTS else None,
               compile=compile_model, dtype=args.dtype, batch_size=x.shape[0], input_size=list(x.shape[-2:]),
               device=str(device), params_m=sum(p.numel() for p in model.parameters()) / 1e6)
    for mode in ('train', 'inference'):
        step = timing.make_step(model, x, target, mode, dtype, device, compile_model=compile_model)[0]
        start = time.perf_counter()
        for _ in range(max(args.warmup, 1 if compile_model else 0)):
            step()
        timing.synchronize(device)
        row[f'{mode}_warmup_s'] = time.perf_counter() - start
        row[f'{mode}_img_s'] = x.shape[0] / statistics.median(timing.time_call(step, device, args.steps, 0))
        row[f'{mode}_peak_mib'] = timing.peak_bytes(step, device) / 2 ** 20
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
    from training.optim import OptimizerSettings, build_optimizer
    device, dtype = torch.device(args.device), timing.DTYPES[args.dtype]
    torch.manual_seed(0)
    model = timing.create_any(name, device, True, x.shape[-2:]).train()
    cross_entropy = nn.CrossEntropyLoss()

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        with autocast(device, amp_dtype(args.dtype)):
            loss = cross_entropy(model(x), target)
        loss.backward()
    bare_s = statistics.median(timing.time_call(bare, device, args.steps, args.warmup))
    optimizer = build_optimizer(model, settings(OptimizerSettings, get_args_parser().parse_args(['--model', name])))
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    step = OptimizerStep(optimizer, device, amp_dtype(args.dtype), scaler)
    ema = ModelEma(model, decay=0.9999)

    def epoch(n: int) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # the epoch's progress lines
            engine.train_one_epoch(model, lambda s, o, t: cross_entropy(o, t), BatchList([(x, target)] * n, len(x)),
                                   step, 0, engine.TrainSettings(print_freq=10 ** 9), model_ema=ema)
    epoch(max(args.warmup, 1))
    n = max(4 * args.steps, 1)
    engine_s = timing.time_call(lambda: epoch(n), device, 1, 0)[0] / n
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

    from run.process import available_cpus
    workers = (args.data_workers or [available_cpus()])[0]
    with tempfile.TemporaryDirectory(prefix='nalaformer-photos-') as root:
        make_photo_jpegs(root, count=args.loader_images)
        dataset = ImageFolder(root, transform=timing.recipe_train_transform(args.input_size[0], uint8=True))
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
    print(f'tools/gpu_benchmark.py: {args.dtype}, batch {args.batch_size}, {height}x{width}, device {device}'
          + (f' ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else '')
          + f', budget {args.budget:.0f} s', flush=True)
    rows = []
    for name in ours:
        rows.append(preset_model_row(name, name, x, target, args))
        rows.append(preset_model_row(name, f'{name} (plain path)', x, target, args, fast_path=False))
    rows += [preset_model_row(name, name, x, target, args) for name in peers]
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
            row = preset_model_row(name, name, x, target, args, compile_model=True)
            slowest = max(slowest, row['train_warmup_s'] + row['inference_warmup_s'])
            rows.append(row)
    print(f'tools/gpu_benchmark.py took {time.perf_counter() - start:.0f} s')
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog='tools/gpu_benchmark.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--preset-models', nargs='+', default=None, help='our variants (default: T and XT)')
    parser.add_argument('--compare', type=lambda s: [n for n in s.split(',') if n], default=None,
                        metavar='MODEL,MODEL', help=f'timm models to compare against (default {",".join(GPU_PEERS)})')
    parser.add_argument('--batch-size', '-b', type=int, default=None, help='default 128 on a GPU, 64 on a CPU')
    parser.add_argument('--input-size', type=int, nargs='+', default=[224], help='side, or height width')
    parser.add_argument('--dtype', default=None, help='fp32, or autocast to bf16 / fp16 (fp16 on GPU only); '
                                                      'default bf16')
    parser.add_argument('--budget', type=float, default=330.0,
                        help='seconds the whole program may take; compiled rows that would not fit are skipped '
                             '(default 330)')
    parser.add_argument('--preset-eager-only', action='store_true', help='without the compiled rows')
    parser.add_argument('--loader-images', type=int, default=256,
                        help='photo JPEGs the loader part writes and reads (default 256)')
    parser.add_argument('--data-workers', type=int, nargs='+', default=None,
                        help="the loader's workers (default: every CPU available)")
    timing.add_machine_args(parser)
    timing.add_step_count_args(parser)
    timing.add_json_arg(parser)
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size or (128 if args.device.startswith('cuda') else 64)
    timing.one_dtype(parser, args, 'bf16')
    timing.default_warmup(args)
    timing.check_variants(parser, args.preset_models, '--preset-models')
    timing.check_timm_models(parser, args.compare)
    if len(args.input_size) not in (1, 2):
        parser.error('--input-size takes one side or height and width')
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    timing.setup_machine(args)
    results = gpu_preset(args)
    print_gpu_tables(results)
    timing.write_jsonl(args.json, results)
    return results


if __name__ == '__main__':
    main()
