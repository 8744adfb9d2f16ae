"""torch.hub entry points: the five NaLaFormer variants, built from this clone's code.

    model = torch.hub.load('/path/to/NaLaFormer', 'NALAFORMER_T', source='local', pretrained=False)
    model = torch.hub.load('/path/to/NaLaFormer', 'nalaformer_t', source='local', pretrained=True,
                           file='release/nalaformer_t_224-1a2b3c4d.safetensors')

No weights are published, so nothing is ever downloaded: ``pretrained=True`` needs ``file=`` (a release
``.safetensors`` file or a training checkpoint; a relative path is read from the working directory). The
model gets the file's number of classes; ``num_classes=N`` with another count re-initialises the
classifier (for fine-tuning). The file's recorded input size and crop ratio go into the model's
``pretrained_cfg``, so ``timm.data.resolve_data_config(model=model)`` gives the transform the weights were
evaluated with. Other keyword arguments go to ``timm.create_model`` (``drop_path_rate``, ``features_only``, ...).
"""
from typing import Any

import torch.nn as nn

dependencies = ['torch', 'timm']


def _create(name: str, pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    import timm

    import models  # noqa: F401  (registers the variants)
    if pretrained:
        if not file:
            raise ValueError(f'{name}: no pretrained weights are published, so nothing is downloaded; pass a local '
                             f"file: torch.hub.load(REPO, '{name}', source='local', pretrained=True, file=PATH)")
        # the model factory reads the class count from the file (models/nalaformer.py)
        kwargs['pretrained_cfg_overlay'] = dict(kwargs.pop('pretrained_cfg_overlay', None) or {}, file=file)
    elif file:
        raise ValueError(f'{name}: file={file!r} is only read with pretrained=True')
    return timm.create_model(name, pretrained=pretrained, **kwargs)


def NALAFORMER_XT(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-XT (6.1M params at 1000 classes)."""
    return _create('NALAFORMER_XT', pretrained, file, **kwargs)


def NALAFORMER_T(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-T (15.9M params)."""
    return _create('NALAFORMER_T', pretrained, file, **kwargs)


def NALAFORMER_S(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-S (25.7M params)."""
    return _create('NALAFORMER_S', pretrained, file, **kwargs)


def NALAFORMER_B(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-B (52.0M params)."""
    return _create('NALAFORMER_B', pretrained, file, **kwargs)


def NALAFORMER_L(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-L (95.4M params)."""
    return _create('NALAFORMER_L', pretrained, file, **kwargs)


# lower-case names, as timm registers them; each passes its own name on, so that messages name what was called
def nalaformer_xt(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-XT, as NALAFORMER_XT."""
    return _create('nalaformer_xt', pretrained, file, **kwargs)


def nalaformer_t(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-T, as NALAFORMER_T."""
    return _create('nalaformer_t', pretrained, file, **kwargs)


def nalaformer_s(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-S, as NALAFORMER_S."""
    return _create('nalaformer_s', pretrained, file, **kwargs)


def nalaformer_b(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-B, as NALAFORMER_B."""
    return _create('nalaformer_b', pretrained, file, **kwargs)


def nalaformer_l(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    """NaLaFormer-L, as NALAFORMER_L."""
    return _create('nalaformer_l', pretrained, file, **kwargs)
