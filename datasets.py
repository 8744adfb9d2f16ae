"""Data sets and transforms, DeiT's: ``build_dataset`` (ImageNet and DIGITS as image folders, CIFAR-100,
iNaturalist 2018/2019) and ``build_transform`` from the model's data config; the extra evaluation sets of
``--eval-sets`` (class folders named as the training classes, ImageNet-V2's numbered folders, a flat folder with a
label file) and ImageNet-ReaL labels (``--real-labels``), which ``engine.evaluate`` scores alongside the validation
set; and mmcv's rescaling of an image to a scale, which both dense tasks (segmentation/, detection/) use.
docs/data.md describes the data sets, their layouts and what happens to undecodable images, docs/evaluation.md the
transforms and the extra sets' layouts; training/image_folder.py reads the folders."""
import json
import os
import pkgutil
import shutil
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import auto_augment, create_transform
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from cli import DATA_SETS, INAT_CATEGORIES
from models.weight_files import small_input_eval
from training.image_folder import (
    FLAT_LAYOUT,
    IMAGEFOLDER_LAYOUT,
    BadSampleMixin,
    DataLayoutError,
    FlatLabelledFolder,
    RobustImageFolder,
    find_label_file,
    has_class_folders,
    layout_error,
    list_classes,
    load_image,
    unwrap_dataset,
)

__all__ = [
    'INatDataset', 'DataSource', 'Augmentation', 'build_dataset', 'build_transform', 'data_config', 'eval_transform',
    'default_data_path', 'prepare_digits', 'EVAL_SET_LAYOUT', 'build_eval_set', 'build_eval_sets', 'parse_eval_set',
    'WithIndex', 'RealLabels', 'rescale_size', 'resize_image',
]

DEIT_DEFAULT_DATA_PATH = '/datasets01/imagenet_full_size/061417/'
DIGITS_DEFAULT_PATH = os.path.join('.', 'data', 'digits')
DIGITS_MARKER = 'DIGITS_COMPLETE'
DIGITS_SEED = 0
DIGITS_SIZE = 32


def _check_imagefolder_root(root: str | None, layout: str, is_train: bool) -> None:
    """Validate ``root/train`` and ``root/val`` before anything is decoded (one-line errors)."""
    if not root:
        raise layout_error('--data-path', 'missing (no data path given)', layout)
    if not os.path.isdir(root):
        raise layout_error(root, 'data path does not exist or is not a directory', layout)
    train_dir, val_dir = os.path.join(root, 'train'), os.path.join(root, 'val')
    # training needs both splits (the run evaluates every epoch); eval-only needs, and lists, only val/
    for d in ((train_dir, val_dir) if is_train else (val_dir,)):
        if not os.path.isdir(d):
            parent = os.path.dirname(os.path.abspath(root))
            splits_above = all(os.path.isdir(os.path.join(parent, s)) for s in ('train', 'val'))
            if splits_above and not os.path.isdir(train_dir) and not os.path.isdir(val_dir) and has_class_folders(root):
                raise DataLayoutError(f'{root}: holds class folders, not train/ and val/: it is a split of '
                                      f'{parent}, which holds both; pass --data-path {parent}')
            raise layout_error(d, f'missing {os.path.basename(d)}/ folder', layout)
    if is_train:  # the training build checks that val/ has the classes of train/
        tc, vc = set(list_classes(train_dir)), set(list_classes(val_dir))
        if tc and not vc and find_label_file(val_dir):  # flat val/ with a label file
            flat = FlatLabelledFolder(val_dir, class_to_idx={c: i for i, c in enumerate(sorted(tc))})
            if not flat.numeric_labels:
                vc = {flat.classes[t] for t in flat.targets}
        if tc and vc and tc != vc:
            miss, extra = sorted(tc - vc), sorted(vc - tc)
            parts = []
            if miss:
                parts.append(f"{len(miss)} train class(es) missing from val/ ({', '.join(miss[:5])}"
                             f"{', ...' if len(miss) > 5 else ''})")
            if extra:
                parts.append(f"{len(extra)} val class(es) not in train/ ({', '.join(extra[:5])}"
                             f"{', ...' if len(extra) > 5 else ''})")
            raise layout_error(val_dir, 'class folders differ from train/: ' + '; '.join(parts),
                               layout)


