"""Parameters and fvcore FLOPs of every NaLaFormer variant, next to the paper's figures.

    python tools/flops.py                       # all variants at 224x224
    python tools/flops.py --model NALAFORMER_T --input-size 384

FLOPs are fvcore's default count (one multiply-add = one FLOP) of matmul, linear, conv, einsum and
norm layers, measured on the model in eval mode with batch 1, as the reference figures are
(``models.flop_count.count_flops``).
"""
import argparse
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import timm

import models  # noqa: F401  (registers the variants)
from models import PAPER_FIGURES, VARIANTS
from models.flop_count import count_flops, count_params  # count_* re-exported for tools
from run.errors import FlagParser, unknown_model

# (title, width) of each column; every value is right-aligned under the right end of its title
COLUMNS = (('model', 15), ('params (M)', 12), ('GFLOPs', 10), ('paper params (M)', 19), ('paper GFLOPs', 14),
           ('paper top-1', 13))


def header() -> str:
    """The table's title line."""
    return ''.join(f'{title:<{width}}' if i == 0 else f'{title:>{width}}' for i, (title, width) in enumerate(COLUMNS))


def format_row(name: str, params: int, flops: float, paper: tuple[float, float, float]) -> str:
    """One variant's line: our params and GFLOPs, then the paper's params, GFLOPs and top-1, each in its column."""
    values = (name, f'{params / 1e6:.2f}', f'{flops / 1e9:.3f}', *(str(v) for v in paper))
    return ''.join(f'{v:<{w}}' if i == 0 else f'{v:>{w}}' for i, (v, (_, w)) in enumerate(zip(values, COLUMNS)))


def main(argv: Sequence[str] = None) -> None:
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', nargs='*', default=list(VARIANTS),
                        help='variants to count (default: all five)')
    parser.add_argument('--input-size', type=int, nargs='+', default=[224],
                        help='input side, or height and width (default 224)')
    parser.add_argument('--num-classes', type=int, default=1000)
    args = parser.parse_args(argv)
    if len(args.input_size) not in (1, 2) or min(args.input_size) < 32:
        parser.error(f'--input-size takes one side or height and width, each >= 32; got {args.input_size}')
    height, width = (args.input_size * 2)[:2]
    unknown = [m for m in args.model if m.upper() not in VARIANTS]
    if unknown:
        parser.error('--model: ' + unknown_model(unknown[0], VARIANTS))

    print(f'input 3x{height}x{width}, batch 1, eval mode, fvcore multiply-adds')
    print(header())
    for name in args.model:
        model = timm.create_model(name.upper(), num_classes=args.num_classes)
        params, flops = count_params(model), count_flops(model, (3, height, width))
        print(format_row(name, params, flops, PAPER_FIGURES[name.upper()]))

if __name__ == '__main__':
    main()
