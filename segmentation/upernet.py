"""UperNet and Semantic FPN over a timm backbone, as mmseg's ``upernet_*`` and ``fpn_*`` ADE20K configs build them.

``UPerHead``: a pyramid pooling module (pool scales 1, 2, 3, 6) on the last feature map, 1x1 lateral convs on
the others, a top-down path that adds each upsampled level to the one below, 3x3 FPN convs, every level
upsampled to stride 4 and fused by a 3x3 conv (512 channels), then dropout 0.1 and a 1x1 classifier.
``FCNHead``: the auxiliary head on stage 3 (one 3x3 conv of 256 channels, dropout 0.1, 1x1 classifier),
whose loss weighs 0.4. Every conv but the classifiers is conv (no bias) + BatchNorm + ReLU, named as mmseg's
ConvModule (``conv``, ``bn``), so the head's state-dict keys are mmseg's. The backbone is timm's
``features_only`` model of the named variant (strides 4, 8, 16, 32), behind ``backbone.model.``.

Semantic FPN (``decoder='fpn'``, the PVT-style repositories' ADE20K recipe): mmseg's ``FPN`` neck (1x1 lateral
convs to 256 channels, a top-down path adding each nearest-upsampled level to the one below, 3x3 output convs;
plain convs with bias, no norm, Xavier-uniform init as its init_cfg) and ``FPNHead`` (per level 3x3 conv + BN +
ReLU blocks of 128 channels, each but stride 4's followed by a 2x bilinear upsampling until stride 4, the levels
summed, then dropout 0.1 and the 1x1 classifier); no auxiliary head in its recipe.

``build_segmentor`` builds either over ``timm.create_model(name, features_only=True, feature_cls='getter')``;
``--pretrained`` loads its backbone by run.weights.load_backbone_weights (the EMA weights when the file has them,
every backbone tensor with its shape, the classifier dropped with a note).
"""
import math
from typing import Any

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import models  # noqa: F401  (registers the NaLaFormer variants)
from segmentation.ade import IGNORE_INDEX

#: the marker segmentation checkpoints carry (checkpoint['task'])
TASK = 'segmentation'


class ConvModule(nn.Module):
    """conv (no bias) + BatchNorm + ReLU, with mmseg's ConvModule names and init (Kaiming normal, fan out); with
    `norm_act` False a plain conv with bias (mmseg's ConvModule without norm and activation)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, norm_act: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=not norm_act)
        self.bn = nn.BatchNorm2d(out_channels) if norm_act else None
        self.activate = nn.ReLU(inplace=True) if norm_act else None
        nn.init.kaiming_normal_(self.conv.weight, mode='fan_out', nonlinearity='relu')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x if self.bn is None else self.activate(self.bn(x))


def resize(x: torch.Tensor, size) -> torch.Tensor:
    """Bilinear resize without corner alignment (mmseg's resize with align_corners=False)."""
    return F.interpolate(x, size=size, mode='bilinear', align_corners=False)


class DecodeHead(nn.Module):
    """What every head ends with: dropout, then the 1x1 classifier (``conv_seg``, normal init std 0.01)."""

    def __init__(self, channels: int, num_classes: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout2d(dropout) if dropout > 0 else nn.Identity()
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)
        nn.init.normal_(self.conv_seg.weight, std=0.01)
        nn.init.zeros_(self.conv_seg.bias)

    def cls_seg(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_seg(self.dropout(x))


class UPerHead(DecodeHead):
    """mmseg's UPerHead on feature maps with `in_channels` (strides 4, 8, 16, 32); logits at stride 4."""

    def __init__(self, in_channels: list[int], num_classes: int, channels: int = 512,
                 pool_scales: tuple[int, ...] = (1, 2, 3, 6), dropout: float = 0.1):
        super().__init__(channels, num_classes, dropout)
        self.psp_modules = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(s), ConvModule(in_channels[-1], channels, 1)) for s in pool_scales)
        self.bottleneck = ConvModule(in_channels[-1] + len(pool_scales) * channels, channels, 3)
        self.lateral_convs = nn.ModuleList(ConvModule(c, channels, 1) for c in in_channels[:-1])
        self.fpn_convs = nn.ModuleList(ConvModule(channels, channels, 3) for _ in in_channels[:-1])
        self.fpn_bottleneck = ConvModule(len(in_channels) * channels, channels, 3)

    def psp_forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [resize(ppm(x), x.shape[2:]) for ppm in self.psp_modules]
        return self.bottleneck(torch.cat([x, *pooled], dim=1))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        laterals = [conv(f) for conv, f in zip(self.lateral_convs, features)]
        laterals.append(self.psp_forward(features[-1]))
        for i in range(len(laterals) - 1, 0, -1):  # top-down: each level gets the (summed) level above it
            laterals[i - 1] = laterals[i - 1] + resize(laterals[i], laterals[i - 1].shape[2:])
        outs = [conv(lat) for conv, lat in zip(self.fpn_convs, laterals)] + [laterals[-1]]
        outs = [outs[0]] + [resize(o, outs[0].shape[2:]) for o in outs[1:]]
        return self.cls_seg(self.fpn_bottleneck(torch.cat(outs, dim=1)))