# --------------------------------------------------------------------------------------------
# iNaturalist
# --------------------------------------------------------------------------------------------
class INatDataset(BadSampleMixin, Dataset):
    """iNaturalist 2018/2019 in its JSON layout, as DeiT's ``INatDataset``.

    Labels: the value of ``category`` (categories.json) of each class, numbered in order of first
    appearance in ``train<year>.json`` (DeiT's order, so DeiT checkpoints keep their heads).
    Image paths: ``root/<file_name>`` if it exists, else DeiT's ``root/<cut0>/<cut2>/<cut3>``.
    """

    def __init__(self, root: str, train: bool = True, year: int = 2018,
                 transform: Callable | None = None, category: str = 'name',
                 strict: bool = False, loader: Callable[[str], Any] = load_image) -> None:
        layout = (f'<data-path>/train{year}.json, val{year}.json, categories.json and the image '
                  f'folders named by their file_name entries (iNaturalist {year} layout)')
        if category not in INAT_CATEGORIES:
            raise layout_error(root, f'unknown iNat category {category!r}',
                               'one of ' + '/'.join(INAT_CATEGORIES))
        if not root or not os.path.isdir(root):
            raise layout_error(root or '--data-path', 'data path does not exist', layout)
        self.root, self.transform, self.target_transform, self.loader = root, transform, None, loader

        def read(name: str) -> Any:
            p = os.path.join(root, name)
            if not os.path.isfile(p):
                raise layout_error(p, 'missing annotation file', layout)
            try:
                with open(p) as f:
                    return json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise layout_error(p, f'unreadable JSON ({exc})', layout) from exc

        split_json = read(f"{'train' if train else 'val'}{year}.json")
        catg = read('categories.json')
        train_json = split_json if train else read(f'train{year}.json')
        by_id = {int(c['id']): c for c in catg} if catg and 'id' in catg[0] else None

        def cat_value(cid: int) -> Any:
            return (by_id[cid] if by_id is not None else catg[cid])[category]

        targeter: dict[Any, int] = {}
        for ann in train_json['annotations']:
            targeter.setdefault(cat_value(int(ann['category_id'])), len(targeter))
        self.nb_classes = len(targeter)
        self.classes = [str(c) for c in targeter]  # in label order
        img_cat = {a['image_id']: int(a['category_id']) for a in split_json.get('annotations', [])}
        self.samples = []
        for im in split_json['images']:
            fname = im['file_name']
            cut = fname.split('/')
            path = os.path.join(root, fname)
            if not os.path.exists(path) and len(cut) >= 4:
                path = os.path.join(root, cut[0], cut[2], cut[3])
            cid = img_cat.get(im.get('id'), int(cut[2]) if len(cut) >= 3 else -1)
            self.samples.append((path, targeter[cat_value(cid)]))
        if not self.samples:
            raise layout_error(root, 'no images listed in the annotation file', layout)
        self.targets = [t for _, t in self.samples]
        self._init_bad_tracking(train, strict)

    def __len__(self) -> int:
        return len(self.samples)


# --------------------------------------------------------------------------------------------
# DIGITS writer
# --------------------------------------------------------------------------------------------
def default_data_path(data_set: str) -> str | None:
    """Default ``--data-path`` of a data set: ``./data/digits`` for DIGITS, None otherwise (``build_dataset``
    uses it when the data path is empty or DeiT's ImageNet default)."""
    return DIGITS_DEFAULT_PATH if data_set == 'DIGITS' else None


