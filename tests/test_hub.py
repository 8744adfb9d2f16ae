"""hubconf.py: torch.hub.load(REPO, NAME, source='local') from a clone."""
import os

import pytest
import timm
import torch
from conftest import REPO

import models


def test_hub_has_every_variant_and_lowercase_alias():
    import importlib.util
    spec = importlib.util.spec_from_file_location('hubconf', os.path.join(REPO, 'hubconf.py'))
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    assert hub.dependencies == ['torch', 'timm']
    for variant in models.VARIANTS:
        assert callable(getattr(hub, variant)) and callable(getattr(hub, variant.lower()))
        assert getattr(hub, variant.lower()).__name__ == variant.lower()  # messages name what was called


def test_hub_load_builds_the_timm_model(one_thread):
    model = torch.hub.load(REPO, 'nalaformer_xt', source='local', pretrained=False, num_classes=7)
    ref = timm.create_model('NALAFORMER_XT', num_classes=7)
    assert isinstance(model, models.NaLaFormer)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert model.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def test_hub_pretrained_without_a_file_says_nothing_is_downloaded():
    with pytest.raises(ValueError, match=r'nothing is downloaded.*file=PATH'):
        torch.hub.load(REPO, 'NALAFORMER_XT', source='local', pretrained=True)


def test_hub_pretrained_loads_a_local_file(tmp_path, one_thread):
    torch.manual_seed(0)
    src = timm.create_model('NALAFORMER_XT', num_classes=5).eval()
    path = tmp_path / 'xt.pth'
    torch.save({'model': src.state_dict()}, path)
    model = torch.hub.load(REPO, 'NALAFORMER_XT', source='local', pretrained=True, file=str(path),
                           num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)


@pytest.mark.parametrize('kind', ['release', 'checkpoint'])
def test_hub_pretrained_takes_the_class_count_of_the_file(tmp_path, one_thread, kind):
    """README's hub line without num_classes: the model gets the file's classes (a release's metadata, or
    the head of a training checkpoint's EMA weights); another num_classes re-initialises only the head."""
    torch.manual_seed(0)
    src = timm.create_model('NALAFORMER_XT', num_classes=10).eval()
    if kind == 'release':
        from tools.release import release
        ckpt = tmp_path / 'ck.pth'
        torch.save({'model': src.state_dict(), 'args': {'model': 'NALAFORMER_XT'}}, ckpt)
        path = release(str(ckpt), str(tmp_path / 'rel'), flops=False)['file']
    else:
        path = str(tmp_path / 'ck.pth')
        junk = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
        torch.save({'model': junk, 'model_ema': src.state_dict()}, path)
    model = torch.hub.load(REPO, 'nalaformer_xt', source='local', pretrained=True, file=path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)
    other = torch.hub.load(REPO, 'nalaformer_xt', source='local', pretrained=True, file=path, num_classes=3)
    assert other.num_classes == 3
    torch.testing.assert_close(other.patch_embed.proj[0].weight, src.patch_embed.proj[0].weight, rtol=0, atol=0)


@pytest.mark.parametrize('name', ['nalaformer_xt', 'NALAFORMER_XT'])
def test_hub_errors_name_the_entry_point_called(tmp_path, name):
    with pytest.raises(ValueError, match=f'^{name}: no pretrained weights are published'):
        torch.hub.load(REPO, name, source='local', pretrained=True)
    with pytest.raises(FileNotFoundError, match=f'^{name}: pretrained file .*missing.pth does not exist'):
        torch.hub.load(REPO, name, source='local', pretrained=True, file=str(tmp_path / 'missing.pth'))


@pytest.mark.parametrize('kind', ['release', 'checkpoint'])
@pytest.mark.parametrize('size, crop, expected', [(48, 0.9, ((3, 48, 48), 0.9, 'center')),
                                                  (32, None, ((3, 32, 32), 1.0, 'squash'))])
def test_hub_pretrained_takes_the_input_size_the_file_records(tmp_path, kind, size, crop, expected):
    """timm.data.resolve_data_config of a hub model loaded from a release (its metadata) or a training
    checkpoint (its args) gives that run's evaluation transform, as main.py --eval builds it; an overlay of the
    caller's own wins."""
    import datasets
    ckpt = tmp_path / 'ck.pth'
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=4).state_dict(),
                'args': {'model': 'NALAFORMER_XT', 'input_size': size, 'eval_crop_ratio': crop}}, ckpt)
    path = str(ckpt)
    if kind == 'release':
        from tools.release import release
        path = release(path, str(tmp_path / 'rel'), flops=False)['file']
    model = torch.hub.load(REPO, 'nalaformer_xt', source='local', pretrained=True, file=path)
    cfg = timm.data.resolve_data_config(model=model)
    assert (cfg['input_size'], cfg['crop_pct'], cfg['crop_mode']) == expected
    main_eval = datasets.data_config('NALAFORMER_XT', size, crop)
    assert {k: main_eval[k] for k in cfg} == cfg
    mine = torch.hub.load(REPO, 'nalaformer_xt', source='local', pretrained=True, file=path,
                          pretrained_cfg_overlay=dict(input_size=(3, 64, 64)))
    assert timm.data.resolve_data_config(model=mine)['input_size'] == (3, 64, 64)
