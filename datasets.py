"""Data sets and transforms (DeiT-compatible), with fault handling.

Public API
----------
``build_dataset(is_train, args) -> (dataset, nb_classes)``
    ``args.data_set`` in IMNET | CIFAR | INAT | INAT19 | DIGITS. Other fields read with ``getattr``
    defaults: data_path, inat_category ('name'), model, input_size and eval_crop_ratio (None: the
    model's pretrained_cfg, see data_config), color_jitter (0.4), aa ('rand-m9-mstd0.5-inc1'),
    train_interpolation (None: the model's), reprob (0.25), remode ('pixel'), recount (1),
    strict_data (False), follow_links (False), hflip / scale (see build_transform). The eval build
    (is_train False) lists only ``val/``.
``data_config(model=None, input_size=None, crop_pct=None) -> dict``
    The one source of the data recipe: the model's ``pretrained_cfg`` (input size, interpolation,
    mean/std, crop_pct, crop_mode) through ``timm.data.resolve_data_config``, the command line's
    ``--input-size`` / ``--eval-crop-ratio`` overriding. ``eval_transform(cfg)`` is timm's
    ``create_transform(**cfg, is_training=False)``: resize the shorter side to
    floor(input_size / crop_pct) (256 at 224 / 0.875), centre crop, mean/std - DeiT's evaluation.
``build_transform(is_train, args)``
    Both splits from ``data_config(args.model, args.input_size, args.eval_crop_ratio)``. Train:
    ``timm.data.create_transform`` with the DeiT flags (``--train-interpolation`` else the model's
    interpolation); eval: ``eval_transform``. Inputs <= 32 px follow DeiT: train replaces the
    random-resized crop by ``RandomCrop(input_size, padding=4)`` and eval only normalises, each
    preceded by a bicubic resize to input_size x input_size (a no-op for 32 px CIFAR images, so
    CIFAR is exactly DeiT; other images no longer crash the crop).
``default_data_path(data_set) -> str | None``
    ``./data/digits`` for DIGITS, None otherwise. ``build_dataset`` uses it when the data path is
    empty, None or DeiT's ImageNet default.
``prepare_digits(root) -> str``
    Writes the scikit-learn digits once as an ImageFolder (see below) and returns ``root``.
``build_eval_sets(args, dataset_val) -> list[(name, dataset)]``
    The extra sets of ``args.eval_sets`` (``NAME=PATH`` or ``PATH``), labelled in the class order of
    ``dataset_val``: class folders named as the training classes; all-numeric folder names
    (ImageNet-V2's 0..999) by their integer value; a folder of images plus a label file
    (``FlatLabelledFolder``). An IMNET ``val/`` without class folders but with a label file is read
    as a ``FlatLabelledFolder`` too (ImageNet's original validation layout).
``RealLabels(dataset_val, path=None)``, ``WithIndex``, ``evaluate_real(loader, model, real, ...)``
    ImageNet-ReaL top-1/top-5 from the labels bundled with timm (or a local real.json), matched by
    file name; the loader iterates ``WithIndex(dataset_val)``.

Errors
------
``DataLayoutError(ValueError)``: raised by ``build_dataset`` before any image is decoded, for a
missing/empty data path, missing ``train/`` or ``val/``, no class folders, an empty class folder
(no image file), ``val/`` classes different from ``train/``, a missing CIFAR pickle folder or
iNaturalist JSON file. ``str(err)`` is ONE line: ``<path>: <problem>; expected <layout>``.

``BadSampleError(RuntimeError)``: raised while loading an image that cannot be decoded (truncated,
corrupt, not an image) when ``strict_data`` is True. ``str(err)`` names the file.

Bad samples (ImageFolder-based sets: IMNET, DIGITS, INAT, INAT19)
----------------------------------------------------------------
With ``strict_data`` False (default) an undecodable image never kills the run:

* train split: the sample is replaced by the next decodable index (idx+1, idx+2, ... wrapping),
  with that sample's own label;
* eval split: the image of the next decodable index is returned with the target ``IGNORE_TARGET``
  (-100, CrossEntropyLoss's default ignore_index). The engine must exclude targets < 0 from the
  loss/accuracy and report "evaluated X of Y" with X = number of targets >= 0 seen and
  Y = ``len(dataset)``. Eval therefore never skips silently.

Either way the path is warned once (``BadSampleWarning``) and recorded in a per-index flag that
lives in shared memory, so it is visible from the main process even when DataLoader workers did the
loading. Read it with ``bad_sample_paths(dataset) -> list[str]`` / ``bad_sample_count(dataset)``
(cumulative since the dataset was built; works through ``Subset`` wrappers; [] / 0 for CIFAR).
Each rank records only the samples it loaded, and with repeated augmentation the same image is
loaded on several ranks, so do not sum per-rank counts: ``bad_sample_count_all_ranks(dataset,
device)`` all-reduces the per-index flags (``bad_sample_mask``) with MAX and counts each bad file
once (a collective: call it on every rank; ``device`` must be CUDA under NCCL).

Image files are recognised by extension, ``IMAGE_EXTENSIONS``: torchvision's ``IMG_EXTENSIONS``
(jpg jpeg png ppm bmp pgm tif tiff webp) plus gif jfif pbm pnm avif, each only if this Pillow build
decodes it. Other files inside class folders are skipped, counted (``dataset.skipped_files``) and
reported in one ``UserWarning`` per split; they are not a layout error. Hidden entries (names
starting with '.') are ignored, neither classes nor files.

Decoding (``load_image``): EXIF orientation applied, first frame of an animation, 16-bit (and 32-bit
integer) images scaled from 0..65535 to 0..255, float images mapped from [0, 1] or kept if in
[0, 255]; other float ranges are undecodable samples (below), never silently clipped to white.

Links: class folders may be links (a broken one, or one to the split folder or a parent, is a
layout error). Directory links inside class folders are not followed unless ``args.follow_links``;
even then links back into the split folder (a loop, another class) or to an ancestor are refused.
Refused links are listed in ``dataset.refused_links`` and named in one ``UserWarning``.

DIGITS
------
``sklearn.datasets.load_digits`` (1797 8x8 images, values 0..16, bundled with scikit-learn, nothing
downloaded) is written as RGB PNGs upscaled to 32x32 with bicubic interpolation (smooth strokes
survive the later resize to 64 px far better than nearest-neighbour blocks), white ink on black,
into ``<root>/train/<digit>/<index>.png`` and ``<root>/val/<digit>/<index>.png`` with a stratified
80/20 split fixed by seed 0 (1437 train / 360 val). The data are written into a temporary sibling
directory and renamed into place in one ``os.rename``: a killed writer leaves no half-written data
set, and concurrent writers (torchrun ranks) race safely - the loser of the rename discards its
copy and uses the winner's. Afterwards DIGITS is read by exactly the IMNET ImageFolder code path.
For DIGITS the train transform defaults to no horizontal flip (digits are not mirror-symmetric) and
crop scale (0.25, 1); ``args.hflip`` / ``args.scale`` override these for any data set.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
import warnings
from typing import Any, Callable, Optional

import numpy as np
import timm
import torch
from PIL import Image, ImageOps
from timm.data import auto_augment, create_transform
from torch.utils.data import Dataset
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

import distributed

__all__ = [
    "DataLayoutError", "BadSampleError", "BadSampleWarning", "IGNORE_TARGET", "RobustImageFolder",
    "INatDataset", "build_dataset", "build_transform", "data_config", "eval_transform", "default_data_path",
    "prepare_digits", "DATA_SETS", "INAT_CATEGORIES",
    "bad_sample_paths", "bad_sample_count", "bad_sample_mask", "bad_sample_count_all_ranks",
    "IMAGE_EXTENSIONS", "load_image", "FlatLabelledFolder", "build_eval_set", "build_eval_sets",
    "RealLabels", "WithIndex", "evaluate_real",
]

IGNORE_TARGET = -100
DEIT_DEFAULT_DATA_PATH = "/datasets01/imagenet_full_size/061417/"
DIGITS_DEFAULT_PATH = os.path.join(".", "data", "digits")
DIGITS_MARKER = "DIGITS_COMPLETE"
DIGITS_SEED = 0
DIGITS_SIZE = 32
#: the --data-set names build_dataset knows
DATA_SETS: tuple[str, ...] = ("CIFAR", "IMNET", "INAT", "INAT19", "DIGITS")
#: the --inat-category choices: the fields of iNaturalist's categories.json a class can be named by
INAT_CATEGORIES: tuple[str, ...] = ("kingdom", "phylum", "class", "order", "supercategory", "family", "genus", "name")

# torchvision's extensions plus the other still-image formats this Pillow build decodes
IMAGE_EXTENSIONS: tuple[str, ...] = tuple(
    e for e in IMG_EXTENSIONS + (".gif", ".jfif", ".pbm", ".pnm", ".avif")
    if e in Image.registered_extensions())
IMAGEFOLDER_LAYOUT = ("<data-path>/train/<class>/<image> and <data-path>/val/<class>/<image> "
                      "with the same class folders in both and image files (" +
                      "/".join(e.lstrip(".") for e in IMAGE_EXTENSIONS) + ")")


class DataLayoutError(ValueError):
    """The data on disk do not have the expected layout; str() is one line naming the path."""


class BadSampleError(RuntimeError):
    """An image file could not be decoded and strict_data is on; str() names the file."""


class BadSampleWarning(UserWarning):
    """An image file could not be decoded and was replaced (warned once per path)."""


def _layout_error(path: str, problem: str, layout: str) -> DataLayoutError:
    return DataLayoutError(f"{path}: {problem}; expected {layout}".replace("\n", " "))


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _list_classes(split_dir: str, layout: str = IMAGEFOLDER_LAYOUT) -> list[str]:
    """Sorted class folder names of ``split_dir``; a broken link to a class folder is an error
    (dropping it would silently change the number of classes and every later label)."""
    classes = []
    for e in os.scandir(split_dir):
        if e.name.startswith("."):
            continue
        if e.is_dir():
            classes.append(e.name)
        elif e.is_symlink() and not os.path.exists(e.path):
            raise _layout_error(e.path, f"class folder is a broken link (-> {os.readlink(e.path)}); "
                                "fix or remove the link", layout)
    return sorted(classes)


def _inside(path: str, root: str) -> bool:
    """True if real path ``path`` is ``root`` or lies below it."""
    return os.path.commonpath([path, root]) == root


def _to_8bit_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB of ``img``: 16/32-bit integer images are scaled from 0..65535 to 0..255 and float
    images mapped from [0, 1] (or kept if in [0, 255]); Pillow's own convert would clip them, turning
    almost every pixel white. Raises ValueError for values that fit neither range."""
    if img.mode.startswith("I;16") or img.mode == "I":
        a = np.asarray(img).astype(np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise ValueError(f"{img.mode} image with values in [{a.min()}, {a.max()}], outside 16-bit "
                             "0..65535; save it as 8 or 16 bits per channel")
        img = Image.fromarray(((a + 128) // 257).astype(np.uint8), "L")
    elif img.mode == "F":
        a = np.asarray(img, dtype=np.float64)
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if not np.isfinite(a).all() or lo < 0 or hi > 255:
            raise ValueError(f"float image with values in [{lo:g}, {hi:g}], neither [0, 1] nor "
                             "[0, 255] (or not finite); save it as 8 or 16 bits per channel")
        img = Image.fromarray(np.round(a * (255.0 if hi <= 1 else 1.0)).astype(np.uint8), "L")
    return img if img.mode == "RGB" else img.convert("RGB")


def load_image(path: str) -> Image.Image:
    """Decode an image file as 8-bit RGB: EXIF orientation applied, the first frame of an animation,
    16-bit and float images scaled (see ``_to_8bit_rgb``)."""
    with open(path, "rb") as f:
        # PIL's warning for a very large image (over Image.MAX_IMAGE_PIXELS, below twice that, where it
        # raises) does not say which file: say it here; other warnings pass through unchanged
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", Image.DecompressionBombWarning)
            img = Image.open(f)
        for w in caught:
            if issubclass(w.category, Image.DecompressionBombWarning):
                warnings.warn(f"{path}: {w.message}", Image.DecompressionBombWarning, stacklevel=2)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
        return _to_8bit_rgb(img)


# --------------------------------------------------------------------------------------------
# Robust ImageFolder
# --------------------------------------------------------------------------------------------
class _BadSampleMixin:
    """Replace-and-record (or raise) for samples whose image cannot be decoded.

    Requires ``self.samples`` (list of (path, target)), ``self.loader``, ``self.transform``,
    ``self.target_transform``, ``self.is_train`` and ``self.strict``.
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
            raise BadSampleError(f"cannot decode image {path}: {type(exc).__name__}: {exc} "
                                 "(strict data mode; drop --strict-data to skip such files)") from exc
        if int(self._bad[index]) == 0:
            self._bad[index] = 1
            what = "replaced by the next image" if self.is_train else \
                "excluded from the evaluation count"
            warnings.warn(f"cannot decode image {path} ({type(exc).__name__}: {exc}); {what}",
                          BadSampleWarning, stacklevel=3)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        n = len(self.samples)
        first_error: Optional[BaseException] = None
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


class RobustImageFolder(_BadSampleMixin, datasets.ImageFolder):
    """``torchvision.datasets.ImageFolder`` with one-line layout errors, counted non-image files,
    hidden entries ignored, refused directory links, and replace-and-record handling of
    undecodable images.

    Class folders may be links. Directory links inside a class folder are not followed unless
    ``follow_links``; even then a link back into the split folder (another class, a loop) or to an
    ancestor of it is refused. Refused links are listed in ``refused_links`` and in one warning.
    """

    def __init__(self, root: str, transform: Optional[Callable] = None, is_train: bool = True,
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
            fix = ("links into the data set or to its parents are never followed" if follow_links
                   else "pass --follow-links to read linked directories")
            warnings.warn(f"{root}: did not follow {len(self.refused_links)} directory link(s) inside "
                          f"class folders: {'; '.join(self.refused_links[:3])}"
                          f"{'; ...' if len(self.refused_links) > 3 else ''} ({fix})",
                          UserWarning, stacklevel=2)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = _list_classes(directory, self.layout)
        if not classes:
            raise _layout_error(directory, "no class folders", self.layout)
        split_real = os.path.realpath(directory)
        for c in classes:
            real = os.path.realpath(os.path.join(directory, c))
            if _inside(split_real, real):
                raise _layout_error(os.path.join(directory, c), f"class folder links to {real}, the "
                                    "split folder or a parent of it (a loop)", self.layout)
        return classes, {c: i for i, c in enumerate(classes)}

    def _refuse_link(self, link: str, here: str, roots: list[str]) -> Optional[str]:
        """Why the directory link ``link`` (found in real directory ``here``) is not followed."""
        if not self.follow_links:
            return "not followed by default"
        target = os.path.realpath(link)
        if _inside(here, target):
            return f"loop: links to its parent {target}"
        if any(_inside(target, r) for r in roots):
            return f"links back into the data set ({target})"
        if target in self._visited:
            return f"{target} already read"
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
                    if d.startswith("."):  # prune hidden
                        continue
                    sub = os.path.join(dirpath, d)
                    why = self._refuse_link(sub, here, roots) if os.path.islink(sub) else None
                    if why:
                        self.refused_links.append(f"{sub} ({why})" if self.follow_links else sub)
                    else:
                        keep.append(d)
                dirnames[:] = keep
                for name in sorted(filenames):
                    if name.startswith("."):
                        continue
                    path = os.path.join(dirpath, name)
                    if _is_image_name(name):
                        samples.append((path, class_to_idx[cls]))
                    else:
                        self.skipped_files.append(path)
            if len(samples) == n_before:
                raise _layout_error(cls_dir, "empty class folder (no image file)", self.layout)
        return samples


def _check_imagefolder_root(root: Optional[str], layout: str, is_train: bool) -> None:
    """Validate ``root/train`` and ``root/val`` before anything is decoded (one-line errors)."""
    if not root:
        raise _layout_error("--data-path", "missing (no data path given)", layout)
    if not os.path.isdir(root):
        raise _layout_error(root, "data path does not exist or is not a directory", layout)
    train_dir, val_dir = os.path.join(root, "train"), os.path.join(root, "val")
    # training needs both splits (the run evaluates every epoch); eval-only needs, and lists, only val/
    for d in ((train_dir, val_dir) if is_train else (val_dir,)):
        if not os.path.isdir(d):
            raise _layout_error(d, f"missing {os.path.basename(d)}/ folder", layout)
    if is_train:  # the training build checks that val/ has the classes of train/
        tc, vc = set(_list_classes(train_dir)), set(_list_classes(val_dir))
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
            raise _layout_error(val_dir, "class folders differ from train/: " + "; ".join(parts),
                                layout)


# --------------------------------------------------------------------------------------------
# iNaturalist
# --------------------------------------------------------------------------------------------
class INatDataset(_BadSampleMixin, Dataset):
    """iNaturalist 2018/2019 in its JSON layout, as DeiT's ``INatDataset``.

    Labels: the value of ``category`` (categories.json) of each class, numbered in order of first
    appearance in ``train<year>.json`` (DeiT's order, so DeiT checkpoints keep their heads).
    Image paths: ``root/<file_name>`` if it exists, else DeiT's ``root/<cut0>/<cut2>/<cut3>``.
    """

    def __init__(self, root: str, train: bool = True, year: int = 2018,
                 transform: Optional[Callable] = None, category: str = "name",
                 strict: bool = False, loader: Callable[[str], Any] = load_image) -> None:
        layout = (f"<data-path>/train{year}.json, val{year}.json, categories.json and the image "
                  f"folders named by their file_name entries (iNaturalist {year} layout)")
        if category not in INAT_CATEGORIES:
            raise _layout_error(root, f"unknown iNat category {category!r}",
                                "one of " + "/".join(INAT_CATEGORIES))
        if not root or not os.path.isdir(root):
            raise _layout_error(root or "--data-path", "data path does not exist", layout)
        self.root, self.transform, self.target_transform, self.loader = root, transform, None, loader

        def read(name: str) -> Any:
            p = os.path.join(root, name)
            if not os.path.isfile(p):
                raise _layout_error(p, "missing annotation file", layout)
            try:
                with open(p) as f:
                    return json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise _layout_error(p, f"unreadable JSON ({exc})", layout) from exc

        split_json = read(f"{'train' if train else 'val'}{year}.json")
        catg = read("categories.json")
        train_json = split_json if train else read(f"train{year}.json")
        by_id = {int(c["id"]): c for c in catg} if catg and "id" in catg[0] else None

        def cat_value(cid: int) -> Any:
            return (by_id[cid] if by_id is not None else catg[cid])[category]

        targeter: dict[Any, int] = {}
        for ann in train_json["annotations"]:
            targeter.setdefault(cat_value(int(ann["category_id"])), len(targeter))
        self.nb_classes = len(targeter)
        self.classes = [str(c) for c in targeter]  # in label order
        img_cat = {a["image_id"]: int(a["category_id"]) for a in split_json.get("annotations", [])}
        self.samples = []
        for im in split_json["images"]:
            fname = im["file_name"]
            cut = fname.split("/")
            path = os.path.join(root, fname)
            if not os.path.exists(path) and len(cut) >= 4:
                path = os.path.join(root, cut[0], cut[2], cut[3])
            cid = img_cat.get(im.get("id"), int(cut[2]) if len(cut) >= 3 else -1)
            self.samples.append((path, targeter[cat_value(cid)]))
        if not self.samples:
            raise _layout_error(root, "no images listed in the annotation file", layout)
        self.targets = [t for _, t in self.samples]
        self._init_bad_tracking(train, strict)

    def __len__(self) -> int:
        return len(self.samples)


# --------------------------------------------------------------------------------------------
# DIGITS writer
# --------------------------------------------------------------------------------------------
def default_data_path(data_set: str) -> Optional[str]:
    """Default ``--data-path`` of a data set: ``./data/digits`` for DIGITS, None otherwise."""
    return DIGITS_DEFAULT_PATH if data_set == "DIGITS" else None


def _digits_complete(root: str) -> bool:
    return os.path.isfile(os.path.join(root, DIGITS_MARKER))


def _write_digits(dest: str) -> None:
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()  # bundled with scikit-learn, never downloads
    idx = np.arange(len(d.target))
    tr, va = train_test_split(idx, test_size=0.2, random_state=DIGITS_SEED, stratify=d.target)
    for split, ids in (("train", tr), ("val", va)):
        for c in range(10):
            os.makedirs(os.path.join(dest, split, str(c)), exist_ok=True)
        for i in sorted(ids.tolist()):
            a = (d.images[i] * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)
            im = Image.fromarray(a, mode="L").resize((DIGITS_SIZE, DIGITS_SIZE), Image.BICUBIC)
            im.convert("RGB").save(os.path.join(dest, split, str(int(d.target[i])), f"{i:04d}.png"))
    with open(os.path.join(dest, DIGITS_MARKER), "w") as f:
        f.write(f"sklearn load_digits, {len(tr)} train / {len(va)} val, seed {DIGITS_SEED}, "
                f"{DIGITS_SIZE}px bicubic RGB PNG\n")


def _cleanup_stale_tmp(parent: str, base: str) -> None:
    host = socket.gethostname()
    for e in os.scandir(parent):
        if not e.name.startswith(f".{base}.tmp-"):
            continue
        parts = e.name.split("-")  # .<base>.tmp-<host>-<pid>-<hex>
        try:
            pid, h = int(parts[-2]), "-".join(parts[1:-2])
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
        if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "val")):
            return root  # a user-provided ImageFolder: read it as is
        raise _layout_error(root, "exists, is not empty and is not a digits data set",
                            "an empty or absent directory to write the digits into, or "
                            + IMAGEFOLDER_LAYOUT)
    parent, base = os.path.split(os.path.abspath(root))
    tmp = os.path.join(parent, f".{base}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(parent, exist_ok=True)
        _write_digits(tmp)
        try:
            os.rename(tmp, root)  # atomic; replaces only an absent or empty directory
        except OSError:
            if not _digits_complete(root):  # not a lost race with another writer
                raise
        _cleanup_stale_tmp(parent, base)
    except OSError as exc:
        raise _layout_error(root, f"cannot write the digits data set ({exc})",
                            "a writable --data-path for DIGITS") from exc
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return root


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------
def _resolve_data_path(args: Any) -> Optional[str]:
    data_set = getattr(args, "data_set", "IMNET")
    path = getattr(args, "data_path", None)
    if data_set == "DIGITS" and (not path or os.path.normpath(path) ==
                                 os.path.normpath(DEIT_DEFAULT_DATA_PATH)):
        return default_data_path(data_set)
    return path


def build_dataset(is_train: bool, args: Any) -> tuple[Dataset, int]:
    """Return ``(dataset, nb_classes)`` for ``args.data_set``; see the module docstring."""
    data_set = getattr(args, "data_set", "IMNET")
    strict = bool(getattr(args, "strict_data", False))
    root = _resolve_data_path(args)
    transform = build_transform(is_train, args)

    if data_set == "CIFAR":
        layout = "<data-path>/cifar-100-python/{train,test,meta} (CIFAR-100 python version; " \
                 "nothing is downloaded)"
        if not root:
            raise _layout_error("--data-path", "missing (no data path given)", layout)
        if os.path.basename(os.path.normpath(root)) == "cifar-100-python":
            root = os.path.dirname(os.path.normpath(root))
        try:
            ds = datasets.CIFAR100(root, train=is_train, transform=transform, download=False)
        except RuntimeError as exc:
            raise _layout_error(root, "CIFAR-100 not found or corrupted", layout) from exc
        return ds, 100

    if data_set in ("INAT", "INAT19"):
        ds = INatDataset(root, train=is_train, year=2018 if data_set == "INAT" else 2019,
                         category=getattr(args, "inat_category", "name"), transform=transform,
                         strict=strict)
        return ds, ds.nb_classes

    if data_set in ("IMNET", "DIGITS"):
        if data_set == "DIGITS":
            root = prepare_digits(root)
        _check_imagefolder_root(root, IMAGEFOLDER_LAYOUT, is_train)
        val_dir = os.path.join(root, "val")
        if not is_train and not _has_class_folders(val_dir):
            if not find_label_file(val_dir):
                raise _layout_error(val_dir, "no class folders and no label file",
                                    IMAGEFOLDER_LAYOUT + ", or val/ as " + FLAT_LAYOUT)
            ds = FlatLabelledFolder(val_dir, transform=transform, strict=strict)
            return ds, len(ds.classes)
        ds = RobustImageFolder(os.path.join(root, "train" if is_train else "val"), transform=transform,
                               is_train=is_train, strict=strict,
                               follow_links=bool(getattr(args, "follow_links", False)))
        if data_set == "DIGITS" and len(ds.classes) != 10:
            raise _layout_error(root, f"{len(ds.classes)} class folders, not 10", IMAGEFOLDER_LAYOUT)
        return ds, len(ds.classes)

    raise _layout_error(str(data_set), "unknown data set", "one of " + ", ".join(DATA_SETS))


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
    for step in getattr(transform, "transforms", []):
        ops = list(getattr(step, "ops", []))
        for sub_policy in getattr(step, "policy", []):
            ops.extend(sub_policy)
        for op in ops:
            if getattr(op, "aug_fn", None) is auto_augment.posterize:
                op.aug_fn = _posterize
    return transform


def data_config(model: Any = None, input_size: Optional[int] = None,
                crop_pct: Optional[float] = None) -> dict[str, Any]:
    """timm's data config (input_size, interpolation, mean, std, crop_pct, crop_mode) of ``model``.

    ``model`` is a model, a registered model name, or None (timm's default ``PretrainedCfg``, equal
    to every NaLaFormer variant's); its ``pretrained_cfg`` is the one home of these values, and
    ``input_size`` (one side) and ``crop_pct`` - the command line - override it. Inputs of 32 px or
    less follow DeiT: resized to input_size x input_size, nothing cropped (crop_pct 1.0, 'squash').
    """
    overrides: dict[str, Any] = {}
    if input_size:
        overrides["input_size"] = (3, int(input_size), int(input_size))
    if crop_pct:
        overrides["crop_pct"] = float(crop_pct)
    pretrained_cfg = None
    if isinstance(model, str):
        pretrained_cfg, model = timm.models.get_pretrained_cfg(model), None
    if model is None:
        pretrained_cfg = (pretrained_cfg or timm.models.PretrainedCfg()).to_dict()
    cfg = timm.data.resolve_data_config(overrides, pretrained_cfg=pretrained_cfg, model=model)
    if cfg["input_size"][-1] <= 32:
        cfg.update(crop_pct=1.0, crop_mode="squash")
    return cfg


def eval_transform(cfg: dict[str, Any]) -> Callable:
    """The evaluation transform of a ``data_config``: timm's, the same for every entry point."""
    return create_transform(**cfg, is_training=False)


def build_transform(is_train: bool, args: Any) -> Callable:
    """DeiT transforms from ``data_config`` (timm ``create_transform``); see the module docstring."""
    cfg = data_config(getattr(args, "model", None), getattr(args, "input_size", None),
                      getattr(args, "eval_crop_ratio", None))
    if not is_train:
        return eval_transform(cfg)
    input_size = cfg["input_size"][-1]
    digits = getattr(args, "data_set", None) == "DIGITS"
    aa = getattr(args, "aa", "rand-m9-mstd0.5-inc1")
    if aa in (None, "", "none", "None"):
        aa = None
    scale = getattr(args, "scale", None) or ((0.25, 1.0) if digits else None)
    hflip = getattr(args, "hflip", None)
    hflip = (0.0 if digits else 0.5) if hflip is None else float(hflip)
    t = create_transform(
        input_size=input_size, is_training=True,
        color_jitter=getattr(args, "color_jitter", 0.4), auto_augment=aa,
        interpolation=getattr(args, "train_interpolation", None) or cfg["interpolation"],
        mean=cfg["mean"], std=cfg["std"],
        re_prob=getattr(args, "reprob", 0.25), re_mode=getattr(args, "remode", "pixel"),
        re_count=getattr(args, "recount", 1), scale=scale, hflip=hflip)
    if input_size <= 32:  # DeiT: random crop with padding; the resize is a no-op on CIFAR
        t.transforms[0:1] = [transforms.Resize((input_size, input_size),
                                               interpolation=transforms.InterpolationMode.BICUBIC),
                             transforms.RandomCrop(input_size, padding=4)]
    return allow_zero_bit_posterize(t)


# --------------------------------------------------------------------------------------------
# Bad-sample reporting
# --------------------------------------------------------------------------------------------
def _unwrap(dataset: Any) -> Any:
    while not hasattr(dataset, "bad_sample_paths") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


def bad_sample_paths(dataset: Any) -> list[str]:
    """Paths found undecodable so far in ``dataset`` (any DataLoader worker); [] if not tracked."""
    ds = _unwrap(dataset)
    return ds.bad_sample_paths() if hasattr(ds, "bad_sample_paths") else []


def bad_sample_count(dataset: Any) -> int:
    """Number of undecodable samples found so far in ``dataset``; 0 if not tracked."""
    ds = _unwrap(dataset)
    if not hasattr(ds, "_bad"):
        return 0
    return int(ds._bad[: len(ds.samples)].sum())


def bad_sample_mask(dataset: Any) -> torch.Tensor:
    """Copy of the per-index flags (uint8, 1 = undecodable) of ``dataset``; empty if not tracked."""
    ds = _unwrap(dataset)
    if not hasattr(ds, "_bad"):
        return torch.zeros(0, dtype=torch.uint8)
    return ds._bad[: len(ds.samples)].clone()


def bad_sample_count_all_ranks(dataset: Any, device: Any = "cpu") -> int:
    """Distinct undecodable files found by any rank (collective when torch.distributed is up)."""
    import torch.distributed as dist
    mask = bad_sample_mask(dataset)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(mask.sum())
    flags = mask.to(device=device, dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return int(flags.sum())


# --------------------------------------------------------------------------------------------
# Extra evaluation sets: flat folders with a label file, ImageNet-V2, ImageNet-ReaL
# --------------------------------------------------------------------------------------------
LABEL_FILE_NAMES = ("val_labels.txt", "val_labels.csv", "labels.txt", "labels.csv",
                    "LOC_val_solution.csv")
FLAT_LAYOUT = ("a folder of image files plus a label file (" + ", ".join(LABEL_FILE_NAMES) +
               ", in the folder or its parent) with one 'filename label' line per image, label a "
               "class folder name (e.g. n01440764) or a class index")
EVAL_SET_LAYOUT = ("NAME=PATH or PATH, PATH a folder of class folders (named as the training "
                   "classes, or 0..N-1 as in ImageNet-V2) or " + FLAT_LAYOUT)


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
            if not line or line.startswith("#"):
                continue
            fields = line.split(",", 1) if "," in line else line.split(None, 1)
            if len(fields) < 2 or not fields[1].split():
                raise _layout_error(path, f"line {n + 1} ({line[:60]!r}) is not 'filename label'",
                                    FLAT_LAYOUT)
            fname, label = fields[0].strip(), fields[1].split()[0]
            if n == 0 and fname.lower() in ("imageid", "image_id", "filename", "file", "image", "path"):
                continue
            pairs.append((fname, label))
    return pairs


class FlatLabelledFolder(_BadSampleMixin, Dataset):
    """Images directly in ``root`` with their labels in a label file (ImageNet's original val
    layout). Labels are class names (mapped with ``class_to_idx``, or sorted if None) or integer
    class indices. Every image must have a label and every label an image (one-line errors)."""

    def __init__(self, root: str, label_file: str | None = None,
                 class_to_idx: dict[str, int] | None = None, transform: Callable | None = None,
                 strict: bool = False, loader: Callable[[str], Any] = load_image) -> None:
        label_file = label_file or find_label_file(root)
        if label_file is None:
            raise _layout_error(root, "no class folders and no label file", FLAT_LAYOUT)
        self.root, self.transform, self.target_transform = root, transform, None
        self.loader = loader
        images = sorted(e.name for e in os.scandir(root)
                        if e.is_file() and not e.name.startswith(".") and _is_image_name(e.name))
        if not images:
            raise _layout_error(root, "no image files", FLAT_LAYOUT)
        by_name = {n: n for n in images} | {os.path.splitext(n)[0]: n for n in images}
        pairs = _read_label_file(label_file)
        unknown = [f for f, _ in pairs if f not in by_name]
        if unknown:
            raise _layout_error(label_file, f"{len(unknown)} listed file(s) not found in {root} "
                                f"(e.g. {unknown[0]})", FLAT_LAYOUT)
        label_of = {by_name[f]: lab for f, lab in pairs}
        unlabelled = [n for n in images if n not in label_of]
        if unlabelled:
            raise _layout_error(root, f"{len(unlabelled)} image(s) have no label in {label_file} "
                                f"(e.g. {unlabelled[0]})", FLAT_LAYOUT)
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
            raise _layout_error(label_file, f"{len(bad)} label(s) not among the {len(self.classes)} "
                                f"classes (e.g. {bad[0]})", FLAT_LAYOUT)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(os.path.join(root, n), to_idx[label_of[n]]) for n in images]
        self.targets = [t for _, t in self.samples]
        self._init_bad_tracking(False, strict)

    def __len__(self) -> int:
        return len(self.samples)


def _has_class_folders(folder: str) -> bool:
    return any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(folder))


def build_eval_set(path: str, classes: list[str], args: Any) -> Dataset:
    """An evaluation set at ``path`` labelled in the model's class order ``classes``.

    Class folders named as ``classes`` take those labels; otherwise all-numeric folder names
    (ImageNet-V2: 0..999) are labelled by their integer value, not by ImageFolder's string order
    ("0", "1", "10", "100", ...). A folder without class folders is read with its label file.
    """
    if not os.path.isdir(path):
        raise _layout_error(path, "evaluation set folder does not exist", EVAL_SET_LAYOUT)
    class_to_idx = {c: i for i, c in enumerate(classes)}
    transform = build_transform(False, args)
    strict = bool(getattr(args, "strict_data", False))
    if not _has_class_folders(path):
        return FlatLabelledFolder(path, class_to_idx=class_to_idx, transform=transform, strict=strict)
    ds = RobustImageFolder(path, transform=None, is_train=False, strict=strict,
                           follow_links=bool(getattr(args, "follow_links", False)))
    if set(ds.classes) <= set(classes):
        mapping = {i: class_to_idx[c] for i, c in enumerate(ds.classes)}
    elif all(c.isdigit() for c in ds.classes):
        mapping = {i: int(c) for i, c in enumerate(ds.classes)}
        bad = [c for c in ds.classes if int(c) >= len(classes)]
        if bad:
            raise _layout_error(path, f"numeric class folder {bad[0]} >= the model's "
                                f"{len(classes)} classes", EVAL_SET_LAYOUT)
    else:
        unknown = sorted(set(ds.classes) - set(classes))
        raise _layout_error(path, f"{len(unknown)} class folder(s) neither training classes nor "
                            f"numbers (e.g. {unknown[0]})", EVAL_SET_LAYOUT)
    ds.samples = [(p, mapping[t]) for p, t in ds.samples]
    ds.targets = [t for _, t in ds.samples]
    ds.imgs = ds.samples
    ds.classes, ds.class_to_idx = list(classes), class_to_idx
    ds.transform = transform
    return ds


def parse_eval_set(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); a bare PATH is named after its last folder."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = os.path.basename(os.path.normpath(spec)), spec
    return name, path


def build_eval_sets(args: Any, dataset_val: Any) -> list[tuple[str, Dataset]]:
    """The extra evaluation sets of ``args.eval_sets`` (a list of ``NAME=PATH`` / ``PATH``), each
    labelled in the class order of ``dataset_val`` (the main validation set the model was built
    for); [] when none is asked for."""
    classes = list(getattr(_unwrap(dataset_val), "classes", None) or [])
    out = []
    for spec in getattr(args, "eval_sets", None) or []:
        name, path = parse_eval_set(spec)
        out.append((name, build_eval_set(path, classes, args)))
    return out


class WithIndex(Dataset):
    """``dataset`` whose target is the sample index (-1 for a replaced, undecodable sample)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        sample, target = self.dataset[index]
        return sample, (index if target >= 0 else -1)


class RealLabels:
    """ImageNet-ReaL label sets of the samples of an ImageNet validation set, matched by file name
    (ILSVRC2012_val_XXXXXXXX.JPEG). ``path`` None reads the labels bundled with timm
    (timm/data/_info/imagenet_real_labels.json); else a local real.json of the same format (a list
    of 50000 label lists in file-name order)."""

    def __init__(self, dataset: Any, path: str | None = None) -> None:
        layout = "a real.json list of 50000 label lists and val images named ILSVRC2012_val_XXXXXXXX.JPEG"
        if path:
            try:
                with open(path) as f:
                    table = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise _layout_error(path, f"cannot read ReaL labels ({exc})", layout) from exc
        else:
            import pkgutil
            table = json.loads(pkgutil.get_data("timm.data", "_info/imagenet_real_labels.json"))
        ds = _unwrap(dataset)
        self.labels: list[list[int]] = []
        for p, _ in ds.samples:
            stem = os.path.splitext(os.path.basename(p))[0]
            num = stem.rsplit("_", 1)[-1]
            if not (stem.startswith("ILSVRC2012_val_") and num.isdigit() and 0 < int(num) <= len(table)):
                raise _layout_error(p, "not an image of the ImageNet validation set; ImageNet-ReaL labels exist only "
                                    "for the 1000-class ImageNet validation set, so evaluate that set or drop "
                                    "--real-labels",
                                    f"val images named ILSVRC2012_val_XXXXXXXX.JPEG (1 to {len(table)})")
            self.labels.append(table[int(num) - 1])
        # ReaL labels index the 1000 ImageNet classes in sorted-synset order: a model with fewer
        # classes would be scored against labels it cannot predict
        n_classes = len(getattr(ds, "classes", []))
        top = max((max(labels) for labels in self.labels if labels), default=-1)
        if top >= n_classes:
            raise _layout_error(path or "timm's imagenet_real_labels.json", f"ReaL label {top} but the "
                                f"validation set has {n_classes} classes", "the 1000 ImageNet classes")

    def count(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[top-1 hits, top-5 hits, images scored] of one batch; images with an empty ReaL label set
        and undecodable ones (index < 0) are not scored."""
        top5 = output.topk(min(5, output.shape[1]), dim=1).indices.tolist()
        c = torch.zeros(3, dtype=torch.float64)
        for pred, i in zip(top5, index.tolist()):
            real = self.labels[i] if i >= 0 else []
            if real:
                c += torch.tensor([pred[0] in real, any(p in real for p in pred), 1], dtype=torch.float64)
        return c


@torch.no_grad()
def evaluate_real(loader: Any, model: torch.nn.Module, real: RealLabels, device: Any = "cpu",
                  amp_dtype: torch.dtype | None = None, channels_last: bool = False,
                  sum_over_ranks: bool = False) -> dict[str, float]:
    """ReaL top-1/top-5 (%) of ``model`` over ``loader`` (built on ``WithIndex(dataset_val)``);
    ``n`` is the number of images scored. With ``sum_over_ranks`` the counts of all ranks are summed."""
    model.eval()
    device = torch.device(device)
    counts = torch.zeros(3, dtype=torch.float64)
    for images, index in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(images)
        counts += real.count(output.float().cpu(), index)
    hit1, hit5, n = distributed.all_reduce_sum(counts.tolist(), device) if sum_over_ranks else counts.tolist()
    return {"acc1": 100.0 * hit1 / n if n else float("nan"),
            "acc5": 100.0 * hit5 / n if n else float("nan"), "n": int(n)}