def _digits_complete(root: str) -> bool:
    return os.path.isfile(os.path.join(root, DIGITS_MARKER))


def _write_digits(dest: str) -> None:
    """scikit-learn's digits as 32 px bicubic-upscaled RGB PNGs in ``dest/{train,val}/<digit>/``, a
    stratified 80/20 split fixed by ``DIGITS_SEED``, then the completion marker."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()  # bundled with scikit-learn, never downloads
    idx = np.arange(len(d.target))
    tr, va = train_test_split(idx, test_size=0.2, random_state=DIGITS_SEED, stratify=d.target)
    for split, ids in (('train', tr), ('val', va)):
        for c in range(10):
            os.makedirs(os.path.join(dest, split, str(c)), exist_ok=True)
        for i in sorted(ids.tolist()):
            a = (d.images[i] * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)
            im = Image.fromarray(a, mode='L').resize((DIGITS_SIZE, DIGITS_SIZE), Image.BICUBIC)
            im.convert('RGB').save(os.path.join(dest, split, str(int(d.target[i])), f'{i:04d}.png'))
    with open(os.path.join(dest, DIGITS_MARKER), 'w') as f:
        f.write(f'sklearn load_digits, {len(tr)} train / {len(va)} val, seed {DIGITS_SEED}, '
                f'{DIGITS_SIZE}px bicubic RGB PNG\n')


def _cleanup_stale_tmp(parent: str, base: str) -> None:
    host = socket.gethostname()
    for e in os.scandir(parent):
        if not e.name.startswith(f'.{base}.tmp-'):
            continue
        parts = e.name.split('-')  # .<base>.tmp-<host>-<pid>-<hex>
        try:
            pid, h = int(parts[-2]), '-'.join(parts[1:-2])
        except (ValueError, IndexError):
            continue
        if h != host:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(e.path, ignore_errors=True)
        except PermissionError:
            pass


def prepare_digits(root: str) -> str:
    """Write the scikit-learn digits as an ImageFolder under ``root`` once; return ``root``.

    Safe against kills (temp dir + one atomic rename) and concurrent callers (loser discards).
    """
    root = os.path.normpath(root)
    if _digits_complete(root):
        return root
    if os.path.isdir(root) and os.listdir(root):
        if os.path.isdir(os.path.join(root, 'train')) and os.path.isdir(os.path.join(root, 'val')):
            return root  # a user-provided ImageFolder: read it as is
        raise layout_error(root, 'exists, is not empty and is not a digits data set',
                           'an empty or absent directory to write the digits into, or '
                           + IMAGEFOLDER_LAYOUT)
    parent, base = os.path.split(os.path.abspath(root))
    tmp = os.path.join(parent, f'.{base}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}')
    try:
        os.makedirs(parent, exist_ok=True)
        _write_digits(tmp)
        try:
            os.rename(tmp, root)  # atomic; replaces only an absent or empty directory
        except OSError:
            if not _digits_complete(root):  # not a lost race with another writer
                raise
        # every writer says it (the ranks of one job race; main.py prints rank 0's lines)
        print(f"DIGITS: wrote scikit-learn's digits (8x8 images upscaled to {DIGITS_SIZE} px) into "
              f'{os.path.abspath(root)} (--data-path sets where; later runs read them from there)')
        _cleanup_stale_tmp(parent, base)
    except OSError as exc:
        raise layout_error(root, f'cannot write the digits data set ({exc})',
                           'a writable --data-path for DIGITS') from exc
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return root


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSource:
    """Which data set a run reads, where, and how its image files are read; each field named as its flag's
    argparse destination (--data-set: data_set)."""
    data_set: str                 # one of DATA_SETS
    data_path: str | None
    inat_category: str            # INAT/INAT19: the class granularity
    strict_data: bool             # an undecodable image stops the run
    follow_links: bool            # follow directory links inside class folders


@dataclass(frozen=True)
class Augmentation:
    """The training transform's flags, each named as its argparse destination."""
    aa: str | None                # RandAugment/AutoAugment policy ('none': off)
    color_jitter: float
    train_interpolation: str | None
    reprob: float                 # random erasing
    remode: str
    recount: int


