"""Eval-mode img/s of every NaLaFormer variant at 224/384/512, as vision papers report throughput.

    python tools/paper_throughput.py                          # GPU: batch 128, fp16 autocast; CPU: batch 64, fp32
    python tools/paper_throughput.py --device cuda --dtype bf16
    python tools/paper_throughput.py --preset-models NALAFORMER_XT NALAFORMER_T --preset-sizes 224 --threads 2
    python tools/paper_throughput.py --tiny                   # XT and T at 32/48 px, batch 2, one step: a smoke test

Each variant is built once (untrained; the speed does not depend on the weights) and steps a no-grad forward
in eval mode at each size: warm-up steps, then the median of the timed steps, printed as each finishes and
then as one Markdown table with the parameters. The machine flags (--threads, --cpu-malloc, --tf32) are those
of ``tools/benchmark.py``.
"""
import argparse
import os
import statistics
import sys
from typing import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from models import VARIANTS
from run.errors import FlagParser
from tools import timing

PAPER_SIZES = (224, 384, 512)
TINY_PRESET = dict(models=['NALAFORMER_XT', 'NALAFORMER_T'], sizes=(32, 48), batch_size=2, warmup=1, steps=1)


def paper_preset(args: argparse.Namespace) -> list[dict]:
    """Inference img/s of each variant at each size: eval mode, no grad, autocast on a GPU (fp16 unless
    --dtype bf16), fp32 on a CPU, warm-up steps then the median of the timed steps."""
    device = torch.device(args.device)
    dtype = timing.DTYPES[args.dtype]
    names = args.preset_models or list(VARIANTS)
    sizes = args.preset_sizes or PAPER_SIZES
    results = []
    for name in names:
        model = timing.create_any(name, device, args.fast_path)
        params = sum(p.numel() for p in model.parameters())
        for size in sizes:
            torch.manual_seed(0)
            x = torch.randn(args.batch_size, 3, size, size, device=device)
            step = timing.make_step(model, x, None, 'inference', dtype, device, compile_model=args.compile)[0]
            times = timing.time_call(step, device, args.steps, args.warmup)
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog='tools/paper_throughput.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--preset-models', nargs='+', default=None, help='variants (default: all)')
    parser.add_argument('--preset-sizes', type=int, nargs='+', default=None,
                        help=f'input sides (default {" ".join(map(str, PAPER_SIZES))})')
    parser.add_argument('--tiny', action='store_true',
                        help='a tiny size (XT and T, 32/48 px, batch 2, one step): a smoke test')
    parser.add_argument('--batch-size', '-b', type=int, default=None, help='default 128 on a GPU, 64 on a CPU')
    parser.add_argument('--dtype', default=None,
                        help='fp32, or autocast to bf16 / fp16 (fp16 on GPU only); default fp16 on a GPU, fp32 on '
                             'a CPU')
    parser.add_argument('--fast-path', action=argparse.BooleanOptionalAction, default=True,
                        help='the fast path (default); --no-fast-path runs the plain path, the reference math')
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    timing.add_machine_args(parser)
    timing.add_step_count_args(parser)
    timing.add_json_arg(parser)
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith('cuda')
    if args.tiny:
        for key, value in TINY_PRESET.items():
            setattr(args, 'preset_' + key if key in ('models', 'sizes') else key, value)
    args.batch_size = args.batch_size or (128 if on_gpu else 64)
    timing.one_dtype(parser, args, 'fp16' if on_gpu else 'fp32')
    timing.default_warmup(args)
    timing.check_variants(parser, args.preset_models, '--preset-models')
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    timing.setup_machine(args)
    results = paper_preset(args)
    print_paper_table(results)
    timing.write_jsonl(args.json, results)
    return results


if __name__ == '__main__':
    main()
