"""NaLaFormer: a hybrid vision backbone with norm×direction linear attention (NaLa) in stages 1-2
and softmax attention in stages 3-4 (docs/method.md#network).

The module and parameter names follow the reference checkpoints (``../shared/reference``), except that
each downsample is the first module of the stage it feeds (timm's ConvNeXt/Swin layout), where the
reference holds it at the end of the previous stage; a reference state dict loads with ``strict=True``
all the same (``from_reference_layout``), and ``to_reference_layout`` converts back. Variants are registered in timm as
``NALAFORMER_XT/T/S/B/L`` and in lowercase (``nalaformer_xt`` ...).
"""
import os
import re
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, SelectAdaptivePool2d, calculate_drop_path_rates, is_scriptable, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch.utils.checkpoint import checkpoint

from .compat import is_fx_symbolic_tracing
from .nala import NaLaAttention, RoPE, SoftmaxAttention
from .ops import depthwise_conv_same, depthwise_conv_same_backward, use_plain_ops
from .weight_files import file_eval_config, file_num_classes, weights_key

__all__ = ['NaLaFormer', 'VARIANTS', 'PAPER_FIGURES', 'MODEL_NAMES', 'checkpoint_filter_fn', 'from_reference_layout',
           'to_reference_layout', 'is_reference_layout', 'set_fast_path', 'batch_slices', 'BATCH_SLICE_BYTES']

HEAD_HIDDEN = 1024

#: ``global_pool`` values: timm's pools that keep the head's width ('' keeps the spatial map).
GLOBAL_POOLS = ('avg', 'max', 'avgmax', '')


def _batch_slice_bytes_from_env(default: int) -> int:
    value = os.environ.get('NALAFORMER_BATCH_SLICE_BYTES', '').strip()
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f'NALAFORMER_BATCH_SLICE_BYTES must be a whole number of bytes (0 turns batch slicing '
                         f'off), got {value!r}')
    return int(value)


#: Batch slicing: on a CPU a stage runs its blocks on slices of the batch whose widest activation (the
#: 4C-wide qkvg output or the FFN hidden) stays within this many bytes. Such slices stay in cache between
#: ops, and glibc serves them from memory freed by the previous slice instead of mapping fresh, zeroed
#: pages. Exact, because the blocks hold no BatchNorm: every image is computed on its own. The environment
#: variable ``NALAFORMER_BATCH_SLICE_BYTES`` sets it at import; 0 turns slicing off (so does a stage's
#: ``batch_slicing`` attribute, ``NaLaFormer.set_batch_slicing``).
BATCH_SLICE_BYTES = _batch_slice_bytes_from_env(16 * 2 ** 20)


