"""Mask R-CNN (Faster R-CNN with ``mask=False``) over a timm backbone, built from torchvision's parts with the
settings of mmdet's ``mask_rcnn_r50_fpn`` model; the recipes and their LR as a function of the iteration; the FLOPs
count papers report.

The backbone is ``timm.create_model(name, features_only=True, feature_cls='getter')`` behind
``backbone.body.model.`` (strides 4, 8, 16, 32), a LayerNorm over the channels of each of its four outputs (as the
Swin and ConvNeXt detection backbones add; not for PVTv2, whose stages end in a LayerNorm of their own), then
torchvision's FPN (256 channels, a fifth level max-pooled from the fourth). Where torchvision's Mask R-CNN differs
from mmdet's, the parts here follow mmdet:

- the training RPN keeps 1000 proposals per image after NMS (torchvision: 2000);
- RoIAlign with ``aligned=True`` and ``sampling_ratio=0``, levels by mmdet's rule (``MultiLevelRoIAlign``);
- L1 losses for the RPN's and the R-CNN's box regression (torchvision: smooth L1 with beta 1/9);
- mask targets are RoIAlign (aligned) crops of the ground-truth masks binarised at 0.5 (torchvision: not aligned,
  soft targets);
- low-quality RPN matches need IoU 0.3 or more (mmdet's ``min_pos_iou``; torchvision takes any), the R-CNN's
  matcher has mmdet's ``match_low_quality``;
- anchors are not rounded and level l has its anchors every 2^(l+2) pixels (torchvision rounds them and derives the
  stride from the padded image, which is off for an odd-sized fifth level);
- FPN and box-head layers start as mmdet's (Xavier, normal 0.01 / 0.001 for the predictors);
- images arrive resized by the data pipeline (detection/coco.py): ``PipelineTransform`` normalises them with the
  ImageNet mean and std and pads the batch to a multiple of 32 but does not resize again; predictions come back
  in the coordinates of ``original_sizes`` with masks pasted there as mmdet pastes them, binarised at 0.5.
"""
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.roi_heads import RoIHeads, maskrcnn_inference
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes
from torchvision.ops import FeaturePyramidNetwork, roi_align
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

import models  # noqa: F401  (registers the NaLaFormer variants)
from detection.coco import TrainPipeline
from run.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # mmdet's img_norm_cfg (123.675, 116.28, 103.53) / 255
IMAGENET_STD = (0.229, 0.224, 0.225)
#: timm models whose stages end in a norm of their own: no output norm is added
NORMALISED_STAGES = ('pvt_v2',)


# --------------------------------------------------------------------------------------------------
# Backbone + FPN
# --------------------------------------------------------------------------------------------------
class BackboneFPN(nn.Module):
    """timm features_only backbone (``body``), a norm per output (``norms``), FPN (``fpn``): the maps '0'-'3' and
    'pool' (strides 4-64) with ``out_channels`` channels that torchvision's heads take."""

    def __init__(self, body: nn.Module, channels: int = 256, output_norm: bool = True):
        super().__init__()
        self.body = body
        in_channels = body.feature_info.channels()
        self.norms = nn.ModuleList(LayerNorm2d(c) if output_norm else nn.Identity() for c in in_channels)
        self.fpn = FeaturePyramidNetwork(in_channels, channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = channels
        for m in self.fpn.modules():  # mmdet's FPN init
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> 'OrderedDict[str, torch.Tensor]':
        features = [norm(f) for norm, f in zip(self.norms, self.body(x))]
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(features)))


def build_backbone(name: str, channels: int = 256, drop_path: float | None = None) -> BackboneFPN:
    """BackboneFPN over timm model `name` (random weights); `drop_path` None keeps the model's own rate. Models
    timm builds for one input size (Swin) are built for any size (``strict_img_size=False``: padded windows, masks
    per size, as the Swin detection backbone)."""
    kwargs: dict[str, Any] = {}
    if drop_path is not None:
        kwargs['drop_path_rate'] = drop_path
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is not None and getattr(cfg, 'fixed_input_size', False):
        kwargs['strict_img_size'] = False
    try:
        body = timm.create_model(name, pretrained=False, features_only=True, feature_cls='getter',
                                 out_indices=(0, 1, 2, 3), **kwargs)
    except TypeError as e:
        raise UserError(f'--model {name}: timm builds it for one input size only ({e}); pick a backbone that takes '
                        f'any size (NaLaFormer, convnext_*, pvt_v2_*, swin_*)') from e
    if body.feature_info.reduction() != [4, 8, 16, 32]:
        raise UserError(f'--model {name}: its feature maps have strides {body.feature_info.reduction()}, the FPN '
                        f'needs 4, 8, 16, 32; pick a hierarchical backbone')
    return BackboneFPN(body, channels, output_norm=not name.lower().startswith(NORMALISED_STAGES))


