"""A synthetic instance set in the COCO 2017 layout, for the demo and the tests: images of flat-coloured shapes on
noisy textured backgrounds with their boxes and masks, written as COCO is (train2017/*.jpg, val2017/*.jpg,
annotations/instances_{train,val}2017.json), so that training and evaluation read it through the real loader.

Three classes with category ids 2, 5 and 9 (COCO's ids have gaps too): rectangles (reddish, masks as polygons),
ellipses (bluish, masks as compressed RLE) and triangles (yellowish, polygons), each colour jittered per shape,
1 to 4 per image, apart from each other. About one image in ten has no annotation (training leaves those out), one
in six has a crowd (iscrowd=1, an uncompressed RLE over a cluster of small shapes, as COCO's crowds), some of them
with nothing else. Every shape is painted from the mask its annotation decodes to, so the pixels and the
annotations agree exactly. Image sizes vary, landscape and portrait. Deterministic for a seed.

    python detection/shapes.py output/det-demo-data        # the demo's 120 training and 50 validation images
"""
import argparse
import json
import os
import sys
import warnings

import numpy as np
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils

#: (category id, name, base colour RGB)
CLASSES = ((2, 'rectangle', (210, 60, 50)), (5, 'ellipse', (60, 90, 220)), (9, 'triangle', (230, 200, 40)))
SIZES = ((128, 160), (160, 128), (144, 144), (120, 176), (176, 120))  # (height, width)


