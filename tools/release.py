"""Turn a training checkpoint into release weights: a safetensors file named ``NAME-<sha8>.safetensors``
(the first 8 hex digits of its SHA-256, as timm and DeiT name their files) and a model card next to it.

    python tools/release.py output/t/best.pth --output-dir release
    python tools/release.py output/t/best.pth --weights model --name nalaformer_t_in1k --output-dir release
    python tools/release.py output/t/best.pth --reference-layout --output-dir release

Only the weights are kept (no optimizer, scheduler, scaler, RNG or arguments). Without ``--weights`` (or with
``--weights default``) the EMA weights are taken when the checkpoint has them, else the raw model weights, which
is what ``timm.create_model(..., pretrained=True)`` and ``checkpoint_path=`` load from a training checkpoint;
``--weights model`` or ``--weights model_ema`` picks one explicitly. The console names the weights taken and
the top-1 both recorded for the checkpoint's epoch; without ``--weights``, EMA weights that recorded a lower
top-1 than the model weights are refused (a short run's EMA lags far behind), naming both choices. The
class names the checkpoint records go into the file's metadata (``classes``, a JSON list), which
``tools/predict.py`` prints. The weights are loaded into the
model with ``strict=True`` before anything is written, and the file is written under a temporary
name and renamed once complete. Load the result with

    timm.create_model('NALAFORMER_T', pretrained=True, pretrained_cfg_overlay=dict(file='release/...safetensors'))

``--reference-layout`` writes the keys of the reference implementation (each stage holds the downsample
that runs after it; ``models.nalaformer.to_reference_layout``), so the file loads there with ``strict=True``;
this repository's loaders read either layout.

The model card's load lines name the file by the path it was written to (relative to the working
directory when ``--output-dir`` is relative), so they work as pasted from where release.py ran.
"""
import argparse
import hashlib
import json
import os
import shlex
import sys
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import timm

import datasets
import models  # noqa: F401  (registers the variants)
from models.nalaformer import VARIANTS, to_reference_layout
from run.checkpoint import load_checkpoint_file, saved_args
from run.errors import FlagParser, UserError, unknown_model
from run.weights import model_for_weights, select_weights

WEIGHT_CHOICES = ('default', 'model', 'model_ema')
#: The model card's line for each key layout a release can have.
LAYOUTS = {'nalaformer': "this repository's (each stage holds the downsample that feeds it)",
           'reference': "the reference implementation's (each stage holds the downsample that runs after it); "
                        "this repository's loaders read it too"}


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()


def eval_numbers(ckpt: dict[str, Any], path: str) -> dict[str, Any]:
    """Accuracy figures recorded with the checkpoint: its ``max_accuracy`` and ``epoch``, and the test
    metrics of that epoch from the ``log.txt`` beside it (when there is one)."""
    out: dict[str, Any] = {k: ckpt[k] for k in ('epoch', 'max_accuracy') if isinstance(ckpt.get(k), (int, float))}
    log = os.path.join(os.path.dirname(os.path.abspath(path)), 'log.txt')
    if 'epoch' in out and os.path.isfile(log):
        with open(log) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and row.get('epoch') == out['epoch']:
                    out.update({k: v for k, v in row.items() if k.startswith('test_') and isinstance(v, (int, float))
                                and not k.endswith(('_n', '_seen'))})  # image counts are not accuracies
    return out


def recorded_acc1(ckpt: dict[str, Any], ev: dict[str, Any]) -> dict[str, float]:
    """The top-1 the checkpoint's epoch recorded for each set of weights ('model', 'model_ema'): its ``acc1``
    entry, else the epoch's ``test_acc1`` / ``test_ema_acc1`` among its ``eval_numbers`` ``ev`` (the log.txt
    beside it). Empty when none."""
    acc = ckpt.get('acc1')
    if isinstance(acc, dict):
        return {k: float(v) for k, v in acc.items() if k in ('model', 'model_ema') and isinstance(v, (int, float))}
    return {k: float(ev[key]) for k, key in (('model', 'test_acc1'), ('model_ema', 'test_ema_acc1')) if key in ev}


WEIGHT_NAMES = {'model': 'model', 'model_ema': 'EMA'}


def describe_choice(taken: str, acc: dict[str, float], epoch: Any) -> str:
    """'the EMA weights (model_ema); recorded top-1 at epoch 3: EMA 61.25%, model 60.25%'."""
    what = f'the {WEIGHT_NAMES[taken]} weights ({taken})' if taken in WEIGHT_NAMES else f'the {taken}'
    if not acc:
        return f'{what}; no top-1 recorded for them'
    at = f' at epoch {epoch}' if isinstance(epoch, int) else ''
    order = [taken] + [k for k in acc if k != taken]
    return f'{what}; recorded top-1{at}: ' + ', '.join(f'{WEIGHT_NAMES[k]} {acc[k]:.2f}%' for k in order if k in acc)


