"""Norm×Direction linear attention (NaLa), the softmax attention of the late stages, and 2-D RoPE.

This module holds all attention math of NaLaFormer (docs/method.md). The function
``nala_attention_plain`` follows the reference implementation's order of operations step by step
and is the oracle the fast path is tested against: ``nala_attention_fast`` takes and returns the
same tensors and computes the same numbers with fewer passes over memory and a hand-written backward
(see the notes above ``NaLaFastFunction`` for the algebra). The attention modules run the fast cores
unless their ``fast_path`` is off.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .compat import arange
from .ops import autocast_off, depthwise_conv_same, use_plain_ops

__all__ = [
    'RoPE', 'rotate_every_two', 'apply_rope', 'nala_attention_plain', 'softmax_attention_plain',
    'GatedAttention', 'NaLaAttention', 'SoftmaxAttention', 'nala_kernel_terms',
    'nala_attention_fast', 'softmax_attention_fast', 'rope_phases', 'rotate', 'rotate_real',
    'rotate_adjoint', 'NaLaFastFunction', 'lepe_fast',
]

NALA_EPS = 1e-6  # added to the normaliser, as in the reference


class RoPE(nn.Module):
    """2-D rotary position embedding tables for one stage (docs/method.md#rope).

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

    def forward(self, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        height, width = hw
        angle = self.angle.float()
        if torch.jit.is_scripting():
            rows = torch.arange(height, device=angle.device, dtype=torch.float32)
            cols = torch.arange(width, device=angle.device, dtype=torch.float32)
        else:  # an explicit else: TorchScript does not compile compat.arange (FX on older torch needs it)
            rows = arange(height, device=angle.device, dtype=torch.float32)
            cols = arange(width, device=angle.device, dtype=torch.float32)
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
    zero query then maps to the zero direction instead of 0/0. (A scalar 1, not ones_like: the legacy
    ONNX exporter would freeze ones_like's shape at the traced size.)"""
    return torch.where(norm > 0, norm, 1.0)


def nala_kernel_terms(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NaLa kernel (docs/method.md#nala-kernel): the 2d-wide features Q = [phi+; phi-] and K = [k+; k-].

    q, k: (..., N, d) float32. Shared by the plain path and the analysis tools, so that the
    attention a tool inspects is the attention the model computes.
    """
    k = k ** 3                                           # cube the keys
    k_pos, k_neg = F.relu(k), F.relu(-k)
    q_norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)  # query norm n
    power = 3 * (0.5 + torch.tanh(q_norm))               # p in [1.5, 4.5)
    q_dir = q / _safe_norm_divisor(q_norm)
    q_pos = F.relu(q_dir) ** power
    q_neg = F.relu(-q_dir) ** power
    return torch.cat([q_pos, q_neg], dim=-1), torch.cat([k_pos, k_neg], dim=-1)


def nala_attention_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         sin: torch.Tensor, cos: torch.Tensor, eps: float = NALA_EPS) -> torch.Tensor:
    """NaLa core (docs/method.md#nala-kernel to #normaliser-and-linear-time-order), in the reference's order
    of operations.

    q, k, v: (B, h, N, d) float32; sin, cos: (N, d). Returns (B, h, N, d). Linear in N: the N x N
    attention matrix is never formed. (``eps`` is an argument because TorchScript reads no globals.)
    """
    head_dim = q.shape[-1]
    q_feat, k_feat = nala_kernel_terms(q, k)
    # RoPE on each d-wide half of the numerator features, with the same tables
    q_rope = torch.cat([apply_rope(q_feat[..., :head_dim], sin, cos),
                        apply_rope(q_feat[..., head_dim:], sin, cos)], dim=-1)
    k_rope = torch.cat([apply_rope(k_feat[..., :head_dim], sin, cos),
                        apply_rope(k_feat[..., head_dim:], sin, cos)], dim=-1)
    # normaliser from the un-rotated features, numerator as Q~ ((K~^T N^-1/2)(V N^-1/2))
    z = 1 / (q_feat @ k_feat.mean(dim=-2, keepdim=True).transpose(-2, -1) + eps)
    # N^-1/2 from a sum over the token axis of q: the legacy ONNX exporter freezes N (and anything made
    # from it, ones_like included) at the traced size, and torch.export cannot serialise it as a float
    scale = (q[..., :1] * 0 + 1).sum(dim=-2, keepdim=True).rsqrt()           # (B, h, 1, 1)
    kv = (k_rope.transpose(-2, -1) * scale) @ (v * scale)
    return (q_rope @ kv) * z


def softmax_attention_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Softmax attention of stages 3-4 (docs/method.md#softmax-attention): RoPE on q and k,
    softmax(q k^T / sqrt(d)) v."""
    q = apply_rope(q, sin, cos)
    k = apply_rope(k, sin, cos)
    attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return attn.softmax(dim=-1) @ v


# ---- fast path ----------------------------------------------------------------------------------
# The same math as ``nala_attention_plain`` with fewer passes over memory. Two identities:
#
# 1. RoPE as a complex product. sin and cos are equal within each channel pair (the angle vector
#    repeats every frequency twice), so read as complex numbers x_2i + i x_2i+1, R multiplies every
#    pair by the phase e^(i theta) = cos + i sin, and its adjoint R^T multiplies by the conjugate
#    (real arithmetic under torch.compile, which has no complex code generation).
#    One vectorised pass over each 2d-wide feature map (the two d-wide halves share the tables, so
#    the phases are repeated twice along channels) replaces the slicing, stacking, pair swapping and
#    concatenation of the plain path's four rotary calls.
# 2. One power instead of two. With u = q / n and p the per-token exponent,
#        [ReLU(u)^p ; ReLU(-u)^p] = ReLU([b ; -b]),  b = sign(u) |u|^p = u * |u|^(p-1),
#    and the backward reuses |u|^(p-1) for dp/du. The power is exp((p-1) log|u|): vectorised exp and
#    log instead of a per-element pow with a tensor exponent (2.5x faster on the CPU), and log|u|
#    is the one dp/dn needs in the backward.
# The backward is written out (NaLaFastFunction) and saves Q, K (2d wide), u, log|u|, |u|^(p-1) and
# the un-normalised output: fewer tensors than autograd keeps for the plain graph, and no rotated copy
# (R(Q) and R(K) are recomputed, one pass each). q, k and v are made head-major first: every
# elementwise result inherits its input's layout, and the batched products need (B*h)-collapsible
# operands, or each of them copies its 2d-wide operand.
# Exact zeros: a zero query has n = 0, the divisor is guarded as in the plain path; where u = 0,
# log|u| = -inf gives |u|^(p-1) = exp(-inf) = 0 exactly (p - 1 >= 0.5), so b = 0 and every gradient
# term carries the factor |u|^(p-1) = 0; the saved log|u| is clamped to a finite value, so
# 0 * log 0 never appears.

_LOG_TINY = math.log(torch.finfo(torch.float32).tiny)


def rope_phases(sin: torch.Tensor, cos: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """(N, repeat*d/2, 2) table of (cos, sin), one row per channel pair (the real and imaginary part of
    its phase e^(i theta)), repeated ``repeat`` times along channels (2 for the 2d-wide NaLa features)."""
    return torch.stack([cos[:, ::2], sin[:, ::2]], dim=-1).repeat(1, repeat, 1)


def rotate_real(x: torch.Tensor, phases: torch.Tensor, conjugate: bool = False) -> torch.Tensor:
    """``rotate`` in real arithmetic: x * cos + swap(x) * (-sin, +sin, ...) with swap exchanging the
    two channels of each pair; sin negated for the adjoint. Several passes in eager mode, one fused
    kernel under torch.compile, which cannot generate code for complex tensors."""
    cos, sin = phases.unbind(-1)
    if conjugate:
        sin = -sin
    cos_full = torch.stack([cos, cos], dim=-1).flatten(-2)
    sin_signed = torch.stack([-sin, sin], dim=-1).flatten(-2)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos_full + swapped * sin_signed


def rotate(x: torch.Tensor, phases: torch.Tensor, conjugate: bool = False) -> torch.Tensor:
    """R(x), each channel pair times its phase from ``rope_phases``; equals ``apply_rope``. With
    ``conjugate`` it is R^T. Eager mode: one complex multiply (x float32 with unit stride along
    channels); under torch.compile: ``rotate_real``."""
    if torch.compiler.is_compiling():
        return rotate_real(x, phases, conjugate)
    phase = torch.view_as_complex(phases)
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * (phase.conj() if conjugate else phase)).flatten(-2)


def rotate_adjoint(grad: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """R^T(g) = g times the conjugate phases: the gradient of ``rotate`` w.r.t. its input."""
    return rotate(grad, phases, conjugate=True)


def _signs(x: torch.Tensor) -> torch.Tensor:
    """The column (1, -1) made on x's device by arange (1, then 1 - 2): no tensor from Python data,
    which on a GPU would be a host-to-device copy, twice per NaLa block and forward."""
    return torch.arange(1.0, -2.0, -2.0, dtype=x.dtype, device=x.device).unsqueeze(-1)


def _split_relu(x: torch.Tensor) -> torch.Tensor:
    """[ReLU(x) ; ReLU(-x)] along the last dim, in one multiply and one in-place clamp."""
    return (x.unsqueeze(-2) * _signs(x)).clamp_min_(0).flatten(-2)


class NaLaFastFunction(torch.autograd.Function):
    """NaLa core (docs/method.md#fast-path) with a hand-written backward; see the notes above.

    q, k, v: (B, h, N, d) float32 (any strides); phases: ``rope_phases(sin, cos, 2)``.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        n_tokens = q.shape[-2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()                 # head-major
        # keys: K = [ReLU(k^3) ; ReLU(-k^3)], R(K)^T V / N, and mean K for the normaliser
        k_feat = _split_relu(k ** 3)                                             # (B, h, N, 2d)
        k_mean = k_feat.mean(dim=-2, keepdim=True)                               # (B, h, 1, 2d)
        kv = (rotate(k_feat, phases).transpose(-2, -1) @ v).div_(n_tokens)       # (B, h, 2d, d)
        # queries: n, p, b = sign(u)|u|^p, Q = [ReLU(b) ; ReLU(-b)]
        q_norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        divisor = torch.where(q_norm > 0, q_norm, torch.ones_like(q_norm))
        tanh_n = torch.tanh(q_norm)
        power = 3 * (0.5 + tanh_n)
        u = q / divisor
        log_u = u.abs().log_()                                                   # -inf where u = 0
        pow_m1 = (power - 1).mul(log_u).exp_()                                   # |u|^(p-1), 0 where u = 0
        b = pow_m1 * u
        q_feat = _split_relu(b)                                                  # (B, h, N, 2d)
        z = 1 / (q_feat @ k_mean.transpose(-2, -1) + NALA_EPS)                   # (B, h, N, 1)
        num = rotate(q_feat, phases) @ kv                                        # (B, h, N, d)
        ctx.save_for_backward(u, k, v, phases, kv, k_mean, z, divisor, tanh_n, power, pow_m1,
                              log_u.clamp_min_(_LOG_TINY), q_feat, k_feat, num)
        return num * z

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (u, k, v, phases, kv, k_mean, z, divisor, tanh_n, power, pow_m1, log_u,
         q_feat, k_feat, num) = ctx.saved_tensors
        n_tokens, d = u.shape[-2], u.shape[-1]
        grad_num = grad * z
        grad_den = (grad * num).sum(dim=-1, keepdim=True).mul_(-z * z)           # d/d(Q . mean K)
        # numerator product and normaliser -> Q
        grad_kv = (rotate(q_feat, phases).transpose(-2, -1) @ grad_num).div_(n_tokens)  # (B, h, 2d, d)
        grad_q_feat = rotate_adjoint(grad_num @ kv.transpose(-2, -1), phases)
        grad_q_feat = grad_q_feat.addcmul_(grad_den, k_mean).unflatten(-1, (2, d))
        # Q = [ReLU(b) ; ReLU(-b)] -> b -> (u, p) -> q
        grad_b = torch.where(u > 0, grad_q_feat[..., 0, :], -grad_q_feat[..., 1, :])
        grad_u = grad_b * power * pow_m1
        grad_n = (grad_b * pow_m1 * u * log_u).sum(dim=-1, keepdim=True) * (3 * (1 - tanh_n * tanh_n))
        radial = (u * grad_u).sum(dim=-1, keepdim=True)
        grad_q = (grad_u - u * radial) / divisor + grad_n * u
        # keys and values
        grad_k_mean = grad_den.transpose(-2, -1) @ q_feat                        # (B, h, 1, 2d)
        grad_v = rotate(k_feat, phases) @ grad_kv
        grad_k_feat = rotate_adjoint(v @ grad_kv.transpose(-2, -1), phases)
        grad_k_feat = grad_k_feat.add_(grad_k_mean / n_tokens).unflatten(-1, (2, d))
        # sign(k^3) = sign(k); where k^3 underflows to 0 the factor 3 k^2 is below 1e-25
        grad_k = torch.where(k > 0, grad_k_feat[..., 0, :], -grad_k_feat[..., 1, :]).mul_(k.square()).mul_(3)
        return grad_q, grad_k, grad_v, None


# The fast path's functions below are FX leaf functions (``torch.fx.wrap``): an FX graph calls them as
# the eager model does, instead of tracing into an autograd Function or a custom op. TorchScript does
# not compile them (``torch.jit.unused``): a scripted model takes the plain path.

@torch.jit.unused
def nala_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """NaLa core with the same inputs and numbers as ``nala_attention_plain`` (fp32, ~1e-6 relative)."""
    return NaLaFastFunction.apply(q, k, v, rope_phases(sin, cos, 2))


@torch.jit.unused
def softmax_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """``softmax_attention_plain`` with one rotary pass over q and k together and fused SDPA."""
    qk = rotate(torch.stack([q, k]), rope_phases(sin, cos))
    return F.scaled_dot_product_attention(qk[0], qk[1], v)


@torch.jit.unused
def lepe_fast(v_map: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LePE's depthwise 'same' conv on the fast path: the custom op on the channels-last map."""
    return depthwise_conv_same(v_map.contiguous(memory_format=torch.channels_last), weight, bias)


torch.fx.wrap('nala_attention_fast')
torch.fx.wrap('softmax_attention_fast')
torch.fx.wrap('lepe_fast')


class GatedAttention(nn.Module):
    """Parameters and the shared frame of both attention kinds (docs/method.md#attention-frame).

    x (B, H, W, C) tokens -> [q|k|v|g] = qkvg(x) -> lepe = DWConv5x5(v) -> core(q, k, v) per head
    -> y = LN(o + lepe) * SiLU(g) -> out_proj -> (B, H, W, C). The part between qkvg and out_proj runs
    in float32, also under autocast. Subclasses define ``core``, which runs one of two functions that
    compute the same numbers: the plain core (the reference's order of operations) or the fast core.
    ``fast_path`` selects the fast core and runs LePE as the custom depthwise op
    (docs/method.md#fast-path); tracers, exporters and TorchScript always get the plain path
    (``models.ops.use_plain_ops``).
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
        self.fast_path = True

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor,
             fast: bool) -> torch.Tensor:
        """The attention core on (B, h, N, d) float32 heads: the fast one if ``fast``, else the plain one."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        qkvg = self.qkvg(x)                                                      # (B, H, W, 4C)
        if torch.jit.is_scripting():
            y = self._mix(qkvg, sin, cos, False)  # TorchScript: the plain path, no autocast region
        else:
            with autocast_off(x):
                y = self._mix(qkvg, sin, cos, self.fast_path and not use_plain_ops())
        return self.out_proj(y.to(qkvg.dtype))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) tokens as (B, h, N, d) heads (a view)."""
        return t.flatten(1, 2).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _mix(self, qkvg: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, fast: bool) -> torch.Tensor:
        """Everything between qkvg and out_proj, in float32."""
        # Split, then cast (a no-op in fp32): under autocast each part becomes its own fp32 tensor,
        # v is already channels-last for LePE, and the backward joins bf16 gradients instead of fp32
        # ones. (Unpacked first: FX cannot iterate over a traced chunk.)
        q, k, v, g = qkvg.chunk(4, dim=-1)
        q, k, v, g = q.float(), k.float(), v.float(), g.float()
        v_map = v.permute(0, 3, 1, 2)                                            # (B, C, H, W) view
        lepe_bias = self.lepe.bias
        assert lepe_bias is not None                                             # for TorchScript's types
        weight, bias = self.lepe.weight.float(), lepe_bias.float()
        if fast:
            lepe = lepe_fast(v_map, weight, bias)
        else:
            lepe = F.conv2d(v_map, weight, bias, padding=self.lepe.padding, groups=self.lepe.groups)
        o = self.core(self._heads(q), self._heads(k), self._heads(v), sin, cos, fast)
        o = o.transpose(1, 2).reshape(v.shape)                                   # (B, H, W, C)
        return F.layer_norm(o + lepe.permute(0, 2, 3, 1), self.ln.normalized_shape, self.ln.weight.float(),
                            self.ln.bias.float(), self.ln.eps) * F.silu(g)


class NaLaAttention(GatedAttention):
    """Norm×direction linear attention (stages 1-2): ``nala_attention_fast`` or ``nala_attention_plain``."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor,
             fast: bool) -> torch.Tensor:
        if fast:
            return nala_attention_fast(q, k, v, sin, cos)
        return nala_attention_plain(q, k, v, sin, cos)


class SoftmaxAttention(GatedAttention):
    """Softmax attention with RoPE (stages 3-4), same parameters and frame as NaLa; the fast core is
    ``softmax_attention_fast`` (one rotary pass, fused scaled_dot_product_attention)."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor,
             fast: bool) -> torch.Tensor:
        if fast:
            return softmax_attention_fast(q, k, v, sin, cos)
        return softmax_attention_plain(q, k, v, sin, cos)
