"""Query norm vs attention entropy, and attention maps, of a NaLaFormer (the paper's claim; docs/analysis.md).

    python tools/analyze_attention.py --model NALAFORMER_XT --data-set DIGITS --input-size 64
    python tools/analyze_attention.py --model NALAFORMER_XT --checkpoint output/demo/checkpoint.pth \\
        --data-set DIGITS --stage 1 --attention-map
    python tools/analyze_attention.py --model NALAFORMER_T --images ./my_images --input-size 224

The images run through the model in eval mode; forward hooks on every attention layer record its
raw q and k (the output of ``attn.qkvg``, split into heads; either path). For every query of the chosen stage
(``--stage``, 0-based as in ``layers.S``; all blocks, heads and images pooled) the tool computes the
attention row that these attention rules give on the same q, k, with RoPE off:

* ``nala``: NaLa as implemented, row_i(j) = Q_i.K_j / sum_j' Q_i.K_j' with Q, K from
  ``models.nala.nala_kernel_terms`` (the model's own kernel: cubed keys, norm-dependent power);
* ``softmax``: softmax(q.k / sqrt(d));
* ``relu``: plain ReLU linear attention, relu(q).relu(k) / sum_j' relu(q).relu(k_j');
* ``nala_p45``: NaLa with the norm taken out (each query rescaled to ||q|| = 10, so p = 4.5 for all):
  what remains of NaLa's correlation there comes from the query directions, the difference to
  ``nala`` is what the norm-dependent power contributes.

It writes, into ``--output-dir`` (default ``output/analysis/<weights>``: ``untrained_seed<S>`` or
``<run folder>_<checkpoint stem>``), ``entropy_stage<S>.png`` (entropy against the query norm ||q|| of
the raw head query, one panel per rule, Pearson r and Spearman rho in the legend),
``entropy_stage<S>.json`` (all numbers) and prints a table. Rows whose normaliser is 0 (every product
zero: possible for the ReLU rules) have no distribution; they are excluded and counted.

``--attention-map`` also writes ``attention_map.png``: for one image (``--image-index``) and one
query position (``--query Y,X`` in fractions of the image), the attention weights of each stage's
last block (mean over heads) over the image, upsampled and overlaid. NaLa stages show NaLa weights,
softmax stages softmax weights; ``--map-rope`` uses the weights exactly as the model applies them
(RoPE on, NaLa's normaliser with its 1e-6), which for NaLa can be negative.

Nothing is downloaded: the model is built from code, weights come from ``--checkpoint`` (else the
untrained initialisation, seeded by ``--seed``), images from ``--images`` or the digits bundled with
scikit-learn. Images go through the evaluation transform of ``main.py --eval`` (``datasets.data_config``:
the model's pretrained_cfg at the checkpoint's recorded input size and crop ratio).
"""
import argparse
import json
import math
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `python tools/X.py` too

import timm

import cli
import datasets
import models  # noqa: F401  (registers the variants)
from models import VARIANTS
from models.nala import NaLaAttention
from run import checkpoint, errors
from run.errors import FlagParser, unknown_model
from run.weights import load_weights_into, select_weights
from tools.attention_rules import (
    METHOD_LABELS,
    METHODS,
    ROW_FNS,
    entropy,
    nala_model_weights,
    pearson,
    softmax_model_weights,
    spearman,
)
from training import image_folder

MAX_SCATTER_POINTS = 8000


# ---------------------------------------------------------------------------------------------
# Capturing q and k
# ---------------------------------------------------------------------------------------------
def attention_layers(model: nn.Module) -> list[tuple[int, int, nn.Module]]:
    """(stage, block, attn) of every attention layer, in forward order."""
    return [(s, b, block.attn) for s, stage in enumerate(model.layers) for b, block in enumerate(stage.blocks)]


