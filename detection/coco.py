"""COCO 2017 instance annotations read with pycocotools, mmdet's data pipelines of the Mask R-CNN recipes, and the
aspect-ratio-grouped batch sampler.

Layout: ``train2017/``, ``val2017/`` (the images) and ``annotations/instances_{train,val}2017.json``. The annotations
are read as mmdet's CocoDataset reads them: the classes are the file's categories sorted by id, as labels 1..N (0 is
torchvision's background; ``label_to_category`` maps back); an annotation is skipped when its box does not overlap
the image, its area is not positive or its box is under one pixel wide or high; crowd annotations (iscrowd=1) stay
out of the training targets (mmdet keeps them as ``gt_bboxes_ignore``, which its Mask R-CNN does not use); training
leaves out the images without any annotation of a class (mmdet's ``filter_empty_gt``: an image whose only
annotations are crowds stays, with no targets) and those under 32 pixels on the short side; evaluation keeps every
image. Masks are decoded from polygons or RLE with pycocotools. A wrong layout, a missing or undecodable image, an
unreadable or inconsistent annotation file is one line naming the file and the fix (``AnnotationError``).

Training pipelines (``TrainPipeline``, mmdet 2.x semantics): a horizontal flip with probability 0.5, then, with
``crop_scales``, one of two policies drawn with equal chance (mmdet's AutoAugment): (a) a resize keeping the aspect
ratio to a short side drawn from ``scales`` (long side at most ``max_size``), or (b) a resize to a short side drawn
from ``crop_scales``, a random crop of height and width each drawn from ``crop_range`` (boxes clipped to it, those
left empty dropped with their masks, a crop without boxes kept: allow_negative_crop), then (a). Without
``crop_scales`` it is (a) alone. Resizing is bilinear without antialiasing for the image and nearest-neighbour for
the masks (mmcv's imresize), boxes scaled by the size ratios and clipped to the image. Every random choice of a
sample comes from a generator seeded by (seed, epoch, index): a sample's augmentation depends neither on the loader
workers nor on where a run was resumed. Evaluation resizes to fit ``test_scale`` (1333x800) keeping the ratio.
Images are decoded with PIL as stored (no EXIF rotation: COCO's annotations refer to the stored pixels).
"""
import contextlib
import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from torch.utils.data import Dataset, Sampler

from datasets import rescale_size, resize_image
from run.errors import first_line
from training.image_folder import DataLayoutError

SPLITS = {'train': 'train2017', 'val': 'val2017'}
LAYOUT = ('train2017/ and val2017/ (the images) and annotations/instances_{train,val}2017.json, as COCO 2017 '
          'unpacks from train2017.zip, val2017.zip and annotations_trainval2017.zip')
MULTI_SCALES = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)  # the short sides of mmdet's 480-800
MIN_TRAIN_SIZE = 32  # mmdet's CocoDataset drops training images under this short side


class AnnotationError(DataLayoutError):
    """The data set on disk is not what the pipeline expects; str() is one line naming the file and the fix."""


