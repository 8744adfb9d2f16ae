"""Synthetic ImageFolders: the tiny one ``tools/smoke.py`` trains on and the tests' real-process runs read, and
JPEGs at ImageNet's sizes whose decoding costs what a photo's does, which the loader benchmarks time
(``tools/loader_speed.py``, ``tools/gpu_benchmark.py``)."""
import os
from typing import Sequence

import numpy as np
from PIL import Image


def write_imagefolder(root: str, classes: int = 3, n_train: int = 8, n_val: int = 4, size: int = 32,
                      seed: int = 0) -> str:
    """Random PNGs in train/ and val/ whose class c brightens colour channel c % 3 (less so for c >= 3)."""
    rng = np.random.default_rng(seed)
    for split, n in (('train', n_train), ('val', n_val)):
        for c in range(classes):
            folder = os.path.join(root, split, f'c{c}')
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                a = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
                a[..., c % 3] += 150 - 40 * (c // 3)
                Image.fromarray(a).save(os.path.join(folder, f'{i}.png'))
    return str(root)


def make_jpegs(root: str, count: int = 200, size: Sequence[int] = (500, 375), quality: int = 90,
               classes: int = 4) -> None:
    """``count`` JPEGs of ``size`` (width, height) in ``classes`` ImageFolder classes under ``root``:
    smooth structure at three scales plus grain, so that decoding costs about what a photo does."""
    rng = np.random.default_rng(0)
    width, height = size
    for i in range(count):
        img = rng.normal(128, 10, (height, width, 3))
        for cells, amp in ((4, 90), (16, 50), (64, 25)):
            small = rng.uniform(0, 255, (max(1, cells * height // width), cells, 3)).astype(np.uint8)
            img += amp * (np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC)) / 127.5 - 1)
        folder = os.path.join(root, f'class{i % classes}')
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(os.path.join(folder, f'{i:05d}.jpg'), quality=quality)


def make_photo_jpegs(root: str, count: int = 200, quality: int = 90, classes: int = 4, seed: int = 0) -> None:
    """``count`` JPEGs (quality ``quality``) in ``classes`` ImageFolder classes under ``root``, cut from
    scikit-learn's two sample photos (china.jpg and flower.jpg, 640x427) and resized to ImageNet's usual
    sizes: the long side 500 px, the short side 333..400 px, one in four portrait. Real photos decode as
    ImageNet's JPEGs do; noise-like synthetic images (``make_jpegs``) decode several times slower."""
    from sklearn.datasets import load_sample_images  # bundled with scikit-learn, never downloads
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)
    for i in range(count):
        photo = photos[i % len(photos)]
        short = int(rng.integers(333, 401))
        width, height = (short, 500) if rng.random() < 0.25 else (500, short)
        # a crop of the target's aspect ratio, 60..100% of the largest that fits, anywhere in the photo
        crop_w = min(photo.width, photo.height * width / height) * rng.uniform(0.6, 1.0)
        crop_h = crop_w * height / width
        left, top = rng.uniform(0, photo.width - crop_w), rng.uniform(0, photo.height - crop_h)
        img = photo.resize((width, height), Image.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
        folder = os.path.join(root, f'class{i % classes}')
        os.makedirs(folder, exist_ok=True)
        img.save(os.path.join(folder, f'{i:05d}.jpg'), quality=quality)
