"""Top-k predictions of a NaLaFormer checkpoint for image files or folders.

    python tools/predict.py cat.jpg photos/ --checkpoint output/t/best.pth
    python tools/predict.py photos/ --model NALAFORMER_T --checkpoint release/nalaformer_t_224-1a2b3c4d.safetensors \\
        --topk 3 --format json --output preds.json --class-names classes.txt

The checkpoint is a training checkpoint (``.pth``; its EMA weights when it has them, as timm loads
it, or ``--weights``) or a released ``.safetensors`` file (``tools/release.py``). Images are read with
the evaluation transform of ``main.py --eval`` (``datasets.data_config``): the model's pretrained_cfg
(bicubic resize, centre crop, mean/std) at the checkpoint's recorded ``--input-size`` and
``--eval-crop-ratio`` (``--input-size`` here overrides, with a note naming both). Folders are searched
recursively for image files, in sorted order; an image named twice (a file and its folder) is predicted
once. Class names are those the checkpoint records (a training checkpoint's ``classes``, the training folders
in label order; a release's metadata, ``tools/release.py``); ``--class-names`` (a text file with one name per
line, line i is class i, or a JSON list) overrides them; with neither, classes are printed as their index.
Output: CSV
(``image,rank,class_index,class_name,probability``) or JSON, to stdout or ``--output``.
"""
import argparse
import csv
import io
import json
import os
import sys
from typing import Any, Sequence

import timm
import torch
from PIL import Image, UnidentifiedImageError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import cli
import datasets
import models  # noqa: F401  (registers the variants)
from models.nalaformer import VARIANTS, from_reference_layout
from run import checkpoint
from run.errors import CheckpointError, FlagParser, UserError, first_line, unknown_model
from run.weights import model_for_weights, select_weights
from tools.release import WEIGHT_CHOICES
from training import image_folder


def list_images(paths: Sequence[str]) -> list[str]:
    """Image files among ``paths``; folders are searched recursively (sorted), files are taken as given. An image
    named twice (a file and the folder holding it, a link to it) is kept once, where it first appears."""
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files
                           if f.lower().endswith(image_folder.IMAGE_EXTENSIONS))
            if not found:
                raise UserError(f'{path}: no image files ({", ".join(image_folder.IMAGE_EXTENSIONS)}) in this folder')
            out += found
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise UserError(f'{path}: no such file or folder')
    unique, seen = [], set()
    for p in out:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            unique.append(p)
    return unique


def _run_info(values: dict[str, Any], crop_key: str, classes: Any = None) -> dict[str, Any]:
    """``model``, ``input_size`` and ``crop_pct`` from a checkpoint's args or a release's metadata, and the class
    names (``classes``), where recorded."""
    info: dict[str, Any] = {}
    for key, name, cast in (('model', 'model', str), ('input_size', 'input_size', int), (crop_key, 'crop_pct', float)):
        if values.get(key):
            info[name] = cast(values[key])
    if isinstance(classes, (list, tuple)) and classes:
        info['classes'] = [str(c) for c in classes]
    return info


def _metadata_classes(meta: dict[str, str]) -> list | None:
    """The class names a release's metadata records (a JSON list under ``classes``), else None."""
    try:
        return json.loads(meta['classes'])
    except (KeyError, ValueError):
        return None


def load_weights(path: str, weights: str = 'default') -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """State dict and run settings (``model``, ``input_size``, ``crop_pct``, ``classes`` when recorded) of a
    training checkpoint or a released safetensors file (in either key layout, ``from_reference_layout``)."""
    if path.endswith('.safetensors'):
        from safetensors import safe_open
        if not os.path.isfile(path):
            raise CheckpointError(f'checkpoint {path} does not exist')
        try:
            with safe_open(path, framework='pt') as f:
                meta = f.metadata() or {}
                sd = from_reference_layout({k: f.get_tensor(k) for k in f.keys()})
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f'{path} is not a readable safetensors file ({first_line(e)})') from e
        return sd, _run_info(meta, 'crop_pct', _metadata_classes(meta))
    ckpt = checkpoint.load_checkpoint_file(path)
    _, sd = select_weights(ckpt, path, weights)
    classes = ckpt.get('classes') if isinstance(ckpt, dict) else None
    return sd, _run_info(checkpoint.saved_args(ckpt), 'eval_crop_ratio', classes)


def predicting_model(model_name: str, sd: dict[str, torch.Tensor], path: str) -> torch.nn.Module:
    """``model_name`` with the classifier size of ``sd``, loaded strictly, in eval mode."""
    if not timm.is_model(model_name):
        raise UserError(unknown_model(model_name, VARIANTS, timm.list_models()))
    return model_for_weights(model_name, sd, path).eval()