# --------------------------------------------------------------------------------------------------
# The layout and the annotation file
# --------------------------------------------------------------------------------------------------
def split_paths(root: str, split: str) -> tuple[str, str]:
    """(image folder, annotation file) of `split` ('train2017' or 'val2017') under `root`, both checked."""
    if not os.path.isdir(root):
        raise AnnotationError(f'--data-path {root}: no such folder; point it at the COCO folder, which holds {LAYOUT}')
    image_dir = os.path.join(root, split)
    ann_file = os.path.join(root, 'annotations', f'instances_{split}.json')
    for path, folder in ((image_dir, True), (ann_file, False)):
        if not (os.path.isdir(path) if folder else os.path.isfile(path)):
            inner = os.path.join(root, 'coco')
            hint = f' (--data-path {inner} holds it)' if os.path.isdir(os.path.join(inner, split)) else ''
            raise AnnotationError(f'{path}: no such {"folder" if folder else "file"}{hint}; --data-path must hold '
                                  f'{LAYOUT}')
    return image_dir, ann_file


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_annotations(data: Any, path: str) -> None:
    """Raise an AnnotationError naming the first entry of a loaded instances file that the loader cannot use: a
    missing list or key, a duplicate image id, an annotation naming an image or category the file does not have,
    a bbox that is not four numbers, a segmentation that is neither polygons nor RLE."""
    fix = 'fix or remove it (the COCO 2017 files are in annotations_trainval2017.zip)'
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ('images', 'annotations',
                                                                                     'categories')):
        raise AnnotationError(f"{path}: not a COCO instances file (it needs the lists 'images', 'annotations' and "
                              f"'categories'); pass the annotations/instances_*.json of COCO 2017")
    images = set()
    for i, im in enumerate(data['images']):
        if not isinstance(im, dict) or not {'id', 'file_name', 'width', 'height'} <= im.keys():
            raise AnnotationError(f"{path}: images[{i}] lacks one of 'id', 'file_name', 'width', 'height'; {fix}")
        if im['id'] in images:
            raise AnnotationError(f'{path}: image id {im["id"]} appears twice in images; {fix}')
        images.add(im['id'])
    categories = set()
    for i, c in enumerate(data['categories']):
        if not isinstance(c, dict) or not {'id', 'name'} <= c.keys():
            raise AnnotationError(f"{path}: categories[{i}] lacks 'id' or 'name'; {fix}")
        categories.add(c['id'])
    for i, ann in enumerate(data['annotations']):
        if not isinstance(ann, dict) or not {'id', 'image_id', 'category_id', 'bbox'} <= ann.keys():
            raise AnnotationError(f"{path}: annotations[{i}] lacks one of 'id', 'image_id', 'category_id', 'bbox'; "
                                  f'{fix}')
        what = f'{path}: annotation {ann["id"]}'
        if ann['image_id'] not in images:
            raise AnnotationError(f'{what} names image {ann["image_id"]}, which is not in images; {fix}')
        if ann['category_id'] not in categories:
            raise AnnotationError(f'{what} names category {ann["category_id"]}, which is not in categories; {fix}')
        box = ann['bbox']
        if not isinstance(box, list) or len(box) != 4 or not all(_is_number(v) for v in box):
            raise AnnotationError(f'{what} has bbox {str(box)[:60]}, not [x, y, width, height]; {fix}')
        segm = ann.get('segmentation')
        if segm is not None and not isinstance(segm, (list, dict)):
            raise AnnotationError(f'{what} has a segmentation that is neither polygons nor RLE; {fix}')


def load_coco(ann_file: str) -> COCO:
    """The pycocotools COCO index of an instances file, checked (``check_annotations``), without its prints."""
    try:
        with open(ann_file, 'rb') as f:
            data = json.load(f)
    except OSError as e:
        raise AnnotationError(f'{ann_file}: cannot be read ({first_line(e)}); check its permissions') from e
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise AnnotationError(f'{ann_file}: not a JSON file ({first_line(e)}); unpack it again from '
                              f'annotations_trainval2017.zip') from e
    check_annotations(data, ann_file)
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def decode_mask(segm: Any, height: int, width: int, what: str) -> np.ndarray:
    """An HxW uint8 mask from COCO polygons, uncompressed RLE or compressed RLE (pycocotools)."""
    try:
        if isinstance(segm, list):
            rle = mask_utils.merge(mask_utils.frPyObjects(segm, height, width))
        elif isinstance(segm.get('counts'), list):
            rle = mask_utils.frPyObjects(segm, height, width)
        else:
            rle = segm
        with warnings.catch_warnings():  # pycocotools' decode trips numpy 2's __array__(copy=) deprecation
            warnings.simplefilter('ignore', DeprecationWarning)
            mask = mask_utils.decode(rle)
    except Exception as e:  # pycocotools raises several types for malformed input
        raise AnnotationError(f'{what}: its segmentation cannot be decoded ({type(e).__name__}: {first_line(e)}); '
                              f'fix or remove the annotation') from e
    if mask.shape != (height, width):
        raise AnnotationError(f'{what}: its RLE segmentation is {mask.shape[1]}x{mask.shape[0]} but its image is '
                              f'{width}x{height}; fix or remove the annotation')
    return mask