def _resolve_data_path(source: DataSource) -> str | None:
    data_set, path = source.data_set, source.data_path
    if data_set == 'DIGITS' and (not path or os.path.normpath(path) ==
                                 os.path.normpath(DEIT_DEFAULT_DATA_PATH)):
        return default_data_path(data_set)
    return path


def build_dataset(is_train: bool, source: DataSource, transform: Callable) -> tuple[Dataset, int]:
    """``(dataset, nb_classes)`` of ``source`` (its data set one of ``DATA_SETS``), the training split or (not
    ``is_train``) the validation split, which alone is listed, its images through ``transform``
    (``build_transform``). Raises ``DataLayoutError`` (one line) for data on disk that do not have the data
    set's layout, before any image is decoded."""
    data_set, strict = source.data_set, source.strict_data
    root = _resolve_data_path(source)

    if data_set == 'CIFAR':
        layout = '<data-path>/cifar-100-python/{train,test,meta} (CIFAR-100 python version; ' \
                 'nothing is downloaded)'
        if not root:
            raise layout_error('--data-path', 'missing (no data path given)', layout)
        if os.path.basename(os.path.normpath(root)) == 'cifar-100-python':
            root = os.path.dirname(os.path.normpath(root))
        try:
            ds = datasets.CIFAR100(root, train=is_train, transform=transform, download=False)
        except RuntimeError as exc:
            raise layout_error(root, 'CIFAR-100 not found or corrupted', layout) from exc
        return ds, 100

    if data_set in ('INAT', 'INAT19'):
        ds = INatDataset(root, train=is_train, year=2018 if data_set == 'INAT' else 2019,
                         category=source.inat_category, transform=transform, strict=strict)
        return ds, ds.nb_classes

    if data_set in ('IMNET', 'DIGITS'):
        if data_set == 'DIGITS':
            root = prepare_digits(root)
        _check_imagefolder_root(root, IMAGEFOLDER_LAYOUT, is_train)
        val_dir = os.path.join(root, 'val')
        if not is_train and not has_class_folders(val_dir):
            if not find_label_file(val_dir):
                raise layout_error(val_dir, 'no class folders and no label file',
                                   IMAGEFOLDER_LAYOUT + ', or val/ as ' + FLAT_LAYOUT)
            ds = FlatLabelledFolder(val_dir, transform=transform, strict=strict)
            return ds, len(ds.classes)
        ds = RobustImageFolder(os.path.join(root, 'train' if is_train else 'val'), transform=transform,
                               is_train=is_train, strict=strict, follow_links=source.follow_links)
        if data_set == 'DIGITS' and len(ds.classes) != 10:
            raise layout_error(root, f'{len(ds.classes)} class folders, not 10', IMAGEFOLDER_LAYOUT)
        return ds, len(ds.classes)

    raise layout_error(str(data_set), 'unknown data set', 'one of ' + ', '.join(DATA_SETS))


def data_classes(dataset: Any) -> list | None:
    """The class names of `dataset` in label order; None where its labels carry no names (a flat val/ labelled
    by class index) or it has none."""
    if getattr(dataset, 'numeric_labels', False):
        return None
    return getattr(dataset, 'classes', None)



def _posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's posterize, also for 0 bits: nothing kept, a black image, as Pillow < 13 gave."""
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