def class_names_for(args: argparse.Namespace, recorded: dict[str, Any], num_classes: int) -> tuple[list | None, str]:
    """The class names to print and where they come from: --class-names, else those the checkpoint records
    (when there is one per class), else none (indices)."""
    if args.class_names:
        return read_class_names(args.class_names, num_classes), f'--class-names {args.class_names}'
    names = recorded.get('classes')
    if names and len(names) == num_classes:
        return names, f'recorded in {args.checkpoint}'
    if names:
        return None, f'none ({args.checkpoint} records {len(names)} names for {num_classes} classes: indices)'
    return None, 'none recorded (indices; --class-names FILE names them)'


def read_class_names(path: str, num_classes: int) -> list[str]:
    """Class names from a text file (one per line) or a JSON list; exactly ``num_classes`` of them."""
    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except OSError as e:
        raise UserError(f'--class-names {path}: {e.strerror}') from e
    if text.lstrip().startswith('['):
        names = json.loads(text)
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(names) != num_classes:
        raise UserError(f'--class-names {path} has {len(names)} names but the model has {num_classes} classes')
    return [str(n) for n in names]


@torch.no_grad()
def predict(model: torch.nn.Module, transform, images: Sequence[str], topk: int = 5, batch_size: int = 16,
            device: str = 'cpu') -> list[list[tuple[int, float]]]:
    """Top-k (class index, probability) for each image, in order."""
    results: list[list[tuple[int, float]]] = []
    k = min(topk, model.num_classes)
    for start in range(0, len(images), batch_size):
        batch = []
        for path in images[start:start + batch_size]:
            try:
                with Image.open(path) as im:
                    batch.append(transform(im.convert('RGB')))
            except (UnidentifiedImageError, OSError) as e:
                raise UserError(f'{path}: cannot read this image ({first_line(e)}); remove it or pass other '
                                f'files') from e
        probs = model(torch.stack(batch).to(device)).float().softmax(dim=1)
        values, indices = probs.topk(k, dim=1)
        results += [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    return results


def format_results(images: Sequence[str], results: Sequence[Sequence[tuple[int, float]]],
                   class_names: Sequence[str] | None, fmt: str) -> str:
    """CSV (one row per image and rank) or JSON (one object per image) text."""
    def name(i: int) -> str:
        return class_names[i] if class_names else str(i)
    if fmt == 'json':
        rows = [{'image': img, 'topk': [{'class_index': i, 'class_name': name(i), 'probability': p} for i, p in res]}
                for img, res in zip(images, results)]
        return json.dumps(rows, indent=1) + '\n'
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator='\n')
    writer.writerow(['image', 'rank', 'class_index', 'class_name', 'probability'])
    for img, res in zip(images, results):
        for rank, (i, p) in enumerate(res, 1):
            writer.writerow([img, rank, i, name(i), f'{p:.6f}'])
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('images', nargs='+', help='image files and/or folders')
    parser.add_argument('--checkpoint', required=True, help='training checkpoint (.pth) or release (.safetensors)')
    parser.add_argument('--model', default=None, help='model name (default: the one recorded in the checkpoint)')
    parser.add_argument('--weights', choices=WEIGHT_CHOICES, default='default',
                        help='for .pth checkpoints: default takes the EMA weights when present')
    parser.add_argument('--input-size', type=int, default=None,
                        help="image size (default: the checkpoint's recorded --input-size, else 224)")
    parser.add_argument('--topk', type=int, default=5)
    parser.add_argument('--format', choices=['csv', 'json'], default='csv')
    parser.add_argument('--output', default=None, help='write here instead of stdout')
    parser.add_argument('--class-names', default=None,
                        help='text file, one class name per line, or a JSON list (default: the names the '
                             'checkpoint records)')
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--device', default='cpu')
    args = parser.parse_args(argv)
    if args.topk < 1 or args.batch_size < 1:
        parser.error('--topk and --batch-size must be at least 1')
    try:
        images = list_images(args.images)
        sd, recorded = load_weights(args.checkpoint, args.weights)
        model_name = args.model or recorded.get('model')
        if not model_name:
            raise UserError(f'{args.checkpoint} does not record its model; pass --model NAME')
        model = predicting_model(model_name, sd, args.checkpoint).to(args.device)
        class_names, names_from = class_names_for(args, recorded, model.num_classes)
        note = cli.override_note('--input-size', args.input_size, recorded.get('input_size'), args.checkpoint)
        if note:
            print(note, file=sys.stderr)
        cfg = datasets.data_config(model, args.input_size or recorded.get('input_size'), recorded.get('crop_pct'))
        results = predict(model, datasets.eval_transform(cfg), images, args.topk, args.batch_size, args.device)
        text = format_results(images, results, class_names, args.format)
    except UserError as e:
        parser.exit(2, f'{parser.prog}: error: {e}\n')
    print(f"{model_name}: {len(images)} image(s) at {cfg['input_size'][-1]} px, crop_pct {cfg['crop_pct']}; "
          f'class names: {names_from}', file=sys.stderr)
    if args.output:
        with open(args.output, 'w', encoding='utf-8') as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
