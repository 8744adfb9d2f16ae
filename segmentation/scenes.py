"""A synthetic scene set in the ADE20K layout, for the demo and the tests: images of textured shapes with their
per-pixel labels, written as ADEChallengeData2016 is (images/*/NAME.jpg, annotations/*/NAME.png, 0 = "other"),
so that training and evaluation read it through the real loader.

Classes 1..5 are textures in a colour of their own, jittered per shape: 1 noise (the background), 2 horizontal
stripes, 3 vertical stripes, 4 a checkerboard, 5 diagonal stripes, their stripes 3 to 5 pixels wide so that
they survive the pipeline's rescaling. A few blotches of flat random colour are labelled 0 ("other": ignored).
The classes' names go to classes.txt (the evaluation's per-class table reads them). Deterministic for a seed.

    python segmentation/scenes.py output/seg-demo-data            # 400 training and 100 validation scenes
"""
import argparse
import os
import sys

import numpy as np
from PIL import Image, ImageDraw

NUM_CLASSES = 5
#: the names of classes 1..5, written to classes.txt
CLASS_NAMES = ('noise', 'horizontal stripes', 'vertical stripes', 'checkerboard', 'diagonal stripes')
#: each class's colour (RGB), jittered by up to 40 per channel and shape
COLOURS = {1: (110, 140, 90), 2: (200, 60, 60), 3: (60, 90, 210), 4: (220, 200, 60), 5: (150, 70, 190)}


def texture(cls: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """An HxWx3 float image of texture `cls`: its colour, jittered, and a darker shade of it."""
    a = np.clip(np.array(COLOURS[cls], float) + rng.uniform(-40, 40, 3), 0, 255)
    b = a * rng.uniform(0.3, 0.6)
    y, x = np.mgrid[0:h, 0:w]
    period = int(rng.integers(6, 11))
    if cls == 1:
        pattern = rng.random((h, w))
    elif cls == 2:
        pattern = (y // (period // 2)) % 2
    elif cls == 3:
        pattern = (x // (period // 2)) % 2
    elif cls == 4:
        pattern = ((y // (period // 2)) + (x // (period // 2))) % 2
    else:
        pattern = ((x + y) // (period // 2)) % 2
    return a * (1 - pattern[..., None]) + b * pattern[..., None]


def shape_mask(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A random ellipse, rectangle or triangle as an HxW boolean mask."""
    canvas = Image.new('L', (w, h), 0)
    draw = ImageDraw.Draw(canvas)
    cy, cx = rng.uniform(0, h), rng.uniform(0, w)
    ry, rx = rng.uniform(0.12, 0.35) * h, rng.uniform(0.12, 0.35) * w
    kind = int(rng.integers(3))
    if kind == 0:
        draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=1)
    elif kind == 1:
        draw.rectangle([cx - rx, cy - ry, cx + rx, cy + ry], fill=1)
    else:
        draw.polygon([(cx, cy - ry), (cx - rx, cy + ry), (cx + rx, cy + ry)], fill=1)
    return np.asarray(canvas) > 0


def scene(h: int, w: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(HxWx3 uint8 image, HxW uint8 label map) of one scene."""
    image = texture(1, h, w, rng)
    label = np.ones((h, w), np.uint8)
    for _ in range(int(rng.integers(2, 5))):
        cls = int(rng.integers(2, NUM_CLASSES + 1))
        mask = shape_mask(h, w, rng)
        image[mask] = texture(cls, h, w, rng)[mask]
        label[mask] = cls
    for _ in range(int(rng.integers(0, 2))):  # "other": flat colour, ignored by training and evaluation
        mask = shape_mask(h, w, rng)
        image[mask] = rng.uniform(0, 255, 3)
        label[mask] = 0
    image += rng.normal(0, 8, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8), label


def make_scenes(root: str, n_train: int = 400, n_val: int = 100, size: tuple[int, int] = (64, 80),
                seed: int = 0) -> str:
    """Write the scene set under `root` (created; files there are replaced) and return `root`. `size` is
    (height, width) of every scene."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, 'classes.txt'), 'w') as f:
        f.write(''.join(name + '\n' for name in CLASS_NAMES))
    for split, n in (('training', n_train), ('validation', n_val)):
        os.makedirs(os.path.join(root, 'images', split), exist_ok=True)
        os.makedirs(os.path.join(root, 'annotations', split), exist_ok=True)
        for i in range(n):
            image, label = scene(*size, rng)
            name = f'ADE_{"train" if split == "training" else "val"}_{i + 1:08d}'
            Image.fromarray(image).save(os.path.join(root, 'images', split, name + '.jpg'), quality=95)
            Image.fromarray(label).save(os.path.join(root, 'annotations', split, name + '.png'))
    return root


def main(argv: list[str] | None = None) -> int:
    """The command line: write the scene set."""
    p = argparse.ArgumentParser(description='Write the synthetic scene set (ADE20K layout) of the demo.')
    p.add_argument('root', help='folder to write images/ and annotations/ into')
    p.add_argument('--train', type=int, default=400, help='training scenes')
    p.add_argument('--val', type=int, default=100, help='validation scenes')
    p.add_argument('--size', type=int, nargs=2, default=(64, 80), metavar=('H', 'W'))
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    make_scenes(args.root, args.train, args.val, tuple(args.size), args.seed)
    print(f'Wrote {args.train} training and {args.val} validation scenes ({NUM_CLASSES} classes, '
          f'{args.size[0]}x{args.size[1]}) to {args.root}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
