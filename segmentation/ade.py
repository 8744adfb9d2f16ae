"""ADE20K as unpacked from ADEChallengeData2016.zip, with mmseg's ADE20K pipelines.

Layout: ``images/{training,validation}/*.jpg`` and ``annotations/{training,validation}/*.png`` of the same
names; a label map holds 0 ("other", ignored) and the classes 1..150, which become 255 and 0..149 (mmseg's
``reduce_zero_label``). A wrong layout, a missing label map, a label map of another size than its image or a
label above the number of classes is one line naming the file and the fix (``LabelError``); ``check_labels``
checks a split's label maps without decoding the images (the validation split, before training).

Training (``TrainPipeline``, mmseg's ``train_pipeline``): rescale to ``img_scale`` (2048, 512) times a ratio in
0.5..2.0 keeping the aspect ratio, a random crop (512²) that no class fills more than 75% of (10 tries), a
horizontal flip, the photometric distortion, normalisation, padding to the crop (image 0, label 255). Every
random choice of a sample comes from a generator seeded by (seed, epoch, index), so a sample's augmentation does
not depend on the loader workers or on where a run was resumed. Evaluation: the image rescaled to fit
``img_scale`` (short side 512 unless the long side would pass 2048), the label map at its original size.
``prediction_picture`` draws an image beside its predicted classes in mmseg's colours (``palette``).
"""
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from datasets import rescale_size, resize_image
from run.errors import first_line
from training.image_folder import DataLayoutError

IGNORE_INDEX = 255
MEAN = (123.675, 116.28, 103.53)  # mmseg's img_norm_cfg (RGB, 0..255)
STD = (58.395, 57.12, 57.375)
SPLITS = {'train': 'training', 'val': 'validation'}
LAYOUT = ('images/{training,validation}/*.jpg and annotations/{training,validation}/*.png of the same names '
          '(ADEChallengeData2016 as unpacked from ADEChallengeData2016.zip)')
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png')
#: mmseg's multi-scale test of ADE20K (--aug-test): these ratios of the evaluation scale, each also flipped
AUG_RATIOS = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75)
CLASS_NAMES_FILE = 'classes.txt'
#: ADE20K's 150 classes in label order (label k is CLASSES[k - 1]), as mmseg's ADE20KDataset names them
CLASSES = (
    'wall', 'building', 'sky', 'floor', 'tree', 'ceiling', 'road', 'bed', 'windowpane', 'grass', 'cabinet',
    'sidewalk', 'person', 'earth', 'door', 'table', 'mountain', 'plant', 'curtain', 'chair', 'car', 'water',
    'painting', 'sofa', 'shelf', 'house', 'sea', 'mirror', 'rug', 'field', 'armchair', 'seat', 'fence', 'desk',
    'rock', 'wardrobe', 'lamp', 'bathtub', 'railing', 'cushion', 'base', 'box', 'column', 'signboard',
    'chest of drawers', 'counter', 'sand', 'sink', 'skyscraper', 'fireplace', 'refrigerator', 'grandstand', 'path',
    'stairs', 'runway', 'case', 'pool table', 'pillow', 'screen door', 'stairway', 'river', 'bridge', 'bookcase',
    'blind', 'coffee table', 'toilet', 'flower', 'book', 'hill', 'bench', 'countertop', 'stove', 'palm',
    'kitchen island', 'computer', 'swivel chair', 'boat', 'bar', 'arcade machine', 'hovel', 'bus', 'towel', 'light',
    'truck', 'tower', 'chandelier', 'awning', 'streetlight', 'booth', 'television receiver', 'airplane',
    'dirt track', 'apparel', 'pole', 'land', 'bannister', 'escalator', 'ottoman', 'bottle', 'buffet', 'poster',
    'stage', 'van', 'ship', 'fountain', 'conveyer belt', 'canopy', 'washer', 'plaything', 'swimming pool', 'stool',
    'barrel', 'basket', 'waterfall', 'tent', 'bag', 'minibike', 'cradle', 'oven', 'ball', 'food', 'step', 'tank',
    'trade name', 'microwave', 'pot', 'animal', 'bicycle', 'lake', 'dishwasher', 'screen', 'blanket', 'sculpture',
    'hood', 'sconce', 'vase', 'traffic light', 'tray', 'ashcan', 'fan', 'pier', 'crt screen', 'plate', 'monitor',
    'bulletin board', 'shower', 'radiator', 'glass', 'clock', 'flag')