# --------------------------------------------------------------------------------------------------
# A sample and the geometric transforms (numpy, HxWx3 uint8 images, (N, H, W) uint8 masks)
# --------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One image and its targets: boxes (N, 4) float32 x1y1x2y2 in pixels, labels (N,) int64 in 1..classes,
    masks (N, H, W) uint8 or None (Faster R-CNN)."""
    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    masks: np.ndarray | None = None

    def keep(self, index: np.ndarray) -> None:
        self.boxes, self.labels = self.boxes[index], self.labels[index]
        if self.masks is not None:
            self.masks = self.masks[index]


def resize_masks(masks: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour resize of (N, H, W) masks to `size` (height, width): source pixel floor(i * in / out), as
    OpenCV's INTER_NEAREST and torch's 'nearest'."""
    h, w = masks.shape[1:]
    if (h, w) == tuple(size):
        return masks
    rows = np.minimum((np.arange(size[0]) * (h / size[0])).astype(np.int64), h - 1)
    cols = np.minimum((np.arange(size[1]) * (w / size[1])).astype(np.int64), w - 1)
    return np.ascontiguousarray(masks[:, rows][:, :, cols])


def flip(sample: Sample) -> None:
    """Horizontal flip: x1' = width - x2, x2' = width - x1 (mmdet's bbox_flip)."""
    w = sample.image.shape[1]
    sample.image = np.ascontiguousarray(sample.image[:, ::-1])
    sample.boxes = np.stack([w - sample.boxes[:, 2], sample.boxes[:, 1], w - sample.boxes[:, 0], sample.boxes[:, 3]],
                            axis=1).astype(np.float32).reshape(-1, 4)
    if sample.masks is not None:
        sample.masks = np.ascontiguousarray(sample.masks[:, :, ::-1])


def rescale(sample: Sample, short: int, max_size: int) -> None:
    """mmdet's Resize with keep_ratio: the image scaled so that its short side is `short` unless its long side would
    pass `max_size`; boxes times the width and height ratios of the new size, clipped to the image."""
    h, w = sample.image.shape[:2]
    size = rescale_size(h, w, (max_size, short))
    sample.image = resize_image(sample.image, size)
    scale = np.array([size[1] / w, size[0] / h, size[1] / w, size[0] / h], np.float32)
    boxes = sample.boxes * scale
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, size[1])
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, size[0])
    sample.boxes = boxes
    if sample.masks is not None:
        sample.masks = resize_masks(sample.masks, size)


def random_crop(sample: Sample, crop_range: tuple[int, int], rng: np.random.Generator) -> None:
    """mmdet's RandomCrop(crop_type='absolute_range', allow_negative_crop=True): height and width each drawn from
    [min(side, lo), min(side, hi)], the corner uniform over the image; boxes shifted and clipped to the crop, those
    left without area dropped with their labels and masks."""
    h, w = sample.image.shape[:2]
    lo, hi = crop_range
    ch, cw = int(rng.integers(min(h, lo), min(h, hi) + 1)), int(rng.integers(min(w, lo), min(w, hi) + 1))
    y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    sample.image = np.ascontiguousarray(sample.image[y0:y0 + ch, x0:x0 + cw])
    boxes = sample.boxes - np.array([x0, y0, x0, y0], np.float32)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, cw)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, ch)
    sample.boxes = boxes
    if sample.masks is not None:
        sample.masks = np.ascontiguousarray(sample.masks[:, y0:y0 + ch, x0:x0 + cw])
    sample.keep(np.flatnonzero((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])))


@dataclass(frozen=True)
class TrainPipeline:
    """A training pipeline of the recipes (see the module docstring). The defaults are the Swin-style 1x/3x
    pipeline (multi-scale 480-800 with the crop policy); ``TrainPipeline(scales=(800,), crop_scales=())`` is the
    single-scale 1333x800 one."""
    scales: tuple[int, ...] = MULTI_SCALES
    max_size: int = 1333
    crop_scales: tuple[int, ...] = (400, 500, 600)
    crop_range: tuple[int, int] = (384, 600)
    flip_prob: float = 0.5

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        if rng.random() < self.flip_prob:
            flip(sample)
        if self.crop_scales and rng.random() < 0.5:
            rescale(sample, self.crop_scales[int(rng.integers(len(self.crop_scales)))], self.max_size)
            random_crop(sample, self.crop_range, rng)
        rescale(sample, self.scales[int(rng.integers(len(self.scales)))], self.max_size)
        return sample


def image_tensor(image: np.ndarray) -> torch.Tensor:
    """An HxWx3 uint8 image as a 3xHxW uint8 tensor (the detector normalises it)."""
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).contiguous()


def collate(batch: Sequence[tuple[Any, Any]]) -> tuple[list, list]:
    """(images, targets) of a batch as lists: the detector takes images of different sizes."""
    return [b[0] for b in batch], [b[1] for b in batch]


