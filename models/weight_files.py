"""Which set of weights a loader takes from a checkpoint file (the one rule of this repository), and what
a weights file records about itself (its number of classes, the input size and crop it was evaluated at).

Training checkpoints hold the raw weights (``model``) and often an EMA of them (``model_ema``). A loader
that needs one set takes them in timm's order (the order of ``timm.create_model(checkpoint_path=...)``):
``state_dict_ema``, ``model_ema``, ``state_dict``, ``model``, else the file itself as a bare state dict.
It lives beside the models so that ``pretrained_cfg_overlay=dict(file=...)`` follows it without the
training code; loading for training, with one-line diagnoses, is the repository's run/weights.py.
"""
import argparse
import zipfile
from typing import Any

import torch

from .compat import safe_globals

DEFAULT_WEIGHTS_ORDER: tuple[str, ...] = ('state_dict_ema', 'model_ema', 'state_dict', 'model')
WEIGHTS_ORDER: dict[str, tuple[str, ...]] = {
    'default': DEFAULT_WEIGHTS_ORDER, 'model': ('state_dict', 'model'), 'model_ema': ('state_dict_ema', 'model_ema')}


def is_state_dict(obj: Any) -> bool:
    """A non-empty dict of tensors."""
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def weights_key(ckpt: Any, which: str = 'default') -> str | None:
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


def is_safetensors(path: str) -> bool:
    """Whether the file `path` is a safetensors file (a release of tools/release.py, whatever its name ends
    with): an 8-byte little-endian header length, then that many bytes of JSON object."""
    try:
        with open(path, 'rb') as f:
            head = f.read(9)
            size = f.seek(0, 2)
    except OSError:
        return False
    n = int.from_bytes(head[:8], 'little') if len(head) == 9 else 0
    return head[8:9] == b'{' and 2 <= n <= size - 8


def file_num_classes(path: str, classifier: str = 'head') -> int | None:
    """Number of classes of the weights in ``path`` (a release ``.safetensors`` file, a state dict or a
    training checkpoint): the ``num_classes`` a release records, else the rows of ``<classifier>.weight``
    of the weights the rule above takes. None when the file does not tell (no classifier, unreadable)."""
    try:
        if is_safetensors(path):
            from safetensors import safe_open
            with safe_open(path, framework='pt') as f:
                recorded = (f.metadata() or {}).get('num_classes', '')
                if recorded.isdigit():
                    return int(recorded)
                keys = [k for k in f.keys() if k.removeprefix('module.') == f'{classifier}.weight']
                return int(f.get_slice(keys[0]).get_shape()[0]) if keys else None
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception:  # the loader that follows reports an unreadable file with its own message
        return None
    key = weights_key(ckpt)
    sd = ckpt if key == '' else ckpt.get(key) if key else None
    weight = next((v for k, v in (sd or {}).items() if k.split('module.')[-1] == f'{classifier}.weight'), None)
    return int(weight.shape[0]) if weight is not None and weight.dim() >= 1 else None


#: inputs of at most this many pixels a side are evaluated as DeiT does: resized to the input size, nothing cropped
SMALL_INPUT = 32


def small_input_eval(input_size: int) -> dict[str, Any]:
    """The data-config entries of DeiT's small-image evaluation at `input_size` (a resize to the input size,
    no crop); {} above SMALL_INPUT px."""
    return {'crop_pct': 1.0, 'crop_mode': 'squash'} if input_size <= SMALL_INPUT else {}


def file_eval_config(path: str) -> dict[str, Any]:
    """The evaluation settings the weights file `path` records, as pretrained_cfg entries (``input_size``,
    ``crop_pct``, ``crop_mode``): a release's metadata, or the --input-size and --eval-crop-ratio of a training
    checkpoint's args (read memory-mapped: its tensors are not loaded). Empty when it records no input size or
    cannot be read (the loader that follows reports an unreadable file)."""
    try:
        if is_safetensors(path):
            from safetensors import safe_open
            with safe_open(path, framework='pt') as f:
                recorded = f.metadata() or {}
            size, crop, mode = recorded.get('input_size'), recorded.get('crop_pct'), recorded.get('crop_mode')
        else:
            with safe_globals([argparse.Namespace]):  # reference checkpoints store their args as a Namespace
                ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=zipfile.is_zipfile(path))
            args = ckpt.get('args') if isinstance(ckpt, dict) else None
            args = vars(args) if isinstance(args, argparse.Namespace) else args if isinstance(args, dict) else {}
            size, crop, mode = args.get('input_size'), args.get('eval_crop_ratio'), None
        size = int(size) if size else None
        crop = float(crop) if crop else None
    except Exception:  # unreadable or odd values: the file's loader has the word on the file itself
        return {}
    if not size:
        return {}
    cfg: dict[str, Any] = {'input_size': (3, size, size)}
    if crop:
        cfg['crop_pct'] = crop
    if mode:
        cfg['crop_mode'] = str(mode)
    cfg.update(small_input_eval(size))
    return cfg