@contextmanager
def record_qk(model: nn.Module) -> Iterator[dict[tuple[int, int], list[dict[str, Any]]]]:
    """Hook every attention layer; yields {(stage, block): [one dict per forward]} with q, k of shape
    (B, heads, N, d) taken from the ``attn.qkvg`` output, (B, H, W, 4C) tokens, and the map size (H, W)."""
    records: dict[tuple[int, int], list[dict[str, Any]]] = {}
    handles = []
    for s, b, attn in attention_layers(model):
        key = (s, b)
        records[key] = []

        def qkvg_hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor, key=key, attn=attn) -> None:
            out = out.detach().float()
            hw = (int(out.shape[1]), int(out.shape[2]))
            q, k = out.flatten(1, 2).chunk(4, dim=-1)[:2]
            split = lambda t: t.unflatten(-1, (attn.num_heads, attn.head_dim)).transpose(1, 2)  # noqa: E731
            records[key].append({'q': split(q), 'k': split(k), 'hw': hw})

        handles.append(attn.qkvg.register_forward_hook(qkvg_hook))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def capture(model: nn.Module, images: torch.Tensor, batch_size: int = 16) -> dict[tuple[int, int], dict[str, Any]]:
    """Run ``images`` through ``model`` (eval, no grad); return per layer q, k (B, h, N, d) over all
    images, hw, and the stage's RoPE tables sin, cos (N, d) for that size."""
    model.eval()
    with torch.no_grad(), record_qk(model) as records:
        for start in range(0, len(images), batch_size):
            model(images[start:start + batch_size])
        out = {}
        for (s, b), recs in records.items():
            hw = recs[0]['hw']
            sin, cos = model.layers[s].RoPE(hw)
            out[(s, b)] = {'q': torch.cat([r['q'] for r in recs]), 'k': torch.cat([r['k'] for r in recs]),
                           'hw': hw, 'sin': sin.float(), 'cos': cos.float()}
    return out


# ---------------------------------------------------------------------------------------------
# Entropy analysis
# ---------------------------------------------------------------------------------------------
def stage_kind(model: nn.Module, stage: int) -> str:
    return 'nala' if isinstance(model.layers[stage].blocks[0].attn, NaLaAttention) else 'softmax'


def entropy_vs_norm(q: torch.Tensor, k: torch.Tensor, methods: Sequence[str] = METHODS
                    ) -> dict[str, Any]:
    """Query norms and, per method, row entropies of q, k (B, h, N, d), one image at a time.

    Returns {'norm': (B, h, N) array, method: {'entropy': (B, h, N) array, 'valid': bool array}}."""
    result: dict[str, Any] = {'norm': q.float().norm(dim=-1).numpy()}
    for m in methods:
        ents, valids = [], []
        for i in range(q.shape[0]):                      # bounds the N x N memory to one image
            rows, valid = ROW_FNS[m](q[i], k[i])
            ents.append(entropy(rows))
            valids.append(valid)
        result[m] = {'entropy': torch.stack(ents).numpy(), 'valid': torch.stack(valids).numpy()}
    return result


def summarise(norm: np.ndarray, ent: np.ndarray, valid: np.ndarray) -> dict[str, Any]:
    """Correlations and entropy statistics over the valid queries."""
    x, y = norm[valid].ravel(), ent[valid].ravel()
    return {'pearson': pearson(x, y), 'spearman': spearman(x, y),
            'mean_entropy': float(y.mean()) if len(y) else float('nan'),
            'median_entropy': float(np.median(y)) if len(y) else float('nan'),
            'n_queries': int(valid.sum()), 'n_excluded': int((~valid).sum())}