def allow_zero_bit_posterize(transform: Callable) -> Callable:
    """Give the posterize ops of timm's Rand/Auto/AugMix augmentation in ``transform`` a 0-bit case.

    The recipe's ``rand-m9-mstd0.5-inc1`` draws magnitudes up to 10, where PosterizeIncreasing keeps
    0 bits; Pillow 13 raises ValueError for that (older Pillow returned a black image), which would
    end a training run a few times per thousand images. Returns ``transform``, changed in place.
    """
    for step in getattr(transform, 'transforms', []):
        ops = list(getattr(step, 'ops', []))
        for sub_policy in getattr(step, 'policy', []):
            ops.extend(sub_policy)
        for op in ops:
            if getattr(op, 'aug_fn', None) is auto_augment.posterize:
                op.aug_fn = _posterize
    return transform


def data_config(model: Any = None, input_size: int | None = None,
                crop_pct: float | None = None) -> dict[str, Any]:
    """timm's data config (input_size, interpolation, mean, std, crop_pct, crop_mode) of ``model``.

    ``model`` is a model, a registered model name, or None (timm's default ``PretrainedCfg``, equal
    to every NaLaFormer variant's); its ``pretrained_cfg`` is the one home of these values, and
    ``input_size`` (one side) and ``crop_pct`` - the command line - override it. Inputs of 32 px or
    less follow DeiT: resized to input_size x input_size, nothing cropped (crop_pct 1.0, 'squash').
    """
    overrides: dict[str, Any] = {}
    if input_size:
        overrides['input_size'] = (3, int(input_size), int(input_size))
    if crop_pct:
        overrides['crop_pct'] = float(crop_pct)
    pretrained_cfg = None
    if isinstance(model, str):
        pretrained_cfg, model = timm.models.get_pretrained_cfg(model), None
    if model is None:
        pretrained_cfg = (pretrained_cfg or timm.models.PretrainedCfg()).to_dict()
    cfg = timm.data.resolve_data_config(overrides, pretrained_cfg=pretrained_cfg, model=model)
    cfg.update(small_input_eval(cfg['input_size'][-1]))
    return cfg




def eval_transform(cfg: dict[str, Any], uint8: bool = False) -> Callable:
    """The evaluation transform of a ``data_config``: timm's, the same for every entry point. It ends in the
    normalised float tensor, or with ``uint8`` in the uint8 tensor of the crop (``DeviceLoader`` normalises)."""
    return create_transform(**cfg, is_training=False, use_prefetcher=uint8)


def build_transform(is_train: bool, cfg: dict[str, Any], augment: Augmentation | None = None, data_set: str = '',
                    uint8: bool = False) -> Callable:
    """DeiT's transform of a split from the data config ``cfg`` (``data_config``): evaluation is
    ``eval_transform``; training is timm's ``create_transform`` with the ``augment`` flags (``--train-interpolation``
    else the model's interpolation). Inputs of 32 px or less follow DeiT: a random crop with 4 px padding instead
    of the random-resized crop, after a bicubic resize to the input size. ``data_set`` DIGITS trains without
    horizontal flip (digits are not mirror-symmetric) and with crop scale (0.25, 1).

    With ``uint8`` the transform stops at the uint8 tensor of the augmented crop: ``DeviceLoader``
    normalises the batch on the device, and the training loop erases (``batch_random_erasing``) there."""
    if not is_train:
        return eval_transform(cfg, uint8)
    input_size = cfg['input_size'][-1]
    digits = data_set == 'DIGITS'
    aa = None if augment.aa in (None, '', 'none', 'None') else augment.aa
    t = create_transform(
        input_size=input_size, is_training=True,
        color_jitter=augment.color_jitter, auto_augment=aa,
        interpolation=augment.train_interpolation or cfg['interpolation'],
        mean=cfg['mean'], std=cfg['std'],
        re_prob=augment.reprob, re_mode=augment.remode, re_count=augment.recount,
        scale=(0.25, 1.0) if digits else None, hflip=0.0 if digits else 0.5, use_prefetcher=uint8)
    if input_size <= 32:  # DeiT: random crop with padding; the resize is a no-op on CIFAR
        t.transforms[0:1] = [transforms.Resize((input_size, input_size),
                                               interpolation=transforms.InterpolationMode.BICUBIC),
                             transforms.RandomCrop(input_size, padding=4)]
    return allow_zero_bit_posterize(t)