def check_better(taken: str, acc: dict[str, float], path: str) -> None:
    """Refuse, in one line naming both --weights choices, to release by default the EMA weights (the default
    rule's choice when a checkpoint has them) when they recorded a lower top-1 than the model weights."""
    other = 'model'
    if taken == 'model_ema' and taken in acc and other in acc and acc[taken] < acc[other]:
        raise UserError(f'{path}: the {WEIGHT_NAMES[taken]} weights, taken by default, recorded top-1 '
                        f'{acc[taken]:.2f}%, the {WEIGHT_NAMES[other]} weights {acc[other]:.2f}%: pass --weights '
                        f'{other} to release the better ones, or --weights {taken} to release these anyway')


def describe_eval(cfg: dict[str, Any]) -> str:
    """What the evaluation transform of a ``datasets.data_config`` does, read off the transform itself."""
    from torchvision import transforms
    steps = datasets.eval_transform(cfg).transforms
    resize = next(t for t in steps if isinstance(t, transforms.Resize)).size
    size = tuple(cfg['input_size'][1:])
    how = (f'resize the shorter side to {resize}' if isinstance(resize, int) else
           f'resize to {resize[0]}x{resize[1]}') + f" {cfg['interpolation']}"
    cropped = isinstance(resize, int) or tuple(resize) != size
    how += f", centre crop {size[0]}x{size[1]} (crop_pct {cfg['crop_pct']})" if cropped else ', no crop'
    return f"{how}; mean {tuple(cfg['mean'])}, std {tuple(cfg['std'])}"


def model_card(info: dict[str, Any]) -> str:
    """Markdown model card for a released file."""
    n_cls = info['num_classes']
    # the path as written, relative to the directory release ran in: where README runs it (the repository
    # root) the load lines below work as pasted, and `models` imports from there too
    file = info['file']
    cfg = info['data_config']
    overlay = f'file={file!r}'
    if n_cls != 1000:
        overlay += f', num_classes={n_cls}'
    # the evaluation settings that differ from the variant's registered pretrained_cfg
    registered = datasets.data_config(info['model'])
    overlay += ''.join(f', {k}={cfg[k]!r}' for k in ('input_size', 'crop_pct', 'crop_mode') if cfg[k] != registered[k])
    kw = f', num_classes={n_cls}' if n_cls != 1000 else ''
    where = 'the paths are absolute' if os.path.isabs(file) else 'the paths are relative to it'
    size = info['input_size']
    lines = [
        f"# {info['name']}",
        '',
        f"- Model: `{info['model']}` (NaLaFormer), {n_cls} classes",
        f'- Input size: {size}x{size} (eval: {describe_eval(cfg)})',
        f"- Parameters: {info['params'] / 1e6:.2f}M ({info['params']})",
    ]
    if info.get('gflops') is not None:
        lines.append(f"- FLOPs: {info['gflops']:.3f} G (fvcore multiply-adds, 1x3x{size}x{size})")
    ev = info['eval']
    if ev:
        lines.append('- Evaluation recorded in the checkpoint: ' + ', '.join(
            f'{k} {v:.2f}' if isinstance(v, float) else f'{k} {v}' for k, v in ev.items()))
    else:
        lines.append('- Evaluation: none recorded in the checkpoint')
    if info.get('data_set'):
        lines.append(f"- Trained on: `{info['data_set']}`")
    if info.get('classes'):
        shown = ', '.join(f'`{c}`' for c in info['classes'][:10]) + (', ...' if len(info['classes']) > 10 else '')
        lines.append(f"- Class names: {shown} (all {len(info['classes'])} in the file's metadata, `classes`; "
                     'tools/predict.py prints them)')
    lines += [
        f"- Source: `{info['source']}`, weights `{info['weights']}`",
        f"- Key layout: {LAYOUTS[info.get('layout', 'nalaformer')]}",
        f"- SHA-256: `{info['sha256']}`",
        f"- License: {info['license']}",
        '',
        '## Use',
        '',
        f'Run these in the directory `tools/release.py` ran in ({where}; the repository root in the README), '
        'where the `models` package of the NaLaFormer repository imports.',
        '',
        '```python',
        'import timm, models  # models/ of the NaLaFormer repository registers the variants',
        f"model = timm.create_model('{info['model']}', pretrained=True{kw},",
        f'                          pretrained_cfg_overlay=dict({overlay})).eval()',
        '```',
        '',
        '```bash',
        f"python tools/predict.py IMAGES --model {info['model']} --checkpoint {shlex.quote(file)} "
        f"--input-size {info['input_size']}",
        '```',
        '',
    ]
    return '\n'.join(lines)


