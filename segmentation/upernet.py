"""UperNet over a timm backbone, as mmseg's ``upernet_*`` ADE20K configs build it.

``UPerHead``: a pyramid pooling module (pool scales 1, 2, 3, 6) on the last feature map, 1x1 lateral convs on
the others, a top-down path that adds each upsampled level to the one below, 3x3 FPN convs, every level
upsampled to stride 4 and fused by a 3x3 conv (512 channels), then dropout 0.1 and a 1x1 classifier.
``FCNHead``: the auxiliary head on stage 3 (one 3x3 conv of 256 channels, dropout 0.1, 1x1 classifier),
whose loss weighs 0.4. Every conv but the classifiers is conv (no bias) + BatchNorm + ReLU, named as mmseg's
ConvModule (``conv``, ``bn``), so the head's state-dict keys are mmseg's. The backbone is timm's
``features_only`` model of the named variant (strides 4, 8, 16, 32), behind ``backbone.model.``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from segmentation.ade import IGNORE_INDEX


class ConvModule(nn.Module):
    """conv (no bias) + BatchNorm + ReLU, with mmseg's ConvModule names and init (Kaiming normal, fan out)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.activate = nn.ReLU(inplace=True)
        nn.init.kaiming_normal_(self.conv.weight, mode='fan_out', nonlinearity='relu')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(self.bn(self.conv(x)))


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


class Segmentor(nn.Module):
    """Backbone + UPerHead (+ FCNHead on the third feature map). Training mode returns (logits, aux logits) at
    stride 4 (the auxiliary ones None without an auxiliary head); eval mode returns the logits upsampled to
    the input's size (mmseg's encode_decode)."""

    def __init__(self, backbone: nn.Module, num_classes: int, channels: int = 512, aux_channels: int = 256,
                 aux: bool = True):
        super().__init__()
        self.backbone = backbone
        in_channels = backbone.feature_info.channels()
        self.decode_head = UPerHead(in_channels, num_classes, channels)
        self.auxiliary_head = FCNHead(in_channels[2], num_classes, aux_channels) if aux else None

    def forward(self, x: torch.Tensor):
        features = self.backbone(x)
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