def batch_slices(x: torch.Tensor, widest: float) -> tuple[torch.Tensor, ...]:
    """x split along the batch into slices whose widest activation, ``widest`` times the size of an
    image of x, stays within ``BATCH_SLICE_BYTES`` (at least one image a slice); ``(x,)`` when that is
    the whole batch, on a GPU, while a tracer, exporter or compiler records the model, or when
    ``BATCH_SLICE_BYTES`` is 0."""
    if (BATCH_SLICE_BYTES <= 0 or is_fx_symbolic_tracing() or use_plain_ops() or torch.compiler.is_compiling()
            or x.device.type != 'cpu' or x.shape[0] == 1):
        return (x,)
    size = max(1, int(BATCH_SLICE_BYTES // (x[0].numel() * x.element_size() * widest)))
    return tuple(x.split(size)) if size < x.shape[0] else (x,)


@torch.jit.unused
def conv_residual_fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + conv(x) as one depthwise 'same' conv whose kernel has 1 added at its centre (the custom op on
    a channels-last map): one pass over x instead of two, and no stored sum; the result differs only
    by rounding.

    It runs in x's dtype, also under autocast, so that the result has the dtype of the plain path's
    ``x + conv(x)``: the fp32 residual stream stays fp32 (rounding it to bf16/fp16 at every CPE would
    change the model's numbers). An FX leaf function; TorchScript does not compile it (a scripted model
    takes the plain path).
    """
    weight, bias = _with_identity(weight, bias, x.dtype)
    return depthwise_conv_same(x, weight, bias)


def _with_identity(weight: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise kernel with 1 added at its centre (x + conv(x) as one conv) and its bias (zeros if None),
    in ``dtype``."""
    kh, kw = weight.shape[-2:]
    # a 1 at the kernel centre, padded out without item assignment
    identity = F.pad(weight.new_ones(1, 1, 1, 1), (kw // 2, kw // 2, kh // 2, kh // 2))
    bias = weight.new_zeros(weight.shape[0]) if bias is None else bias
    return (weight + identity).to(dtype), bias.to(dtype)


class ConvFFNFunction(torch.autograd.Function):
    """fc2(a + DWConv3x3(a)), a = GELU(h), on (B, H, W, F) tokens h, with a backward that recomputes a and the
    conv's output from h: it saves h alone, where autograd keeps h, a and the conv's output (each F wide, the
    widest activations of a block). All in h's dtype; the conv kernel has the identity folded in."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, fc2_weight: torch.Tensor,
                fc2_bias: torch.Tensor) -> torch.Tensor:
        c = depthwise_conv_same(F.gelu(h).permute(0, 3, 1, 2), conv_weight, conv_bias)      # channels-last map
        ctx.save_for_backward(h, conv_weight, conv_bias, fc2_weight)
        return F.linear(c.permute(0, 2, 3, 1), fc2_weight, fc2_bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, conv_weight, conv_bias, fc2_weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])                                  # (tokens, C)
        grad_c = (grad @ fc2_weight).reshape(h.shape).permute(0, 3, 1, 2)        # (B, F, H, W) channels-last
        a = F.gelu(h).permute(0, 3, 1, 2)
        c = depthwise_conv_same(a, conv_weight, conv_bias)
        grad_fc2_weight = grad.t() @ c.permute(0, 2, 3, 1).reshape(grad.shape[0], -1)
        del c
        grad_a, grad_conv_weight, grad_conv_bias = depthwise_conv_same_backward(grad_c, a, conv_weight)
        del a, grad_c
        grad_h = torch.ops.aten.gelu_backward(grad_a.permute(0, 2, 3, 1), h)
        return grad_h, grad_conv_weight, grad_conv_bias, grad_fc2_weight, grad.sum(0)


@torch.jit.unused
def conv_ffn_fast(h: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  fc2_weight: torch.Tensor, fc2_bias: torch.Tensor) -> torch.Tensor:
    """The FFN after fc1 on the fast path (``ConvFFNFunction``), in h's dtype (bf16/fp16 under autocast,
    as the plain path's GELU, conv and fc2 run there). An FX leaf function; TorchScript does not compile it."""
    conv_weight, conv_bias = _with_identity(conv_weight, conv_bias, h.dtype)
    return ConvFFNFunction.apply(h, conv_weight, conv_bias, fc2_weight.to(h.dtype), fc2_bias.to(h.dtype))


torch.fx.wrap('conv_residual_fast')
torch.fx.wrap('conv_ffn_fast')


class ChannelsLastLayerNorm(nn.Module):
    """LayerNorm over the channels of (B, H, W, C) tokens, held as ``.norm`` (reference key layout)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class ConvFFN(nn.Module):
    """fc1 -> exact GELU -> y + DWConv3x3(y) -> fc2, on (B, H, W, C) tokens. The depthwise conv reads
    the (B, H, W, F) activations as a (B, F, H, W) map by a permute; ``fast_path`` runs everything after
    fc1 as ``conv_ffn_fast`` (the residual folded into the conv's kernel, GELU and the conv recomputed in
    the backward)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.dwconv = nn.Conv2d(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.act = nn.GELU()
        self.fast_path = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.fast_path and not use_plain_ops():
            return conv_ffn_fast(h, self.dwconv.weight, self.dwconv.bias, self.fc2.weight, self.fc2.bias)
        y = self.act(h).permute(0, 3, 1, 2)                                      # (B, F, H, W) view
        return self.fc2((y + self.dwconv(y)).permute(0, 2, 3, 1))


class StochasticDepth(DropPath):
    """timm's DropPath (same rate, same rescaling by the keep probability) with its per-sample keep mask
    drawn as ``torch.rand(...) < keep_prob`` instead of ``bernoulli_``: torch.rand gives the same stream
    on every supported torch release, the CPU ``bernoulli_`` does not (torch 2.4 and 2.14 draw different
    masks from one seed), so a seeded run drops the same blocks whichever torch it runs on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        # x.new_empty(...).uniform_() is torch.rand's draw, and FX records it on every torch release
        mask = (x.new_empty(shape, dtype=torch.float32).uniform_() < keep_prob).to(x.dtype)
        if keep_prob > 0.0 and self.scale_by_keep:
            mask = mask / keep_prob
        return x * mask


class NaLaBlock(nn.Module):
    """x += cpe1(x); x += DropPath(g1 * attn(norm1(x))); x += cpe2(x); x += DropPath(g2 * ffn(norm2(x))).

    x is a (B, C, H, W) map; the block hands its (B, H, W, C) permute to the norms, the attention and
    the FFN, which work on tokens. On a map in channels_last memory (the fast path's layout) these
    permutes are free. ``fast_path`` folds the CPE residuals into their kernels and makes each
    layer-scale residual one addcmul.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, linear: bool,
                 drop_path: float = 0.0, layer_scale_init: float = 1.0) -> None:
        super().__init__()
        self.gamma_1 = nn.Parameter(torch.full((1, dim, 1, 1), float(layer_scale_init)))
        self.gamma_2 = nn.Parameter(torch.full((1, dim, 1, 1), float(layer_scale_init)))
        self.norm1 = ChannelsLastLayerNorm(dim)
        self.attn = NaLaAttention(dim, num_heads) if linear else SoftmaxAttention(dim, num_heads)
        self.norm2 = ChannelsLastLayerNorm(dim)
        self.ffn = ConvFFN(dim, int(mlp_ratio * dim))
        self.cpe1 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.cpe2 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.drop_path = StochasticDepth(drop_path) if drop_path > 0 else nn.Identity()
        self.fast_path = True

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        fast = self.fast_path and not use_plain_ops()
        x = conv_residual_fast(x, self.cpe1.weight, self.cpe1.bias) if fast else x + self.cpe1(x)
        x = self._add_scaled(x, self.gamma_1, self.attn(self.norm1(x.permute(0, 2, 3, 1)), sin, cos), fast)
        x = conv_residual_fast(x, self.cpe2.weight, self.cpe2.bias) if fast else x + self.cpe2(x)
        return self._add_scaled(x, self.gamma_2, self.ffn(self.norm2(x.permute(0, 2, 3, 1))), fast)

    def _add_scaled(self, x: torch.Tensor, gamma: torch.Tensor, tokens: torch.Tensor, fast: bool) -> torch.Tensor:
        """x + DropPath(gamma * y), y the (B, H, W, C) tokens as a map; one addcmul on the fast path
        when drop path is inactive."""
        y = tokens.permute(0, 3, 1, 2)
        if fast and (isinstance(self.drop_path, nn.Identity) or not self.training):
            return torch.addcmul(x, gamma, y)
        return x + self.drop_path(gamma * y)


class Downsample(nn.Module):
    """Conv3x3 stride 2 with bias, then BatchNorm."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.reduction = nn.Conv2d(dim, out_dim, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.reduction(x))


class NaLaStage(nn.Module):
    """One stage: the downsample that feeds it (Identity in stage 0), RoPE tables, then the blocks. Its
    output is its feature map.

    ``fast_path`` hands the blocks a channels-last map (the layout of the fast path's ops);
    ``batch_slicing`` runs the blocks on slices of the batch on a CPU (``batch_slices``).
    """

    def __init__(self, in_dim: int, dim: int, depth: int, num_heads: int, mlp_ratio: float, linear: bool,
                 drop_path: Sequence[float], layer_scale_init: float, downsample: bool = True) -> None:
        super().__init__()
        self.downsample = Downsample(in_dim, dim) if downsample else nn.Identity()
        self.RoPE = RoPE(dim, num_heads)
        self.blocks = nn.ModuleList([
            NaLaBlock(dim, num_heads, mlp_ratio, linear, drop_path[i], layer_scale_init)
            for i in range(depth)])
        self.grad_checkpointing = False
        self.fast_path = True
        self.batch_slicing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        sin, cos = self.RoPE((x.shape[-2], x.shape[-1]))
        if self.fast_path and not use_plain_ops():
            x = x.contiguous(memory_format=torch.channels_last)
        if self.batch_slicing and not use_plain_ops():
            return self._run_sliced(x, sin, cos)
        return self._run_blocks(x, sin, cos)

    @torch.jit.unused
    def _run_sliced(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        """The blocks on each slice of ``batch_slices``, concatenated."""
        fc1 = self.blocks[0].ffn.fc1
        parts = batch_slices(x, max(4, fc1.out_features / fc1.in_features))
        if len(parts) == 1:
            return self._run_blocks(x, sin, cos)
        return torch.cat([self._run_blocks(part, sin, cos) for part in parts])

    def _run_blocks(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x, sin, cos, use_reentrant=False)
            else:
                x = block(x, sin, cos)
        return x


def _stem(in_chans: int, dim: int) -> nn.Sequential:
    """Four 3x3 convs (stride 2, 1, 1, 2) with BN and GELU: indices match the reference keys."""
    half = dim // 2
    return nn.Sequential(
        nn.Conv2d(in_chans, half, 3, 2, 1), nn.BatchNorm2d(half), nn.GELU(),
        nn.Conv2d(half, half, 3, 1, 1), nn.BatchNorm2d(half), nn.GELU(),
        nn.Conv2d(half, half, 3, 1, 1), nn.BatchNorm2d(half), nn.GELU(),
        nn.Conv2d(half, dim, 3, 2, 1), nn.BatchNorm2d(dim),
    )


class PatchEmbed(nn.Module):
    """Convolutional stem of stride 4, held as ``.proj``."""

    def __init__(self, in_chans: int, dim: int) -> None:
        super().__init__()
        self.proj = _stem(in_chans, dim)
        self.fast_path = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_path:  # oneDNN's convs, BN and GELU are faster channels-last, the layout the blocks use
            x = x.contiguous(memory_format=torch.channels_last)
        return self.proj(x)


class NaLaFormer(nn.Module):
    """NaLaFormer backbone and classifier.

    Stages whose index is below ``num_linear_stages`` use NaLa, the rest softmax attention; every
    shipped variant uses 2. ``fast_path`` (default True) runs the fast path (docs/method.md#fast-path);
    False runs the plain path, the reference's math step by step. Both give the same numbers.
    """

    def __init__(
            self,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dims: Sequence[int] = (64, 128, 320, 512),
            depths: Sequence[int] = (3, 5, 9, 3),
            num_heads: Sequence[int] = (1, 2, 5, 8),
            mlp_ratio: float = 4.0,
            layer_scale_init: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
            num_linear_stages: int = 2,
            drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            fast_path: bool = True,
            global_pool: str = 'avg',
    ) -> None:
        super().__init__()
        _check_global_pool(global_pool)
        self.num_classes = num_classes
        self.embed_dims = tuple(embed_dims)
        self.num_features = embed_dims[-1]
        self.head_hidden_size = HEAD_HIDDEN
        self.drop_rate = drop_rate
        self.grad_checkpointing = False
        self.fast_path = True  # set with every submodule's by set_fast_path below

        self.patch_embed = PatchEmbed(in_chans, embed_dims[0])
        # stochastic depth rising linearly over all blocks, in block order, split by stage
        dpr = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)
        stages, self.feature_info = [], []
        for i, depth in enumerate(depths):
            stages.append(NaLaStage(
                embed_dims[max(i - 1, 0)], embed_dims[i], depth, num_heads[i], mlp_ratio,
                linear=i < num_linear_stages, drop_path=dpr[i],
                layer_scale_init=layer_scale_init[i], downsample=i > 0))
            self.feature_info.append(dict(num_chs=embed_dims[i], reduction=4 * 2 ** i, module=f'layers.{i}'))
        # Sequential: timm's 'dict'/'hook' extractors run its stages one by one
        self.layers = nn.Sequential(*stages)

        self.proj = nn.Linear(embed_dims[-1], HEAD_HIDDEN)
        self.norm = nn.BatchNorm2d(HEAD_HIDDEN)
        self.act = nn.SiLU()
        self.global_pool = SelectAdaptivePool2d(pool_type=global_pool)
        self.flatten = nn.Flatten(1) if global_pool else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Conv2d(HEAD_HIDDEN, num_classes, 1) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        self.set_fast_path(fast_path)
        if is_scriptable():  # timm's set_scriptable(True) asks for models TorchScript compiles as they run
            self.set_fast_path(False)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Weights in the reference layout (the reference's checkpoints and this repository's older ones)
        load through every loader: their downsample keys move to the stages that hold them here."""
        if is_reference_layout(state_dict, prefix):
            moved = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix + 'layers.')]}
            state_dict.update(_shift_downsamples(moved, 1, prefix))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Conv2d):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    # ---- timm model API ------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Nothing beyond timm's rule (1-D params and biases skip decay).

        ``gamma_1``/``gamma_2`` are (1, C, 1, 1) and are decayed, as in the reference's training
        (whose list named parameters that do not exist); the RoPE ``angle`` is a buffer.
        """
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's parameter groups. Fine: one group per block, and a stage's downsample joins the previous
        stage's last block (the suffix sorts it after that block, and timm's MATCH_PREV_GROUP, 99999,
        merges it there), so layer-wise LR decay scales it as the op that runs right after that block.
        Coarse: one group per stage, its downsample included."""
        return dict(
            stem=r'^patch_embed',
            blocks=r'^layers\.(\d+)' if coarse else [
                (r'^layers\.(\d+)\.downsample', (-1, 99999)),
                (r'^layers\.(\d+)\.blocks\.(\d+)', None),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        for stage in self.layers:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier for ``num_classes`` (0: none); ``global_pool`` (None: unchanged) as at creation."""
        if global_pool is not None:
            _check_global_pool(global_pool)
            self.global_pool = SelectAdaptivePool2d(pool_type=global_pool)
            self.flatten = nn.Flatten(1) if global_pool else nn.Identity()
        self.num_classes = num_classes
        if num_classes > 0:
            self.head = nn.Conv2d(HEAD_HIDDEN, num_classes, 1)
            self._init_weights(self.head)
        else:
            self.head = nn.Identity()

    def set_fast_path(self, enable: bool = True) -> None:
        """Switch the whole model between the fast path and the plain path (same numbers): sets
        ``fast_path`` on the model and on every submodule that has one."""
        set_fast_path(self, enable)

    def set_batch_slicing(self, enable: bool = True) -> None:
        """Switch batch slicing (``BATCH_SLICE_BYTES``) on or off in every stage; numbers are the same."""
        if not isinstance(enable, bool):
            raise ValueError(f'batch slicing must be True or False, got {enable!r}')
        for stage in self.layers:
            stage.batch_slicing = enable

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: int | list[int] | None = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Stage feature maps at strides 4, 8, 16, 32; timm's signature."""
        if output_fmt != 'NCHW':
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        intermediates = []
        x = self.patch_embed(x)
        stages = self.layers[:max_index + 1] if stop_early or intermediates_only else self.layers
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: int | list[int] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> list[int]:
        """Drop the stages after the last wanted feature map (and the head)."""
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        self.layers = self.layers[:max_index + 1]
        if prune_head:
            self.proj = nn.Identity()
            self.norm = nn.Identity()
            self.reset_classifier(0)
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.patch_embed(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The hidden layer (a per-position linear, BN, SiLU), the global pool, the classifier (a 1x1
        conv). Without pooling (``global_pool=''``) every position goes through the hidden layer and
        the classifier, and the result is a (B, C, H, W) map."""
        batch, height, width = x.shape[0], x.shape[-2], x.shape[-1]
        x = self.proj(x.flatten(2).transpose(1, 2))                             # (B, N, 1024)
        x = x.transpose(1, 2).reshape(batch, -1, height, width)
        x = self.global_pool(self.act(self.norm(x)))
        x = self.head_drop(x)
        if pre_logits:
            return self.flatten(x)
        return self.flatten(self.head(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _check_global_pool(global_pool: str) -> None:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f'NaLaFormer: global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r} '
                         "(pools that widen the features, such as 'catavgmax', do not fit the head)")


def set_fast_path(module: nn.Module, enable: bool) -> None:
    """Set ``fast_path`` on every module in ``module`` (a model, a stage or a block) that has one."""
    if not isinstance(enable, bool):
        raise ValueError(f'fast_path must be True or False, got {enable!r}')
    for m in module.modules():
        if hasattr(m, 'fast_path'):
            m.fast_path = enable


def is_reference_layout(state_dict: Mapping[str, Any], prefix: str = '') -> bool:
    """Whether ``state_dict`` (its keys under ``prefix``) holds NaLaFormer weights in the reference
    layout, where stage i holds the downsample that runs after it: stage 0 has one there, none here."""
    return (f'{prefix}layers.0.downsample.reduction.weight' in state_dict
            and f'{prefix}layers.0.RoPE.angle' in state_dict)


def _shift_downsamples(state_dict: Mapping[str, Any], shift: int, prefix: str = '') -> dict[str, Any]:
    """``state_dict`` with each ``{prefix}layers.{i}.downsample.*`` key renamed to stage i + shift, in order."""
    pattern = re.compile(re.escape(prefix) + r'layers\.(\d+)\.downsample\.')
    out = {}
    for key, value in state_dict.items():
        m = pattern.match(key)
        out[f'{prefix}layers.{int(m[1]) + shift}.downsample.{key[m.end():]}' if m else key] = value
    return out


def from_reference_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict of the reference layout in this model's: ``layers.{i}.downsample.*`` (run after
    stage i) becomes ``layers.{i+1}.downsample.*`` (the first module of the stage it feeds). Key order
    follows; a state dict already in this model's layout comes back as a copy."""
    return _shift_downsamples(state_dict, 1) if is_reference_layout(state_dict) else dict(state_dict)


def to_reference_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``from_reference_layout``: this model's state dict with the keys (and key order)
    of the reference implementation, for loading our weights in the reference code."""
    return dict(state_dict) if is_reference_layout(state_dict) else _shift_downsamples(state_dict, -1)


def checkpoint_filter_fn(state_dict: dict[str, Any], model: NaLaFormer) -> dict[str, torch.Tensor]:
    """Accept a bare state dict or a training checkpoint, with or without a DDP ``module.`` prefix, in
    this model's layout or the reference layout (``from_reference_layout``). A training checkpoint gives
    the weights of the repository's one loader rule (models/weight_files.py: ``model_ema`` when present, as
    timm's ``load_checkpoint`` does)."""
    from timm.models import clean_state_dict
    key = weights_key(state_dict)
    if key is None:
        raise ValueError('the pretrained file holds no model weights (expected a state dict or a dict with "model")')
    return from_reference_layout(clean_state_dict(state_dict[key] if key else state_dict))


#: Every variant, one row each: its architecture; ``drop_path``, the stochastic-depth rate the recipe trains
#: it with and the model's default ``drop_path_rate`` (an explicit ``drop_path_rate`` argument wins); and
#: ``paper``, the published figures (params M, GFLOPs, ImageNet top-1) that reports print next to ours.
#: Each row is registered in timm under its name and in lowercase, and is a torch.hub entry point
#: (hubconf.py); a new variant is a new row (and its reference key list in tests/reference/).
VARIANTS: dict[str, dict[str, Any]] = {
    'NALAFORMER_XT': dict(embed_dims=(32, 64, 128, 384), depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 12),
                          mlp_ratio=3.5, layer_scale_init=(1, 1, 1, 1), drop_path=0.10, paper=(8, 1.0, 79.1)),
    'NALAFORMER_T': dict(embed_dims=(64, 128, 256, 512), depths=(2, 2, 6, 2), num_heads=(1, 2, 4, 8),
                         mlp_ratio=4.0, layer_scale_init=(1, 1, 1, 1), drop_path=0.10, paper=(15, 2.7, 82.6)),
    'NALAFORMER_S': dict(embed_dims=(64, 128, 320, 512), depths=(3, 5, 9, 3), num_heads=(1, 2, 5, 8),
                         mlp_ratio=3.5, layer_scale_init=(1, 1, 1, 1), drop_path=0.15, paper=(26, 5.1, 84.3)),
    'NALAFORMER_B': dict(embed_dims=(96, 192, 384, 512), depths=(4, 6, 12, 6), num_heads=(1, 2, 6, 8),
                         mlp_ratio=4.0, layer_scale_init=(1, 1, 1e-6, 1e-6), drop_path=0.40, paper=(52, 12, 85.2)),
    'NALAFORMER_L': dict(embed_dims=(96, 192, 448, 640), depths=(4, 7, 19, 8), num_heads=(1, 2, 7, 10),
                         mlp_ratio=3.5, layer_scale_init=(1e-6, 1e-6, 1e-6, 1e-6), drop_path=0.55,
                         paper=(95, 18, 85.7)),
}

#: The paper's published figures of each variant (params M, GFLOPs, ImageNet top-1), from ``VARIANTS``.
PAPER_FIGURES: dict[str, tuple[float, float, float]] = {name: row['paper'] for name, row in VARIANTS.items()}

#: Every registered model name: each variant under its own name and in lowercase, as timm names models.
MODEL_NAMES: tuple[str, ...] = tuple(name for variant in VARIANTS for name in (variant, variant.lower()))


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        'url': '', 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': 0.875, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj.0', 'classifier': 'head',
        'paper_ids': 'arXiv:2506.21137', 'paper_name': 'Norm×Direction: Restoring the Missing Query Norm '
                                                       'in Vision Linear Attention',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({name: _cfg() for name in MODEL_NAMES})


def _create_nalaformer(variant: str, pretrained: bool = False, **kwargs: Any) -> NaLaFormer:
    arch = {k: v for k, v in VARIANTS[variant.upper()].items() if k != 'paper'}
    arch['drop_path_rate'] = arch.pop('drop_path')
    overlay = kwargs.get('pretrained_cfg_overlay') or {}
    if pretrained and not any(overlay.get(k) for k in ('file', 'url', 'hf_hub_id', 'state_dict')):
        raise ValueError(f'{variant}: no pretrained weights are published yet; load yours with '
                         f'pretrained_cfg_overlay=dict(file=PATH) or checkpoint_path=PATH')
    file = overlay.get('file') if pretrained else None
    if file:
        if not os.path.isfile(file):  # timm's own loader raises a FileNotFoundError without a message
            raise FileNotFoundError(f'{variant}: pretrained file {file} does not exist (a relative path is read '
                                    f'from the working directory, {os.getcwd()})')
        recorded = file_eval_config(file)
        if 'num_classes' not in overlay:
            # the file's class count: the default num_classes, and a different num_classes given by the
            # caller re-initialises the classifier (timm drops a pretrained head of another size)
            num_classes = file_num_classes(file)
            if num_classes is not None:
                recorded['num_classes'] = num_classes
        # and the input size and crop the weights were evaluated at, so that timm.data.resolve_data_config
        # gives their evaluation transform; the caller's own overlay entries win
        kwargs['pretrained_cfg_overlay'] = {**recorded, **overlay}
    return build_model_with_cfg(
        NaLaFormer, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=(0, 1, 2, 3), feature_cls='getter', flatten_sequential=True),
        **{**arch, **kwargs},
    )


def _entrypoint(name: str) -> Any:
    """The timm entry point of model ``name``, a function named after it (timm registers it by ``__name__``)."""
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> NaLaFormer:
        return _create_nalaformer(name, pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__doc__ = f'NaLaFormer-{name.split("_")[-1].upper()} (``VARIANTS[{name.upper()!r}]``).'
    return entrypoint


for _name in MODEL_NAMES:
    globals()[_name] = register_model(_entrypoint(_name))