#: ADE20K's colours in label order (label k is drawn PALETTE[k - 1], RGB), mmseg's ADE20KDataset.PALETTE
PALETTE = (
    (120, 120, 120), (180, 120, 120), (6, 230, 230), (80, 50, 50), (4, 200, 3), (120, 120, 80), (140, 140, 140),
    (204, 5, 255), (230, 230, 230), (4, 250, 7), (224, 5, 255), (235, 255, 7), (150, 5, 61), (120, 120, 70),
    (8, 255, 51), (255, 6, 82), (143, 255, 140), (204, 255, 4), (255, 51, 7), (204, 70, 3), (0, 102, 200),
    (61, 230, 250), (255, 6, 51), (11, 102, 255), (255, 7, 71), (255, 9, 224), (9, 7, 230), (220, 220, 220),
    (255, 9, 92), (112, 9, 255), (8, 255, 214), (7, 255, 224), (255, 184, 6), (10, 255, 71), (255, 41, 10),
    (7, 255, 255), (224, 255, 8), (102, 8, 255), (255, 61, 6), (255, 194, 7), (255, 122, 8), (0, 255, 20),
    (255, 8, 41), (255, 5, 153), (6, 51, 255), (235, 12, 255), (160, 150, 20), (0, 163, 255), (140, 140, 140),
    (250, 10, 15), (20, 255, 0), (31, 255, 0), (255, 31, 0), (255, 224, 0), (153, 255, 0), (0, 0, 255),
    (255, 71, 0), (0, 235, 255), (0, 173, 255), (31, 0, 255), (11, 200, 200), (255, 82, 0), (0, 255, 245),
    (0, 61, 255), (0, 255, 112), (0, 255, 133), (255, 0, 0), (255, 163, 0), (255, 102, 0), (194, 255, 0),
    (0, 143, 255), (51, 255, 0), (0, 82, 255), (0, 255, 41), (0, 255, 173), (10, 0, 255), (173, 255, 0),
    (0, 255, 153), (255, 92, 0), (255, 0, 255), (255, 0, 245), (255, 0, 102), (255, 173, 0), (255, 0, 20),
    (255, 184, 184), (0, 31, 255), (0, 255, 61), (0, 71, 255), (255, 0, 204), (0, 255, 194), (0, 255, 82),
    (0, 10, 255), (0, 112, 255), (51, 0, 255), (0, 194, 255), (0, 122, 255), (0, 255, 163), (255, 153, 0),
    (0, 255, 10), (255, 112, 0), (143, 255, 0), (82, 0, 255), (163, 255, 0), (255, 235, 0), (8, 184, 170),
    (133, 0, 255), (0, 255, 92), (184, 0, 255), (255, 0, 31), (0, 184, 255), (0, 214, 255), (255, 0, 112),
    (92, 255, 0), (0, 224, 255), (112, 224, 255), (70, 184, 160), (163, 0, 255), (153, 0, 255), (71, 255, 0),
    (255, 0, 163), (255, 204, 0), (255, 0, 143), (0, 255, 235), (133, 255, 0), (255, 0, 235), (245, 0, 255),
    (255, 0, 122), (255, 245, 0), (10, 190, 212), (214, 255, 0), (0, 204, 255), (20, 0, 255), (255, 255, 0),
    (0, 153, 255), (0, 41, 255), (0, 255, 204), (41, 0, 255), (41, 255, 0), (173, 0, 255), (0, 245, 255),
    (71, 0, 255), (122, 0, 255), (0, 255, 184), (0, 92, 255), (184, 255, 0), (0, 133, 255), (255, 214, 0),
    (25, 194, 194), (102, 255, 0), (92, 0, 255))
