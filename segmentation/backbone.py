"""The segmentation model of a timm backbone, the classification weights it starts from (--pretrained) and
the optimizer's parameter groups.

The backbone is ``timm.create_model(name, features_only=True, feature_cls='getter')``: the classification
network without its classifier, behind ``model.``, giving the maps of strides 4, 8, 16 and 32. ``--pretrained``
takes one set of weights of a classification checkpoint or release of this repository by the loaders' rule
(run.weights.select_weights: the EMA when the file has one; either key layout): every backbone tensor must be
there with its shape (strict), the classifier's tensors are dropped with a note, anything else is an error.
"""
from typing import Any

import timm
import torch

import models  # noqa: F401  (registers the NaLaFormer variants)
from run.weights import load_backbone_weights
from segmentation.upernet import Segmentor

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


def load_pretrained(model: Segmentor, path: str, name: str) -> str:
    """Load the backbone of `model` from the classification weights in `path` (see the module docstring:
    run.weights.load_backbone_weights); returns the line that says what was loaded and dropped."""
    return load_backbone_weights(model.backbone, path, name, TASK)


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
