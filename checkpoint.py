"""The checkpoint format of NaLaFormer training runs, and reading a checkpoint's recorded command line.

A training checkpoint is a dict with the reference checkpoints' entries (the weights in this model's key layout;
loaders also take the reference layout), loadable with ``torch.load(weights_only=True)``:

    model, model_ema         state dicts without a ``module.`` prefix (model_ema only with an EMA)
    optimizer, lr_scheduler  their state dicts
    scaler                   the fp16 GradScaler's state dict, or None
    epoch                    the last finished epoch (or, with ``step``, the epoch stopped in the middle)
    args                     the command line as a plain dict
    max_accuracy             best top-1 so far, max over the model and the EMA
    n_parameters             trainable parameters

and ours: ``best_weights`` ('model' or 'model_ema': which weights gave max_accuracy), ``best_epoch``,
``best_acc1`` (the two accuracies of that epoch), ``acc1`` (this epoch's two accuracies; None when a stop cut
the epoch's evaluation short, which the resumed run then does first), ``log`` (the epoch's log.txt record),
``files`` (the names this state was written to), ``classes`` and ``n_train_images`` (the training data),
``rng_state`` (one entry per process), ``train_carry`` (the skipped-step counts); mid-epoch stops add ``step``,
``epoch_rng_state`` and ``loss_meter`` (one entry per process; these and ``rng_state``, ``train_carry`` hold a
``train_state.EpochState``), and ``checksum`` (a sha256 of every part, verified on load).

Who does what with it: saver.py writes a run's checkpoints and names them, resume.py restores a run from one,
checkpoint_io.py reads and writes the files (a release's safetensors reads as a checkpoint of weights only),
weights.py takes one set of weights from one.
"""
import argparse
from typing import Any

import numpy as np
import torch

from checkpoint_io import load_checkpoint_file


def saved_args(ckpt: Any) -> dict[str, Any]:
    """The command line stored in a checkpoint as a dict (ours store a dict, the reference's a Namespace)."""
    args = ckpt.get('args') if isinstance(ckpt, dict) else None
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args) if isinstance(args, dict) else {}


def recorded_args(path: str) -> dict[str, Any]:
    """The command line the checkpoint file `path` records (saved_args), read before the run builds anything:
    memory-mapped, so its tensors are not read (the full load, checksum verified, comes later)."""
    return saved_args(load_checkpoint_file(path, verify=False, mmap=True))


def describe_best(ckpt: Any) -> str:
    """Which weights a checkpoint records as its best, in words."""
    if not isinstance(ckpt, dict) or 'max_accuracy' not in ckpt:
        return ''
    which = ckpt.get('best_weights')
    if which not in ('model', 'model_ema'):
        return ('the checkpoint does not record which weights gave its best accuracy '
                f'({float(ckpt["max_accuracy"]):.2f}%)')
    epoch = f' at epoch {ckpt["best_epoch"]}' if ckpt.get('best_epoch') is not None else ''
    return (f'the checkpoint records its best accuracy, {float(ckpt["max_accuracy"]):.2f}%{epoch}, from the '
            f'{"EMA" if which == "model_ema" else "model"} weights')


def comparable(v: Any) -> Any:
    """A list as a tuple, so that a value read back from a checkpoint compares equal to the one it was."""
    return tuple(v) if isinstance(v, list) else v


def _to_plain(obj: Any) -> Any:
    """Convert to types that torch.load(weights_only=True) accepts (dict/list/tuple/str/int/float/bool/None)."""
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def args_to_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The command line as a plain dict (the checkpoint's ``args``)."""
    return _to_plain(dict(vars(args)))
