"""mIoU, mAcc and aAcc from one confusion matrix summed over every validation image, as mmseg computes them,
exact under DDP: each process scores its own images (samplers.DistributedEvalSampler: every image on exactly
one process, no padding) and one all_reduce sums the integer matrices, so the figures are those of one
process. Inference: "whole" (the rescaled image in one forward) or "slide" (crops with a stride, overlaps
averaged), the logits resized to the label map's original size, as mmseg's single-scale test; or mmseg's
multi-scale and flip test (``--aug-test``, ``aug_probabilities``) when the loader gives each image at several
scales. The per-class table and log record name the classes (``class_table``, ``class_record``); ``evaluate``'s
`show` receives each image's prediction as scored (--show-dir draws it).
"""
import functools
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from run.distributed import is_dist_avail_and_initialized
from segmentation.ade import IGNORE_INDEX
from training.step import autocast


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
    has no IoU; one never labelled has no Acc: None in the lists 'IoU' and 'Acc'), aAcc = all TP / all labelled
    pixels; in percent."""
    m = matrix.double()
    tp, labelled, predicted = m.diag(), m.sum(1), m.sum(0)
    union = labelled + predicted - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.nan)
    acc = torch.where(labelled > 0, tp / labelled.clamp(min=1), torch.nan)
    total = labelled.sum().item()
    return {'mIoU': 100 * iou.nanmean().item(), 'mAcc': 100 * acc.nanmean().item(),
            'aAcc': 100 * tp.sum().item() / total if total else math.nan, 'pixels': int(total),
            'IoU': [None if math.isnan(v) else 100 * v for v in iou.tolist()],
            'Acc': [None if math.isnan(v) else 100 * v for v in acc.tolist()]}


def class_table(result: dict[str, Any]) -> str:
    """mmseg's per-class table of an evaluation's result: each class's name, IoU and Acc (nan where undefined)."""
    names = result['classes']
    width = max(len('Class'), *map(len, names))

    def cell(v: float | None) -> str:
        return f'{"nan" if v is None else f"{v:.2f}":>6}'

    rule = f'+-{"-" * width}-+--------+--------+'
    rows = [f'| {name:<{width}} | {cell(iou)} | {cell(acc)} |'
            for name, iou, acc in zip(names, result['IoU'], result['Acc'])]
    return '\n'.join(['per class results:', rule, f'| {"Class":<{width}} |    IoU |    Acc |', rule, *rows, rule])


def class_record(result: dict[str, Any]) -> dict[str, float | None]:
    """The per-class scores for log.txt, keyed as mmseg's log.json: 'IoU.wall', ..., 'Acc.wall', ... (percent;
    None where undefined)."""
    return {**{f'IoU.{n}': v for n, v in zip(result['classes'], result['IoU'])},
            **{f'Acc.{n}': v for n, v in zip(result['classes'], result['Acc'])}}


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


def logits_at(model: torch.nn.Module, image: torch.Tensor, size: Sequence[int], num_classes: int,
              device: torch.device, amp_dtype: torch.dtype | None = None, mode: str = 'whole', crop: int = 512,
              stride: int = 341) -> torch.Tensor:
    """float32 logits of `image` (moved to `device`; "whole" or "slide" inference), resized bilinearly to `size`
    (the label map's)."""
    image = image.to(device, non_blocking=True)
    with autocast(device, amp_dtype):
        logits = model(image) if mode == 'whole' else slide_logits(model, image, num_classes, crop, stride)
    return F.interpolate(logits.float(), size=size, mode='bilinear', align_corners=False)


def aug_probabilities(logits_of: Callable[[torch.Tensor], torch.Tensor], images: list[torch.Tensor]) -> torch.Tensor:
    """mmseg's multi-scale + flip test (0.x's aug_test, 1.x's SegTTAModel): for each scale's image and its
    horizontal flip, the softmax of its logits at the label's size (`logits_of`), the flipped one flipped back;
    their mean, in the order scale by scale, unflipped first."""
    total = None
    for image in images:
        for flip in (False, True):
            prob = logits_of(image.flip(-1) if flip else image).softmax(1)
            prob = prob.flip(-1) if flip else prob
            total = prob if total is None else total + prob
    return total / (2 * len(images))


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, num_classes: int, device: torch.device,
             amp_dtype: torch.dtype | None = None, mode: str = 'whole', crop: int = 512, stride: int = 341,
             sum_over_ranks: bool = False, stop_flag: Any = None, print_freq: int = 50,
             class_names: Sequence[str] | None = None,
             show: Callable[[int, torch.Tensor], None] | None = None) -> dict[str, Any]:
    """Scores (`scores`) of `model` (eval mode: logits at the input's size) on `loader`'s (image, label, index)
    items, one image a batch (a list of the image at several scales: the multi-scale + flip test); with
    `sum_over_ranks` the confusion matrices of every process are summed. A stop signal ends the pass early: the
    result's 'aborted' is then true (on every rank with `sum_over_ranks`). The result also holds 'classes' (the
    names, class_names' default: class_1 ..) and 'scales' (1, or the number of scales of the flip test). `show`,
    when given, is called with each image's index (the item's third) and its prediction: the HxW argmax at the
    label map's size that the confusion matrix counts."""
    model.eval()
    # the matrix, then the images seen and whether a stop cut the pass short, in one tensor: one collective
    counts = torch.zeros(num_classes ** 2 + 2, dtype=torch.int64, device=device)
    n, scales = len(loader), 1
    for i, (image, label, index) in enumerate(loader):
        if stop_flag is not None and stop_flag.requested:
            counts[-1] = 1
            break
        label = label.to(device, non_blocking=True)
        logits_of = functools.partial(logits_at, model, size=tuple(label.shape[-2:]), num_classes=num_classes,
                                      device=device, amp_dtype=amp_dtype, mode=mode, crop=crop, stride=stride)
        if isinstance(image, (list, tuple)):
            scales = len(image)
            pred = aug_probabilities(logits_of, image).argmax(1)
        else:
            pred = logits_of(image).argmax(1)
        counts[:-2] += confusion_matrix(pred, label, num_classes).reshape(-1)
        if show is not None:
            show(int(index[0]), pred[0])
        counts[-2] += 1
        if print_freq and (i % print_freq == 0 or i == n - 1):
            print(f'Test: [{i + 1}/{n}] images', flush=True)
    if sum_over_ranks and is_dist_avail_and_initialized():
        torch.distributed.all_reduce(counts)
    counts = counts.cpu()
    result = scores(counts[:-2].reshape(num_classes, num_classes))
    result.update(images=int(counts[-2]), aborted=bool(counts[-1] > 0), scales=scales,
                  classes=list(class_names or (f'class_{k}' for k in range(1, num_classes + 1))))
    return result


def summary_line(result: dict[str, Any], mode: str) -> str:
    """'mIoU 45.12  mAcc 56.78  aAcc 81.23  (2000 images, whole-image inference)' (', 6 scales + flip' with the
    multi-scale + flip test)."""
    how = 'whole-image inference' if mode == 'whole' else 'sliding-window inference'
    if result.get('scales', 1) > 1:
        how += f", {result['scales']} scales + flip"
    return (f"mIoU {result['mIoU']:.2f}  mAcc {result['mAcc']:.2f}  aAcc {result['aAcc']:.2f}  "
            f"({result['images']} images, {how})")
