"""Parameters and fvcore FLOPs of every NaLaFormer variant, next to the paper's figures.

    python tools/flops.py                       # all variants at 224x224
    python tools/flops.py --model NALAFORMER_T --input-size 384

FLOPs are fvcore's default count (one multiply-add = one FLOP) of matmul, linear, conv, einsum and
norm layers, measured on the model in eval mode with batch 1, as the reference figures are.
"""
import argparse
import logging
import os
import sys
import warnings
from math import prod
from typing import List, Sequence, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import timm  # noqa: E402
import models  # noqa: E402,F401  (registers the variants)
from models import PAPER_FIGURES, VARIANTS  # noqa: E402


def count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _shape(value) -> List[int]:
    return value.type().sizes()


def nala_fast_flop_jit(inputs, outputs) -> int:
    """``NaLaFastFunction`` (q, k, v (B, h, N, d), table): the multiply-adds of the plain path's three
    products, Q.mean(K) (N x 2d x 1), R(K)^T V (2d x N x d) and R(Q) (K^T V) (N x 2d x d), per head."""
    batch, heads, tokens, head_dim = _shape(inputs[0])
    return batch * heads * tokens * 2 * head_dim * (1 + 2 * head_dim)


def sdpa_flop_jit(inputs, outputs) -> int:
    """``scaled_dot_product_attention``: q k^T and attn v, as fvcore counts the two matmuls."""
    *lead, tokens, head_dim = _shape(inputs[0])
    keys, value_dim = _shape(inputs[2])[-2:]
    return int(prod(lead)) * tokens * keys * (head_dim + value_dim)


def depthwise_conv_flop_jit(inputs, outputs) -> int:
    """``nalaformer::depthwise_conv_same`` (x, weight (C, 1, kh, kw), bias): as fvcore counts a conv."""
    return int(prod(_shape(outputs[0]))) * int(prod(_shape(inputs[1])[1:]))


#: Handles for the fast path's ops that fvcore cannot see into, so that its totals equal the plain path's.
FAST_PATH_HANDLES = {
    'prim::PythonOp.NaLaFastFunction': nala_fast_flop_jit,
    'aten::scaled_dot_product_attention': sdpa_flop_jit,
    'nalaformer::depthwise_conv_same': depthwise_conv_flop_jit,
}


def count_flops(model: nn.Module, input_size: Tuple[int, int, int] = (3, 224, 224)) -> int:
    """fvcore FLOPs (multiply-adds) of one forward pass at batch 1, with the model in eval mode."""
    with warnings.catch_warnings():  # fvcore's own import scripts a loss with the deprecated torch.jit
        warnings.simplefilter('ignore', FutureWarning)
        from fvcore.nn import FlopCountAnalysis
    was_training = model.training
    model.eval()
    param = next(model.parameters())
    x = torch.zeros(1, *input_size, device=param.device, dtype=param.dtype)
    logging.getLogger('fvcore').setLevel(logging.ERROR)
    with torch.no_grad():
        analysis = FlopCountAnalysis(model, x)
        analysis.set_op_handle(**FAST_PATH_HANDLES)
        analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        total = analysis.total()
    model.train(was_training)
    return int(total)


def main(argv: Sequence[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        parser.error(f'unknown model {unknown}; choose from {list(VARIANTS)}')

    print(f'input 3x{height}x{width}, batch 1, eval mode, fvcore multiply-adds')
    print(f"{'model':<15}{'params (M)':>12}{'GFLOPs':>10}   {'paper params / FLOPs / top-1':>30}")
    for name in args.model:
        model = timm.create_model(name.upper(), num_classes=args.num_classes)
        params, flops = count_params(model), count_flops(model, (3, height, width))
        p_params, p_flops, p_top1 = PAPER_FIGURES[name.upper()]
        print(f'{name:<15}{params / 1e6:>12.2f}{flops / 1e9:>10.3f}   '
              f'{f"{p_params}M / {p_flops}G / {p_top1}":>30}')


if __name__ == '__main__':
    main()