# --------------------------------------------------------------------------------------------------
# Extra evaluation sets (--eval-sets) and ImageNet-ReaL labels (--real-labels)
# --------------------------------------------------------------------------------------------------
EVAL_SET_LAYOUT = ('NAME=PATH or PATH, PATH a folder of class folders (named as the training '
                   'classes, or 0..N-1 as in ImageNet-V2) or ' + FLAT_LAYOUT)


def build_eval_set(path: str, classes: list[str], transform: Callable, strict: bool = False,
                   follow_links: bool = False) -> Dataset:
    """An evaluation set at ``path`` labelled in the model's class order ``classes``.

    Class folders named as ``classes`` take those labels; otherwise all-numeric folder names
    (ImageNet-V2: 0..999) are labelled by their integer value, not by ImageFolder's string order
    ("0", "1", "10", "100", ...). A folder without class folders is read with its label file.
    Images go through ``transform`` (the validation set's); ``strict`` and ``follow_links`` as --strict-data and
    --follow-links.
    """
    if not os.path.isdir(path):
        raise layout_error(path, 'evaluation set folder does not exist', EVAL_SET_LAYOUT)
    class_to_idx = {c: i for i, c in enumerate(classes)}
    if not has_class_folders(path):
        return FlatLabelledFolder(path, class_to_idx=class_to_idx, transform=transform, strict=strict)
    ds = RobustImageFolder(path, transform=None, is_train=False, strict=strict,
                           follow_links=follow_links)
    if set(ds.classes) <= set(classes):
        mapping = {i: class_to_idx[c] for i, c in enumerate(ds.classes)}
    elif all(c.isdigit() for c in ds.classes):
        mapping = {i: int(c) for i, c in enumerate(ds.classes)}
        bad = [c for c in ds.classes if int(c) >= len(classes)]
        if bad:
            raise layout_error(path, f"numeric class folder {bad[0]} >= the model's "
                               f"{len(classes)} classes", EVAL_SET_LAYOUT)
    else:
        unknown = sorted(set(ds.classes) - set(classes))
        raise layout_error(path, f'{len(unknown)} class folder(s) neither training classes nor '
                           f'numbers (e.g. {unknown[0]})', EVAL_SET_LAYOUT)
    ds.samples = [(p, mapping[t]) for p, t in ds.samples]
    ds.targets = [t for _, t in ds.samples]
    ds.imgs = ds.samples
    ds.classes, ds.class_to_idx = list(classes), class_to_idx
    ds.transform = transform
    return ds


def parse_eval_set(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); a bare PATH is named after its last folder."""
    name, sep, path = spec.partition('=')
    if not sep:
        name, path = os.path.basename(os.path.normpath(spec)), spec
    return name, path


def build_eval_sets(specs: list[str], dataset_val: Any, transform: Callable, strict: bool = False,
                    follow_links: bool = False) -> list[tuple[str, Dataset]]:
    """The extra evaluation sets of --eval-sets ``specs`` (``NAME=PATH`` / ``PATH``), each labelled in the class
    order of ``dataset_val`` (the main validation set the model was built for), through ``transform``; [] when
    none is asked for."""
    classes = list(getattr(unwrap_dataset(dataset_val), 'classes', None) or [])
    out = []
    for spec in specs:
        name, path = parse_eval_set(spec)
        out.append((name, build_eval_set(path, classes, transform, strict, follow_links)))
    return out


class WithIndex(Dataset):
    """``dataset`` whose items also carry their index, ``(sample, target, index)``: the batches
    ``engine.evaluate`` reads with ReaL labels, which are looked up by index."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        sample, target = self.dataset[index]
        return sample, target, index