def analyse_stage(captured: dict[tuple[int, int], dict[str, Any]], stage: int,
                  methods: Sequence[str] = METHODS) -> dict[str, Any]:
    """Entropy vs query norm for every query of ``stage`` (all blocks, heads, images pooled), plus
    per-(block, head) correlations and entropy means in query-norm deciles.

    Pooled correlations mix layers whose norm ranges differ (untrained XT: block 0 of stage 0 has
    ||q|| ~ 0.5-1, block 1 ~ 3-4), so ``within_layer_*`` (the mean of the per-(block, head)
    correlations) is reported next to them."""
    blocks = sorted(b for s, b in captured if s == stage)
    if not blocks:
        raise ValueError(f'stage {stage} has no attention layers')
    per_layer, norms, ents, valids = [], [], {m: [] for m in methods}, {m: [] for m in methods}
    for b in blocks:
        rec = captured[(stage, b)]
        res = entropy_vs_norm(rec['q'], rec['k'], methods)
        for h in range(rec['q'].shape[1]):
            entry: dict[str, Any] = {'block': b, 'head': h}
            for m in methods:
                s = summarise(res['norm'][:, h], res[m]['entropy'][:, h], res[m]['valid'][:, h])
                entry[m] = {'pearson': s['pearson'], 'spearman': s['spearman'], 'mean_entropy': s['mean_entropy']}
            per_layer.append(entry)
        norms.append(res['norm'].ravel())
        for m in methods:
            ents[m].append(res[m]['entropy'].ravel())
            valids[m].append(res[m]['valid'].ravel())
    norm = np.concatenate(norms)
    rec0 = captured[(stage, blocks[0])]
    n_tokens = rec0['q'].shape[2]
    out: dict[str, Any] = {
        'stage': stage, 'blocks': blocks, 'heads': int(rec0['q'].shape[1]), 'head_dim': int(rec0['q'].shape[3]),
        'hw': list(rec0['hw']), 'n_tokens': n_tokens, 'log_n': math.log(n_tokens), 'rope': False,
        'query_norm': {'mean': float(norm.mean()), 'std': float(norm.std()), 'min': float(norm.min()),
                       'max': float(norm.max())},
        # NaLa's power p = 3 (0.5 + tanh ||q||) over these queries (docs/method.md#nala-kernel): how much room the
        # norm has to sharpen the feature map (p saturates at 4.5)
        'nala_power': {'min': 3 * (0.5 + math.tanh(float(norm.min()))), 'max': 3 * (0.5 + math.tanh(float(norm.max()))),
                       'mean': float((3 * (0.5 + np.tanh(norm))).mean())},
        'methods': {}, 'per_layer': per_layer, 'deciles': [],
    }
    arrays = {'norm': norm}
    for m in methods:
        e, v = np.concatenate(ents[m]), np.concatenate(valids[m])
        out['methods'][m] = summarise(norm, e, v)
        arrays[m] = e
        arrays[m + '_valid'] = v
    edges = np.quantile(norm, np.linspace(0, 1, 11))
    bins = np.clip(np.searchsorted(edges, norm, side='right') - 1, 0, 9)
    for i in range(10):
        sel = bins == i
        row: dict[str, Any] = {'norm_lo': float(edges[i]), 'norm_hi': float(edges[i + 1])}
        for m in methods:
            ok = sel & arrays[m + '_valid']
            row[m] = float(arrays[m][ok].mean()) if ok.any() else float('nan')
        out['deciles'].append(row)
    for m in methods:
        rs = [e[m]['pearson'] for e in per_layer if not math.isnan(e[m]['pearson'])]
        rhos = [e[m]['spearman'] for e in per_layer if not math.isnan(e[m]['spearman'])]
        out['methods'][m]['within_layer_pearson'] = float(np.mean(rs)) if rs else float('nan')
        out['methods'][m]['within_layer_spearman'] = float(np.mean(rhos)) if rhos else float('nan')
    arrays['block'] = np.concatenate([np.full(captured[(stage, b)]['q'][..., 0].numel(), b) for b in blocks])
    out['_arrays'] = arrays
    return out


def format_table(result: dict[str, Any]) -> str:
    """The short table printed to stdout."""
    lines = [f"stage {result['stage']} ({result['kind']}), {result['hw'][0]}x{result['hw'][1]} tokens "
             f"(log N = {result['log_n']:.3f}), {result['heads']} head(s) x {len(result['blocks'])} block(s), "
             f"{result['n_images']} image(s), RoPE off; ||q|| mean {result['query_norm']['mean']:.3f} "
             f"[{result['query_norm']['min']:.3f}, {result['query_norm']['max']:.3f}], NaLa power p in "
             f"[{result['nala_power']['min']:.2f}, {result['nala_power']['max']:.2f}]",
             f"{'':<8} {'pooled':>17}  {'within layer (mean)':>19}",
             f"{'method':<8} {'pearson':>8} {'spearman':>8}  {'pearson':>9} {'spearman':>9} {'mean H':>8} "
             f"{'queries':>8} {'excluded':>8}"]
    for m, s in result['methods'].items():
        lines.append(f"{m:<8} {s['pearson']:>8.3f} {s['spearman']:>8.3f}  {s['within_layer_pearson']:>9.3f} "
                     f"{s['within_layer_spearman']:>9.3f} {s['mean_entropy']:>8.3f} {s['n_queries']:>8d} "
                     f"{s['n_excluded']:>8d}")
    return '\n'.join(lines)