# --------------------------------------------------------------------------------------------------
# The data set
# --------------------------------------------------------------------------------------------------
def aspect_group(width: int, height: int) -> int:
    """mmdet's aspect-ratio flag: 1 for landscape images (width / height > 1), 0 otherwise."""
    return int(width / height > 1)


class CocoDetection(Dataset):
    """One split of a COCO-layout folder. Training (`pipeline` given): items are keyed by (epoch, index) and give
    (3xHxW uint8 image, target) through the pipeline, its random choices seeded by (seed, epoch, index); the target
    holds boxes, labels, masks (unless `masks` is False) and image_id. Evaluation: items are keyed by index and give
    (the image resized to fit `test_scale`, {'image_id', 'orig_size': (height, width)})."""

    def __init__(self, root: str, split: str, pipeline: TrainPipeline | None = None,
                 test_scale: tuple[int, int] = (1333, 800), masks: bool = True, seed: int = 0):
        self.root, self.split, self.pipeline, self.test_scale = root, split, pipeline, test_scale
        self.masks, self.seed = masks, seed
        self.image_dir, self.ann_file = split_paths(root, split)
        self.coco = load_coco(self.ann_file)
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat_to_label = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        self.class_names = [self.coco.cats[c]['name'] for c in self.cat_ids]
        ids = self.coco.getImgIds()  # the file's order, as mmdet
        self.dropped = {'without annotations': 0, f'under {MIN_TRAIN_SIZE} px': 0}
        if pipeline is not None:
            ids = self._training_ids(ids)
        self.image_ids = ids
        self._check_files()

    def _training_ids(self, ids: list[int]) -> list[int]:
        """mmdet's training filter: images with at least one annotation of a class (crowds count), short side
        at least MIN_TRAIN_SIZE; how many each rule left out goes to `dropped`."""
        kept = []
        for i in ids:
            info = self.coco.imgs[i]
            if not self.coco.imgToAnns.get(i):
                self.dropped['without annotations'] += 1
            elif min(info['width'], info['height']) < MIN_TRAIN_SIZE:
                self.dropped[f'under {MIN_TRAIN_SIZE} px'] += 1
            else:
                kept.append(i)
        if not kept:
            raise AnnotationError(f'{self.ann_file}: no image with annotations to train on; pass a COCO folder whose '
                                  f'instances_{self.split}.json annotates its images')
        return kept

    def _check_files(self) -> None:
        present = set(os.listdir(self.image_dir))
        missing = [self.coco.imgs[i]['file_name'] for i in self.image_ids
                   if self.coco.imgs[i]['file_name'] not in present]
        if missing:
            more = f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''
            raise AnnotationError(f'{os.path.join(self.image_dir, missing[0])}: missing{more}, listed in '
                                  f'{self.ann_file}; restore the images from {self.split}.zip')

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def label_to_category(self) -> list[int]:
        """COCO category id of each label (index 0, the background, holds 0)."""
        return [0, *self.cat_ids]

    def aspect_groups(self) -> list[int]:
        """Each image's aspect_group, from the annotation file's sizes."""
        return [aspect_group(self.coco.imgs[i]['width'], self.coco.imgs[i]['height']) for i in self.image_ids]

    def image_path(self, index: int) -> str:
        return os.path.join(self.image_dir, self.coco.imgs[self.image_ids[index]]['file_name'])

    def read_image(self, index: int) -> np.ndarray:
        """The HxWx3 uint8 RGB image of item `index`, checked against the annotation file's size."""
        info, path = self.coco.imgs[self.image_ids[index]], self.image_path(index)
        try:
            with Image.open(path) as im:
                image = np.array(im.convert('RGB'))
        except OSError as e:
            raise AnnotationError(f'{path}: cannot be decoded ({first_line(e)}); restore it from {self.split}.zip') \
                from e
        if image.shape[:2] != (info['height'], info['width']):
            raise AnnotationError(f'{path}: the image is {image.shape[1]}x{image.shape[0]} but {self.ann_file} says '
                                  f'{info["width"]}x{info["height"]}; the images and the annotation file do not belong '
                                  f'together')
        return image

    def sample(self, index: int, masks: bool) -> Sample:
        """Item `index`'s image and training targets by mmdet's rules (see the module docstring)."""
        image = self.read_image(index)
        image_id = self.image_ids[index]
        info = self.coco.imgs[image_id]
        h, w = info['height'], info['width']
        boxes, labels, segms = [], [], []
        for ann in self.coco.imgToAnns.get(image_id, []):
            x, y, bw, bh = ann['bbox']
            inter_w = max(0, min(x + bw, w) - max(x, 0))
            inter_h = max(0, min(y + bh, h) - max(y, 0))
            if ann.get('ignore', False) or inter_w * inter_h == 0 or ann.get('area', bw * bh) <= 0 or bw < 1 \
                    or bh < 1 or ann.get('iscrowd', 0):
                continue
            boxes.append([x, y, x + bw, y + bh])
            labels.append(self.cat_to_label[ann['category_id']])
            if masks:
                if ann.get('segmentation') is None:
                    raise AnnotationError(f'{self.ann_file}: annotation {ann["id"]} has no segmentation, which Mask '
                                          f'R-CNN trains on; add it, or train Faster R-CNN (--no-mask)')
                segms.append(decode_mask(ann['segmentation'], h, w, f'{self.ann_file}: annotation {ann["id"]}'))
        return Sample(image=image, boxes=np.array(boxes, np.float32).reshape(-1, 4),
                      labels=np.array(labels, np.int64),
                      masks=(np.stack(segms) if segms else np.zeros((0, h, w), np.uint8)) if masks else None)

    def __getitem__(self, key):
        if self.pipeline is not None:
            epoch, index = key
            sample = self.pipeline(self.sample(index, self.masks), np.random.default_rng([self.seed, epoch, index]))
            target = {'boxes': torch.from_numpy(sample.boxes), 'labels': torch.from_numpy(sample.labels),
                      'image_id': self.image_ids[index]}
            if sample.masks is not None:
                target['masks'] = torch.from_numpy(sample.masks)
            return image_tensor(sample.image), target
        image = self.read_image(key)
        h, w = image.shape[:2]
        image = resize_image(image, rescale_size(h, w, self.test_scale))
        return image_tensor(image), {'image_id': self.image_ids[key], 'orig_size': (h, w)}


