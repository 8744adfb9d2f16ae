"""One NaLa block against one softmax block of the same width over input sizes: time and peak memory per token.

    python tools/block_sweep.py --model NALAFORMER_T --steps 2 --warmup 1 --out docs/results/sweep
    python tools/block_sweep.py --model NALAFORMER_XT --sweep-sizes 224 512 1024 --mode inference --dtype bf16

The blocks have the width and heads of the chosen stage of the chosen variant (``--sweep-stage``, default
stage 2; batch 1); each input size gives ``size / stride`` tokens a side. Every point is stepped until its
steps took ``--sweep-min-seconds``, and the fastest step is kept (the best estimate of the block's own cost on
a machine shared with other processes); peak memory is that of one more step above what was live before it.
On the fast path the plain softmax block, which forms the N x N matrix, is added (up to
``--sweep-plain-max`` px). Writes time (fastest step) and peak memory per token to ``OUT.json`` and
``OUT.png``.
"""
import argparse
import json
import os
import sys
from typing import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

from models import VARIANTS
from run.errors import FlagParser
from tools import timing
from training.step import amp_dtype, autocast


def sweep(args: argparse.Namespace) -> dict:
    """Time per token and peak memory per token of each block at each of ``--sweep-sizes``."""
    from models.nala import RoPE
    from models.nalaformer import NaLaBlock, set_fast_path
    device = torch.device(args.device)
    amp = amp_dtype(args.dtype)
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
                    with autocast(device, amp):
                        out = block(x, sin, cos)
                    out.float().sum().backward()
                else:
                    block.eval()
                    with torch.no_grad(), autocast(device, amp):
                        block(x, sin, cos)
            # small sizes take milliseconds: repeat them for >= 1 s and keep the fastest step, the
            # best estimate of the block's own cost on a machine shared with other processes
            times = timing.time_call(step, device, args.steps, args.warmup)
            while sum(times) < args.sweep_min_seconds and len(times) < 200:
                times += timing.time_call(step, device, args.steps, 0)
            peak = timing.peak_bytes(step, device)
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog='tools/block_sweep.py', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='NALAFORMER_T', help='the variant whose stage width the blocks take')
    parser.add_argument('--batch-size', '-b', type=int, default=1)
    parser.add_argument('--mode', choices=['train', 'inference'], default='train')
    parser.add_argument('--dtype', default='fp32', help='fp32, or autocast to bf16 / fp16 (fp16 on GPU only)')
    parser.add_argument('--fast-path', action=argparse.BooleanOptionalAction, default=True,
                        help='the fast path (default); --no-fast-path runs the plain path, the reference math')
    parser.add_argument('--sweep-sizes', type=int, nargs='+', default=[224, 320, 448, 512, 640, 768, 896, 1024])
    parser.add_argument('--sweep-stage', type=int, default=1, help='stage (0-based) whose width the blocks use')
    parser.add_argument('--sweep-min-seconds', type=float, default=1.0,
                        help='repeat each sweep point until its steps took this long')
    parser.add_argument('--sweep-plain-max', type=int, default=768,
                        help='largest size for the plain softmax curve (its N x N matrix grows fast)')
    parser.add_argument('--out', default='sweep', help='writes OUT.json and OUT.png')
    timing.add_machine_args(parser)
    timing.add_step_count_args(parser)
    args = parser.parse_args(argv)
    timing.one_dtype(parser, args, 'fp32')
    timing.default_warmup(args)
    timing.check_variants(parser, [args.model], '--model')
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    timing.setup_machine(args)
    results = sweep(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + '.json', 'w') as f:
        json.dump(results, f, indent=1)
    plot_sweep(results, args.out + '.png')
    print(f'wrote {args.out}.json and {args.out}.png')
    return results


if __name__ == '__main__':
    main()
