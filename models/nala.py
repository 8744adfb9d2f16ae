"""Norm×Direction linear attention (NaLa), the softmax attention of the late stages, and 2-D RoPE.

This module holds all attention math of NaLaFormer (SPEC sections 2-4). The function
``nala_attention_plain`` follows the reference implementation's order of operations step by step
and is the oracle every faster implementation is tested against. Implementations are chosen by
name through ``NALA_IMPLS``; they all take and return the same tensors.
"""
from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    'RoPE', 'rotate_every_two', 'apply_rope', 'nala_attention_plain', 'softmax_attention_plain',
    'NALA_IMPLS', 'GatedAttention', 'NaLaAttention', 'SoftmaxAttention', 'nala_kernel_terms',
]

NALA_EPS = 1e-6  # added to the normaliser, as in the reference


class RoPE(nn.Module):
    """2-D rotary position embedding tables for one stage (SPEC section 4).

    ``angle`` (length d/2) is a persistent buffer because the reference checkpoints carry it.
    ``forward((H, W))`` returns ``sin, cos`` of shape (H*W, d), rebuilt for the actual size, so any
    input resolution works.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        head_dim = dim // num_heads
        if head_dim * num_heads != dim or head_dim % 4:
            raise ValueError(f'RoPE needs dim divisible by num_heads and a head dim divisible by 4, '
                             f'got dim={dim}, num_heads={num_heads}')
        freqs = 1.0 / (10000 ** torch.linspace(0, 1, head_dim // 4))
        self.register_buffer('angle', freqs.repeat_interleave(2))

    def forward(self, hw: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
        height, width = hw
        angle = self.angle.float()
        rows = torch.arange(height, device=angle.device, dtype=torch.float32)
        cols = torch.arange(width, device=angle.device, dtype=torch.float32)
        theta_h = (rows[:, None] * angle[None, :])[:, None, :].expand(height, width, -1)
        theta_w = (cols[:, None] * angle[None, :])[None, :, :].expand(height, width, -1)
        theta = torch.cat([theta_h, theta_w], dim=-1).reshape(height * width, -1)
        return theta.sin(), theta.cos()


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """Map each channel pair (x_2i, x_2i+1) to (-x_2i+1, x_2i)."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """R(x) = x * cos(theta) + rot(x) * sin(theta); tables broadcast over leading dims."""
    return x * cos + rotate_every_two(x) * sin


def _safe_norm_divisor(norm: torch.Tensor) -> torch.Tensor:
    """The query norm with exact zeros replaced by 1: identical for every non-zero query, and a
    zero query then maps to the zero direction instead of 0/0."""
    return torch.where(norm > 0, norm, torch.ones_like(norm))


def nala_kernel_terms(q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Steps 4-7 of SPEC section 2: the 2d-wide features Q = [phi+; phi-] and K = [k+; k-].

    q, k: (..., N, d) float32. Shared by the plain path and the analysis tools, so that the
    attention a tool inspects is the attention the model computes.
    """
    k = k ** 3                                           # step 4: cube the keys
    k_pos, k_neg = F.relu(k), F.relu(-k)
    q_norm = q.norm(dim=-1, keepdim=True)                # step 5: query norm n
    power = 3 * (0.5 + torch.tanh(q_norm))               # step 6: p in [1.5, 4.5)
    q_dir = q / _safe_norm_divisor(q_norm)
    q_pos = F.relu(q_dir) ** power
    q_neg = F.relu(-q_dir) ** power
    return torch.cat([q_pos, q_neg], dim=-1), torch.cat([k_pos, k_neg], dim=-1)  # step 7