# --------------------------------------------------------------------------------------------------
# The batch sampler
# --------------------------------------------------------------------------------------------------
class GroupedBatchSampler(Sampler[list]):
    """Batches of images of one aspect group (mmdet's DistributedGroupSampler), as lists of (epoch, index) keys,
    for iterations `start` to `end` (None: without end).

    Epoch e: with a generator seeded by seed + e, each group (in order 0, 1) is shuffled and padded by repeating
    itself to a multiple of batch_size x world, the groups are joined, cut into batches and the batches shuffled;
    rank r takes the r-th of `world` equal runs of batches. Every rank gets `steps` batches an epoch, and iteration
    `it` is batch it % steps of epoch it // steps whatever ran before: a run resumes inside an epoch. The order
    depends on (seed, epoch, world, rank, batch_size) only."""

    def __init__(self, groups: Sequence[int], batch_size: int, world: int = 1, rank: int = 0, seed: int = 0,
                 start: int = 0, end: int | None = None):
        if not groups:
            raise ValueError('no images to sample from')
        self.groups = np.asarray(groups)
        self.batch_size, self.world, self.rank, self.seed = batch_size, world, rank, seed
        self.start, self.end = start, end
        per_step = batch_size * world
        self.steps = sum(-(-int(n) // per_step) for n in np.bincount(self.groups) if n)  # batches per rank and epoch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches (image indices) of `epoch`."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        per_step = self.batch_size * self.world
        chunks = []
        for flag in np.unique(self.groups):
            members = np.flatnonzero(self.groups == flag)
            members = members[torch.randperm(len(members), generator=g).numpy()]
            chunks.append(np.resize(members, -(-len(members) // per_step) * per_step))  # padded by repeating
        batches = np.concatenate(chunks).reshape(-1, self.batch_size)
        batches = batches[torch.randperm(len(batches), generator=g).numpy()]
        return batches[self.rank * self.steps:(self.rank + 1) * self.steps].tolist()

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        it = self.start
        while self.end is None or it < self.end:
            epoch, step = divmod(it, self.steps)
            for batch in self.epoch_batches(epoch)[step:]:
                if self.end is not None and it >= self.end:
                    return
                yield [(epoch, i) for i in batch]
                it += 1

    def __len__(self) -> int:
        if self.end is None:
            raise TypeError('a GroupedBatchSampler without end has no length')
        return max(self.end - self.start, 0)