#: the seed of the colours of a data set with another number of classes (mmseg's custom-dataset palette)
PALETTE_SEED = 42


class LabelError(DataLayoutError):
    """The data set on disk is not what the pipeline expects; str() is one line naming the file and the fix."""


def scan(root: str, split: str) -> list[tuple[str, str]]:
    """The (image, label map) paths of `split` ('training' or 'validation') under `root`, sorted by name."""
    if not os.path.isdir(root):
        raise LabelError(f'--data-path {root}: no such folder; point it at the ADEChallengeData2016 folder, which '
                         f'holds images/ and annotations/')
    image_dir, label_dir = os.path.join(root, 'images', split), os.path.join(root, 'annotations', split)
    for d in (image_dir, label_dir):
        if not os.path.isdir(d):
            inner = os.path.join(root, 'ADEChallengeData2016')
            hint = f' (--data-path {inner} holds it)' if os.path.isdir(inner) else ''
            raise LabelError(f'{d}: no such folder{hint}; --data-path must hold {LAYOUT}')
    images = sorted(f for f in os.listdir(image_dir) if f.lower().endswith(IMAGE_SUFFIXES))
    if not images:
        raise LabelError(f'{image_dir}: no images (.jpg); --data-path must hold {LAYOUT}')
    labels = set(os.listdir(label_dir))
    pairs = []
    for name in images:
        label = os.path.splitext(name)[0] + '.png'
        if label not in labels:
            raise LabelError(f'{os.path.join(label_dir, label)}: missing, the label map of '
                             f'{os.path.join(image_dir, name)}; restore it from the ADE20K archive, or move the '
                             f'image out of {image_dir}')
        pairs.append((os.path.join(image_dir, name), os.path.join(label_dir, label)))
    return pairs


def class_names(root: str, num_classes: int) -> tuple[str, ...]:
    """The names of labels 1..num_classes (see the module docstring); a classes.txt that does not name each class
    once is one line."""
    path = os.path.join(root, CLASS_NAMES_FILE)
    if os.path.isfile(path):
        with open(path, encoding='utf-8') as f:
            names = tuple(line.strip() for line in f if line.strip())
        if len(names) != num_classes or len(set(names)) != num_classes:
            raise LabelError(f'{path}: {len(names)} names ({len(set(names))} different) for --num-classes '
                             f'{num_classes}; it names each class once, one name a line, line k naming label k '
                             f'(or remove it for generic names)')
        return names
    if num_classes == len(CLASSES):
        return CLASSES
    return tuple(f'class_{k}' for k in range(1, num_classes + 1))


