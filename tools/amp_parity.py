"""Fast path against plain path under autocast: one block per stage of a variant, with the variant's
own widths, heads and layer scale.

Under autocast both paths follow one precision policy (docs/method.md#precision: the branches, the
attention frame included, compute in the autocast dtype with float32 kept for the NaLa feature maps, the
normaliser and LayerNorm's statistics), but they round different intermediate values, so they cannot
agree bit for bit. The rule they follow: the residual stream stays fp32 on both paths, and the fast path
may differ from the plain path by no more than the plain path itself differs from fp32
(tests/test_precision.py applies the same rule to the gradients). ``amp_path_parity`` measures that
on any device and dtype; the tests run it on the CPU with bfloat16 and float16, a GPU check can run it
with both.
"""
import contextlib

import torch

from models.nala import RoPE
from models.nalaformer import VARIANTS, NaLaBlock, NaLaFormer, set_fast_path

__all__ = ['amp_path_parity', 'AMP_TOLERANCE']

#: ``fast_vs_plain`` may exceed ``plain_vs_fp32`` by this factor: where the branches are small (layer
#: scale 1e-6) the fast path is fp32 up to rounding and the two errors are equal to a few digits.
AMP_TOLERANCE = 1.1


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _run(block: NaLaBlock, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, fast: bool,
         dtype: torch.dtype | None) -> dict[str, object]:
    """The block's output and the dtypes of its residual stream after each CPE (what norm1 and norm2
    read), under ``dtype`` autocast (None: fp32)."""
    set_fast_path(block, fast)
    seen = []
    hooks = [norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
             for norm in (block.norm1, block.norm2)]
    try:
        amp = contextlib.nullcontext() if dtype is None else torch.autocast(x.device.type, dtype=dtype)
        with torch.no_grad(), amp:
            out = block(x, sin, cos)
    finally:
        for hook in hooks:
            hook.remove()
    return dict(out=out, stream_dtypes=seen)


def amp_path_parity(variant: str, device: str | torch.device = 'cpu', dtype: torch.dtype = torch.bfloat16,
                    size: int = 14, batch: int = 2, seed: int = 0) -> list[dict[str, object]]:
    """For each stage of ``variant`` (e.g. 'NALAFORMER_B'), one freshly initialised block on a
    (batch, C, size, size) fp32 input under ``dtype`` autocast on ``device``.

    Returns one row per stage: ``fast_vs_plain`` and ``plain_vs_fp32`` (relative Frobenius errors of
    the block's output), ``stream_dtypes`` (the residual stream's dtypes after the CPEs, fast and
    plain path) and ``ok``: the stream is fp32 on both paths and
    ``fast_vs_plain <= AMP_TOLERANCE * plain_vs_fp32``.
    """
    arch = VARIANTS[variant.upper()]
    device = torch.device(device)
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for stage, (dim, heads) in enumerate(zip(arch['embed_dims'], arch['num_heads'])):
            block = NaLaBlock(dim, heads, arch['mlp_ratio'], linear=stage < 2,
                              layer_scale_init=arch['layer_scale_init'][stage])
            block.apply(NaLaFormer._init_weights)
            block = block.to(device).eval()
            x = torch.randn(batch, dim, size, size).to(device).contiguous(memory_format=torch.channels_last)
            sin, cos = (t.to(device) for t in RoPE(dim, heads)((size, size)))
            ref = _run(block, x, sin, cos, fast=False, dtype=None)['out']
            plain = _run(block, x, sin, cos, fast=False, dtype=dtype)
            fast = _run(block, x, sin, cos, fast=True, dtype=dtype)
            fast_vs_plain, plain_vs_fp32 = _rel_err(fast['out'], plain['out']), _rel_err(plain['out'], ref)
            dtypes = fast['stream_dtypes'] + plain['stream_dtypes']
            rows.append(dict(variant=variant, stage=stage, layer_scale=arch['layer_scale_init'][stage],
                             dtype=str(dtype).replace('torch.', ''), fast_vs_plain=fast_vs_plain,
                             plain_vs_fp32=plain_vs_fp32, stream_dtypes=[str(d).replace('torch.', '') for d in dtypes],
                             ok=all(d == torch.float32 for d in dtypes)
                             and fast_vs_plain <= AMP_TOLERANCE * plain_vs_fp32))
    return rows