def plot_entropy(result: dict[str, Any], path: str, title: str, seed: int = 0) -> None:
    """Scatter of entropy against query norm, one panel per method, correlations in the legends."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    arrays, methods = result['_arrays'], list(result['methods'])
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4.4), squeeze=False,
                             layout='constrained')
    rng = np.random.default_rng(seed)
    for ax, m in zip(axes[0], methods):
        valid = arrays[m + '_valid']
        idx = np.flatnonzero(valid)
        if len(idx) > MAX_SCATTER_POINTS:
            idx = np.sort(rng.choice(idx, MAX_SCATTER_POINTS, replace=False))
        s = result['methods'][m]
        for b in result['blocks']:
            sel = idx[arrays['block'][idx] == b]
            layer_r = [e[m]['pearson'] for e in result['per_layer'] if e['block'] == b]
            r_mean = np.nanmean(layer_r) if not np.all(np.isnan(layer_r)) else float('nan')
            ax.scatter(arrays['norm'][sel], arrays[m][sel], s=3, alpha=0.25, color=f'C{b % 10}', rasterized=True,
                       label=f'block {b} (r = {r_mean:.3f}'
                             + (', mean over heads)' if len(layer_r) > 1 else ')'))
        ax.plot([], [], ' ', label=f"pooled: Pearson r = {s['pearson']:.3f}, Spearman ρ = {s['spearman']:.3f}")
        ax.plot([], [], ' ', label=f"within layer: r = {s['within_layer_pearson']:.3f}, "
                                  f"ρ = {s['within_layer_spearman']:.3f}")
        centres = [(d['norm_lo'] + d['norm_hi']) / 2 for d in result['deciles']]
        ax.plot(centres, [d[m] for d in result['deciles']], 'o-', color='k', ms=3, lw=1, label='mean per norm decile')
        ax.axhline(result['log_n'], color='gray', ls='--', lw=1, label=f"log N = {result['log_n']:.2f} (uniform)")
        ax.set_title(METHOD_LABELS[m])
        ax.set_xlabel('query norm ‖q‖ (raw head query)')
        ax.set_ylabel('attention entropy (nats)')
        lo = float(arrays[m][valid].min()) if valid.any() else 0.0
        pad = 0.05 * max(result['log_n'] - lo, 1e-3)
        ax.set_ylim(lo - pad, result['log_n'] + pad)
        ax.legend(loc='lower left', fontsize=7, markerscale=3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Attention maps
# ---------------------------------------------------------------------------------------------
def query_token(hw: tuple[int, int], query: tuple[float, float]) -> int:
    """Row-major token index at fractional image position (y, x) in [0, 1]."""
    h, w = hw
    r = min(int(query[0] * h), h - 1)
    c = min(int(query[1] * w), w - 1)
    return r * w + c


def attention_maps(captured: dict[tuple[int, int], dict[str, Any]], kinds: dict[int, str], image_index: int,
                   query: tuple[float, float], rope: bool = False) -> list[dict[str, Any]]:
    """For each stage: the (H, W) attention weights of the query token in the stage's last block,
    mean over heads, for image ``image_index``. NaLa stages use NaLa weights, softmax stages softmax."""
    maps = []
    for stage in sorted({s for s, _ in captured}):
        block = max(b for s, b in captured if s == stage)
        rec = captured[(stage, block)]
        q, k = rec['q'][image_index], rec['k'][image_index]   # (h, N, d)
        tok = query_token(rec['hw'], query)
        if rope:
            fn = nala_model_weights if kinds[stage] == 'nala' else softmax_model_weights
            rows = fn(q, k, rec['sin'], rec['cos'])[:, tok:tok + 1]
        else:
            rows = ROW_FNS[kinds[stage]](q[:, tok:tok + 1], k)[0]
        weights = rows[:, 0].mean(dim=0)                           # mean over heads, (N,)
        ent = float(entropy(rows[:, 0].clamp_min(0)).mean()) if not rope else float('nan')
        maps.append({'stage': stage, 'block': block, 'kind': kinds[stage], 'hw': rec['hw'], 'token': tok,
                     'weights': weights.reshape(rec['hw']), 'entropy': ent})
    return maps


def plot_attention_maps(image: np.ndarray, maps: list[dict[str, Any]], query: tuple[float, float], path: str,
                        title: str, rope: bool) -> None:
    """Input image plus one overlay per stage; the query position is marked with a cross."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    size = image.shape[:2]
    fig, axes = plt.subplots(1, len(maps) + 1, figsize=(3.1 * (len(maps) + 1), 3.8), squeeze=False,
                             layout='constrained')
    axes = axes[0]
    qy, qx = query[0] * size[0] - 0.5, query[1] * size[1] - 0.5
    axes[0].imshow(image)
    axes[0].set_title('input, query ×', fontsize=9)
    for ax, mp in zip(axes[1:], maps):
        w = mp['weights'][None, None].float()
        up = F.interpolate(w, size=size, mode='bilinear', align_corners=False)[0, 0].numpy()
        ax.imshow(image)
        if up.min() < 0:
            lim = float(np.abs(up).max()) or 1.0
            ax.imshow(up, cmap='coolwarm', alpha=0.6, vmin=-lim, vmax=lim)
        else:
            ax.imshow(up, cmap='jet', alpha=0.5, vmin=float(up.min()), vmax=float(up.max()))
        h, w_ = mp['hw']
        label = 'NaLa' if mp['kind'] == 'nala' else 'softmax'
        peak = float(mp['weights'].max()) * h * w_
        sub = f'{h}x{w_} tokens, max×N={peak:.2f}'
        if not rope and h * w_ > 1:
            sub += f", H/logN={mp['entropy'] / math.log(h * w_):.2f}"
        ax.set_title(f"stage {mp['stage']} {label} (block {mp['block']})\n{sub}", fontsize=9)
    for ax in axes:
        ax.plot([qx], [qy], 'x', color='white', ms=9, mew=2.5)
        ax.plot([qx], [qy], 'x', color='black', ms=7, mew=1.2)
        ax.set_xticks([])
        ax.set_yticks([])
    scale = ('colour scale per panel from min to max weight' if not any(float(m['weights'].min()) < 0 for m in maps)
             else 'colour scale per panel from min to max weight, signed panels (coolwarm) centred at 0')
    fig.suptitle(f'{title}\n{scale}; max×N = 1 is uniform', fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Model and images
# ---------------------------------------------------------------------------------------------
def load_model(name: str, checkpoint_path: str | None = None, weights: str = 'default',
               num_classes: int | None = None, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """Build ``name``; load ``checkpoint_path`` (training dict or bare state dict) with strict=True.

    ``weights`` picks the weights as weights.select_weights does: 'default' is the one loader rule
    (the EMA when the file has one, as timm's checkpoint_path loader), 'model' or 'model_ema' ask for
    those. The number of classes comes from the checkpoint's ``head.weight``, the input size from its
    ``args`` (``input_size``, and ``crop_pct`` from ``eval_crop_ratio``). Without a checkpoint the weights
    are the untrained initialisation under ``seed``."""
    meta: dict[str, Any] = {'checkpoint': checkpoint_path, 'weights': None}
    if checkpoint_path is None:
        torch.manual_seed(seed)
        model = timm.create_model(name, num_classes=num_classes or 1000)
        return model.eval(), meta
    ckpt = checkpoint.load_checkpoint_file(checkpoint_path)
    key, state = select_weights(ckpt, checkpoint_path, weights)
    if 'head.weight' not in state:
        raise errors.CheckpointError(f'{checkpoint_path}: no head.weight; not a NaLaFormer checkpoint')
    model = timm.create_model(name, num_classes=int(state['head.weight'].shape[0]))
    load_weights_into(model, state, name, checkpoint_path)
    meta['weights'] = key or 'state dict'
    run = checkpoint.saved_args(ckpt)
    meta['input_size'], meta['crop_pct'] = run.get('input_size'), run.get('eval_crop_ratio')
    meta['epoch'] = ckpt.get('epoch')
    return model.eval(), meta


def image_paths(root: str) -> list[str]:
    """The image files under ``root`` (recursive, sorted paths); one line naming the flag when there are none."""
    if not os.path.isdir(root):
        raise errors.UserError(f'--images {root}: no such folder; pass a folder of images, or --data-set DIGITS')
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files
                   if f.lower().endswith(image_folder.IMAGE_EXTENSIONS) and not f.startswith('.'))
    if not paths:
        raise errors.UserError(f'--images {root}: no image files ({", ".join(image_folder.IMAGE_EXTENSIONS)}) in '
                               'it or below it')
    return paths


def images_from_dir(root: str, cfg: dict[str, Any], limit: int, paths: list[str] | None = None) -> torch.Tensor:
    """The first ``limit`` images under ``root`` (recursive, sorted paths; ``paths`` when ``image_paths`` listed
    them already) through the evaluation transform of ``cfg`` (a ``datasets.data_config``, as main.py --eval
    and tools/predict.py)."""
    from PIL import Image
    t = datasets.eval_transform(cfg)
    out = []
    for p in (paths if paths is not None else image_paths(root))[:limit]:
        with Image.open(p) as im:
            out.append(t(im.convert('RGB')))
    return torch.stack(out)


def digits_images(cfg: dict[str, Any], limit: int, data_path: str | None) -> torch.Tensor:
    """The first ``limit`` images of the DIGITS validation split (written once under ``data_path``, default
    ./data/digits), through datasets.build_dataset with the evaluation transform of the data config ``cfg``."""
    source = datasets.DataSource(data_set='DIGITS', data_path=data_path, inat_category='name', strict_data=False,
                                 follow_links=False)
    ds, _ = datasets.build_dataset(False, source, datasets.build_transform(False, cfg))
    return torch.stack([ds[i][0] for i in range(min(limit, len(ds)))])


def to_display(image: torch.Tensor, cfg: dict[str, Any]) -> np.ndarray:
    """Undo the normalisation by ``cfg``'s mean/std: (3, H, W) tensor -> (H, W, 3) array in [0, 1]."""
    mean = torch.tensor(cfg['mean'])[:, None, None]
    std = torch.tensor(cfg['std'])[:, None, None]
    return (image * std + mean).clamp(0, 1).permute(1, 2, 0).numpy()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def parse_query(text: str) -> tuple[float, float]:
    try:
        y, x = (float(v) for v in text.split(','))
    except ValueError:
        raise argparse.ArgumentTypeError(f'--query wants Y,X fractions in [0, 1], got {text!r}') from None
    if not (0 <= y <= 1 and 0 <= x <= 1):
        raise argparse.ArgumentTypeError(f'--query wants Y,X fractions in [0, 1], got {text!r}')
    return y, x


def get_parser() -> argparse.ArgumentParser:
    p = FlagParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='NALAFORMER_XT', help='timm name of a NaLaFormer variant')
    p.add_argument('--checkpoint', default=None, help='training checkpoint or state dict (default: untrained)')
    p.add_argument('--weights', choices=['default', 'model', 'model_ema'], default='default',
                   help="which weights of a training checkpoint: default = model_ema when the file has one, "
                        "else model (the rule of every single-weights loader, timm's checkpoint_path included)")
    p.add_argument('--ema', dest='weights', action='store_const', const='model_ema',
                   help='same as --weights model_ema')
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument('--images', default=None, help='folder of images (searched recursively)')
    src.add_argument('--data-set', choices=['DIGITS'], default=None, help='the bundled digits (val split)')
    p.add_argument('--data-path', default=None, help='where DIGITS lives / is written (default ./data/digits)')
    p.add_argument('--input-size', type=int, default=None,
                   help="input resolution (default: the checkpoint's args.input_size, else 64 for DIGITS, "
                        "else the model's, 224)")
    p.add_argument('--num-images', type=int, default=32)
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--stage', type=int, default=0, help='stage whose queries are analysed (0-based, layers.S)')
    p.add_argument('--attention-map', action='store_true', help='also write attention_map.png')
    p.add_argument('--image-index', type=int, default=0, help='image of the attention map')
    p.add_argument('--query', type=parse_query, default=(0.5, 0.5), help='query position Y,X in [0, 1]')
    p.add_argument('--map-rope', action='store_true',
                   help='attention map with the weights exactly as the model applies them (RoPE on)')
    p.add_argument('--output-dir', default=None,
                   help='where the files go (default: output/analysis/<weights>, one folder per set of weights; '
                        'see default_output_dir)')
    p.add_argument('--seed', type=int, default=0, help='initialisation seed when no checkpoint is given')
    return p