# --------------------------------------------------------------------------------------------------
# The parts that differ from torchvision's defaults
# --------------------------------------------------------------------------------------------------
class MultiLevelRoIAlign(nn.Module):
    """mmdet's SingleRoIExtractor: each box is pooled from level floor(log2(sqrt(area) / 56 + 1e-6)) (clamped to
    0..3, strides 4..32) by RoIAlign with ``aligned`` and ``sampling_ratio`` (0: adaptive). Called as torchvision's
    MultiScaleRoIAlign: (features, boxes per image, image sizes)."""

    def __init__(self, output_size: int, sampling_ratio: int = 0, aligned: bool = True,
                 strides: tuple[int, ...] = (4, 8, 16, 32), finest_scale: int = 56):
        super().__init__()
        self.output_size, self.sampling_ratio, self.aligned = output_size, sampling_ratio, aligned
        self.strides, self.finest_scale = strides, finest_scale
        self.featmap_names = [str(i) for i in range(len(strides))]

    def levels(self, boxes: torch.Tensor) -> torch.Tensor:
        scale = torch.sqrt((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))
        return torch.floor(torch.log2(scale / self.finest_scale + 1e-6)).clamp(0, len(self.strides) - 1).long()

    def forward(self, features: dict[str, torch.Tensor], boxes: list[torch.Tensor],
                image_shapes: list[tuple[int, int]]) -> torch.Tensor:
        first = features[self.featmap_names[0]]
        rois = torch.cat([torch.cat([b.new_full((len(b), 1), i), b], dim=1) for i, b in enumerate(boxes)])
        out = first.new_zeros((len(rois), first.shape[1], self.output_size, self.output_size))
        levels = self.levels(rois[:, 1:])
        for level, (name, stride) in enumerate(zip(self.featmap_names, self.strides)):
            index = torch.where(levels == level)[0]
            if len(index):
                out[index] = roi_align(features[name], rois[index], self.output_size, 1 / stride,
                                       self.sampling_ratio, self.aligned).to(out.dtype)
        return out


class MaxIoUMatcher(det_utils.Matcher):
    """torchvision's Matcher with mmdet's MaxIoUAssigner low-quality rule: a prediction whose IoU with a ground-truth
    box is that box's best (all ties) becomes that box's match when the IoU is at least `min_pos_iou`, the box of
    the highest index winning where several claim one prediction."""

    def __init__(self, high: float, low: float, min_pos_iou: float):
        super().__init__(high, low, allow_low_quality_matches=True)
        self.min_pos_iou = min_pos_iou

    def set_low_quality_matches_(self, matches: torch.Tensor, all_matches: torch.Tensor,
                                 match_quality_matrix: torch.Tensor) -> None:
        best = match_quality_matrix.max(dim=1, keepdim=True).values
        claims = (match_quality_matrix == best) & (best >= self.min_pos_iou)
        gt_index = torch.arange(len(match_quality_matrix), device=matches.device)[:, None]
        last = torch.where(claims, gt_index, torch.full_like(gt_index, -1)).max(dim=0).values
        hit = last >= 0
        matches[hit] = last[hit]