def release(checkpoint: str, output_dir: str, weights: str | None = None, name: str | None = None,
            model_name: str | None = None, flops: bool = True,
            license_line: str = 'see the LICENSE of the NaLaFormer repository and the terms of the training data',
            reference_layout: bool = False) -> dict[str, Any]:
    """Write ``NAME-<sha8>.safetensors`` and ``NAME-<sha8>.md`` into ``output_dir``; return what was written.
    ``weights`` None takes the default rule's weights, refused when they recorded a lower top-1 than the others
    (check_better); ``reference_layout`` writes the reference implementation's keys (``to_reference_layout``)."""
    from safetensors.torch import save
    ckpt = load_checkpoint_file(checkpoint)
    args = saved_args(ckpt)
    model_name = model_name or args.get('model')
    if not model_name:
        raise UserError(f'{checkpoint} does not record its model (no args.model); pass --model NAME')
    if not timm.is_model(model_name):
        raise UserError(unknown_model(model_name, VARIANTS) + '; pass --model with one of them')
    key, sd = select_weights(ckpt, checkpoint, weights or 'default')
    taken = key or 'state dict'  # '': the file is a bare state dict
    ev = eval_numbers(ckpt, checkpoint) if isinstance(ckpt, dict) else {}
    acc = recorded_acc1(ckpt, ev) if isinstance(ckpt, dict) else {}
    if weights is None:
        check_better(taken, acc, checkpoint)
    classes = ckpt.get('classes') if isinstance(ckpt, dict) else None
    classes = [str(c) for c in classes] if isinstance(classes, (list, tuple)) else []
    cfg = datasets.data_config(model_name, args.get('input_size'), args.get('eval_crop_ratio'))
    input_size, crop_pct = cfg['input_size'][-1], cfg['crop_pct']

    model = model_for_weights(model_name, sd, checkpoint)
    num_classes = model.num_classes

    os.makedirs(output_dir, exist_ok=True)
    name = name or f'{model_name.lower()}_{input_size}' + ('_reference' if reference_layout else '')
    tmp = os.path.join(output_dir, f'.{name}.safetensors.tmp')
    layout = 'reference' if reference_layout else 'nalaformer'
    tensors = {k: v.detach().to('cpu').contiguous().clone()
               for k, v in (to_reference_layout(sd) if reference_layout else sd).items()}
    meta = {'format': 'pt', 'model': model_name, 'num_classes': str(num_classes), 'input_size': str(input_size),
            'crop_pct': str(crop_pct), 'crop_mode': cfg['crop_mode'], 'source_weights': taken, 'layout': layout}
    classes = classes if len(classes) == num_classes else []
    if classes:
        meta['classes'] = json.dumps(classes)
    with open(tmp, 'wb') as f:  # open's mode (0666 less the umask), readable by others as any file written here
        f.write(save(tensors, metadata=meta))
    digest = sha256_file(tmp)
    final = os.path.join(output_dir, f'{name}-{digest[:8]}.safetensors')
    os.replace(tmp, final)

    info = dict(name=os.path.basename(final)[:-len('.safetensors')], model=model_name, num_classes=num_classes,
                input_size=input_size, crop_pct=crop_pct, data_config=cfg,
                params=sum(p.numel() for p in model.parameters()),
                gflops=None, eval=ev,
                data_set=args.get('data_set'), source=checkpoint, weights=taken, sha256=digest,
                license=license_line, file=final, layout=layout, classes=classes,
                choice=describe_choice(taken, acc, ckpt.get('epoch') if isinstance(ckpt, dict) else None))
    if flops:
        from models.flop_count import count_flops
        info['gflops'] = count_flops(model, (3, input_size, input_size)) / 1e9
    card = final[:-len('.safetensors')] + '.md'
    with open(card, 'w') as f:
        f.write(model_card(info))
    info['card'] = card
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('checkpoint', help='training checkpoint (.pth) or a bare state dict')
    parser.add_argument('--output-dir', '--output_dir', dest='output_dir', required=True)
    parser.add_argument('--weights', choices=WEIGHT_CHOICES, default=None,
                        help='default: the EMA weights when the checkpoint has them, else the model weights; '
                             'without the flag, EMA weights that recorded a lower top-1 than the model weights '
                             'are refused')
    parser.add_argument('--name', default=None, help='file name stem (default: <model>_<input size>)')
    parser.add_argument('--model', default=None, help='model name (default: the one recorded in the checkpoint)')
    parser.add_argument('--no-flops', dest='flops', action='store_false', help='leave FLOPs out of the model card')
    parser.add_argument('--reference-layout', action='store_true',
                        help="write the reference implementation's keys, so the file loads there strictly "
                             '(default name <model>_<input size>_reference)')
    parser.add_argument('--license', dest='license_line',
                        default='see the LICENSE of the NaLaFormer repository and the terms of the training data')
    args = parser.parse_args(argv)
    try:
        info = release(args.checkpoint, args.output_dir, weights=args.weights, name=args.name, model_name=args.model,
                       flops=args.flops, license_line=args.license_line, reference_layout=args.reference_layout)
    except UserError as e:
        parser.exit(2, f'{parser.prog}: error: {e}\n')
    print(f"Released {info['choice']}")
    print(f"{info['file']}  ({info['weights']} weights of {info['source']}, sha256 {info['sha256']})")
    print(info['card'])
    return 0


if __name__ == '__main__':
    sys.exit(main())
