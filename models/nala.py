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
from .ops import autocast_off, depthwise_conv_same, norm_params, use_plain_ops

__all__ = [
    'RoPE', 'rotate_every_two', 'apply_rope', 'nala_attention_plain', 'softmax_attention_plain',
    'GatedAttention', 'NaLaAttention', 'SoftmaxAttention', 'nala_kernel_terms',
    'nala_attention_fast', 'softmax_attention_fast', 'rope_phases', 'rotate', 'rotate_real',
    'rotate_adjoint', 'NaLaFastFunction', 'lepe_fast', 'GatedNormFunction', 'gated_norm_fast', 'wide_dtype',
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


def wide_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the elementwise maps for an input x: float32 for bf16, fp16 and float32, float64 for
    float64. An FX leaf function: torch 2.4's FX cannot record ``torch.promote_types`` of a traced dtype."""
    return torch.promote_types(x.dtype, torch.float32)


torch.fx.wrap('wide_dtype')


def nala_attention_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         sin: torch.Tensor, cos: torch.Tensor, eps: float = NALA_EPS) -> torch.Tensor:
    """NaLa core (docs/method.md#nala-kernel to #normaliser-and-linear-time-order), in the reference's order
    of operations.

    q, k, v: (B, h, N, d) in the compute dtype (float32, or bf16/fp16 under autocast); sin, cos: (N, d).
    Returns (B, h, N, d) in that dtype. Linear in N: the N x N attention matrix is never formed. Precision
    (docs/method.md#precision): the feature maps and their rotation are computed in float32 (float64 for
    float64 inputs) and rounded to the compute dtype for the two products; the normaliser stays float32.
    Autocast must be off (the attention frame's region), or it would round the normaliser's product too.
    (``eps`` is an argument because TorchScript reads no globals.)
    """
    dtype, wide = v.dtype, wide_dtype(v)
    head_dim = q.shape[-1]
    q_feat, k_feat = nala_kernel_terms(q.to(wide), k.to(wide))
    # RoPE on each d-wide half of the numerator features, with the same tables
    q_rope = torch.cat([apply_rope(q_feat[..., :head_dim], sin, cos),
                        apply_rope(q_feat[..., head_dim:], sin, cos)], dim=-1).to(dtype)
    k_rope = torch.cat([apply_rope(k_feat[..., :head_dim], sin, cos),
                        apply_rope(k_feat[..., head_dim:], sin, cos)], dim=-1).to(dtype)
    # normaliser from the un-rotated features, numerator as Q~ ((K~^T N^-1/2)(V N^-1/2))
    z = 1 / (q_feat @ k_feat.mean(dim=-2, keepdim=True).transpose(-2, -1) + eps)
    # N^-1/2 from a sum over the token axis of q: the legacy ONNX exporter freezes N (and anything made
    # from it, ones_like included) at the traced size, and torch.export cannot serialise it as a float
    scale = (q[..., :1].to(wide) * 0 + 1).sum(dim=-2, keepdim=True).rsqrt().to(dtype)  # (B, h, 1, 1)
    kv = (k_rope.transpose(-2, -1) * scale) @ (v * scale)
    return ((q_rope @ kv) * z).to(dtype)