class Anchors(AnchorGenerator):
    """mmdet's AnchorGenerator (scales 8, ratios 0.5/1/2, strides 4..64): base anchors not rounded, and a level's
    anchors every `stride` pixels."""

    def __init__(self, strides: tuple[int, ...] = (4, 8, 16, 32, 64), ratios: tuple[float, ...] = (0.5, 1.0, 2.0)):
        super().__init__(tuple((8 * s,) for s in strides), (ratios,) * len(strides))
        self.strides = strides

    def generate_anchors(self, scales: list[int], aspect_ratios: list[float], dtype: torch.dtype = torch.float32,
                         device: torch.device | str = 'cpu') -> torch.Tensor:
        scales = torch.as_tensor(scales, dtype=dtype, device=device)
        h_ratios = torch.sqrt(torch.as_tensor(aspect_ratios, dtype=dtype, device=device))
        ws = (scales[None, :] / h_ratios[:, None]).view(-1)
        hs = (scales[None, :] * h_ratios[:, None]).view(-1)
        return torch.stack([-ws, -hs, ws, hs], dim=1) / 2

    def forward(self, image_list: ImageList, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        grid_sizes = [list(f.shape[-2:]) for f in feature_maps]
        device = feature_maps[0].device
        self.set_cell_anchors(feature_maps[0].dtype, device)
        strides = [[torch.tensor(s, dtype=torch.int64, device=device)] * 2 for s in self.strides]
        anchors = torch.cat(self.grid_anchors(grid_sizes, strides))
        return [anchors for _ in image_list.image_sizes]


class ProposalNetwork(RegionProposalNetwork):
    """torchvision's RPN with mmdet's L1 box loss (the sum over the sampled positives divided by the number of
    sampled anchors, as both libraries normalise)."""

    def compute_loss(self, objectness: torch.Tensor, pred_bbox_deltas: torch.Tensor, labels: list[torch.Tensor],
                     regression_targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        pos, neg = self.fg_bg_sampler(labels)
        pos, neg = torch.where(torch.cat(pos))[0], torch.where(torch.cat(neg))[0]
        sampled = torch.cat([pos, neg])
        labels, regression_targets = torch.cat(labels), torch.cat(regression_targets)
        box_loss = F.l1_loss(pred_bbox_deltas[pos].float(), regression_targets[pos], reduction='sum')
        objectness_loss = F.binary_cross_entropy_with_logits(objectness.flatten()[sampled].float(), labels[sampled])
        return objectness_loss, box_loss / max(sampled.numel(), 1)


def box_losses(class_logits: torch.Tensor, box_regression: torch.Tensor, labels: list[torch.Tensor],
               regression_targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """mmdet's R-CNN losses: cross-entropy over the sampled RoIs; L1 of the positives' class-specific deltas summed
    and divided by the number of sampled RoIs."""
    labels, regression_targets = torch.cat(labels), torch.cat(regression_targets)
    pos = torch.where(labels > 0)[0]
    deltas = box_regression.reshape(len(labels), -1, 4)[pos, labels[pos]]
    box_loss = F.l1_loss(deltas.float(), regression_targets[pos], reduction='sum') / max(labels.numel(), 1)
    return F.cross_entropy(class_logits.float(), labels), box_loss


def mask_loss(mask_logits: torch.Tensor, proposals: list[torch.Tensor], gt_masks: list[torch.Tensor],
              gt_labels: list[torch.Tensor], matched: list[torch.Tensor]) -> torch.Tensor:
    """mmdet's mask loss: binary cross-entropy of each positive RoI's mask of its class against its ground-truth
    mask cropped by RoIAlign (aligned, adaptive sampling) to the mask size and binarised at 0.5, averaged."""
    size = mask_logits.shape[-1]
    targets, labels = [], []
    for masks, boxes, idx, classes in zip(gt_masks, proposals, matched, gt_labels):
        rois = torch.cat([idx[:, None].to(boxes), boxes], dim=1)
        crops = roi_align(masks[:, None].to(boxes), rois, (size, size), 1.0, 0, True)[:, 0]
        targets.append((crops >= 0.5).to(crops.dtype))
        labels.append(classes[idx])
    targets, labels = torch.cat(targets), torch.cat(labels)
    if targets.numel() == 0:
        return mask_logits.sum() * 0
    logits = mask_logits[torch.arange(len(labels), device=labels.device), labels]
    return F.binary_cross_entropy_with_logits(logits.float(), targets)


class MmdetRoIHeads(RoIHeads):
    """torchvision's RoIHeads with the losses of mmdet (``box_losses``, ``mask_loss``); inference unchanged (the
    class-specific boxes, score threshold, NMS per class, top detections; the mask of the predicted class)."""

    def forward(self, features: dict[str, torch.Tensor], proposals: list[torch.Tensor],
                image_shapes: list[tuple[int, int]], targets: list[dict[str, torch.Tensor]] | None = None):
        if self.training:
            proposals, matched_idxs, labels, regression_targets = self.select_training_samples(proposals, targets)
        class_logits, box_regression = self.box_predictor(self.box_head(self.box_roi_pool(features, proposals,
                                                                                          image_shapes)))
        result: list[dict[str, torch.Tensor]] = []
        losses: dict[str, torch.Tensor] = {}
        if self.training:
            losses['loss_classifier'], losses['loss_box_reg'] = box_losses(class_logits, box_regression, labels,
                                                                           regression_targets)
        else:
            boxes, scores, classes = self.postprocess_detections(class_logits, box_regression, proposals, image_shapes)
            result = [{'boxes': b, 'labels': c, 'scores': s} for b, s, c in zip(boxes, scores, classes)]
        if self.has_mask():
            if self.training:
                positive = [torch.where(lab > 0)[0] for lab in labels]
                mask_proposals = [p[i] for p, i in zip(proposals, positive)]
                matched = [m[i] for m, i in zip(matched_idxs, positive)]
            else:
                mask_proposals = [r['boxes'] for r in result]
            logits = self.mask_predictor(self.mask_head(self.mask_roi_pool(features, mask_proposals, image_shapes)))
            if self.training:
                losses['loss_mask'] = mask_loss(logits, mask_proposals, [t['masks'] for t in targets],
                                                [t['labels'] for t in targets], matched)
            else:
                for probs, r in zip(maskrcnn_inference(logits, [r['labels'] for r in result]), result):
                    r['masks'] = probs
        return result, losses


def paste_masks(probs: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int],
                threshold: float = 0.5) -> torch.Tensor:
    """mmdet's _do_paste_mask: each (M, M) mask probability map bilinearly sampled (grid_sample, align_corners=False)
    at the centres of the image's pixels inside its box (scaled to the box), then >= `threshold`: (N, H, W) bool."""
    h, w = size
    out = torch.zeros((len(probs), h, w), dtype=torch.bool, device=probs.device)
    for i, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
        xa, ya = max(math.floor(x0) - 1, 0), max(math.floor(y0) - 1, 0)
        xb, yb = min(math.ceil(x1) + 1, w), min(math.ceil(y1) + 1, h)
        if xb <= xa or yb <= ya or x1 <= x0 or y1 <= y0:
            continue
        ys = (torch.arange(ya, yb, device=probs.device, dtype=torch.float32) + 0.5 - y0) / (y1 - y0) * 2 - 1
        xs = (torch.arange(xa, xb, device=probs.device, dtype=torch.float32) + 0.5 - x0) / (x1 - x0) * 2 - 1
        grid = torch.stack([xs[None, :].expand(len(ys), -1), ys[:, None].expand(-1, len(xs))], dim=-1)
        pasted = F.grid_sample(probs[i][None, None].float(), grid[None], align_corners=False)[0, 0]
        out[i, ya:yb, xa:xb] = pasted >= threshold
    return out


class PipelineTransform(GeneralizedRCNNTransform):
    """GeneralizedRCNNTransform that takes images the data pipeline has resized: it normalises them (uint8 0..255
    or float 0..1) with the ImageNet mean and std and pads the batch to a multiple of 32 (zeros after
    normalisation, as mmdet's Pad), without resizing; postprocess rescales the boxes to the original sizes and pastes
    the masks there (``paste_masks``)."""

    def __init__(self, mask_threshold: float = 0.5):
        super().__init__(min_size=800, max_size=1333, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD),
                         size_divisible=32)
        self.mask_threshold = mask_threshold

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        if not image.is_floating_point():
            image = image.float() / 255
        return super().normalize(image)

    def resize(self, image: torch.Tensor, target: dict[str, torch.Tensor] | None = None):
        return image, target

    def postprocess(self, result: list[dict[str, torch.Tensor]], image_shapes: list[tuple[int, int]],
                    original_image_sizes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        for det, shape, original in zip(result, image_shapes, original_image_sizes):
            det['boxes'] = resize_boxes(det['boxes'], shape, original)
            if 'masks' in det:
                det['masks'] = paste_masks(det['masks'][:, 0], det['boxes'], tuple(original), self.mask_threshold)
        return result


# --------------------------------------------------------------------------------------------------
# The detector
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Heads:
    """Widths and sampling of the FPN and the R-CNN heads; the defaults are mmdet's mask_rcnn_r50_fpn."""
    fpn_channels: int = 256
    box_fc: int = 1024  # the two fully connected layers of the box head (Shared2FCBBoxHead)
    mask_convs: int = 4  # FCNMaskHead's 3x3 convs
    mask_channels: int = 256
    rpn_batch: int = 256  # anchors sampled per image for the RPN losses, half positive at most
    roi_batch: int = 512  # proposals sampled per image for the R-CNN losses, a quarter positive at most
    rpn_pre_nms: tuple[int, int] = (2000, 1000)  # top anchors per level before the RPN's NMS (training, test)
    rpn_post_nms: tuple[int, int] = (1000, 1000)  # proposals kept per image after it (training, test)
    score_thresh: float = 0.05
    nms_thresh: float = 0.5
    detections: int = 100
    mask_threshold: float = 0.5


#: the demo's narrow heads (make det-demo): on 128-192 px images the full-width FPN and heads would take most of a
#: CPU step; the sampling and every threshold stay mmdet's
DEMO_HEADS = Heads(fpn_channels=64, box_fc=256, mask_channels=64, roi_batch=128)


class Detector(GeneralizedRCNN):
    """Mask R-CNN (Faster R-CNN when built without mask) with the parts above. ``model(images, targets)`` in
    training mode returns the losses; ``model(images, original_sizes=...)`` in eval mode returns per image 'boxes'
    (x1y1x2y2 in the original image's pixels), 'labels' (1..classes), 'scores' and with masks 'masks' ((N, H, W)
    bool at the original size). Images are 3xHxW, uint8 or float in 0..1, already resized."""

    def __init__(self, backbone: BackboneFPN, num_classes: int, mask: bool = True, heads: Heads = Heads()):
        channels = backbone.out_channels
        rpn = ProposalNetwork(
            Anchors(), RPNHead(channels, 3), fg_iou_thresh=0.7, bg_iou_thresh=0.3,
            batch_size_per_image=heads.rpn_batch, positive_fraction=0.5,
            pre_nms_top_n=dict(training=heads.rpn_pre_nms[0], testing=heads.rpn_pre_nms[1]),
            post_nms_top_n=dict(training=heads.rpn_post_nms[0], testing=heads.rpn_post_nms[1]), nms_thresh=0.7)
        rpn.proposal_matcher = MaxIoUMatcher(0.7, 0.3, min_pos_iou=0.3)
        box_head = TwoMLPHead(channels * 7 * 7, heads.box_fc)
        box_predictor = FastRCNNPredictor(heads.box_fc, num_classes + 1)
        masks: dict[str, Any] = {}
        if mask:
            masks = dict(mask_roi_pool=MultiLevelRoIAlign(14),
                         mask_head=MaskRCNNHeads(channels, [heads.mask_channels] * heads.mask_convs, 1),
                         mask_predictor=MaskRCNNPredictor(heads.mask_channels, heads.mask_channels, num_classes + 1))
        roi_heads = MmdetRoIHeads(
            MultiLevelRoIAlign(7), box_head, box_predictor, fg_iou_thresh=0.5, bg_iou_thresh=0.5,
            batch_size_per_image=heads.roi_batch, positive_fraction=0.25, bbox_reg_weights=(10.0, 10.0, 5.0, 5.0),
            score_thresh=heads.score_thresh, nms_thresh=heads.nms_thresh, detections_per_img=heads.detections,
            **masks)
        roi_heads.proposal_matcher = MaxIoUMatcher(0.5, 0.5, min_pos_iou=0.5)
        super().__init__(backbone, rpn, roi_heads, PipelineTransform(heads.mask_threshold))
        self.num_classes, self.mask, self.heads = num_classes, mask, heads
        for fc in (box_head.fc6, box_head.fc7):  # mmdet's Shared2FCBBoxHead init
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)
        for layer, std in ((box_predictor.cls_score, 0.01), (box_predictor.bbox_pred, 0.001)):
            nn.init.normal_(layer.weight, std=std)
            nn.init.zeros_(layer.bias)

    def forward(self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]] | None = None,
                original_sizes: list[tuple[int, int]] | None = None):
        sizes = [tuple(im.shape[-2:]) for im in images]
        batch, targets = self.transform(images, targets)
        features = self.backbone(batch.tensors)
        proposals, rpn_losses = self.rpn(batch, features, targets)
        detections, roi_losses = self.roi_heads(features, proposals, batch.image_sizes, targets)
        if self.training:
            return {**rpn_losses, **roi_losses}
        return self.transform.postprocess(detections, batch.image_sizes, original_sizes or sizes)


