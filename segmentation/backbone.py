"""The segmentation model of a timm backbone, the classification weights it starts from (--pretrained) and
the optimizer's parameter groups.

The backbone is ``timm.create_model(name, features_only=True, feature_cls='getter')``: the classification
network without its classifier, behind ``model.``, giving the maps of strides 4, 8, 16 and 32. ``--pretrained``
takes one set of weights of a classification checkpoint or release of this repository by the loaders' rule
(weights.select_weights: the EMA when the file has one; either key layout): every backbone tensor must be there
with its shape (strict), the classifier's tensors are dropped with a note, anything else is an error.
"""
import os
from typing import Any

import timm
import torch

import models  # noqa: F401  (registers the NaLaFormer variants)
from checkpoint_io import load_checkpoint_file
from errors import CheckpointError
from segmentation.upernet import Segmentor
from weights import select_weights

#: the marker segmentation checkpoints carry (checkpoint['task'])
TASK = 'segmentation'


def build_segmentor(name: str, num_classes: int, channels: int = 512, aux: bool = True,
                    drop_path: float | None = None, img_size: int | tuple[int, int] | None = None,
                    decoder: str = 'upernet') -> Segmentor:
    """UperNet, or Semantic FPN with `decoder` 'fpn' (+ the auxiliary FCN head), over timm model `name`.
    `drop_path` None keeps the variant's own rate; `img_size` (a side or (height, width)) is passed to backbones
    built for one input size (Swin)."""
    kwargs: dict[str, Any] = {}
    if drop_path is not None:
        kwargs['drop_path_rate'] = drop_path
    if img_size is not None and timm.create_model(name, pretrained=False).pretrained_cfg.get('fixed_input_size'):
        kwargs['img_size'] = img_size
    backbone = timm.create_model(name, pretrained=False, features_only=True, feature_cls='getter',
                                 out_indices=(0, 1, 2, 3), **kwargs)
    return Segmentor(backbone, num_classes, channels=channels, aux=aux, decoder=decoder)


def classifier_only_keys(name: str) -> set[str]:
    """The state-dict keys of timm model `name` that its features_only backbone leaves out (the classifier and
    whatever feeds only it), built on the meta device: nothing is allocated."""
    with torch.device('meta'):
        full = set(timm.create_model(name, pretrained=False).state_dict())
        kept = {k.removeprefix('model.') for k in timm.create_model(
            name, pretrained=False, features_only=True, feature_cls='getter').state_dict()}
    return full - kept


def read_weights_file(path: str) -> Any:
    """A classification checkpoint (.pth) or release (.safetensors), as loaded, with one-line errors."""
    if path.endswith('.safetensors'):
        if not os.path.isfile(path):
            raise CheckpointError(f'--pretrained {path}: no such file')
        from safetensors.torch import load_file
        return load_file(path)
    return load_checkpoint_file(path)


def load_pretrained(model: Segmentor, path: str, name: str) -> str:
    """Load the backbone of `model` from the classification weights in `path` (see the module docstring);
    returns the line that says what was loaded and dropped."""
    ckpt = read_weights_file(path)
    if isinstance(ckpt, dict) and ckpt.get('task') == TASK:
        raise CheckpointError(f'--pretrained {path} is a segmentation checkpoint; continue it with --resume {path} '
                              f'(or evaluate it with --eval --resume {path})')
    key, sd = select_weights(ckpt, path)
    own = model.backbone.state_dict()
    wanted = {k.removeprefix('model.'): k for k in own}
    missing = [k for k in wanted if k not in sd]
    wrong = [k for k in wanted if k in sd and tuple(sd[k].shape) != tuple(own[wanted[k]].shape)]
    head = classifier_only_keys(name)
    extra = [k for k in sd if k not in wanted]
    unexpected = [k for k in extra if k not in head]
    if missing or wrong or unexpected:
        what = (f'{len(missing)} backbone tensors missing (e.g. {missing[0]})' if missing else
                f'{len(wrong)} backbone tensors of other shapes (e.g. {wrong[0]}: {tuple(sd[wrong[0]].shape)} here, '
                f'{tuple(own[wanted[wrong[0]]].shape)} in {name})' if wrong else
                f"{len(unexpected)} tensors that are not {name}'s (e.g. {unexpected[0]})")
        raise CheckpointError(f'--pretrained {path} does not hold {name} classification weights: {what}; pass a '
                              f'checkpoint or release of --model {name}')
    model.backbone.load_state_dict({wanted[k]: sd[k] for k in wanted}, strict=True)
    weights = f'{key} weights' if key else 'weights'
    dropped = f'; dropped the classifier ({", ".join(sorted(extra))})' if extra else ''
    return f'Pretrained: loaded the {len(wanted)} backbone tensors of {path} ({weights}){dropped}'


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's parameter groups: weight decay on weight matrices and conv kernels, none on 1-d parameters (every
    norm's weight and bias, every bias) nor on what the backbone's no_weight_decay() names (timm's rule)."""
    backbone = getattr(model.backbone, 'model', model.backbone)
    skip = {f'backbone.model.{n}' for n in getattr(backbone, 'no_weight_decay', lambda: set())()}
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or n in skip else decay).append(p)
    return [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