def read_pair(image_path: str, label_path: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(RGB image HxWx3 uint8, label map HxW uint8 with 255 ignored and classes 0..num_classes-1)."""
    image = decode_image(image_path)
    return image, checked_label(label_path, image_path, image.shape[:2], num_classes)


def decode_image(image_path: str) -> np.ndarray:
    """The image `image_path` as read from disk: RGB HxWx3 uint8 (an undecodable file is a LabelError)."""
    try:
        with Image.open(image_path) as im:
            return np.array(im.convert('RGB'))
    except OSError as e:
        raise LabelError(_undecodable_image(image_path, e)) from e


def _undecodable_image(image_path: str, e: BaseException) -> str:
    return (f'{image_path}: cannot be decoded ({first_line(e)}); replace it from the ADE20K archive, or move it and '
            f'its label map out of the data set')


def checked_label(label_path: str, image_path: str, image_size: tuple[int, int], num_classes: int) -> np.ndarray:
    """The label map of the image `image_path` of `image_size` (height, width), reduced (255 ignored, classes
    0..num_classes-1) and checked: one single-channel 8-bit map of the image's size, no class above
    `num_classes`."""
    try:
        with Image.open(label_path) as lm:
            if lm.mode not in ('L', 'P'):
                raise LabelError(f'{label_path}: a {lm.mode} image; label maps are single-channel 8-bit PNGs '
                                 f'(mode L or P) of class indices, 0 for "other"')
            label = np.asarray(lm)
    except OSError as e:
        raise LabelError(f'{label_path}: cannot be decoded ({first_line(e)}); replace it from the ADE20K archive') \
            from e
    if label.shape != tuple(image_size):
        raise LabelError(f'{label_path}: the label map is {label.shape[1]}x{label.shape[0]} but its image '
                         f"{image_path} is {image_size[1]}x{image_size[0]}; a label map must have its image's "
                         f'size: restore both from the ADE20K archive (or resize the label map with '
                         f'nearest-neighbour interpolation)')
    label = label - np.uint8(1)  # mmseg's reduce_zero_label: 0 ("other") -> 255, class k -> k - 1
    label[label == 254] = IGNORE_INDEX  # a 255 in the file stays ignored
    top = int(label[label != IGNORE_INDEX].max(initial=0))
    if top >= num_classes:
        raise LabelError(f'{label_path}: holds label {top + 1}, above the {num_classes} classes of --num-classes '
                         f'{num_classes}; pass the number of classes of this data set')
    return label


def check_labels(pairs: list[tuple[str, str]], num_classes: int) -> int:
    """Check the label maps of the (image, label map) `pairs` as loading them does (checked_label), each image's
    size read from its header (the image is not decoded); returns the number of labelled pixels (neither "other"
    nor 255)."""
    labelled = 0
    for image_path, label_path in pairs:
        try:
            with Image.open(image_path) as im:
                width, height = im.size
        except OSError as e:
            raise LabelError(_undecodable_image(image_path, e)) from e
        labelled += int((checked_label(label_path, image_path, (height, width), num_classes) != IGNORE_INDEX).sum())
    return labelled


# --------------------------------------------------------------------------------------------------
# Pictures of predictions (--show-dir)
# --------------------------------------------------------------------------------------------------
def palette(num_classes: int) -> np.ndarray:
    """(num_classes, 3) uint8 RGB colours of the classes 0..num_classes-1 (label k + 1 on disk): PALETTE for
    ADE20K's 150, else the colours mmseg gives a data set without a palette, numpy's
    RandomState(PALETTE_SEED).randint(0, 255, (num_classes, 3)): the same at every run and on every process."""
    if num_classes == len(PALETTE):
        return np.array(PALETTE, np.uint8)
    return np.random.RandomState(PALETTE_SEED).randint(0, 255, size=(num_classes, 3)).astype(np.uint8)


def colour_labels(labels: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """An HxW map of classes (0..len(colours)-1) as an HxWx3 uint8 RGB picture, class c in colours[c]; any other
    value (IGNORE_INDEX: no class) black."""
    labels = np.asarray(labels).astype(np.int64)
    out = np.zeros((*labels.shape, 3), np.uint8)
    known = (labels >= 0) & (labels < len(colours))
    out[known] = colours[labels[known]]
    return out


def prediction_picture(image: np.ndarray, prediction: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """The picture --show-dir writes of one image: the image (HxWx3 uint8, as read from disk) on the left, its
    predicted label map (HxW, the same size) in `colours` (colour_labels) on the right."""
    if image.shape[:2] != prediction.shape:
        raise ValueError(f'a prediction of {prediction.shape[1]}x{prediction.shape[0]} for an image of '
                         f"{image.shape[1]}x{image.shape[0]}: the prediction is drawn at the image's size")
    return np.concatenate([image, colour_labels(prediction, colours)], axis=1)


# --------------------------------------------------------------------------------------------------
# Resizing (OpenCV's sampling grid: half-pixel centres, no antialiasing, as mmcv's imresize)
# --------------------------------------------------------------------------------------------------
def resize_label(label: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour resize of an HxW label map to `size` (height, width)."""
    if label.shape == tuple(size):
        return label
    t = torch.from_numpy(np.ascontiguousarray(label))[None, None].float()
    return F.interpolate(t, size=size, mode='nearest')[0, 0].to(torch.uint8).numpy()


def normalize(image: np.ndarray) -> torch.Tensor:
    """An HxWx3 uint8 RGB image as a normalised float32 3xHxW tensor (mmseg's img_norm_cfg)."""
    t = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float()
    return (t - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


# --------------------------------------------------------------------------------------------------
# Photometric distortion (mmseg's PhotoMetricDistortion, in OpenCV's 8-bit HSV: hue 0..179)
# --------------------------------------------------------------------------------------------------
def _convert(x: np.ndarray, alpha: float = 1.0, beta: float = 0.0) -> np.ndarray:
    return np.clip(x.astype(np.float32) * alpha + beta, 0, 255).astype(np.uint8)


def rgb_to_hsv(image: np.ndarray) -> np.ndarray:
    """uint8 RGB -> uint8 HSV on OpenCV's 8-bit scales (H = degrees / 2, S and V 0..255)."""
    rgb = image.astype(np.float32)
    v = rgb.max(-1)
    delta = v - rgb.min(-1)
    s = np.where(v > 0, delta / np.maximum(v, 1e-6) * 255, 0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    safe = np.maximum(delta, 1e-6)
    h = np.where(v == r, 60 * (g - b) / safe, np.where(v == g, 120 + 60 * (b - r) / safe, 240 + 60 * (r - g) / safe))
    h = np.where(delta > 0, h % 360, 0) / 2
    return np.stack([np.round(h) % 180, np.round(s), v], -1).astype(np.uint8)


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """rgb_to_hsv's inverse (uint8 HSV on OpenCV's scales -> uint8 RGB): channel n is V - C clip(min(k, 4 - k),
    0, 1) with k = (n + H / 60) mod 6 and n = 5, 3, 1 for R, G, B, and the chroma C = V S."""
    sector = hsv[..., 0].astype(np.float32) / 30  # H in degrees / 60
    v = hsv[..., 2].astype(np.float32)
    c = v * hsv[..., 1].astype(np.float32) / 255
    rgb = []
    for n in (5, 3, 1):
        k = (n + sector) % 6
        rgb.append(v - c * np.clip(np.minimum(k, 4 - k), 0, 1))
    return np.clip(np.round(np.stack(rgb, -1)), 0, 255).astype(np.uint8)


def photometric_distortion(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """mmseg's PhotoMetricDistortion: brightness +-32, contrast and saturation x0.5..1.5, hue +-18 (of 180),
    each with probability 1/2, contrast before or after the colour changes."""
    if rng.integers(2):
        image = _convert(image, beta=rng.uniform(-32, 32))
    contrast_first = rng.integers(2)
    if contrast_first and rng.integers(2):
        image = _convert(image, alpha=rng.uniform(0.5, 1.5))
    if rng.integers(2):
        hsv = rgb_to_hsv(image)
        hsv[..., 1] = _convert(hsv[..., 1], alpha=rng.uniform(0.5, 1.5))
        image = hsv_to_rgb(hsv)
    if rng.integers(2):
        hsv = rgb_to_hsv(image)
        hsv[..., 0] = (hsv[..., 0].astype(np.int64) + rng.integers(-18, 18)) % 180
        image = hsv_to_rgb(hsv)
    if not contrast_first and rng.integers(2):
        image = _convert(image, alpha=rng.uniform(0.5, 1.5))
    return image


# --------------------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainPipeline:
    """mmseg's ADE20K training pipeline (see the module docstring); sizes are (height, width)."""
    crop: tuple[int, int] = (512, 512)
    img_scale: tuple[int, int] = (2048, 512)  # (long edge, short edge) at ratio 1
    ratio_range: tuple[float, float] = (0.5, 2.0)
    cat_max_ratio: float = 0.75
    flip_prob: float = 0.5
    photometric: bool = True

    def _crop_box(self, h: int, w: int, rng: np.random.Generator) -> tuple[int, int]:
        return int(rng.integers(0, max(h - self.crop[0], 0) + 1)), int(rng.integers(0, max(w - self.crop[1], 0) + 1))

    def crop_origin(self, label: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
        """A random crop's top-left corner; up to 10 draws until no class covers cat_max_ratio of its labelled
        pixels (and it has more than one class), as mmseg's RandomCrop."""
        y, x = self._crop_box(*label.shape, rng)
        if self.cat_max_ratio < 1:
            for _ in range(10):
                counts = np.bincount(label[y:y + self.crop[0], x:x + self.crop[1]].ravel(), minlength=256)[:255]
                counts = counts[counts > 0]
                if len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio:
                    break
                y, x = self._crop_box(*label.shape, rng)
        return y, x

    def __call__(self, image: np.ndarray, label: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        """(normalised 3 x crop image, crop label map uint8) of one sample."""
        ratio = rng.random() * (self.ratio_range[1] - self.ratio_range[0]) + self.ratio_range[0]
        size = rescale_size(*image.shape[:2], (int(self.img_scale[0] * ratio), int(self.img_scale[1] * ratio)))
        image, label = resize_image(image, size), resize_label(label, size)
        y, x = self.crop_origin(label, rng)
        image, label = image[y:y + self.crop[0], x:x + self.crop[1]], label[y:y + self.crop[0], x:x + self.crop[1]]
        if rng.random() < self.flip_prob:
            image, label = image[:, ::-1], label[:, ::-1]
        if self.photometric:
            image = photometric_distortion(image, rng)
        pad = (0, self.crop[1] - image.shape[1], 0, self.crop[0] - image.shape[0])  # bottom and right
        out = F.pad(normalize(image), pad, value=0.0)
        target = F.pad(torch.from_numpy(np.ascontiguousarray(label)), pad, value=IGNORE_INDEX)
        return out, target


class ADE20K(Dataset):
    """One split of an ADE20K-layout folder. Training (`pipeline` given): items are keyed by (epoch, index) and
    give (image, label) through the pipeline, its random choices seeded by (seed, epoch, index). Evaluation:
    items are keyed by index and give (image rescaled to fit `eval_scale` and normalised, label map at the
    original size, index); with `eval_ratios` the first is the list of the image rescaled to fit each ratio of
    `eval_scale`. `classes`: the names of the classes in label order (class_names)."""

    def __init__(self, root: str, split: str, num_classes: int = 150, pipeline: TrainPipeline | None = None,
                 eval_scale: tuple[int, int] = (2048, 512), seed: int = 0,
                 eval_ratios: tuple[float, ...] | None = None):
        self.root, self.split, self.num_classes = root, split, num_classes
        self.pairs = scan(root, split)
        self.classes = class_names(root, num_classes)
        self.pipeline, self.eval_scale, self.seed, self.eval_ratios = pipeline, eval_scale, seed, eval_ratios

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, key):
        if self.pipeline is not None:
            epoch, index = key
            image, label = read_pair(*self.pairs[index], self.num_classes)
            return self.pipeline(image, label, np.random.default_rng([self.seed, epoch, index]))
        image, label = read_pair(*self.pairs[key], self.num_classes)
        label = torch.from_numpy(label.copy())
        if self.eval_ratios:  # mmseg 0.x's img_ratios: (int(long * r), int(short * r)) for each ratio r
            scales = [(int(self.eval_scale[0] * r), int(self.eval_scale[1] * r)) for r in self.eval_ratios]
            return [normalize(resize_image(image, rescale_size(*image.shape[:2], s))) for s in scales], label, key
        return normalize(resize_image(image, rescale_size(*image.shape[:2], self.eval_scale))), label, key
