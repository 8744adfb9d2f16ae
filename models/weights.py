"""Which set of weights a loader takes from a checkpoint file: the one rule of this repository.

Training checkpoints hold the raw weights (``model``) and often an EMA of them (``model_ema``). A loader
that needs one set takes them in timm's order (the order of ``timm.create_model(checkpoint_path=...)``):
``state_dict_ema``, ``model_ema``, ``state_dict``, ``model``, else the file itself as a bare state dict.
It lives beside the models so that ``pretrained_cfg_overlay=dict(file=...)`` follows it without the
training code.
"""
from typing import Any, Dict, Optional, Tuple

import torch

DEFAULT_WEIGHTS_ORDER: Tuple[str, ...] = ('state_dict_ema', 'model_ema', 'state_dict', 'model')
WEIGHTS_ORDER: Dict[str, Tuple[str, ...]] = {
    'default': DEFAULT_WEIGHTS_ORDER, 'model': ('state_dict', 'model'), 'model_ema': ('state_dict_ema', 'model_ema')}


def is_state_dict(obj: Any) -> bool:
    """A non-empty dict of tensors."""
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def weights_key(ckpt: Any, which: str = 'default') -> Optional[str]:
    """The key of the weights a loader takes ('' for a bare state dict), or None when the file has none.

    which: 'default' (the rule above), 'model' or 'model_ema' (those weights only)."""
    if which not in WEIGHTS_ORDER:
        raise ValueError(f"which must be one of {', '.join(WEIGHTS_ORDER)}, got {which!r}")
    if not isinstance(ckpt, dict):
        return None
    for key in WEIGHTS_ORDER[which]:
        if is_state_dict(ckpt.get(key)):
            return key
    if which != 'model_ema' and is_state_dict(ckpt) and not any(k in ckpt for k in DEFAULT_WEIGHTS_ORDER):
        return ''
    return None