class RealLabels:
    """ImageNet-ReaL label sets of the samples of an ImageNet validation set, matched by file name
    (ILSVRC2012_val_XXXXXXXX.JPEG). ``path`` None reads the labels bundled with timm
    (timm/data/_info/imagenet_real_labels.json); else a local real.json of the same format (a list
    of 50000 label lists in file-name order)."""

    def __init__(self, dataset: Any, path: str | None = None) -> None:
        layout = 'a real.json list of 50000 label lists and val images named ILSVRC2012_val_XXXXXXXX.JPEG'
        if path:
            try:
                with open(path) as f:
                    table = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise layout_error(path, f'cannot read ReaL labels ({exc})', layout) from exc
        else:
            table = json.loads(pkgutil.get_data('timm.data', '_info/imagenet_real_labels.json'))
        ds = unwrap_dataset(dataset)
        self.labels: list[list[int]] = []
        for p, _ in ds.samples:
            stem = os.path.splitext(os.path.basename(p))[0]
            num = stem.rsplit('_', 1)[-1]
            if not (stem.startswith('ILSVRC2012_val_') and num.isdigit() and 0 < int(num) <= len(table)):
                raise layout_error(p, 'not an image of the ImageNet validation set; ImageNet-ReaL labels exist only '
                                   'for the 1000-class ImageNet validation set, so evaluate that set or drop '
                                   '--real-labels',
                                   f'val images named ILSVRC2012_val_XXXXXXXX.JPEG (1 to {len(table)})')
            self.labels.append(table[int(num) - 1])
        # ReaL labels index the 1000 ImageNet classes in sorted-synset order: a model with fewer
        # classes would be scored against labels it cannot predict
        n_classes = len(getattr(ds, 'classes', []))
        top = max((max(labels) for labels in self.labels if labels), default=-1)
        if top >= n_classes:
            raise layout_error(path or "timm's imagenet_real_labels.json", f'ReaL label {top} but the '
                               f'validation set has {n_classes} classes', 'the 1000 ImageNet classes')
        # the label sets as one tensor, padded with -1 (never a class), so batches are scored on the device
        width = max((len(labels) for labels in self.labels), default=0) or 1
        self.table = torch.tensor([labels + [-1] * (width - len(labels)) for labels in self.labels],
                                  dtype=torch.int64).view(len(self.labels), width)

    def count(self, top: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[top-1 hits, top-5 hits, images scored] (float64, on the device of ``top``) of one batch from
        its top-k predicted classes ``top`` (batch x k, best first) and sample indices ``index``. Images
        with an empty ReaL label set and undecodable ones (``valid`` false) are not scored."""
        if self.table.device != top.device:
            self.table = self.table.to(top.device)
        real = self.table[index]
        scored = valid & (real >= 0).any(1)
        hit = top.unsqueeze(2).eq(real.unsqueeze(1)).any(2) & scored.view(-1, 1)
        return torch.stack([hit[:, 0].sum(dtype=torch.float64), hit.any(1).sum(dtype=torch.float64),
                            scored.sum(dtype=torch.float64)])


# --------------------------------------------------------------------------------------------------
# Rescaling as mmcv does, for segmentation's and detection's pipelines (OpenCV's sampling grid: half-pixel
# centres, no antialiasing, as mmcv's imresize)
# --------------------------------------------------------------------------------------------------
def rescale_size(h: int, w: int, scale: tuple[float, float]) -> tuple[int, int]:
    """(height, width) of an image rescaled, aspect ratio kept, to fit `scale` = (long edge, short edge)
    (mmcv's rescale_size)."""
    factor = min(max(scale) / max(h, w), min(scale) / min(h, w))
    return int(h * factor + 0.5), int(w * factor + 0.5)


def resize_image(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of an HxWx3 uint8 image to `size` (height, width), rounded back to uint8."""
    if image.shape[:2] == tuple(size):
        return image
    t = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
    t = F.interpolate(t, size=size, mode='bilinear', align_corners=False)
    return t[0].round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
