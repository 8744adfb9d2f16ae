"""NaLaFormer as a detection backbone: features_only stage maps -> torchvision FPN -> Faster/Mask R-CNN.

    python tools/detection_example.py                    # Faster R-CNN on NALAFORMER_XT, one 512x384 image
    python tools/detection_example.py --mask --model NALAFORMER_T

Builds the detector, runs one training step on a synthetic image with one box (and mask), then one
forward in eval mode, and prints the losses and the number of detections. A starting point for your
own training loop: swap in your data and load backbone weights with ``backbone_checkpoint``.
"""
import argparse
import os
import sys
from collections import OrderedDict
from typing import Sequence

import timm
import torch
import torch.nn as nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import models  # registers the variants
from run.errors import FlagParser, unknown_model


class NaLaFormerFPN(nn.Module):
    """Stage maps at strides 4-32 (``features_only``) -> FPN with ``out_channels`` channels, plus a
    max-pooled level: the five maps torchvision's R-CNN heads expect, keyed '0'-'3' and 'pool'."""

    def __init__(self, model_name: str = 'NALAFORMER_XT', out_channels: int = 256,
                 backbone_checkpoint: str | None = None, **kwargs) -> None:
        super().__init__()
        self.body = timm.create_model(model_name, features_only=True, checkpoint_path=backbone_checkpoint or '',
                                      **kwargs)
        self.fpn = FeaturePyramidNetwork(self.body.feature_info.channels(), out_channels,
                                         extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(self.body(x))))


def build_detector(model_name: str = 'NALAFORMER_XT', num_classes: int = 91, mask: bool = False,
                   min_size: int = 384, max_size: int = 512, **backbone_kwargs) -> nn.Module:
    """Faster R-CNN (or Mask R-CNN with ``mask``) on a NaLaFormer FPN backbone. torchvision resizes
    images so the short side is ``min_size`` (long side at most ``max_size``): 512x384 by default."""
    detector = MaskRCNN if mask else FasterRCNN
    return detector(NaLaFormerFPN(model_name, **backbone_kwargs), num_classes=num_classes,
                    min_size=min_size, max_size=max_size)


def synthetic_sample(height: int = 384, width: int = 512, mask: bool = False, seed: int = 0):
    """One random image and a target with one box (label 1), and its mask for Mask R-CNN."""
    gen = torch.Generator().manual_seed(seed)
    image = torch.rand(3, height, width, generator=gen)
    x0, y0, x1, y1 = width // 4, height // 4, 3 * width // 4, 3 * height // 4
    target = {'boxes': torch.tensor([[x0, y0, x1, y1]], dtype=torch.float32), 'labels': torch.tensor([1])}
    if mask:
        masks = torch.zeros(1, height, width, dtype=torch.uint8)
        masks[0, y0:y1, x0:x1] = 1
        target['masks'] = masks
    return image, target


def train_step_and_predict(detector: nn.Module, images: list[torch.Tensor], targets: list[dict],
                           lr: float = 1e-3) -> dict[str, object]:
    """One SGD step in train mode (returns the loss dict), then a forward in eval mode."""
    detector.train()
    optimizer = torch.optim.SGD([p for p in detector.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    losses = detector(images, targets)
    optimizer.zero_grad()
    sum(losses.values()).backward()
    optimizer.step()
    detector.eval()
    with torch.no_grad():
        detections = detector(images)
    return {'losses': {k: v.item() for k, v in losses.items()}, 'detections': detections}


def main(argv: Sequence[str] | None = None) -> None:
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='NALAFORMER_XT')
    parser.add_argument('--mask', action='store_true', help='Mask R-CNN instead of Faster R-CNN')
    parser.add_argument('--backbone-checkpoint', default=None, help='backbone weights (a classification checkpoint)')
    args = parser.parse_args(argv)
    if args.model.upper() not in models.VARIANTS:
        parser.error('--model: ' + unknown_model(args.model, models.VARIANTS))
    if args.backbone_checkpoint and not os.path.isfile(args.backbone_checkpoint):
        parser.error(f'--backbone-checkpoint {args.backbone_checkpoint}: no such file')
    detector = build_detector(args.model, mask=args.mask, backbone_checkpoint=args.backbone_checkpoint)
    image, target = synthetic_sample(mask=args.mask)
    result = train_step_and_predict(detector, [image], [target])
    print('training losses:', ', '.join(f'{k} {v:.3f}' for k, v in result['losses'].items()))
    print(f"eval: {len(result['detections'][0]['boxes'])} detections on a 512x384 image")


if __name__ == '__main__':
    main()
