"""Fault-tolerant image folders and image decoding: one-line layout errors, undecodable images replaced and
recorded (or raised with ``--strict-data``), counted non-image files and refused directory links.
docs/data.md describes the layouts and the bad-sample rules."""
import os
import re
import warnings
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS

from run import distributed
from run.errors import BadSampleError

__all__ = [
    'DataLayoutError', 'BadSampleWarning', 'IGNORE_TARGET', 'IMAGE_EXTENSIONS',
    'IMAGEFOLDER_LAYOUT', 'LABEL_FILE_NAMES', 'FLAT_LAYOUT', 'layout_error', 'load_image', 'BadSampleMixin',
    'RobustImageFolder', 'FlatLabelledFolder', 'find_label_file', 'has_class_folders', 'list_classes',
    'unwrap_dataset', 'bad_sample_paths', 'bad_sample_count', 'bad_sample_mask', 'bad_sample_count_all_ranks',
]

#: the target of an undecodable evaluation image (CrossEntropyLoss's default ignore_index): not counted
IGNORE_TARGET = -100

IMAGE_EXTENSIONS: tuple[str, ...] = tuple(
    e for e in IMG_EXTENSIONS + ('.gif', '.jfif', '.pbm', '.pnm', '.avif')
    if e in Image.registered_extensions())
IMAGEFOLDER_LAYOUT = ('<data-path>/train/<class>/<image> and <data-path>/val/<class>/<image> '
                      'with the same class folders in both and image files (' +
                      '/'.join(e.lstrip('.') for e in IMAGE_EXTENSIONS) + ')')


class DataLayoutError(ValueError):
    """The data on disk do not have the expected layout; str() is one line naming the path."""


def data_error_line(e: BaseException) -> str:
    """The one line of a DataLayoutError (or a subclass), also when a data-loader worker raised it: torch then puts
    the worker's traceback before the message, whose line stays last, prefixed with the class name."""
    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return re.sub(r'^[\w.]*Error: ', '', last)


class BadSampleWarning(UserWarning):
    """An image file could not be decoded and was replaced (warned once per path)."""


def layout_error(path: str, problem: str, layout: str) -> DataLayoutError:
    return DataLayoutError(f'{path}: {problem}; expected {layout}'.replace('\n', ' '))


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def list_classes(split_dir: str, layout: str = IMAGEFOLDER_LAYOUT) -> list[str]:
    """Sorted class folder names of ``split_dir``; a broken link to a class folder is an error
    (dropping it would silently change the number of classes and every later label)."""
    classes = []
    for e in os.scandir(split_dir):
        if e.name.startswith('.'):
            continue
        if e.is_dir():
            classes.append(e.name)
        elif e.is_symlink() and not os.path.exists(e.path):
            raise layout_error(e.path, f'class folder is a broken link (-> {os.readlink(e.path)}); '
                               'fix or remove the link', layout)
    return sorted(classes)


def _inside(path: str, root: str) -> bool:
    """True if real path ``path`` is ``root`` or lies below it."""
    return os.path.commonpath([path, root]) == root


