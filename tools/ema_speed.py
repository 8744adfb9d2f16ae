"""Milliseconds per EMA update: timm's ModelEmaV3 (two state dicts per update) against main.py's ema.ModelEma.

    OMP_NUM_THREADS=1 python tools/ema_speed.py --device cpu --threads 1 --steps 20 --warmup 3
    python tools/ema_speed.py --device cuda --preset-models NALAFORMER_T NALAFORMER_B

Per model (default XT and L, untrained): one update of each EMA per round, interleaved, the median over
``--steps`` rounds after ``--warmup``.
"""
import argparse
import os
import statistics
import sys
from typing import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from run.errors import FlagParser
from tools import timing
from training.optim import ModelEma

EMA_MODELS = ('NALAFORMER_XT', 'NALAFORMER_L')


def ema_update_times(args: argparse.Namespace) -> list[dict]:
    """ms per EMA update of each model (default XT and L) on ``args.device``: timm's ModelEmaV3 and main.py's
    ema.ModelEma, one update of each per round (interleaved), median over ``args.steps`` rounds after
    ``args.warmup``."""
    from timm.utils import ModelEmaV3
    device = torch.device(args.device)
    results = []
    for name in args.preset_models or EMA_MODELS:
        model = timing.create_any(name, device, args.fast_path)
        emas = {'timm ModelEmaV3': ModelEmaV3(model, decay=0.9999),
                'ema.ModelEma': ModelEma(model, decay=0.9999)}
        times: dict[str, list[float]] = {k: [] for k in emas}
        for i in range(args.warmup + args.steps):
            for label, ema in emas.items():
                t = timing.time_call(lambda ema=ema, model=model: ema.update(model), device, 1, warmup=0)[0]
                if i >= args.warmup:
                    times[label].append(t)
        row = dict(model=name, device=str(device), threads=torch.get_num_threads(),
                   tensors=len(model.state_dict()), params_m=sum(p.numel() for p in model.parameters()) / 1e6,
                   **{f'{label} ms': 1e3 * statistics.median(t) for label, t in times.items()})
        print(f"{name}: {row['tensors']} tensors, {row['params_m']:.1f} M parameters: "
              + ', '.join(f"{label} {row[f'{label} ms']:.2f} ms" for label in emas) + ' per update', flush=True)
        results.append(row)
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog='tools/ema_speed.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--preset-models', nargs='+', default=None,
                        help=f'variants (default {" ".join(EMA_MODELS)})')
    parser.add_argument('--fast-path', action=argparse.BooleanOptionalAction, default=True,
                        help='the fast path (default); --no-fast-path builds the plain path')
    timing.add_machine_args(parser, tf32=False, cpu_malloc=False)
    timing.add_step_count_args(parser)
    timing.add_json_arg(parser)
    args = parser.parse_args(argv)
    timing.default_warmup(args)
    timing.check_variants(parser, args.preset_models, '--preset-models')
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    timing.setup_machine(args)
    results = ema_update_times(args)
    timing.write_jsonl(args.json, results)
    return results


if __name__ == '__main__':
    main()
