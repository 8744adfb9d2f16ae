"""Data sets and transforms, DeiT's: ``build_dataset`` (ImageNet and DIGITS as image folders, CIFAR-100,
iNaturalist 2018/2019) and ``build_transform`` from the model's data config. docs/data.md describes the
data sets, their layouts and what happens to undecodable images, docs/evaluation.md the transforms;
image_folder.py reads the folders, eval_sets.py the extra evaluation sets."""
import json
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import timm
from PIL import Image
from timm.data import auto_augment, create_transform
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from image_folder import (
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
)
from models.weight_files import small_input_eval

__all__ = [
    'INatDataset', 'DataSource', 'Augmentation', 'build_dataset', 'build_transform', 'data_config', 'eval_transform',
    'default_data_path', 'prepare_digits', 'DATA_SETS', 'INAT_CATEGORIES',
]

DEIT_DEFAULT_DATA_PATH = '/datasets01/imagenet_full_size/061417/'
DIGITS_DEFAULT_PATH = os.path.join('.', 'data', 'digits')
DIGITS_MARKER = 'DIGITS_COMPLETE'
DIGITS_SEED = 0
DIGITS_SIZE = 32
#: the --data-set names build_dataset knows
DATA_SETS: tuple[str, ...] = ('CIFAR', 'IMNET', 'INAT', 'INAT19', 'DIGITS')
#: the --inat-category choices: the fields of iNaturalist's categories.json a class can be named by
INAT_CATEGORIES: tuple[str, ...] = ('kingdom', 'phylum', 'class', 'order', 'supercategory', 'family', 'genus', 'name')


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


def override_note(flag: str, given: Any, recorded: Any, source: str) -> str:
    """The note every entry point prints when a flag of the evaluation transform given on the command line
    differs from the value the checkpoint ``source`` records (the command line wins); '' when they agree or
    one of them is missing."""
    if given is None or recorded is None or given == recorded:
        return ''
    return f'Note: {flag} {given} on the command line, {recorded} in {source}; using {given}'


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