def softmax_attention_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Softmax attention of stages 3-4 (docs/method.md#softmax-attention): RoPE on q and k,
    softmax(q k^T / sqrt(d)) v. The rotation runs in float32 (float64 for float64 inputs) and is rounded to
    the compute dtype (v's: float32, or bf16/fp16 under autocast), in which the rest runs."""
    dtype, wide = v.dtype, wide_dtype(v)
    q = apply_rope(q.to(wide), sin, cos).to(dtype)
    k = apply_rope(k.to(wide), sin, cos).to(dtype)
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
#        [ReLU(u)^p ; ReLU(-u)^p] = [ReLU(b) ; ReLU(-b)],  b = sign(u) |u|^p = u * |u|^(p-1),
#    and the backward reuses |u|^(p-1) for dp/du. The power is exp((p-1) log|u|): vectorised exp and
#    log instead of a per-element pow with a tensor exponent (2.5x faster on the CPU), and log|u|
#    is the one dp/dn needs in the backward.
# 3. Features [ReLU(x) ; x] instead of [ReLU(x) ; ReLU(-x)]. With ReLU(-x) = ReLU(x) - x, the NaLa
#    features are Q = F_Q T and K = F_K T for F_Q = [ReLU(b) ; b], F_K = [ReLU(k^3) ; k^3] and the
#    fixed 2d x 2d matrix T = [[I, I], [0, -I]] (rows: the halves of F). T acts on whole d-wide halves,
#    so it commutes with R, and Q K^T = F_Q (T T^T) F_K^T: the products and the normaliser take F_Q and
#    F_K with M = T T^T = [[2I, -I], [-I, I]] applied to the small (2d x d) kv and to mean F_K. F is
#    written in two passes (x into one half, ReLU(x) into the other) where [ReLU(x) ; ReLU(-x)] takes a
#    2d-wide product and a clamp, and the gradient of F back to x is one select and add.
# The backward is written out (NaLaFastFunction). It saves q, k and v as they come (slices of the
# qkvg output, which the frame keeps anyway), the small (2d x d) kv product, mean K and the per-token
# normaliser, and recomputes the elementwise maps from q and k: the 2d-wide features, their rotations,
# u, log|u|, |u|^(p-1) and the numerator. So the core adds no (B, h, N, d)-sized tensor to what a
# training step keeps, at the cost of one more pass of the maps in the backward. q, k and v are made
# head-major (in the forward and again in the backward): every elementwise result inherits its input's
# layout, and the batched products need (B*h)-collapsible operands, or each of them copies its 2d-wide
# operand.
# Precision (docs/method.md#precision): the maps are computed in float32 (``wide_dtype``) from q and k; the
# two products run in the compute dtype (v's: float32, or bf16/fp16 under autocast) on the rotated
# features rounded to it; mean K, the normaliser and its gradient stay float32.
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


def _head_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (B, h, N, d) in ``dtype``, contiguous (head-major): one pass at most, none if it already is."""
    return x.to(dtype, memory_format=torch.contiguous_format)


def _relu_and_self(x: torch.Tensor) -> torch.Tensor:
    """F = [ReLU(x) ; x] along the last dim, as torch.compile takes it (out= ops are not traceable there);
    eager mode writes x into F's second half and ReLU(x) from there into the first."""
    return torch.cat([x.clamp_min(0), x], dim=-1)


def _key_features(k: torch.Tensor) -> torch.Tensor:
    """F_K = [ReLU(k^3) ; k^3], (B, h, N, 2d) in k's dtype, from k in a head-major layout."""
    d = k.shape[-1]
    if torch.compiler.is_compiling():
        return _relu_and_self(k ** 3)
    feat = k.new_empty(*k.shape[:-1], 2 * d)
    torch.pow(k, 3, out=feat[..., d:])
    torch.clamp_min(feat[..., d:], 0, out=feat[..., :d])
    return feat


def _query_features(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """F_Q = [ReLU(b) ; b], b = sign(u)|u|^p, in ``wide_dtype(q)``, head-major (B, h, N, 2d), from q of any
    strides; with the terms its gradient needs: u, log|u| (-inf where u = 0), |u|^(p-1), p, tanh(n) and the
    guarded divisor n."""
    q = _head_major(q, wide_dtype(q))
    q_norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    divisor = _safe_norm_divisor(q_norm)
    tanh_n = torch.tanh(q_norm)
    power = 3 * (0.5 + tanh_n)
    u = q / divisor
    log_u = u.abs().log_()                                                       # -inf where u = 0
    pow_m1 = (power - 1).mul(log_u).exp_()                                       # |u|^(p-1), 0 where u = 0
    d = q.shape[-1]
    if torch.compiler.is_compiling():
        feat = _relu_and_self(pow_m1 * u)
    else:
        feat = q.new_empty(*q.shape[:-1], 2 * d)
        torch.mul(pow_m1, u, out=feat[..., d:])
        torch.clamp_min(feat[..., d:], 0, out=feat[..., :d])
    return feat, u, log_u, pow_m1, power, tanh_n, divisor


def _mix_halves(x: torch.Tensor) -> torch.Tensor:
    """M x for M = [[2I, -I], [-I, I]] acting on the two halves of dim -2 (M is symmetric, so this is also
    the gradient map): [2 x1 - x2 ; x2 - x1]."""
    first, second = x.chunk(2, dim=-2)
    return torch.cat([2 * first - second, second - first], dim=-2)


def _grad_of_relu_and_self(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient w.r.t. x of F = [ReLU(x) ; x] given the gradient of F."""
    d = x.shape[-1]
    return torch.where(x > 0, grad[..., :d] + grad[..., d:], grad[..., d:])


class NaLaFastFunction(torch.autograd.Function):
    """NaLa core (docs/method.md#fast-path) with a hand-written backward that recomputes the elementwise
    maps; see the notes above.

    q, k, v: (B, h, N, d) in one dtype (any strides); phases: ``rope_phases(sin, cos, 2)``. Call it with
    autocast off: it computes in the dtype of its inputs.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        dtype, inv_sqrt_n = v.dtype, q.shape[-2] ** -0.5
        # keys: M (R(F_K) N^-1/2)^T (V N^-1/2) in the compute dtype, M mean F_K in float32 for the normaliser
        k_feat = _key_features(_head_major(k, wide_dtype(v)))                   # (B, h, N, 2d)
        k_mean = _mix_halves(k_feat.mean(dim=-2).unsqueeze(-1))                  # (B, h, 2d, 1)
        k_rot = rotate(k_feat, phases * inv_sqrt_n).to(dtype)
        del k_feat
        if torch.compiler.is_compiling():                                        # out= is not traceable
            v_scaled = v * inv_sqrt_n
        else:
            v_scaled = torch.mul(v, inv_sqrt_n, out=v.new_empty(v.shape))        # head-major
        kv = _mix_halves((k_rot.transpose(-2, -1) @ v_scaled).to(k_mean.dtype)).to(dtype)  # (B, h, 2d, d)
        del k_rot, v_scaled
        q_feat = _query_features(q)[0]
        z = 1 / (q_feat @ k_mean + NALA_EPS)                                     # (B, h, N, 1) float32
        num = rotate(q_feat, phases).to(dtype) @ kv                              # (B, h, N, d)
        ctx.save_for_backward(q, k, v, phases, kv, k_mean, z)
        return num.mul_(z) if dtype == z.dtype else (num * z).to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, phases, kv, k_mean, z = ctx.saved_tensors
        dtype, n_tokens = v.dtype, q.shape[-2]
        inv_sqrt_n = n_tokens ** -0.5
        q_feat, u, log_u, pow_m1, power, tanh_n, divisor = _query_features(q)
        # the sums over tokens below take both factors scaled by N^-1/2, as the forward's (no fp16 overflow)
        q_rot = rotate(q_feat, phases * inv_sqrt_n).to(dtype)                    # R(F_Q) N^-1/2
        grad_num = (grad * (z * inv_sqrt_n)).to(dtype)                           # d/d(num) N^-1/2
        # numerator product -> F_Q and kv
        grad_kv = q_rot.transpose(-2, -1) @ grad_num                             # (B, h, 2d, d), d/d(kv) / N
        del q_rot
        grad_q_feat = rotate_adjoint((grad_num @ kv.transpose(-2, -1)).to(z.dtype), phases * n_tokens ** 0.5)
        # normaliser: sum_d grad num = R(F_Q) . (grad kv^T) = F_Q . R^T(grad kv^T) (R is orthogonal), which is
        # F_Q . grad_q_feat / z at this point: no second numerator product
        grad_den = torch.linalg.vecdot(q_feat, grad_q_feat).unsqueeze(-1).mul_(-z)  # d/d(F_Q . M mean F_K)
        grad_q_feat = grad_q_feat.addcmul_(grad_den, k_mean.transpose(-2, -1))
        d = u.shape[-1]
        b = q_feat[..., d:]
        grad_b = _grad_of_relu_and_self(grad_q_feat, b)
        del grad_q_feat
        # b = u |u|^(p-1) -> (u, p) -> q
        grad_u = grad_b * power * pow_m1
        log_u = log_u.clamp_min_(_LOG_TINY)                                      # 0 * log 0 -> 0 below
        grad_n = torch.linalg.vecdot(grad_b * b, log_u).unsqueeze(-1) * (3 * (1 - tanh_n * tanh_n))
        radial = torch.linalg.vecdot(u, grad_u).unsqueeze(-1)
        grad_q = torch.addcmul(grad_u.div_(divisor), u, grad_n - radial / divisor).to(dtype)
        # keys and values
        grad_k_mean = _mix_halves(q_feat.transpose(-2, -1) @ grad_den)          # (B, h, 2d, 1), M F_Q^T grad
        del q_feat, u, log_u, pow_m1, grad_b, grad_u, b
        grad_kv = _mix_halves(grad_kv.to(grad_k_mean.dtype)).to(dtype)          # d/d(R(F_K)^T V) / N
        k = _head_major(k, wide_dtype(v))
        k_feat = _key_features(k)
        grad_v = rotate(k_feat, phases).to(dtype) @ grad_kv
        del k_feat
        grad_k_feat = rotate_adjoint((_head_major(v, dtype) @ grad_kv.transpose(-2, -1)).to(k.dtype), phases)
        grad_k_feat = grad_k_feat.add_(grad_k_mean.transpose(-2, -1) / n_tokens)
        # sign(k^3) = sign(k); where k^3 underflows to 0 the factor 3 k^2 is below 1e-25
        grad_k = _grad_of_relu_and_self(grad_k_feat, k).mul_(k.square()).mul_(3)
        return grad_q, grad_k.to(dtype), grad_v, None


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
    """``softmax_attention_plain`` with one rotary pass over q and k together (float32, rounded to v's dtype
    as there) and fused SDPA in v's dtype."""
    qk = rotate(torch.stack([q, k]).to(wide_dtype(v)), rope_phases(sin, cos)).to(v.dtype)
    return F.scaled_dot_product_attention(qk[0], qk[1], v)


@torch.jit.unused
def lepe_fast(v_map: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LePE's depthwise 'same' conv on the fast path: the custom op, which takes v's map as it lies in the
    qkvg output and keeps no channels-last copy of it for the backward."""
    return depthwise_conv_same(v_map, weight, bias)


class GatedNormFunction(torch.autograd.Function):
    """y = LN(s) * SiLU(g) on (B, H, W, C) tokens with a backward that recomputes LN(s) and SiLU(g): it saves
    s, g (a slice of the qkvg output) and LN's per-token statistics, where autograd would also keep
    LN(s), SiLU(g) and g's copy. Same numbers as the plain path's F.layer_norm(s) * F.silu(g) (the same
    kernels), in s's dtype; weight and bias as ``norm_params`` gives them."""

    @staticmethod
    def forward(ctx, s: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
        normed, mean, rstd = torch.native_layer_norm(s, (s.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(s, g, weight, bias, mean, rstd)
        ctx.eps = eps
        return normed.mul_(F.silu(g))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        s, g, weight, bias, mean, rstd = ctx.saved_tensors
        shape = [s.shape[-1]]
        normed = torch.native_layer_norm(s, shape, weight, bias, ctx.eps)[0]
        grad_g = torch.ops.aten.silu_backward(grad * normed, g)
        del normed
        grad_s, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad * F.silu(g), s, shape, mean, rstd, weight, bias, [True, True, True])
        return grad_s, grad_g, grad_weight, grad_bias, None


@torch.jit.unused
def gated_norm_fast(s: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """LN(s) * SiLU(g) of the attention frame on the fast path (``GatedNormFunction``)."""
    return GatedNormFunction.apply(s, g, weight, bias, eps)


torch.fx.wrap('nala_attention_fast')
torch.fx.wrap('softmax_attention_fast')
torch.fx.wrap('lepe_fast')
torch.fx.wrap('gated_norm_fast')


class GatedAttention(nn.Module):
    """Parameters and the shared frame of both attention kinds (docs/method.md#attention-frame).

    x (B, H, W, C) tokens -> [q|k|v|g] = qkvg(x) -> lepe = DWConv5x5(v) -> core(q, k, v) per head
    -> y = LN(o + lepe) * SiLU(g) -> out_proj -> (B, H, W, C). The part between qkvg and out_proj runs
    with autocast off in the dtype of the qkvg output (float32, or bf16/fp16 under autocast), with
    float32 kept where accuracy needs it (docs/method.md#precision). Subclasses define ``core``, which
    runs one of two functions that compute the same numbers: the plain core (the reference's order of
    operations) or the fast core. ``fast_path`` selects the fast core, runs LePE as the custom
    depthwise op and the gated LayerNorm as ``gated_norm_fast`` (docs/method.md#fast-path); tracers,
    exporters and TorchScript always get the plain path (``models.ops.use_plain_ops``).
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
        """The attention core on (B, h, N, d) heads (the compute dtype): the fast one if ``fast``, else the
        plain one."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        qkvg = self.qkvg(x)                                                      # (B, H, W, 4C)
        if torch.jit.is_scripting():
            y = self._mix(qkvg, sin, cos, False)  # TorchScript: the plain path, no autocast region
        else:
            with autocast_off(x):
                y = self._mix(qkvg, sin, cos, self.fast_path and not use_plain_ops())
        return self.out_proj(y)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) tokens as (B, h, N, d) heads (a view)."""
        return t.flatten(1, 2).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _mix(self, qkvg: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, fast: bool) -> torch.Tensor:
        """Everything between qkvg and out_proj, in qkvg's dtype; autocast must be off."""
        # unpacked first: FX cannot iterate over a traced chunk
        q, k, v, g = qkvg.chunk(4, dim=-1)
        v_map = v.permute(0, 3, 1, 2)                                            # (B, C, H, W) view
        lepe_bias = self.lepe.bias
        assert lepe_bias is not None                                             # for TorchScript's types
        weight, bias = self.lepe.weight.to(qkvg.dtype), lepe_bias.to(qkvg.dtype)
        if fast:
            lepe = lepe_fast(v_map, weight, bias)
        else:
            lepe = F.conv2d(v_map, weight, bias, padding=self.lepe.padding, groups=self.lepe.groups)
        o = self.core(self._heads(q), self._heads(k), self._heads(v), sin, cos, fast)
        s = o.transpose(1, 2).reshape(v.shape) + lepe.permute(0, 2, 3, 1)        # (B, H, W, C)
        ln_weight, ln_bias = norm_params(self.ln.weight, self.ln.bias, s)
        if fast:
            return gated_norm_fast(s, g, ln_weight, ln_bias, self.ln.eps)
        return F.layer_norm(s, self.ln.normalized_shape, ln_weight, ln_bias, self.ln.eps) * F.silu(g)


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
