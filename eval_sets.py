"""Extra evaluation sets of ``--eval-sets`` (class folders named as the training classes, ImageNet-V2's
numbered folders, a flat folder with a label file) and ImageNet-ReaL labels (``--real-labels``), which
``engine.evaluate`` scores alongside the validation set. docs/evaluation.md describes the layouts."""
import json
import os
import pkgutil
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from image_folder import (
    FLAT_LAYOUT,
    FlatLabelledFolder,
    RobustImageFolder,
    has_class_folders,
    layout_error,
    unwrap_dataset,
)

__all__ = ['EVAL_SET_LAYOUT', 'build_eval_set', 'build_eval_sets', 'parse_eval_set', 'WithIndex', 'RealLabels']

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