def build_detector(name: str, num_classes: int, mask: bool = True, heads: Heads = Heads(),
                   drop_path: float | None = None) -> Detector:
    """Mask R-CNN (or Faster R-CNN) over timm model `name` for `num_classes` object classes (labels 1..N)."""
    return Detector(build_backbone(name, heads.fpn_channels, drop_path), num_classes, mask, heads)


# --------------------------------------------------------------------------------------------------
# Recipes and the LR
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """A training recipe (docs/detection.md gives each field's source). `batch_size` is the global batch;
    `lr_steps` are the epochs from which the LR is multiplied by `gamma` once more."""
    name: str
    lr: float
    weight_decay: float
    epochs: int
    lr_steps: tuple[int, ...]
    pipeline: TrainPipeline = field(default_factory=TrainPipeline)
    norm_bias_decay: bool = False
    gamma: float = 0.1
    warmup_iters: int = 500
    warmup_ratio: float = 0.001
    batch_size: int = 16
    per_process: int = 2  # --batch-size's default: 8 processes x 2
    betas: tuple[float, float] = (0.9, 0.999)
    test_scale: tuple[int, int] = (1333, 800)
    heads: Heads = field(default_factory=Heads)


RECIPES = {
    '1x': Recipe('1x', lr=1e-4, weight_decay=0.05, epochs=12, lr_steps=(8, 11)),
    'pvt-1x': Recipe('pvt-1x', lr=2e-4, weight_decay=1e-4, epochs=12, lr_steps=(8, 11),
                     pipeline=TrainPipeline(scales=(800,), crop_scales=()), norm_bias_decay=True),
    '3x': Recipe('3x', lr=1e-4, weight_decay=0.05, epochs=36, lr_steps=(27, 33)),
    # make det-demo: the 1x machinery scaled to detection/shapes.py's 128-176 px images on one CPU process
    'demo': Recipe('demo', lr=1e-3, weight_decay=0.05, epochs=3, lr_steps=(2,), warmup_iters=15, batch_size=4,
                   per_process=4, test_scale=(320, 160), heads=DEMO_HEADS,
                   pipeline=TrainPipeline(scales=(128, 144, 160, 176, 192), max_size=320, crop_scales=(96, 120, 144),
                                          crop_range=(92, 144))),
}


