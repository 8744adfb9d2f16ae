"""mIoU, mAcc and aAcc from one confusion matrix summed over every validation image, as mmseg computes them,
exact under DDP: each process scores its own images (samplers.DistributedEvalSampler: every image on exactly
one process, no padding) and one all_reduce sums the integer matrices, so the figures are those of one
process. Inference: "whole" (the rescaled image in one forward) or "slide" (crops with a stride, overlaps
averaged), the logits resized to the label map's original size, as mmseg's single-scale test.
"""
import math
from typing import Any

import torch
import torch.nn.functional as F

from distributed import is_dist_avail_and_initialized
from precision import autocast
from segmentation.ade import IGNORE_INDEX


def confusion_matrix(pred: torch.Tensor, label: torch.Tensor, num_classes: int) -> torch.Tensor:
    """int64 (num_classes, num_classes) counts of (label row, prediction column) over the pixels whose label is
    not IGNORE_INDEX."""
    label = label.reshape(-1).long()
    valid = label != IGNORE_INDEX
    index = label[valid] * num_classes + pred.reshape(-1).long()[valid]
    return torch.bincount(index, minlength=num_classes ** 2).reshape(num_classes, num_classes)


def scores(matrix: torch.Tensor) -> dict[str, Any]:
    """mmseg's metrics from a confusion matrix: per class IoU = TP / (TP + FP + FN) and Acc = TP / labelled,
    mIoU and mAcc their means over the classes where they are defined (a class neither labelled nor predicted
    has no IoU; one never labelled has no Acc), aAcc = all TP / all labelled pixels; in percent."""
    m = matrix.double()
    tp, labelled, predicted = m.diag(), m.sum(1), m.sum(0)
    union = labelled + predicted - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.nan)
    acc = torch.where(labelled > 0, tp / labelled.clamp(min=1), torch.nan)
    total = labelled.sum().item()
    return {'mIoU': 100 * iou.nanmean().item(), 'mAcc': 100 * acc.nanmean().item(),
            'aAcc': 100 * tp.sum().item() / total if total else math.nan, 'pixels': int(total),
            'IoU': [None if math.isnan(v) else 100 * v for v in iou.tolist()]}


def slide_logits(model: torch.nn.Module, image: torch.Tensor, num_classes: int, crop: int, stride: int) -> torch.Tensor:
    """mmseg's slide inference: crops of `crop`² every `stride` pixels (the last one flush with the border),
    their logits summed into place and divided by the number of crops covering each pixel."""
    _, _, h, w = image.shape
    rows = max(h - crop + stride - 1, 0) // stride + 1
    cols = max(w - crop + stride - 1, 0) // stride + 1
    logits = image.new_zeros((image.shape[0], num_classes, h, w))
    count = image.new_zeros((1, 1, h, w))
    for r in range(rows):
        for c in range(cols):
            y2, x2 = min(r * stride + crop, h), min(c * stride + crop, w)
            y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
            logits[:, :, y1:y2, x1:x2] += model(image[:, :, y1:y2, x1:x2]).float()
            count[:, :, y1:y2, x1:x2] += 1
    return logits / count


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, num_classes: int, device: torch.device,
             amp_dtype: torch.dtype | None = None, mode: str = 'whole', crop: int = 512, stride: int = 341,
             sum_over_ranks: bool = False, stop_flag: Any = None, print_freq: int = 50) -> dict[str, Any]:
    """Scores (`scores`) of `model` (eval mode: logits at the input's size) on `loader`'s (image, label, index)
    items, one image a batch; with `sum_over_ranks` the confusion matrices of every process are summed. A stop
    signal ends the pass early: the result's 'aborted' is then true (on every rank with `sum_over_ranks`)."""
    model.eval()
    # the matrix, then the images seen and whether a stop cut the pass short, in one tensor: one collective
    counts = torch.zeros(num_classes ** 2 + 2, dtype=torch.int64, device=device)
    n = len(loader)
    for i, (image, label, _) in enumerate(loader):
        if stop_flag is not None and stop_flag.requested:
            counts[-1] = 1
            break
        image, label = image.to(device, non_blocking=True), label.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            logits = model(image) if mode == 'whole' else slide_logits(model, image, num_classes, crop, stride)
        logits = F.interpolate(logits.float(), size=label.shape[-2:], mode='bilinear', align_corners=False)
        counts[:-2] += confusion_matrix(logits.argmax(1), label, num_classes).reshape(-1)
        counts[-2] += 1
        if print_freq and (i % print_freq == 0 or i == n - 1):
            print(f'Test: [{i + 1}/{n}] images', flush=True)
    if sum_over_ranks and is_dist_avail_and_initialized():
        torch.distributed.all_reduce(counts)
    counts = counts.cpu()
    result = scores(counts[:-2].reshape(num_classes, num_classes))
    result.update(images=int(counts[-2]), aborted=bool(counts[-1] > 0))
    return result


def summary_line(result: dict[str, Any], mode: str) -> str:
    """'mIoU 45.12  mAcc 56.78  aAcc 81.23  (2000 images, whole-image inference)'."""
    how = 'whole-image inference' if mode == 'whole' else 'sliding-window inference'
    return (f"mIoU {result['mIoU']:.2f}  mAcc {result['mAcc']:.2f}  aAcc {result['aAcc']:.2f}  "
            f"({result['images']} images, {how})")