def nala_attention_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """NaLa core, steps 4-9 of SPEC section 2, in the reference's order of operations.

    q, k, v: (B, h, N, d) float32; sin, cos: (N, d). Returns (B, h, N, d). Linear in N: the N x N
    attention matrix is never formed.
    """
    n_tokens, head_dim = q.shape[-2], q.shape[-1]
    q_feat, k_feat = nala_kernel_terms(q, k)
    # step 8: RoPE on each d-wide half of the numerator features, with the same tables
    q_rope = torch.cat([apply_rope(q_feat[..., :head_dim], sin, cos),
                        apply_rope(q_feat[..., head_dim:], sin, cos)], dim=-1)
    k_rope = torch.cat([apply_rope(k_feat[..., :head_dim], sin, cos),
                        apply_rope(k_feat[..., head_dim:], sin, cos)], dim=-1)
    # step 9: normaliser from the un-rotated features, numerator as Q~ ((K~^T N^-1/2)(V N^-1/2))
    z = 1 / (q_feat @ k_feat.mean(dim=-2, keepdim=True).transpose(-2, -1) + NALA_EPS)
    scale = n_tokens ** -0.5
    kv = (k_rope.transpose(-2, -1) * scale) @ (v * scale)
    return (q_rope @ kv) * z


def softmax_attention_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Softmax attention of stages 3-4 (SPEC section 3): RoPE on q and k, softmax(q k^T / sqrt(d)) v."""
    q = apply_rope(q, sin, cos)
    k = apply_rope(k, sin, cos)
    attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return attn.softmax(dim=-1) @ v


AttnCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: NaLa core implementations by name; every entry computes the same numbers as ``'plain'``.
NALA_IMPLS: Dict[str, AttnCore] = {'plain': nala_attention_plain}


class GatedAttention(nn.Module):
    """Parameters and the shared frame of both attention kinds (SPEC sections 2.1-2.3 and 2.10).

    x (B, C, H, W) -> tokens -> [q|k|v|g] = qkvg(x) -> lepe = DWConv5x5(v) -> core(q, k, v) per head
    -> y = LN(o + lepe) * SiLU(g) -> out_proj -> (B, C, H, W). Subclasses choose the core.
    The part between qkvg and out_proj runs in float32, also under autocast.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkvg = nn.Linear(dim, 4 * dim)
        self.lepe = nn.Conv2d(dim, dim, 5, padding=2, groups=dim)
        self.out_proj = nn.Linear(dim, dim)
        self.ln = nn.LayerNorm(dim)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        tokens = x.flatten(2).transpose(1, 2)                                   # (B, N, C)
        qkvg = self.qkvg(tokens)
        with torch.autocast(device_type=x.device.type, enabled=False):
            q, k, v, g = qkvg.float().chunk(4, dim=-1)
            v_map = v.transpose(1, 2).reshape(batch, channels, height, width)
            lepe = F.conv2d(v_map, self.lepe.weight.float(), self.lepe.bias.float(),
                            padding=2, groups=channels).flatten(2).transpose(1, 2)
            heads = [t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) for t in (q, k, v)]
            o = self.core(*heads, sin, cos).transpose(1, 2).flatten(2)            # (B, N, C)
            y = F.layer_norm(o + lepe, (channels,), self.ln.weight.float(), self.ln.bias.float(),
                             self.ln.eps) * F.silu(g)
        out = self.out_proj(y.to(qkvg.dtype))
        return out.transpose(1, 2).reshape(batch, channels, height, width)


class NaLaAttention(GatedAttention):
    """Norm×direction linear attention (stages 1-2). ``attn_impl`` names an entry of ``NALA_IMPLS``."""

    def __init__(self, dim: int, num_heads: int, attn_impl: str = 'plain') -> None:
        super().__init__(dim, num_heads)
        self.attn_impl = attn_impl

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, name: str) -> None:
        if name not in NALA_IMPLS:
            raise ValueError(f'unknown attn_impl {name!r}; choose one of {sorted(NALA_IMPLS)}')
        self._attn_impl = name

    def core(self, q, k, v, sin, cos):
        return NALA_IMPLS[self._attn_impl](q, k, v, sin, cos)


class SoftmaxAttention(GatedAttention):
    """Softmax attention with RoPE (stages 3-4), same parameters and frame as NaLa."""

    def core(self, q, k, v, sin, cos):
        return softmax_attention_plain(q, k, v, sin, cos)