def step_lr(iteration: int, steps_per_epoch: int, recipe: Recipe) -> float:
    """The LR of 0-based `iteration`: mmdet's step schedule by epoch (lr x gamma^(steps passed), epoch = iteration
    // steps_per_epoch) times mmcv's linear warmup by iteration (1 - (1 - it / warmup_iters)(1 - warmup_ratio)
    for the first warmup_iters)."""
    epoch = iteration // steps_per_epoch
    lr = recipe.lr * recipe.gamma ** sum(epoch >= s for s in recipe.lr_steps)
    if iteration < recipe.warmup_iters:
        lr *= 1 - (1 - iteration / recipe.warmup_iters) * (1 - recipe.warmup_ratio)
    return lr


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------
class FlopsForward(nn.Module):
    """The forward papers count (mmdet's forward_dummy, which Swin's and PVT's get_flops run): backbone and FPN, the
    RPN head on every level, the box head on 1000 proposals and the mask head on 100 of them, no NMS."""

    def __init__(self, detector: Detector, proposals: int = 1000, masks: int = 100):
        super().__init__()
        self.detector, self.proposals, self.masks = detector, proposals, masks

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = self.detector
        features = d.backbone(x)
        objectness, deltas = d.rpn.head(list(features.values()))
        h, w = x.shape[-2:]
        g = torch.Generator().manual_seed(0)
        xy = torch.rand(self.proposals, 2, generator=g) * torch.tensor([w, h]) * 0.8
        boxes = torch.cat([xy, xy + torch.rand(self.proposals, 2, generator=g) * torch.tensor([w, h]) * 0.2 + 1], 1)
        boxes = boxes.to(x)
        roi = d.roi_heads
        outs = [*objectness, *deltas, *roi.box_predictor(roi.box_head(roi.box_roi_pool(features, [boxes], [(h, w)])))]
        if roi.has_mask():
            outs.append(roi.mask_predictor(roi.mask_head(roi.mask_roi_pool(features, [boxes[:self.masks]], [(h, w)]))))
        return tuple(outs)


def count_detector_flops(detector: Detector, size: tuple[int, int] = (1280, 800)) -> dict[str, int]:
    """fvcore multiply-adds (papers' "FLOPs") of `FlopsForward` at `size` (height, width; mmdet's get_flops
    default 1280x800), and of the backbone alone."""
    from models.flop_count import count_flops
    return {'total': count_flops(FlopsForward(detector), size), 'backbone': count_flops(detector.backbone.body, size)}
