"""COCO box and mask AP of a detector with pycocotools' COCOeval, exact under DDP, and the pictures of --show-dir.

Each process predicts its own share of the validation images (samplers.DistributedEvalSampler: every image on
exactly one process, no padding); the predictions become COCO results there (boxes as [x, y, width, height] in the
original image's pixels, labels mapped back to the file's category ids, masks run-length encoded by pycocotools),
are gathered to rank 0, and one COCOeval per type ('bbox', 'segm') runs against the annotation file with its
default parameters (every image of the file, maxDets 1/10/100). The figures do not depend on the number of
processes. As mmdet (2.12 and later), mask results carry no 'bbox', so that COCOeval sorts them into small, medium
and large by their mask's area.
"""
import colorsys
import contextlib
import io
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detection.coco import AnnotationError
from run import distributed
from run.errors import UserError
from training.image_folder import data_error_line
from training.step import autocast

#: the first six of COCOeval's stats, by the names mmdet logs them with
STAT_NAMES = ('AP', 'AP50', 'AP75', 'APs', 'APm', 'APl')


def coco_results(det: dict[str, torch.Tensor], image_id: int,
                 label_to_category: Sequence[int]) -> tuple[list[dict], list[dict]]:
    """(box results, mask results) of one image's predictions in COCO's result format."""
    boxes = det['boxes'].detach().float().cpu()
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
    categories = [label_to_category[int(c)] for c in det['labels'].tolist()]
    scores = det['scores'].detach().float().cpu().tolist()
    bbox = [{'image_id': image_id, 'category_id': c, 'bbox': b, 'score': s}
            for b, c, s in zip(xywh, categories, scores)]
    segm = []
    if 'masks' in det and len(categories):
        masks = det['masks'].detach().cpu().numpy().astype(np.uint8)
        rles = mask_utils.encode(np.asfortranarray(masks.transpose(1, 2, 0)))
        for rle, c, s in zip(rles, categories, scores):
            rle['counts'] = rle['counts'].decode('ascii')  # a str: picklable, JSON-able
            segm.append({'image_id': image_id, 'category_id': c, 'segmentation': rle, 'score': s})
    return bbox, segm


def run_cocoeval(coco_gt: COCO, results: list[dict], iou_type: str) -> tuple[list[float], list[str]]:
    """(COCOeval's 12 stats, the 12 lines its summarize() prints) of `results` of `iou_type` ('bbox' or 'segm').
    No result at all scores 0 wherever the file has objects."""
    with contextlib.redirect_stdout(io.StringIO()):
        if results:
            coco_dt = coco_gt.loadRes([dict(r) for r in results])  # loadRes adds keys to the dicts it is given
        else:  # loadRes cannot take an empty list
            coco_dt = COCO()
            coco_dt.dataset = {'images': coco_gt.dataset['images'], 'categories': coco_gt.dataset['categories'],
                               'annotations': []}
            coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iou_type)
        ev.evaluate()
        ev.accumulate()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        ev.summarize()
    return [float(v) for v in ev.stats], text.getvalue().strip().splitlines()


def score(coco_gt: COCO, bbox: list[dict], segm: list[dict] | None) -> dict[str, Any]:
    """box_AP, box_AP50, ... (and mask_AP, ... when `segm` is not None) in percent, and COCOeval's lines."""
    result: dict[str, Any] = {'lines': []}
    for prefix, iou_type, results in (('box', 'bbox', bbox), ('mask', 'segm', segm)):
        if results is None:
            continue
        stats, lines = run_cocoeval(coco_gt, results, iou_type)
        result.update({f'{prefix}_{name}': 100 * v for name, v in zip(STAT_NAMES, stats)})
        result['lines'] += [f'Evaluating {iou_type}:', *lines]
    return result


def summary_line(result: dict[str, Any]) -> str:
    """'box AP 38.2  mask AP 34.9' (box only for Faster R-CNN)."""
    line = f"box AP {result['box_AP']:.1f}"
    return line + (f"  mask AP {result['mask_AP']:.1f}" if 'mask_AP' in result else '')


