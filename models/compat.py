"""Every call whose API differs between the supported PyTorch releases (torch 2.4 up to the newest).

Each function uses the current API where the installed torch has it and the equivalent of older
releases otherwise, so the rest of the code base never checks versions. The models package imports
it without the training code on the path; the training code and the tools import it from here.
"""
import contextlib
from typing import Any, Iterator

import torch
import torch.fx._symbolic_trace as _fx_trace

__all__ = ['TORCH_VERSION', 'torch_at_least', 'is_fx_symbolic_tracing', 'is_exporting', 'safe_globals',
           'set_tf32_flags', 'export_dim', 'dynamo_onnx_export_error', 'export_program_error', 'arange', 'total_norm']


def _release(version: str) -> tuple:
    """(major, minor) of a version string such as '2.4.0+cu121'."""
    return tuple(int(p) for p in version.split('+')[0].split('.')[:2])


TORCH_VERSION = _release(torch.__version__)


# The current APIs, None on the releases that lack them.
_FX_SYMBOLIC_TRACING = getattr(_fx_trace, 'is_fx_symbolic_tracing', None)
_IS_EXPORTING = getattr(torch.compiler, 'is_exporting', None)
_SAFE_GLOBALS = getattr(torch.serialization, 'safe_globals', None)
_DIM_DYNAMIC = getattr(torch.export.Dim, 'DYNAMIC', None)
_GET_TOTAL_NORM = getattr(torch.nn.utils, 'get_total_norm', None)


def torch_at_least(version: str) -> bool:
    """Whether the installed torch is at least ``version`` ('2.5')."""
    return TORCH_VERSION >= _release(version)


def is_fx_symbolic_tracing() -> bool:
    """True while torch.fx.symbolic_trace records the model (values are Proxies without a device).

    Older releases only have ``is_fx_tracing``, which symbolic tracing sets there too, but so does
    torch.export's tracing, which is told apart by ``is_exporting``."""
    if _FX_SYMBOLIC_TRACING is not None:
        return _FX_SYMBOLIC_TRACING()
    return _fx_trace.is_fx_tracing() and not is_exporting()


def is_exporting() -> bool:
    """True while torch.export (also the torch.export-based ONNX exporter) traces the model, False
    under torch.compile.

    Releases without ``torch.compiler.is_exporting`` only say "compiling" for both: a non-strict
    export sets that flag without Dynamo, a strict export runs Dynamo in its export mode."""
    if _IS_EXPORTING is not None:
        return _IS_EXPORTING()
    return torch.compiler.is_compiling() and _dynamo_absent_or_exporting()


@torch.compiler.assume_constant_result
def _dynamo_absent_or_exporting() -> bool:
    # Dynamo calls this at trace time (its result becomes a constant of the graph), so it can ask
    # Dynamo's current frame translator whether it traces for torch.export.
    from torch._dynamo import symbolic_convert
    tx = getattr(symbolic_convert.tls, 'current_tx', None)
    return tx is None or bool(getattr(tx, 'export', False))


@contextlib.contextmanager
def safe_globals(classes: list[Any]) -> Iterator[None]:
    """Let torch.load(weights_only=True) unpickle ``classes`` inside the block.

    Releases without ``torch.serialization.safe_globals`` have only the process-wide allow-list:
    the classes are added to it for the block and the previous list is restored afterwards."""
    if _SAFE_GLOBALS is not None:
        with _SAFE_GLOBALS(classes):
            yield
        return
    saved = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals(classes)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def set_tf32_flags(enabled: bool) -> None:
    """Let CUDA fp32 matmuls and cuDNN convolutions use TF32 (``enabled``) or force full fp32.

    Uses the precision settings that every supported release reads consistently:
    ``set_float32_matmul_precision`` and ``cudnn.allow_tf32``. Setting the newer per-backend
    ``fp32_precision`` attributes instead makes later reads through the older names
    (``torch.get_float32_matmul_precision()``, which Inductor's max-autotune calls, and
    ``torch.backends.cuda.matmul.allow_tf32``) raise RuntimeError; with these settings both the old
    and the new names read back the state."""
    torch.set_float32_matmul_precision('high' if enabled else 'highest')
    torch.backends.cudnn.allow_tf32 = enabled


def export_dim(name: str) -> Any:
    """A free dimension for torch.export's ``dynamic_shapes``: ``Dim.DYNAMIC`` (its size and its
    relations to other sizes inferred) where it exists, else a named ``Dim``."""
    return _DIM_DYNAMIC if _DIM_DYNAMIC is not None else torch.export.Dim(name)


def export_program_error() -> str | None:
    """Why a torch.export program of the model cannot be made here (one line), or None if it can.

    Releases without ``Dim.DYNAMIC`` (torch < 2.6) fail on the model: torch 2.4's exporter rejects the
    autocast region of the plain path and its shape solver fails on free stride-32 sizes."""
    if _DIM_DYNAMIC is not None:
        return None
    return (f'a torch.export program of the model needs torch >= 2.6 (installed: {torch.__version__}); '
            'upgrade torch, or use --format torchscript or --format onnx --legacy-onnx')


def dynamo_onnx_export_error() -> str | None:
    """Why ONNX export through torch.export is unavailable here (one line), or None if it is."""
    if torch_at_least('2.6'):
        return None
    return (f'ONNX export through torch.export needs torch >= 2.6 (installed: {torch.__version__}); '
            'upgrade torch or pass --legacy-onnx')


def arange(end: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.arange(end, **kwargs)`` that FX symbolic tracing records when ``end`` is a traced size
    (a Proxy), as current releases do by themselves; older ones reject the Proxy."""
    if isinstance(end, torch.fx.Proxy):
        return end.tracer.create_proxy('call_function', torch.arange, (end,), kwargs)
    return torch.arange(end, **kwargs)


def total_norm(tensors: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm (L2 by default; ``math.inf``: the largest magnitude, NaN if any element is NaN)
    of all ``tensors`` together (``torch.nn.utils.get_total_norm`` where it exists)."""
    if _GET_TOTAL_NORM is not None:
        return _GET_TOTAL_NORM(tensors, norm_type=norm_type)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, norm_type) for t in tensors]),
                                    norm_type)
