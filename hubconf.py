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
from typing import Any, Callable

import torch.nn as nn

from models.nalaformer import MODEL_NAMES as _MODEL_NAMES

dependencies = ['torch', 'timm']


def _create(name: str, pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
    import timm
    if pretrained:
        if not file:
            raise ValueError(f'{name}: no pretrained weights are published, so nothing is downloaded; pass a local '
                             f"file: torch.hub.load(REPO, '{name}', source='local', pretrained=True, file=PATH)")
        # the model factory reads the class count from the file (models/nalaformer.py)
        kwargs['pretrained_cfg_overlay'] = dict(kwargs.pop('pretrained_cfg_overlay', None) or {}, file=file)
    elif file:
        raise ValueError(f'{name}: file={file!r} is only read with pretrained=True')
    return timm.create_model(name, pretrained=pretrained, **kwargs)


def _entrypoint(name: str) -> Callable[..., nn.Module]:
    """The hub entry point of model ``name``, named after it (torch.hub finds entry points by name)."""
    def entrypoint(pretrained: bool = False, file: str | None = None, **kwargs: Any) -> nn.Module:
        return _create(name, pretrained, file, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__doc__ = (f'NaLaFormer-{name.split("_")[-1].upper()} from timm.create_model({name!r}); '
                          f'pretrained=True reads file=PATH.')
    return entrypoint


# one entry point per registered name (each variant in capitals and in lowercase, as in timm), each passing
# its own name on, so that messages name what was called
for _name in _MODEL_NAMES:
    globals()[_name] = _entrypoint(_name)
