"""Data the tests write for themselves: tiny image folders, and data-set arguments."""
import os
from types import SimpleNamespace

from PIL import Image

import cli
import datasets
from tools.synthetic import write_imagefolder
from training import loaders


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


def transform_of(is_train, args, uint8=False):
    """main.py's transform of a split for the command line `args` (its one data config)."""
    cfg = datasets.data_config(args.model, args.input_size, args.eval_crop_ratio)
    return datasets.build_transform(is_train, cfg, cli.settings(datasets.Augmentation, args), args.data_set, uint8)


def dataset_of(is_train, args, uint8=False):
    """main.py's data set of a split for the command line `args`."""
    source = cli.settings(datasets.DataSource, args)
    return datasets.build_dataset(is_train, source, transform_of(is_train, args, uint8))


def eval_sets_of(args, dataset_val, uint8=False):
    """main.py's --eval-sets of the command line `args`, labelled as `dataset_val`."""
    return datasets.build_eval_sets(args.eval_sets, dataset_val, transform_of(False, args, uint8), args.strict_data,
                                     args.follow_links)


def loaders_of(args, dataset_train, dataset_val):
    """main.py's samplers and loaders of the command line `args`."""
    return loaders.build_loaders(dataset_train, dataset_val, cli.settings(loaders.LoaderSettings, args))


def device_loader_of(loader, args, device):
    """`loader` normalising on `device` with the data config of the command line `args`."""
    cfg = datasets.data_config(args.model, args.input_size, args.eval_crop_ratio)
    return loaders.device_loader(loader, cfg, device)


def erasing_of(args, device):
    """main.py's random erasing on the device for the command line `args`."""
    return loaders.batch_random_erasing(cli.settings(datasets.Augmentation, args), device)


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

