"""Data the tests write for themselves: tiny image folders, and data-set arguments."""
import os
from types import SimpleNamespace

from PIL import Image

import cli
from tools.synthetic import write_imagefolder


def make_imagefolder(root, classes=3, n_train=8, n_val=5, size=32, seed=0):
    """Colour-coded classes (class c brightens channel c % 3), PNG files in train/ and val/; 5 val images per
    class by default, an odd total that two processes cannot split evenly."""
    return write_imagefolder(str(root), classes, n_train, n_val, size, seed)


def make_args(**kw):
    """The command line's defaults with the data fields of a small test (``kw`` overrides)."""
    a = dict(data_set='IMNET', data_path=None, input_size=32, color_jitter=0.4,
             aa='rand-m9-mstd0.5-inc1', train_interpolation='bicubic', reprob=0.25, remode='pixel',
             recount=1, inat_category='name', strict_data=False)
    a.update(kw)
    return cli.get_args_parser().parse_args([], namespace=SimpleNamespace(**a))


def save_img(path, color=(255, 0, 0), size=6, fmt=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new('RGB', (size, size), color).save(path, fmt)


def make_folder(root, classes=('cat', 'dog'), n=3, splits=('train', 'val'), ext='.png'):
    for split in splits:
        for ci, c in enumerate(classes):
            for i in range(n):
                save_img(os.path.join(root, split, c, f'{i}{ext}'), (ci * 100, i * 40, 0))
    return str(root)


def assert_one_line_error(exc_info, *needles):
    msg = str(exc_info.value)
    assert '\n' not in msg and 'expected' in msg, msg
    for s in needles:
        assert str(s) in msg, (s, msg)
    return msg

