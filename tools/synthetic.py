"""A tiny synthetic ImageFolder: what ``tools/smoke.py`` trains on and the tests' real-process runs read."""
import os

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