def _to_8bit_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB of ``img``: 16/32-bit integer images are scaled from 0..65535 to 0..255 and float
    images mapped from [0, 1] (or kept if in [0, 255]); Pillow's own convert would clip them, turning
    almost every pixel white. Raises ValueError for values that fit neither range."""
    if img.mode.startswith('I;16') or img.mode == 'I':
        a = np.asarray(img).astype(np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise ValueError(f'{img.mode} image with values in [{a.min()}, {a.max()}], outside 16-bit '
                             '0..65535; save it as 8 or 16 bits per channel')
        img = Image.fromarray(((a + 128) // 257).astype(np.uint8), 'L')
    elif img.mode == 'F':
        a = np.asarray(img, dtype=np.float64)
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if not np.isfinite(a).all() or lo < 0 or hi > 255:
            raise ValueError(f'float image with values in [{lo:g}, {hi:g}], neither [0, 1] nor '
                             '[0, 255] (or not finite); save it as 8 or 16 bits per channel')
        img = Image.fromarray(np.round(a * (255.0 if hi <= 1 else 1.0)).astype(np.uint8), 'L')
    return img if img.mode == 'RGB' else img.convert('RGB')


def load_image(path: str) -> Image.Image:
    """Decode an image file as 8-bit RGB: EXIF orientation applied, the first frame of an animation,
    16-bit and float images scaled (see ``_to_8bit_rgb``)."""
    with open(path, 'rb') as f:
        # PIL's warning for a very large image (over Image.MAX_IMAGE_PIXELS, below twice that, where it
        # raises) does not say which file: say it here; other warnings pass through unchanged
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always', Image.DecompressionBombWarning)
            img = Image.open(f)
        for w in caught:
            if issubclass(w.category, Image.DecompressionBombWarning):
                warnings.warn(f'{path}: {w.message}', Image.DecompressionBombWarning, stacklevel=2)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
        return _to_8bit_rgb(img)



# --------------------------------------------------------------------------------------------
# Undecodable images, class folders
# --------------------------------------------------------------------------------------------
class BadSampleMixin:
    """Replace-and-record (or, ``strict``, raise ``BadSampleError``) for samples whose image cannot be
    decoded: training reads the next decodable index with its own label; evaluation reads it with target
    ``IGNORE_TARGET``, which the engine does not count. Each bad path is warned once and flagged in a
    per-index tensor in shared memory, so the main process sees what DataLoader workers found.

    Requires ``self.samples`` (list of (path, target)), ``self.loader``, ``self.transform`` and
    ``self.target_transform``; subclasses call ``_init_bad_tracking`` once ``samples`` is set.
    """

    samples: list
    _bad: torch.Tensor

    def _init_bad_tracking(self, is_train: bool, strict: bool) -> None:
        self.is_train = is_train
        self.strict = strict
        # one byte per sample in shared memory: visible from the main process and every worker
        self._bad = torch.zeros(max(len(self.samples), 1), dtype=torch.uint8).share_memory_()

    def _mark_bad(self, index: int, path: str, exc: BaseException) -> None:
        if self.strict:
            raise BadSampleError(f'cannot decode image {path}: {type(exc).__name__}: {exc} '
                                 '(strict data mode; drop --strict-data to skip such files)') from exc
        if int(self._bad[index]) == 0:
            self._bad[index] = 1
            what = 'replaced by the next image' if self.is_train else \
                'excluded from the evaluation count'
            warnings.warn(f'cannot decode image {path} ({type(exc).__name__}: {exc}); {what}',
                          BadSampleWarning, stacklevel=3)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        n = len(self.samples)
        first_error: BaseException | None = None
        for k in range(n):
            i = (index + k) % n
            path, target = self.samples[i]
            if k > 0 and int(self._bad[i]):
                continue  # known bad, do not retry it as a replacement
            try:
                sample = self.loader(path)
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
                # OSError covers truncated files and PIL.UnidentifiedImageError
                self._mark_bad(i, path, exc)
                first_error = first_error or exc
                continue
            if k > 0 and not self.is_train:
                target = IGNORE_TARGET
            if self.transform is not None:
                sample = self.transform(sample)
            if self.target_transform is not None and target != IGNORE_TARGET:
                target = self.target_transform(target)
            return sample, target
        raise BadSampleError(f"no decodable image left in the data set rooted at "
                             f"{getattr(self, 'root', '?')} (first error: {first_error})")

    def bad_sample_paths(self) -> list[str]:
        """Paths of the samples found undecodable so far (in this process and its workers)."""
        idx = torch.nonzero(self._bad[: len(self.samples)]).flatten().tolist()
        return [self.samples[i][0] for i in idx]


class RobustImageFolder(BadSampleMixin, datasets.ImageFolder):
    """``torchvision.datasets.ImageFolder`` with one-line layout errors, counted non-image files,
    hidden entries ignored, refused directory links, and replace-and-record handling of
    undecodable images.

    Class folders may be links. Directory links inside a class folder are not followed unless
    ``follow_links``; even then a link back into the split folder (another class, a loop) or to an
    ancestor of it is refused. Refused links are listed in ``refused_links`` and in one warning.
    """

    def __init__(self, root: str, transform: Callable | None = None, is_train: bool = True,
                 strict: bool = False, layout: str = IMAGEFOLDER_LAYOUT,
                 loader: Callable[[str], Any] = load_image, follow_links: bool = False) -> None:
        self.layout = layout
        self.follow_links = follow_links
        self.skipped_files: list[str] = []
        self.refused_links: list[str] = []
        super().__init__(root, transform=transform, loader=loader)
        self._init_bad_tracking(is_train, strict)
        if self.skipped_files:
            warnings.warn(f"{root}: skipped {len(self.skipped_files)} non-image file(s) "
                          f"(e.g. {self.skipped_files[0]}); only "
                          f"{'/'.join(IMAGE_EXTENSIONS)} files are read", UserWarning, stacklevel=2)
        if self.refused_links:
            fix = ('links into the data set or to its parents are never followed' if follow_links
                   else 'pass --follow-links to read linked directories')
            warnings.warn(f"{root}: did not follow {len(self.refused_links)} directory link(s) inside "
                          f"class folders: {'; '.join(self.refused_links[:3])}"
                          f"{'; ...' if len(self.refused_links) > 3 else ''} ({fix})",
                          UserWarning, stacklevel=2)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = list_classes(directory, self.layout)
        if not classes:
            raise layout_error(directory, 'no class folders', self.layout)
        split_real = os.path.realpath(directory)
        for c in classes:
            real = os.path.realpath(os.path.join(directory, c))
            if _inside(split_real, real):
                raise layout_error(os.path.join(directory, c), f'class folder links to {real}, the '
                                   'split folder or a parent of it (a loop)', self.layout)
        return classes, {c: i for i, c in enumerate(classes)}

    def _refuse_link(self, link: str, here: str, roots: list[str]) -> str | None:
        """Why the directory link ``link`` (found in real directory ``here``) is not followed."""
        if not self.follow_links:
            return 'not followed by default'
        target = os.path.realpath(link)
        if _inside(here, target):
            return f'loop: links to its parent {target}'
        if any(_inside(target, r) for r in roots):
            return f'links back into the data set ({target})'
        if target in self._visited:
            return f'{target} already read'
        return None

    def make_dataset(self, directory: str, class_to_idx: dict[str, int], extensions=None,
                     is_valid_file=None, allow_empty: bool = False) -> list[tuple[str, int]]:
        samples: list[tuple[str, int]] = []
        # real paths of the split and class folders: a followed link must not lead back into them
        roots = [os.path.realpath(directory)] + [os.path.realpath(os.path.join(directory, c))
                                                 for c in class_to_idx]
        self._visited: set[str] = set()
        for cls in sorted(class_to_idx):
            cls_dir = os.path.join(directory, cls)
            n_before = len(samples)
            for dirpath, dirnames, filenames in os.walk(cls_dir, followlinks=self.follow_links):
                here = os.path.realpath(dirpath)
                self._visited.add(here)
                keep = []
                for d in sorted(dirnames):
                    if d.startswith('.'):  # prune hidden
                        continue
                    sub = os.path.join(dirpath, d)
                    why = self._refuse_link(sub, here, roots) if os.path.islink(sub) else None
                    if why:
                        self.refused_links.append(f'{sub} ({why})' if self.follow_links else sub)
                    else:
                        keep.append(d)
                dirnames[:] = keep
                for name in sorted(filenames):
                    if name.startswith('.'):
                        continue
                    path = os.path.join(dirpath, name)
                    if is_image_name(name):
                        samples.append((path, class_to_idx[cls]))
                    else:
                        self.skipped_files.append(path)
            if len(samples) == n_before:
                raise layout_error(cls_dir, 'empty class folder (no image file)', self.layout)
        return samples


# --------------------------------------------------------------------------------------------
# A flat folder with a label file (ImageNet's original validation layout)
# --------------------------------------------------------------------------------------------
LABEL_FILE_NAMES = ('val_labels.txt', 'val_labels.csv', 'labels.txt', 'labels.csv',
                    'LOC_val_solution.csv')
FLAT_LAYOUT = ('a folder of image files plus a label file (' + ', '.join(LABEL_FILE_NAMES) +
               ", in the folder or its parent) with one 'filename label' line per image, label a "
               "class folder name (e.g. n01440764) or a class index")


def find_label_file(folder: str) -> str | None:
    """The first of ``LABEL_FILE_NAMES`` found in ``folder`` or its parent, else None."""
    for d in (folder, os.path.dirname(os.path.normpath(folder))):
        for name in LABEL_FILE_NAMES:
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def _read_label_file(path: str) -> list[tuple[str, str]]:
    """(file name, label) pairs of a 'filename label' file (whitespace or comma separated; for a
    comma-separated line the label is the first word of the second field, as in Kaggle's
    LOC_val_solution.csv). A header line (ImageId/filename/...) is skipped."""
    pairs = []
    with open(path) as f:
        for n, line in enumerate(f):
            line = line.strip()
            if not line or line.startswith('#'):
                continue
            fields = line.split(',', 1) if ',' in line else line.split(None, 1)
            if len(fields) < 2 or not fields[1].split():
                raise layout_error(path, f"line {n + 1} ({line[:60]!r}) is not 'filename label'",
                                   FLAT_LAYOUT)
            fname, label = fields[0].strip(), fields[1].split()[0]
            if n == 0 and fname.lower() in ('imageid', 'image_id', 'filename', 'file', 'image', 'path'):
                continue
            pairs.append((fname, label))
    return pairs


class FlatLabelledFolder(BadSampleMixin, Dataset):
    """Images directly in ``root`` with their labels in a label file (ImageNet's original val
    layout). Labels are class names (mapped with ``class_to_idx``, or sorted if None) or integer
    class indices. Every image must have a label and every label an image (one-line errors)."""

    def __init__(self, root: str, label_file: str | None = None,
                 class_to_idx: dict[str, int] | None = None, transform: Callable | None = None,
                 strict: bool = False, loader: Callable[[str], Any] = load_image) -> None:
        label_file = label_file or find_label_file(root)
        if label_file is None:
            raise layout_error(root, 'no class folders and no label file', FLAT_LAYOUT)
        self.root, self.transform, self.target_transform = root, transform, None
        self.loader = loader
        images = sorted(e.name for e in os.scandir(root)
                        if e.is_file() and not e.name.startswith('.') and is_image_name(e.name))
        if not images:
            raise layout_error(root, 'no image files', FLAT_LAYOUT)
        by_name = {n: n for n in images} | {os.path.splitext(n)[0]: n for n in images}
        pairs = _read_label_file(label_file)
        unknown = [f for f, _ in pairs if f not in by_name]
        if unknown:
            raise layout_error(label_file, f'{len(unknown)} listed file(s) not found in {root} '
                               f'(e.g. {unknown[0]})', FLAT_LAYOUT)
        label_of = {by_name[f]: lab for f, lab in pairs}
        unlabelled = [n for n in images if n not in label_of]
        if unlabelled:
            raise layout_error(root, f'{len(unlabelled)} image(s) have no label in {label_file} '
                               f'(e.g. {unlabelled[0]})', FLAT_LAYOUT)
        labels = set(label_of.values())
        self.numeric_labels = all(lab.isdigit() for lab in labels)
        if self.numeric_labels:
            n_cls = len(class_to_idx) if class_to_idx is not None else max(int(x) for x in labels) + 1
            self.classes = [str(i) for i in range(n_cls)] if class_to_idx is None else \
                sorted(class_to_idx, key=class_to_idx.__getitem__)
            to_idx = {lab: int(lab) for lab in labels}
        else:
            if class_to_idx is None:
                class_to_idx = {c: i for i, c in enumerate(sorted(labels))}
            self.classes = sorted(class_to_idx, key=class_to_idx.__getitem__)
            to_idx = {lab: class_to_idx.get(lab, -1) for lab in labels}
        bad = sorted(lab for lab, i in to_idx.items() if not 0 <= i < len(self.classes))
        if bad:
            raise layout_error(label_file, f'{len(bad)} label(s) not among the {len(self.classes)} '
                               f'classes (e.g. {bad[0]})', FLAT_LAYOUT)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(os.path.join(root, n), to_idx[label_of[n]]) for n in images]
        self.targets = [t for _, t in self.samples]
        self._init_bad_tracking(False, strict)

    def __len__(self) -> int:
        return len(self.samples)


def has_class_folders(folder: str) -> bool:
    """Whether ``folder`` holds a (non-hidden) sub-folder."""
    return any(e.is_dir() and not e.name.startswith('.') for e in os.scandir(folder))


# --------------------------------------------------------------------------------------------
# Bad-sample reporting
# --------------------------------------------------------------------------------------------
def unwrap_dataset(dataset: Any) -> Any:
    """The data set under ``Subset``-like wrappers (those with a ``dataset`` attribute)."""
    while not hasattr(dataset, 'bad_sample_paths') and hasattr(dataset, 'dataset'):
        dataset = dataset.dataset
    return dataset


def bad_sample_paths(dataset: Any) -> list[str]:
    """Paths found undecodable so far in ``dataset`` (any DataLoader worker); [] if not tracked."""
    ds = unwrap_dataset(dataset)
    return ds.bad_sample_paths() if hasattr(ds, 'bad_sample_paths') else []


def bad_sample_count(dataset: Any) -> int:
    """Number of undecodable samples found so far in ``dataset``; 0 if not tracked."""
    ds = unwrap_dataset(dataset)
    if not hasattr(ds, '_bad'):
        return 0
    return int(ds._bad[: len(ds.samples)].sum())


def bad_sample_mask(dataset: Any) -> torch.Tensor:
    """Copy of the per-index flags (uint8, 1 = undecodable) of ``dataset``; empty if not tracked."""
    ds = unwrap_dataset(dataset)
    if not hasattr(ds, '_bad'):
        return torch.zeros(0, dtype=torch.uint8)
    return ds._bad[: len(ds.samples)].clone()


def bad_sample_count_all_ranks(dataset: Any, device: Any = 'cpu') -> int:
    """Distinct undecodable files found by any rank (a collective when several processes run: call it on
    every rank; ``device`` must be CUDA under NCCL)."""
    mask = bad_sample_mask(dataset)
    if distributed.get_world_size() == 1:
        return int(mask.sum())
    return int(sum(distributed.all_reduce_max(mask.tolist(), device)))