@torch.no_grad()
def predict(model: torch.nn.Module, loader: Any, device: torch.device, label_to_category: Sequence[int],
            amp_dtype: torch.dtype | None = None, stop_flag: Any = None, print_freq: int = 50,
            show: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """This process's predictions on `loader`'s (images, targets) batches (coco.CocoDetection's evaluation items) as
    COCO results: {'bbox', 'segm', 'image_ids', 'aborted'}. `show(image_id, detections)` sees every image's
    detections (--show-dir). A stop signal ends the pass early ('aborted')."""
    model.eval()
    out: dict[str, Any] = {'bbox': [], 'segm': [], 'image_ids': [], 'aborted': False}
    n = len(loader)
    for i, (images, targets) in enumerate(loader):
        if stop_flag is not None and stop_flag.requested:
            out['aborted'] = True
            break
        images = [im.to(device, non_blocking=True) for im in images]
        with autocast(device, amp_dtype):
            detections = model(images, original_sizes=[tuple(t['orig_size']) for t in targets])
        for det, target in zip(detections, targets):
            bbox, segm = coco_results(det, target['image_id'], label_to_category)
            out['bbox'] += bbox
            out['segm'] += segm
            out['image_ids'].append(target['image_id'])
            if show is not None:
                show(target['image_id'], det)
        if print_freq and (i % print_freq == 0 or i == n - 1):
            print(f'Test: [{i + 1}/{n}] batches', flush=True)
    return out


def gather_to_rank0(predictions: dict[str, Any]) -> dict[str, Any] | None:
    """Every process's predictions joined on rank 0 (gather_object: nothing is sent to the other ranks); None
    elsewhere. Without a process group: `predictions`."""
    if not distributed.is_dist_avail_and_initialized():
        return predictions
    parts: list[Any] | None = [None] * distributed.get_world_size() if distributed.get_rank() == 0 else None
    dist.gather_object(predictions, parts, dst=0)
    if parts is None:
        return None
    return {'bbox': [r for p in parts for r in p['bbox']], 'segm': [r for p in parts for r in p['segm']],
            'image_ids': [i for p in parts for i in p['image_ids']], 'aborted': any(p['aborted'] for p in parts)}


def evaluate(model: torch.nn.Module, loader: Any, coco_gt: COCO, label_to_category: Sequence[int],
             device: torch.device, mask: bool = True, amp_dtype: torch.dtype | None = None, stop_flag: Any = None,
             print_freq: int = 50, show: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Box (and mask) AP of `model` on `loader`, the same on every rank: box_AP, box_AP50, ..., mask_AP, ...,
    'lines' (COCOeval's), 'images' (scored), 'detections' (over all images), 'aborted'. Every rank must call it;
    under DDP each rank's loader holds its own share of the images (an image seen twice is an error: it would count
    its detections twice)."""
    def predict_here() -> dict[str, Any]:
        try:
            return predict(model, loader, device, label_to_category, amp_dtype=amp_dtype, stop_flag=stop_flag,
                           print_freq=print_freq, show=show)
        except AnnotationError as e:  # also raised in a loader worker: its one line
            raise UserError(data_error_line(e)) from e

    # a rank that fails says so to the others, which would otherwise wait in the gather
    merged = gather_to_rank0(distributed.on_every_rank(predict_here, device, 'COCO evaluation'))

    def on_main() -> dict[str, Any]:
        ids = merged['image_ids']
        if len(set(ids)) != len(ids):
            raise UserError(f'the evaluation scored {len(ids) - len(set(ids))} images twice; evaluate with '
                            f'samplers.DistributedEvalSampler (each image on one process, no padding)')
        if merged['aborted']:
            return {'aborted': True, 'images': len(ids), 'lines': []}
        result = score(coco_gt, merged['bbox'], merged['segm'] if mask else None)
        result.update(images=len(ids), detections=len(merged['bbox']), aborted=False)
        return result

    return distributed.broadcast_object(distributed.on_rank0(on_main, device, 'COCO evaluation'))


# --------------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------------
def class_colour(label: int) -> tuple[int, int, int]:
    """A bright colour per label, the same in every picture: hues a golden ratio apart, so that neighbouring labels
    differ."""
    r, g, b = colorsys.hsv_to_rgb((label * 0.618034) % 1.0, 0.85, 1.0)
    return round(255 * r), round(255 * g), round(255 * b)


def draw_detections(image: np.ndarray, det: dict[str, torch.Tensor], class_names: Sequence[str],
                    score_thr: float = 0.3, alpha: float = 0.5) -> np.ndarray:
    """An HxWx3 uint8 copy of `image` with the detections scoring at least `score_thr` (mmdet's show_result
    default): masks blended in their class's colour, boxes outlined, 'name score' above each box. Labels are 1..N
    indexing `class_names` from 1."""
    keep = (det['scores'] >= score_thr).nonzero().flatten().tolist()
    canvas = image.astype(np.float32)
    labels = det['labels'].tolist()
    if 'masks' in det:
        masks = det['masks'].cpu().numpy()
        for i in keep:
            canvas[masks[i]] = canvas[masks[i]] * (1 - alpha) + np.array(class_colour(labels[i])) * alpha
    picture = Image.fromarray(canvas.round().clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(picture)
    width = max(1, round(min(image.shape[:2]) / 300))
    for i in keep:
        x0, y0, x1, y1 = det['boxes'][i].tolist()
        colour = class_colour(labels[i])
        draw.rectangle([x0, y0, x1, y1], outline=colour, width=width)
        name = class_names[labels[i] - 1] if 0 < labels[i] <= len(class_names) else str(labels[i])
        text = f'{name} {float(det["scores"][i]):.2f}'
        left, top, right, bottom = draw.textbbox((0, 0), text)
        tx = max(min(x0, image.shape[1] - (right - left) - 2), 0)  # inside the picture
        ty = max(y0 - (bottom - top) - 2, 0)
        draw.rectangle([tx, ty, tx + right - left + 2, ty + bottom - top + 2], fill=colour)
        draw.text((tx + 1 - left, ty + 1 - top), text, fill=(0, 0, 0))
    return np.asarray(picture)


def save_detections(path: str, image_path: str, det: dict[str, torch.Tensor], class_names: Sequence[str],
                    score_thr: float = 0.3) -> None:
    """Write the original image at `image_path` with its detections drawn (``draw_detections``) to `path`."""
    with Image.open(image_path) as im:
        image = np.array(im.convert('RGB'))
    Image.fromarray(draw_detections(image, det, class_names, score_thr)).save(path)
