"""Numeric precision of a run: the autocast region of --amp fp16/bf16, TF32 on CUDA (--tf32), and the refusal of
bf16 where a GPU would only emulate it."""
from contextlib import nullcontext
from typing import Any

import torch

from errors import UserError
from models.compat import set_tf32_flags

#: --amp's choices and the autocast dtype of each (no --amp: fp32)
AMP_DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


def amp_dtype(amp: str | None) -> torch.dtype | None:
    """The autocast dtype of an --amp value, None for fp32."""
    return AMP_DTYPES.get(amp) if amp else None


def autocast(device: str | torch.device, amp_dtype: torch.dtype | None):
    """torch.autocast on `device`'s type to `amp_dtype`; nothing with None (fp32)."""
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype)


def set_tf32(device, enabled: bool = True) -> bool:
    """Let fp32 matmuls and convolutions use TF32 tensor cores on CUDA (as the reference trained), or force
    full fp32 (`enabled=False`). Does nothing off CUDA; returns whether the flags were set."""
    if torch.device(device).type != 'cuda':
        return False
    set_tf32_flags(enabled)
    return True


def check_bf16(device: Any) -> None:
    """Refuse --amp bf16 on a GPU without native bfloat16 (e.g. V100, T4), where torch would emulate it
    many times slower. Called after the process's GPU is made current, so every rank checks its own."""
    device = torch.device(device)
    if device.type == 'cuda' and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UserError(f'--amp bf16: {torch.cuda.get_device_name(device)} has no native bfloat16 (it would be '
                        f'emulated, many times slower); use --amp fp16')
