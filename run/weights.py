"""Loading one set of weights into a model for training and the tools (--resume, --finetune, --teacher-path,
--eval, predict, release, analysis), strictly, with one-line diagnoses of weights that do not fit; and a dense
task's backbone from a classification checkpoint or release (--pretrained of segmentation/ and detection/).

Which weights a checkpoint's loaders take is models/weight_files.py's rule (``weights_key``: the EMA when the file
has one); ``select_weights`` applies it to a loaded file, removes DDP/compile prefixes and maps the reference
key layout onto the model's. A mismatch names its cause: another number of classes (use ``--finetune``),
another variant (its name, from the shapes of the file's keys against ``VARIANTS``), or the first missing,
unexpected or misshapen key.
"""
import re
from typing import Any, Sequence

import timm
import torch
from timm.models import clean_state_dict, create_model, get_pretrained_cfg

from models.nalaformer import VARIANTS, from_reference_layout
from models.weight_files import weights_key
from run.checkpoint import RELEASE_KEY, load_checkpoint_file, task_of
from run.errors import CheckpointError


def select_weights(ckpt: Any, path: str = 'the checkpoint',
                   which: str = 'default') -> tuple[str, dict[str, torch.Tensor]]:
    """(key, state dict) of the one set of weights a loader takes from a loaded checkpoint.

    which='default' is timm's rule (``timm.create_model(checkpoint_path=...)``): ``state_dict_ema``,
    else ``model_ema``, else ``state_dict``, else ``model``, else the file itself as a bare state dict
    (key ''). 'model' and 'model_ema' ask for those weights. DDP/compile prefixes are removed, and
    NaLaFormer weights in the reference layout are mapped onto the model's (``from_reference_layout``)."""
    key = weights_key(ckpt, which)
    if key is None:
        if which == 'model_ema':
            raise CheckpointError(f'{path} has no EMA weights (model_ema); '
                                  'take its model weights instead (--weights model)')
        raise CheckpointError(f'{path} is a torch file but holds no model weights '
                              f'(expected a state dict or a dict with "model")')
    return key, from_reference_layout(clean_state_dict(ckpt[key] if key else ckpt))


def classifier_keys(model: torch.nn.Module) -> set:
    """State-dict keys of the classifier (those re-initialised by --finetune)."""
    keys = set()
    get = getattr(model, 'get_classifier', None)
    clf = get() if callable(get) else None
    if isinstance(clf, torch.nn.Module):
        ids = {id(p) for p in clf.parameters()}
        for name, p in model.named_parameters():
            if id(p) in ids:
                keys.add(name)
    return keys


_BLOCK_KEY = re.compile(r'layers\.(\d+)\.blocks\.(\d+)\.')


def _architecture(sd: dict[str, torch.Tensor]) -> dict[tuple[int, str], int]:
    """Per stage of a NaLaFormer state dict: width, depth, heads and FFN width, read from block and RoPE
    keys only (the stem, the downsamples and the head say nothing the blocks do not)."""
    arch: dict[tuple[int, str], int] = {}
    for k in sd:
        m = _BLOCK_KEY.match(k)
        if m:
            stage, block = int(m.group(1)), int(m.group(2))
            arch[stage, 'depth'] = max(arch.get((stage, 'depth'), 0), block + 1)
    for stage in sorted({s for s, _ in arch}):
        norm = sd.get(f'layers.{stage}.blocks.0.norm1.norm.weight')
        fc1 = sd.get(f'layers.{stage}.blocks.0.ffn.fc1.weight')
        angle = sd.get(f'layers.{stage}.RoPE.angle')
        if norm is not None and norm.dim() == 1:
            arch[stage, 'dim'] = norm.shape[0]
            if angle is not None and angle.dim() == 1 and angle.shape[0]:
                arch[stage, 'heads'] = norm.shape[0] // (2 * angle.shape[0])  # angle: half a head's width
        if fc1 is not None and fc1.dim() == 2:
            arch[stage, 'hidden'] = fc1.shape[0]
    return arch


def _variant_architecture(cfg: dict[str, Any]) -> dict[tuple[int, str], int]:
    """_architecture's description of a ``VARIANTS`` entry."""
    arch: dict[tuple[int, str], int] = {}
    for stage, (dim, depth, heads) in enumerate(zip(cfg['embed_dims'], cfg['depths'], cfg['num_heads'])):
        arch.update({(stage, 'dim'): dim, (stage, 'depth'): depth, (stage, 'heads'): heads,
                     (stage, 'hidden'): int(cfg['mlp_ratio'] * dim)})
    return arch