def default_output_dir(checkpoint_path: str | None, weights: str = 'default', seed: int = 0) -> str:
    """``output/analysis/<name>``, one folder per set of weights, so that analyses of different weights do
    not overwrite each other: ``untrained_seed<S>``, or ``<run folder>_<checkpoint file stem>`` (plus
    ``_<weights>`` when ``--weights`` is not the default), e.g. ``demo_checkpoint`` for
    ``output/demo/checkpoint.pth``."""
    if not checkpoint_path:
        return os.path.join('output', 'analysis', f'untrained_seed{seed}')
    run = os.path.basename(os.path.dirname(os.path.abspath(checkpoint_path)))
    name = f'{run}_{os.path.splitext(os.path.basename(checkpoint_path))[0]}'
    return os.path.join('output', 'analysis', name + ('' if weights == 'default' else f'_{weights}'))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.model.upper() not in VARIANTS:
        parser.error('--model: ' + unknown_model(args.model, VARIANTS))
    try:
        return analyse(args)
    except errors.UserError as e:  # a bad checkpoint or image folder: one line, exit 1
        raise SystemExit(f'analyze_attention: error: {e}') from None


def analyse(args: argparse.Namespace) -> dict[str, Any]:
    """main() after parsing: the analysis of one stage (and the attention maps) for the parsed ``args``."""
    if args.output_dir is None:
        args.output_dir = default_output_dir(args.checkpoint, args.weights, args.seed)
    paths = image_paths(args.images) if args.images is not None else None  # a bad folder fails before the model
    model, meta = load_model(args.model, args.checkpoint, args.weights, seed=args.seed)
    note = cli.override_note('--input-size', args.input_size, meta.get('input_size'), args.checkpoint)
    if note:
        print(note)
    cfg = datasets.data_config(model, args.input_size or meta.get('input_size') or (64 if args.data_set else None),
                               meta.get('crop_pct'))
    input_size = cfg['input_size'][-1]
    if not 0 <= args.stage < len(model.layers):
        raise SystemExit(f'analyze_attention: error: --stage {args.stage} out of range 0..{len(model.layers) - 1}')
    images = (digits_images(cfg, args.num_images, args.data_path) if args.data_set
              else images_from_dir(args.images, cfg, args.num_images, paths))
    captured = capture(model, images, args.batch_size)
    kinds = {s: stage_kind(model, s) for s in range(len(model.layers))}

    result = analyse_stage(captured, args.stage)
    result.update(model=args.model, checkpoint=args.checkpoint, weights=meta['weights'], kind=kinds[args.stage],
                  input_size=input_size, n_images=len(images),
                  source=args.images or args.data_set, seed=None if args.checkpoint else args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    weights = (os.path.join(os.path.basename(os.path.dirname(os.path.abspath(args.checkpoint))),
                            os.path.basename(args.checkpoint))
               + (f" (epoch {meta['epoch']})" if meta.get('epoch') is not None else '')
               + (' EMA' if meta['weights'] == 'model_ema' else '')
               if args.checkpoint else f'untrained (seed {args.seed})')
    title = (f"{args.model}, {weights}, stage {args.stage} ({'NaLa' if kinds[args.stage] == 'nala' else 'softmax'} "
             f"layer), {result['n_tokens']} tokens, {len(images)} images at {input_size}px - RoPE off "
             f"for every distribution; NaLa power p in [{result['nala_power']['min']:.2f}, "
             f"{result['nala_power']['max']:.2f}]")
    png = os.path.join(args.output_dir, f'entropy_stage{args.stage}.png')
    plot_entropy(result, png, title)
    arrays = result.pop('_arrays')
    files = [png]
    if args.attention_map:
        if not 0 <= args.image_index < len(images):
            raise SystemExit(f'analyze_attention: error: --image-index {args.image_index} out of range')
        maps = attention_maps(captured, kinds, args.image_index, args.query, args.map_rope)
        map_png = os.path.join(args.output_dir, 'attention_map.png')
        plot_attention_maps(to_display(images[args.image_index], cfg), maps, args.query, map_png,
                            f"{args.model}, {weights}, image {args.image_index}, query (y, x) = "
                            f"({args.query[0]:.2f}, {args.query[1]:.2f}), last block of each stage, mean over "
                            f"heads, RoPE {'on (model weights)' if args.map_rope else 'off'}", args.map_rope)
        result['attention_map'] = [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in mp.items()}
                                   for mp in maps]
        files.append(map_png)
    js = os.path.join(args.output_dir, f'entropy_stage{args.stage}.json')
    with open(js, 'w') as f:
        json.dump(result, f, indent=1, allow_nan=True)
    files.append(js)
    print(format_table(result))
    print('wrote ' + ', '.join(files))
    result['_arrays'] = arrays
    return result


if __name__ == '__main__':
    main()