def background(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """An HxWx3 float image: a greyish-green colour with blotchy noise and stripes."""
    base = np.array([110, 120, 100], float) + rng.uniform(-30, 30, 3)
    coarse = np.kron(rng.normal(0, 18, (h // 8 + 1, w // 8 + 1, 3)), np.ones((8, 8, 1)))[:h, :w]
    y, x = np.mgrid[0:h, 0:w]
    stripes = 12 * np.sin((x * rng.uniform(-0.4, 0.4) + y * rng.uniform(-0.4, 0.4)))[..., None]
    return base + coarse + stripes + rng.normal(0, 10, (h, w, 3))


def shape_polygon(kind: str, box: tuple[float, float, float, float]) -> list[float]:
    """The outline of a rectangle, ellipse (32 points) or triangle inside `box` (x0, y0, x1, y1), flattened."""
    x0, y0, x1, y1 = box
    if kind == 'rectangle':
        pts = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    elif kind == 'triangle':
        pts = [((x0 + x1) / 2, y0), (x1, y1), (x0, y1)]
    else:
        t = np.linspace(0, 2 * np.pi, 32, endpoint=False)
        cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
        pts = list(zip(cx + rx * np.cos(t), cy + ry * np.sin(t)))
    return [round(float(v), 2) for p in pts for v in p]


def place(h: int, w: int, taken: list, rng: np.random.Generator, lo: int, hi: int) -> tuple | None:
    """A box of sides lo..hi inside the image that keeps 3 pixels from every box in `taken` (None after 30 tries)."""
    for _ in range(30):
        bw, bh = rng.integers(lo, hi + 1, 2)
        x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
        box = (x0, y0, x0 + bw, y0 + bh)
        if all(box[0] > t[2] + 3 or box[2] < t[0] - 3 or box[1] > t[3] + 3 or box[3] < t[1] - 3 for t in taken):
            return box
    return None


def paint(image: np.ndarray, mask: np.ndarray, colour, rng: np.random.Generator) -> None:
    """Paint `mask`'s pixels of `image` in `colour` jittered by up to 35 per channel, with light noise."""
    c = np.clip(np.array(colour, float) + rng.uniform(-35, 35, 3), 0, 255)
    m = mask.astype(bool)
    image[m] = c + rng.normal(0, 6, (int(m.sum()), 3))


def scene(h: int, w: int, image_id: int, next_ann: int, rng: np.random.Generator) -> tuple[np.ndarray, list]:
    """(HxWx3 uint8 image, its annotations) of one scene."""
    image = background(h, w, rng)
    anns, taken = [], []
    kind_of_image = rng.random()
    n_objects = 0 if kind_of_image < 0.1 else int(rng.integers(1, 5))
    crowd = 0.1 <= kind_of_image < 0.27
    if crowd and rng.random() < 0.3:
        n_objects = 0  # a crowd alone
    if crowd:
        box = place(h, w, taken, rng, 36, 48)
        if box is not None:
            taken.append(box)
            cat, _, colour = CLASSES[int(rng.integers(len(CLASSES)))]
            canvas = Image.new('L', (w, h), 0)
            draw = ImageDraw.Draw(canvas)
            for _ in range(int(rng.integers(4, 8))):
                cx, cy = rng.uniform(box[0] + 4, box[2] - 4), rng.uniform(box[1] + 4, box[3] - 4)
                draw.ellipse([cx - 4, cy - 4, cx + 4, cy + 4], fill=1)
            mask = np.asfortranarray(np.asarray(canvas, np.uint8))
            paint(image, mask, colour, rng)
            rle = mask_utils.encode(mask)
            flat = mask.flatten(order='F')  # COCO's crowd format: uncompressed RLE counts, column-major
            change = np.flatnonzero(np.diff(flat)) + 1
            counts = np.diff(np.concatenate([[0], change, [flat.size]])).tolist()
            if flat[0]:
                counts = [0] + counts
            anns.append({'id': next_ann + len(anns), 'image_id': image_id, 'category_id': cat, 'iscrowd': 1,
                         'segmentation': {'counts': counts, 'size': [h, w]},
                         'area': float(mask_utils.area(rle)), 'bbox': [float(v) for v in mask_utils.toBbox(rle)]})
    for _ in range(n_objects):
        box = place(h, w, taken, rng, 18, 64)
        if box is None:
            break
        taken.append(box)
        cat, kind, colour = CLASSES[int(rng.integers(len(CLASSES)))]
        polygon = shape_polygon(kind, box)
        rle = mask_utils.merge(mask_utils.frPyObjects([polygon], h, w))
        with warnings.catch_warnings():  # pycocotools' decode trips numpy 2's __array__(copy=) deprecation
            warnings.simplefilter('ignore', DeprecationWarning)
            mask = mask_utils.decode(rle)
        paint(image, mask, colour, rng)
        if kind == 'ellipse':
            segmentation = {'counts': rle['counts'].decode('ascii'), 'size': [h, w]}
        else:
            segmentation = [polygon]
        anns.append({'id': next_ann + len(anns), 'image_id': image_id, 'category_id': cat, 'iscrowd': 0,
                     'segmentation': segmentation, 'area': float(mask_utils.area(rle)),
                     'bbox': [float(v) for v in mask_utils.toBbox(rle)]})
    return np.clip(image, 0, 255).astype(np.uint8), anns


def make_shapes(root: str, n_train: int = 120, n_val: int = 50, seed: int = 0) -> str:
    """Write the set under `root` (created; files there are replaced) and return `root`."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, 'annotations'), exist_ok=True)
    image_id, ann_id = 1, 1
    for split, n in (('train2017', n_train), ('val2017', n_val)):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        images, annotations = [], []
        for _ in range(n):
            h, w = SIZES[int(rng.integers(len(SIZES)))]
            image, anns = scene(h, w, image_id, ann_id, rng)
            name = f'{image_id:012d}.jpg'
            Image.fromarray(image).save(os.path.join(root, split, name), quality=95)
            images.append({'id': image_id, 'file_name': name, 'width': w, 'height': h})
            annotations += anns
            image_id, ann_id = image_id + 1, ann_id + len(anns)
        data = {'info': {'description': 'synthetic shapes (detection/shapes.py)'}, 'licenses': [],
                'images': images, 'annotations': annotations,
                'categories': [{'id': c, 'name': name, 'supercategory': 'shape'} for c, name, _ in CLASSES]}
        with open(os.path.join(root, 'annotations', f'instances_{split}.json'), 'w') as f:
            json.dump(data, f)
    return root


def main(argv: list[str] | None = None) -> int:
    """The command line: write the set."""
    p = argparse.ArgumentParser(description='Write the synthetic shapes set (COCO 2017 layout) of the detection demo.')
    p.add_argument('root', help='folder to write train2017/, val2017/ and annotations/ into')
    p.add_argument('--train', type=int, default=120, help='training images')
    p.add_argument('--val', type=int, default=50, help='validation images')
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    make_shapes(args.root, args.train, args.val, args.seed)
    print(f'Wrote {args.train} training and {args.val} validation images ({len(CLASSES)} classes) to {args.root}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
