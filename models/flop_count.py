"""Parameters and fvcore FLOPs of a model, the convention of the reference figures.

FLOPs are fvcore's default count (one multiply-add = one FLOP) of matmul, linear, conv, einsum and
norm layers, on the model in eval mode with batch 1. fvcore traces the model with torch.jit.trace,
under which NaLaFormer takes its plain path (``models.ops.use_plain_ops``), so a plain
``FlopCountAnalysis(model, x)`` gives the same totals as ``count_flops``, without custom handles.
"""
import logging
import warnings
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ['count_params', 'count_flops']


def count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def count_flops(model: nn.Module, input_size: int | Sequence[int] = 224) -> int:
    """fvcore FLOPs (multiply-adds) of one forward pass at batch 1, with the model in eval mode.

    ``input_size``: a side, (H, W) or (C, H, W); C defaults to 3. The model's mode and the global
    random stream are left as they were.
    """
    size = (input_size,) * 2 if isinstance(input_size, int) else tuple(input_size)
    if len(size) == 2:
        size = (3, *size)
    with warnings.catch_warnings():  # fvcore's import scripts a loss with the deprecated torch.jit
        warnings.simplefilter('ignore')
        from fvcore.nn import FlopCountAnalysis
    logging.getLogger('fvcore').setLevel(logging.ERROR)
    param = next(model.parameters())
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter('ignore')  # tracer warnings about shapes used as Python numbers
            x = torch.zeros(1, *size, device=param.device, dtype=param.dtype)
            analysis = FlopCountAnalysis(model, x)
            analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            return int(analysis.total())
    finally:
        model.train(was_training)