class FCNHead(DecodeHead):
    """mmseg's FCNHead with one 3x3 conv (num_convs=1, concat_input=False): the auxiliary head."""

    def __init__(self, in_channels: int, num_classes: int, channels: int = 256, dropout: float = 0.1):
        super().__init__(channels, num_classes, dropout)
        self.convs = nn.Sequential(ConvModule(in_channels, channels, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls_seg(self.convs(x))


class FPN(nn.Module):
    """mmseg's FPN neck as Semantic FPN uses it: `in_channels` maps (strides 4..32) to as many of `channels`."""

    def __init__(self, in_channels: list[int], channels: int = 256):
        super().__init__()
        self.lateral_convs = nn.ModuleList(ConvModule(c, channels, 1, norm_act=False) for c in in_channels)
        self.fpn_convs = nn.ModuleList(ConvModule(channels, channels, 3, norm_act=False) for _ in in_channels)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        laterals = [conv(f) for conv, f in zip(self.lateral_convs, features)]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], size=laterals[i - 1].shape[2:],
                                                              mode='nearest')
        return [conv(lat) for conv, lat in zip(self.fpn_convs, laterals)]


class FPNHead(DecodeHead):
    """mmseg's FPNHead over maps of `in_channels` at `strides`: logits at the first map's stride (4)."""

    def __init__(self, in_channels: int, num_classes: int, channels: int = 128,
                 strides: tuple[int, ...] = (4, 8, 16, 32), dropout: float = 0.1):
        super().__init__(channels, num_classes, dropout)
        self.scale_heads = nn.ModuleList()
        for stride in strides:
            layers: list[nn.Module] = []
            for k in range(max(1, int(math.log2(stride) - math.log2(strides[0])))):
                layers.append(ConvModule(in_channels if k == 0 else channels, channels, 3))
                if stride != strides[0]:
                    layers.append(nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False))
            self.scale_heads.append(nn.Sequential(*layers))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        out = self.scale_heads[0](features[0])
        for head, f in zip(self.scale_heads[1:], features[1:]):
            out = out + resize(head(f), out.shape[2:])
        return self.cls_seg(out)


DECODERS = ('upernet', 'fpn')
FPN_CHANNELS = 256  # Semantic FPN's neck


class Segmentor(nn.Module):
    """Backbone + decoder: UPerHead, or (`decoder='fpn'`) the FPN neck and FPNHead (+ an FCNHead on the third
    map: the backbone's, or the neck's with one, as mmseg feeds it). Training mode returns (logits, aux logits) at
    stride 4 (the auxiliary ones None without an auxiliary head); eval mode returns the logits upsampled to the
    input's size (mmseg's encode_decode). `description` names the decoder for the run's Model line."""

    def __init__(self, backbone: nn.Module, num_classes: int, channels: int = 512, aux_channels: int = 256,
                 aux: bool = True, decoder: str = 'upernet'):
        super().__init__()
        if decoder not in DECODERS:
            raise ValueError(f'decoder {decoder!r}: one of {", ".join(DECODERS)}')
        self.backbone = backbone
        in_channels = backbone.feature_info.channels()
        if decoder == 'fpn':
            self.neck = FPN(in_channels, FPN_CHANNELS)
            in_channels = [FPN_CHANNELS] * len(in_channels)
            self.decode_head = FPNHead(FPN_CHANNELS, num_classes, channels)
            self.description = f'Semantic FPN (neck {FPN_CHANNELS}, head {channels} channels'
        else:
            self.neck = None
            self.decode_head = UPerHead(in_channels, num_classes, channels)
            self.description = f'UperNet ({channels} channels'
        self.auxiliary_head = FCNHead(in_channels[2], num_classes, aux_channels) if aux else None
        self.description += ', auxiliary FCN head)' if aux else ')'

    def forward(self, x: torch.Tensor):
        features = self.backbone(x)
        if self.neck is not None:
            features = self.neck(features)
        logits = self.decode_head(features)
        if not self.training:
            return resize(logits, x.shape[2:])
        return logits, self.auxiliary_head(features[2]) if self.auxiliary_head is not None else None


class SegLoss(nn.Module):
    """mmseg's decode and auxiliary losses: cross-entropy of the logits upsampled to the label's size, 255
    ignored, averaged over every pixel (mmseg's default avg_non_ignore=False: ignored pixels count as zero
    loss), the auxiliary head's weighted by `aux_weight`. Called as criterion(samples, outputs, labels), the
    engine's optimizer step's convention."""

    def __init__(self, aux_weight: float = 0.4):
        super().__init__()
        self.aux_weight = aux_weight

    @staticmethod
    def pixel_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = resize(logits.float(), labels.shape[-2:])
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction='none').mean()

    def forward(self, samples: torch.Tensor, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = outputs
        loss = self.pixel_ce(logits, labels)
        if aux is not None:
            loss = loss + self.aux_weight * self.pixel_ce(aux, labels)
        return loss


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
