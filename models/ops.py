"""Custom ops of the fast path that torch.compile must not look into (see their docstrings), and the
switch that sends tracers and exporters to the plain path instead."""
import contextlib
from typing import ContextManager

import torch
import torch.nn.functional as F

from .compat import is_exporting, is_fx_symbolic_tracing

__all__ = ['depthwise_conv_same', 'depthwise_conv_same_backward', 'use_plain_ops', 'autocast_off', 'norm_params']


def use_plain_ops() -> bool:
    """True while a tracer or exporter records the model: torch.jit.trace (also fvcore and the legacy
    ONNX exporter), torch.export (also the dynamo ONNX exporter), and in TorchScript.

    The fast path's autograd Function and custom op are opaque to these tools (fvcore counts no FLOPs
    in them, ONNX has no translation for them, a traced graph cannot be saved, TorchScript cannot
    compile them), so the model takes the plain path, which computes the same numbers from standard
    ops. torch.compile is not affected, nor is FX symbolic tracing: the fast path's pieces are FX leaf
    functions (``torch.fx.wrap``), so an FX graph computes exactly what the eager model computes.
    """
    if torch.jit.is_scripting():
        return True
    else:  # an explicit else: TorchScript then does not compile these Python-only checks
        return torch.jit.is_tracing() or is_exporting() or torch.onnx.is_in_onnx_export()


def autocast_off(x: torch.Tensor) -> ContextManager:
    """A region where autocast is off on x's device. While FX traces, x is a Proxy without a device
    and a graph cannot record a context manager, so the region is a no-op there."""
    if is_fx_symbolic_tracing():
        return contextlib.nullcontext()
    return torch.autocast(device_type=x.device.type, enabled=False)


def norm_params(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm parameters for an input x of any float dtype, such that the statistics are float32.

    On a CPU, LayerNorm takes a bf16/fp16 input with float32 parameters and then keeps its mean and
    1/std in float32; given parameters of the input's dtype it would store them in that dtype. CUDA's
    LayerNorm keeps them in float32 either way but needs parameters of the input's dtype. In float32
    both are the parameters themselves. While FX traces, x is a Proxy whose device is unknown: the graph
    gets the parameters as they are, right on a CPU (where FX graphs run without the autocast region,
    CUDA's autocast makes LayerNorm float32 itself).
    """
    if torch.jit.is_scripting():
        keep = x.device.type == 'cpu'
    else:  # an explicit else: TorchScript then does not compile the FX check
        keep = is_fx_symbolic_tracing() or x.device.type == 'cpu'
    if keep:
        return weight, bias
    return weight.to(x.dtype), bias.to(x.dtype)


@torch.library.custom_op('nalaformer::depthwise_conv_same', mutates_args=())
def depthwise_conv_same(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Depthwise conv, stride 1, 'same' padding: F.conv2d, as an op torch.compile does not look into.

    Inductor lowered the depthwise convs' backward (CPE, FFN, LePE) with the input re-laid out as
    (B, H, C, W), on which oneDNN's depthwise backward is several times slower than on the
    channels-last map. As an opaque op with an opaque backward, its tensors keep the strides eager
    mode gives them. Same numbers as F.conv2d; the output is channels-last. x may be any strided map
    (LePE passes a slice of the qkvg output): the op convolves a channels-last copy and its backward
    saves x itself and makes the copy again, so that no copy is kept for the backward. It computes in
    its inputs' dtype, also under autocast (which is still on inside a custom op), as its fake says.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.conv2d(x.contiguous(memory_format=torch.channels_last), weight, bias, 1, weight.shape[-1] // 2, 1,
                        x.shape[1])


@depthwise_conv_same.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.channels_last)


def _depthwise_weight_grad_by_3x3(grad: torch.Tensor, x: torch.Tensor, kernel: int) -> torch.Tensor:
    """The weight gradient of a depthwise 'same' conv with an odd kernel above 3x3, put together from 3x3
    weight gradients on windows of the zero-padded input: the gradient of tap (i, j) is the sum of x
    shifted by (i, j) times grad over batch and space, whichever kernel holds the tap, so a 3x3 kernel
    placed at offset (a, b) inside the large one gives its taps (a..a+2, b..b+2); overlapping windows
    give equal values. oneDNN's 3x3 weight gradient is several times faster than its 5x5 one on a CPU
    (2x in float32, over 10x in bf16, where the 5x5 one is slower than in float32)."""
    channels, (height, width) = x.shape[1], x.shape[-2:]
    pad = kernel // 2
    padded = F.pad(x, (pad, pad, pad, pad)).contiguous(memory_format=torch.channels_last)
    offsets = list(range(0, kernel - 3, 2)) + [kernel - 3]
    weight3 = x.new_zeros(channels, 1, 3, 3)
    out = x.new_empty(channels, 1, kernel, kernel)
    for row in offsets:
        for col in offsets:
            window = padded[..., row:row + height + 2, col:col + width + 2]
            out[..., row:row + 3, col:col + 3] = torch.ops.aten.convolution_backward(
                grad, window, weight3, None, [1, 1], [0, 0], [1, 1], False, [0, 0], channels, [False, True, False])[1]
    return out


@torch.library.custom_op('nalaformer::depthwise_conv_same_backward', mutates_args=())
def depthwise_conv_same_backward(grad: torch.Tensor, x: torch.Tensor,
                                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``depthwise_conv_same`` w.r.t. x, weight and bias (oneDNN's backward).

    For kernels above 3x3 on a CPU (LePE's 5x5) the weight gradient comes from 3x3 ones
    (``_depthwise_weight_grad_by_3x3``) and the bias gradient is a plain sum: oneDNN's 5x5 depthwise
    weight gradient is the slow part of its backward; for 3x3 its combined kernel is the faster one.
    """
    pad, channels = weight.shape[-1] // 2, weight.shape[0]
    x = x.contiguous(memory_format=torch.channels_last)
    if x.device.type == 'cpu' and weight.shape[-1] > 3:
        grad_x = torch.ops.aten.convolution_backward(grad, x, weight, None, [1, 1], [pad, pad], [1, 1], False,
                                                     [0, 0], channels, [True, False, False])[0]
        return grad_x, _depthwise_weight_grad_by_3x3(grad, x, weight.shape[-1]), grad.sum((0, 2, 3))
    return torch.ops.aten.convolution_backward(grad, x, weight, [channels], [1, 1], [pad, pad], [1, 1], False,
                                               [0, 0], channels, [True, True, True])


@depthwise_conv_same_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.channels_last), torch.empty_like(weight),
            weight.new_empty(weight.shape[0]))


def _depthwise_setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _depthwise_backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    return depthwise_conv_same_backward(grad.contiguous(memory_format=torch.channels_last), x, weight)


depthwise_conv_same.register_autograd(_depthwise_backward, setup_context=_depthwise_setup_context)