def guess_variant(sd: dict[str, torch.Tensor],
                  candidates: Sequence[str] | None = None) -> tuple[str | None, float]:
    """The NaLaFormer variant whose stages (width, depth, heads, FFN width) fit `sd` best, and the share of
    those that match (1.0: all). Reads the configurations in ``VARIANTS``; builds no model.
    `candidates`: the variant names to consider (default: all)."""
    found = _architecture(sd)
    if not found:
        return None, 0.0
    best, best_score = None, 0.0
    names = [n for n in VARIANTS if candidates is None or n in {c.upper() for c in candidates}]
    for name in names:
        want = _variant_architecture(VARIANTS[name])
        keys = set(want) | set(found)
        score = sum(1 for k in keys if want.get(k) == found.get(k)) / len(keys)
        if score > best_score:
            best, best_score = name, score
    return best, best_score


def describe_mismatch(model: torch.nn.Module, sd: dict[str, torch.Tensor], model_name: str,
                      path: str) -> str | None:
    """One line explaining why `sd` does not load into `model` strictly (None if it does)."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    wrong = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if not (missing or unexpected or wrong):
        return None
    clf = classifier_keys(model)
    if not missing and not unexpected and wrong and set(wrong) <= clf:
        k = sorted(wrong)[0]
        n_ckpt = sd[k].shape[0]
        return (f'{path} has a {n_ckpt}-class classifier but the model has {own[k].shape[0]} classes; '
                f'to start from it with a new head use --finetune {path}')
    guess, score = guess_variant(sd)
    if guess is not None and guess != model_name.upper() and score > 0.9:
        return f'{path} looks like a {guess} checkpoint, not {model_name}; pass --model {guess}'
    detail = []
    if missing:
        detail.append(f'{len(missing)} missing keys (e.g. {missing[0]})')
    if unexpected:
        detail.append(f'{len(unexpected)} unexpected keys (e.g. {unexpected[0]})')
    if wrong:
        k = wrong[0]
        detail.append(f'{len(wrong)} shape mismatches (e.g. {k}: {tuple(sd[k].shape)} vs {tuple(own[k].shape)})')
    return f'{path} does not match {model_name}: ' + ', '.join(detail)


def check_weights(model: torch.nn.Module, sd: dict[str, torch.Tensor], model_name: str, path: str) -> None:
    """Raise a one-line CheckpointError naming the mismatch when `sd` would not load into `model` strictly."""
    msg = describe_mismatch(model, sd, model_name, path)
    if msg:
        raise CheckpointError(msg)


def load_weights_into(model: torch.nn.Module, sd: dict[str, torch.Tensor], model_name: str, path: str) -> None:
    """load_state_dict(strict=True) after check_weights."""
    check_weights(model, sd, model_name, path)
    model.load_state_dict(sd, strict=True)


def model_for_weights(model_name: str, sd: dict[str, torch.Tensor], path: str) -> torch.nn.Module:
    """timm's `model_name` with the classifier size of the state dict `sd` (of file `path`; no classifier when
    `sd` has none), its weights loaded strictly (load_weights_into)."""
    clf = getattr(get_pretrained_cfg(model_name), 'classifier', None) or 'head'
    num_classes = int(sd[f'{clf}.weight'].shape[0]) if f'{clf}.weight' in sd else 0
    model = create_model(model_name, num_classes=num_classes)
    load_weights_into(model, sd, model_name, path)
    return model


def load_model_weights(model: torch.nn.Module, path: str, model_name: str) -> Any:
    """Load the weights of checkpoint `path` (the default rule: the EMA when present) into `model` (strict);
    returns the loaded checkpoint."""
    ckpt = load_checkpoint_file(path)
    _, sd = select_weights(ckpt, path)
    load_weights_into(model, sd, model_name, path)
    return ckpt


def finetune_from(model: torch.nn.Module, path: str, model_name: str) -> None:
    """Start from the weights of `path` (the default rule: the EMA when present), re-initialising a
    classifier whose shape differs; every other tensor must match."""
    ckpt = load_checkpoint_file(path)
    key, sd = select_weights(ckpt, path)
    own = model.state_dict()
    clf = classifier_keys(model)
    dropped = [k for k in sd if k in own and k in clf and tuple(sd[k].shape) != tuple(own[k].shape)]
    rest = {k: v for k, v in sd.items() if k not in dropped}
    wrong = [k for k in rest if k in own and tuple(rest[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if wrong or unexpected or (set(missing) - clf):
        msg = describe_mismatch(model, rest, model_name, path)
        raise CheckpointError(msg or f'{path} does not match {model_name}')
    model.load_state_dict(rest, strict=False)
    release = ckpt.get(RELEASE_KEY) if isinstance(ckpt, dict) else None
    if isinstance(release, dict):  # a release's weights are stored as 'model' whichever set it took
        what = f'{path}, a release of {release.get("source_weights") or "a checkpoint"} weights'
    else:
        what = f'{path} ({key} weights)' if key else path
    if dropped:
        shapes = ', '.join(f'{k} {tuple(sd[k].shape)} -> {tuple(own[k].shape)}' for k in dropped)
        print(f'Finetune: loaded {what}; classifier re-initialised (shape differs): {shapes}')
    else:
        print(f'Finetune: loaded {what} (all {len(own)} tensors, classifier kept)')


# --------------------------------------------------------------------------------------------------
# A dense task's backbone from classification weights (--pretrained)
# --------------------------------------------------------------------------------------------------
def classifier_only_keys(name: str) -> set[str]:
    """The state-dict keys of timm model `name` that its features_only backbone leaves out (the classifier and
    whatever feeds only it), built on the meta device: nothing is allocated."""
    with torch.device('meta'):
        full = set(timm.create_model(name, pretrained=False).state_dict())
        kept = {k.removeprefix('model.') for k in timm.create_model(
            name, pretrained=False, features_only=True, feature_cls='getter').state_dict()}
    return full - kept


def load_backbone_weights(backbone: torch.nn.Module, path: str, name: str, task: str) -> str:
    """Load a dense task's backbone (timm model `name` built with ``features_only=True, feature_cls='getter'``: the
    network without its classifier, behind ``model.``) from the classification checkpoint or release `path`: one
    set of its weights by the loaders' rule (select_weights: the EMA when the file has one; either key layout),
    every backbone tensor there with its shape (strict), the classifier's tensors dropped with a note, anything else
    an error. A checkpoint of the run's own `task` (segmentation, detection) is refused with the command that
    continues it, one of another task with what to pass instead. Returns the line that says what was loaded and
    dropped."""
    ckpt = load_checkpoint_file(path)
    other = task_of(ckpt)
    if other == task:
        raise CheckpointError(f'--pretrained {path} is a {task} checkpoint; continue it with --resume {path} '
                              f'(or evaluate it with --eval --resume {path})')
    if other != 'classification':
        raise CheckpointError(f'--pretrained {path} is a {other} checkpoint; pass classification weights of '
                              f'--model {name} (a checkpoint of main.py or a release)')
    key, sd = select_weights(ckpt, path)
    own = backbone.state_dict()
    wanted = {k.removeprefix('model.'): k for k in own}
    missing = [k for k in wanted if k not in sd]
    wrong = [k for k in wanted if k in sd and tuple(sd[k].shape) != tuple(own[wanted[k]].shape)]
    head = classifier_only_keys(name)
    extra = [k for k in sd if k not in wanted]
    unexpected = [k for k in extra if k not in head]
    if missing or wrong or unexpected:
        what = (f'{len(missing)} backbone tensors missing (e.g. {missing[0]})' if missing else
                f'{len(wrong)} backbone tensors of other shapes (e.g. {wrong[0]}: {tuple(sd[wrong[0]].shape)} here, '
                f'{tuple(own[wanted[wrong[0]]].shape)} in {name})' if wrong else
                f"{len(unexpected)} tensors that are not {name}'s (e.g. {unexpected[0]})")
        raise CheckpointError(f'--pretrained {path} does not hold {name} classification weights: {what}; pass a '
                              f'checkpoint or release of --model {name}')
    backbone.load_state_dict({wanted[k]: sd[k] for k in wanted}, strict=True)
    # a release holds one set of weights (under 'model' once read): named as such, not by a key
    weights = f'{key} weights' if key and RELEASE_KEY not in ckpt else 'weights'
    dropped = f'; dropped the classifier ({", ".join(sorted(extra))})' if extra else ''
    return f'Pretrained: loaded the {len(wanted)} backbone tensors of {path} ({weights}){dropped}'
